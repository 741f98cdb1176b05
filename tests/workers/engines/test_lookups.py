"""The connector's lookups off vLLM's scheduler thread: "not yet" while a lookup runs, its
answer once there, a miss past the deadline or on an error."""

from __future__ import annotations

import threading
import time

import pytest

from workers.engines.lookups import Lookups

MISS = (0, (), ())


@pytest.fixture
def gate():
    """A lookup that answers only once the test opens the gate."""
    opened, calls = threading.Event(), []

    def lookup(*question):
        calls.append(question)
        assert opened.wait(10), "the test never opened the gate"
        return ("found", *question)

    yield opened, calls, lookup
    opened.set()


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_quick_lookup_is_answered_at_once():
    lookups = Lookups(lambda *q: ("found", *q), MISS, "test", wait_s=5.0)
    assert lookups.ask("r1", "ns", (1, 2), 1) == ("found", "ns", (1, 2), 1)
    assert lookups.in_flight == 0  # handed out and forgotten
    lookups.check_integrity()
    lookups.close()


def test_a_slow_lookup_is_not_yet_then_its_answer(gate):
    opened, calls, lookup = gate
    lookups = Lookups(lookup, MISS, "test", wait_s=0.01, deadline_s=60.0)
    assert lookups.ask("r1", "ns", (1, 2), 1) is None  # the scheduler goes on
    assert lookups.ask("r1", "ns", (1, 2), 1) is None  # asked again: still running, once
    wait_for(lambda: len(calls) == 1)
    opened.set()
    wait_for(lambda: lookups.ask("r1", "ns", (1, 2), 1) is not None)
    assert calls == [("ns", (1, 2), 1)]  # one lookup for all the asks
    assert lookups.in_flight == 0
    lookups.check_integrity()
    lookups.close()


def test_a_lookup_past_its_deadline_is_a_miss(gate):
    opened, calls, lookup = gate
    lookups = Lookups(lookup, MISS, "test", wait_s=0.0, deadline_s=0.05)
    assert lookups.ask("r1", "ns", (1,), 1) is None
    time.sleep(0.1)
    assert lookups.ask("r1", "ns", (1,), 1) == MISS
    # A lookup queued behind the stuck one is past its deadline by its turn: a miss,
    # without a call.
    assert lookups.ask("r2", "ns", (2,), 1) is None
    time.sleep(0.1)
    opened.set()
    wait_for(lambda: lookups.ask("r2", "ns", (2,), 1) is not None)
    assert calls == [("ns", (1,), 1)]
    lookups.check_integrity()
    lookups.close()


def test_a_failed_lookup_is_a_miss_and_a_new_question_replaces_the_old(gate):
    def broken(*question):
        raise RuntimeError("the service said no")

    lookups = Lookups(broken, MISS, "test", wait_s=5.0)
    assert lookups.ask("r1", "ns", (1,), 1) == MISS
    lookups.close()

    opened, calls, lookup = gate
    lookups = Lookups(lookup, MISS, "test", wait_s=0.0, deadline_s=60.0)
    assert lookups.ask("r1", "ns", (1,), 1) is None
    assert lookups.ask("r1", "ns", (1, 2), 2) is None  # vLLM asks anew: the old is dropped
    lookups.forget("r9")  # never asked: nothing happens
    assert lookups.in_flight == 1
    opened.set()
    wait_for(lambda: (answer := lookups.ask("r1", "ns", (1, 2), 2)) is not None and answer)
    lookups.ask("r3", "ns", (3,), 1)
    lookups.forget("r3")  # finished before its answer: nobody keeps it
    assert lookups.in_flight == 0
    lookups.check_integrity()
    lookups.close()
