"""Every request ends: by its deadline in any phase, when its caller leaves, and without a
slow copy holding up the others.

Workers on the tiny model, in process, with a real service. Slowness is a fault of
`benchmarks.faults`, wrapped around a worker's own parts (its forward pass, a peer's page
source), never a switch in the worker. A request that hangs is a failure: every call runs under a
bound of its own (`call`), and the module under pytest-timeout's.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from benchmarks.faults import heal, slow_passes, slow_peer
from tests.waiting import call, wait_until
from tests.workers.conftest import make_worker
from workers.api import DeadlineExceeded, GenerateRequest, RequestCancelled, ServingStopped
from workers.serving.config import SchedulerConfig
from workers.serving.sequence import Phase

pytestmark = pytest.mark.timeout(120)

PROMPT = [(5 * i + 2) % 250 + 1 for i in range(21)]  # 5 pages of 4 tokens and one more
LONG = 120  # tokens to decode: long enough to be caught mid-way with slowed passes
SLOW_PASS_S = 0.05  # a slowed pass: LONG tokens take 6 s, far past every wait below
ENDS_WITHIN_S = 3.0  # an ended request's pages are released by then (a pass or two)


@pytest.fixture
def pair(service):
    """A holder of PROMPT's pages (published) and a worker that copies from it."""
    holder, copier = make_worker(service, "h"), make_worker(service, "c")
    infos = [holder.info(), copier.info()]
    holder.set_peers(infos)
    copier.set_peers(infos)
    expected = call(holder.generate, PROMPT, 4)
    assert holder.flush()
    yield holder, copier, expected
    for w in (holder, copier):
        w.check_integrity()
        w.shutdown()


def no_pages_held(worker) -> bool:
    return worker.cache.pages_referenced() == 0 and not worker.scheduler.running


def ended(fn, *args: Any) -> BaseException:
    """The error `fn(*args)` ended with (under `call`'s bound)."""
    with pytest.raises(Exception) as info:
        call(fn, *args)
    return info.value


def request(worker, prompt=PROMPT, max_new_tokens=4, **options: Any) -> GenerateRequest:
    return worker.request(prompt, max_new_tokens, ignore_eos=True, **options)


# -- deadlines, one per phase ----------------------------------------------------------


def test_a_request_queued_past_its_deadline_ends_there(service):
    worker = make_worker(service, "q")
    try:
        worker.scheduler.config = SchedulerConfig(max_running=1)
        slow_passes(worker, SLOW_PASS_S)
        long = [request(worker, max_new_tokens=LONG)]
        first = threading.Thread(target=call, args=(worker.generate_batch, long))
        first.start()
        wait_until(lambda: worker.scheduler.running, 10, "the first request to run")
        error = ended(worker.generate_batch, [request(worker, [7, 8, 9], timeout_s=0.3)])
        assert isinstance(error, DeadlineExceeded) and error.phase == "queued", error
        assert set(error.spent) == {"queued"} and error.spent["queued"] >= 0.3
        assert "deadline of 0.3s while queued" in str(error)
        assert worker.scheduler.ended == 1
        first.join(60)
        wait_until(lambda: no_pages_held(worker), 10, "every page released")
    finally:
        worker.check_integrity()
        worker.shutdown()


def test_a_request_copying_past_its_deadline_ends_at_once_and_frees_its_pages(pair):
    holder, copier, expected = pair
    slow = slow_peer(copier, 3.0)
    start = time.monotonic()
    error = ended(copier.generate_batch, [request(copier, timeout_s=0.5)])
    assert isinstance(error, DeadlineExceeded) and error.phase == "copying", error
    assert set(error.spent) == {"queued", "copying"}
    assert time.monotonic() - start < 2.5  # answered before the copy returned
    assert slow and slow[0].in_flight.is_set()
    assert copier.scheduler.running  # its pages wait for the copy to return
    wait_until(lambda: no_pages_held(copier), 10, "its pages released after the copy")
    out = call(copier.generate, PROMPT, 4, ignore_eos=True)  # the worker goes on
    assert out.token_ids == expected.token_ids


def test_a_pass_that_hangs_ends_its_request_at_the_deadline(worker):
    slow_passes(worker, 3.0)  # the prefill's pass hangs 3 s
    start = time.monotonic()
    error = ended(worker.generate_batch, [request(worker, timeout_s=0.5)])
    assert isinstance(error, DeadlineExceeded) and error.phase == "prefill", error
    assert time.monotonic() - start < 2.5  # the caller did not wait for the pass
    heal(worker)  # the passes after it run as before
    wait_until(lambda: no_pages_held(worker), 10, "its pages released after the pass")
    assert len(call(worker.generate, PROMPT, 4).token_ids) == 4


def test_a_decode_past_its_deadline_ends_and_keeps_what_it_published(worker):
    slow_passes(worker, SLOW_PASS_S)
    error = ended(worker.generate_batch, [request(worker, max_new_tokens=LONG, timeout_s=0.6)])
    assert isinstance(error, DeadlineExceeded) and error.phase == "decode", error
    assert list(error.spent) == ["queued", "copying", "prefill", "decode"]
    wait_until(lambda: no_pages_held(worker), ENDS_WITHIN_S, "its pages released")
    again = call(worker.generate, PROMPT, 4)
    assert again.stats.local_hit_tokens == 20  # its prompt pages stayed cached


# -- cancellation ----------------------------------------------------------------------


def test_an_abandoned_stream_is_cancelled_and_its_pages_freed(worker):
    slow_passes(worker, SLOW_PASS_S)
    stream = worker.stream(request(worker, max_new_tokens=LONG))
    assert next(stream).token_id is not None and next(stream).token_id is not None
    assert worker.cache.pages_referenced() > 0
    stream.close()  # what Ray does with a consumer that left, or the caller's close()
    wait_until(lambda: no_pages_held(worker), ENDS_WITHIN_S, "the stream's pages released")
    assert worker.scheduler.ended == 1
    assert call(worker.generate, PROMPT, 4).stats.local_hit_tokens == 20


def test_a_request_cancelled_by_its_id_ends_with_request_cancelled(worker):
    slow_passes(worker, SLOW_PASS_S)
    body = request(worker, max_new_tokens=LONG, request_id="r-1")
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            worker.generate_batch([body])
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: any(s.phase is Phase.DECODE for s in worker.scheduler.running), 10, "decode")
    assert worker.cancel(["r-1", "not-here"]) == 1
    thread.join(ENDS_WITHIN_S)
    assert not thread.is_alive()
    assert isinstance(outcome["error"], RequestCancelled), outcome
    wait_until(lambda: no_pages_held(worker), 10, "its pages released")
    assert worker.cancel(["r-1"]) == 0  # ended: nothing to cancel


# -- copy-in off the serving thread ----------------------------------------------------


def test_a_slow_copy_does_not_hold_up_the_sequences_running(pair):
    holder, copier, expected = pair
    slow_passes(copier, SLOW_PASS_S)
    running = threading.Thread(
        target=call, args=(copier.generate_batch, [request(copier, [9] * 8, max_new_tokens=LONG)])
    )
    running.start()
    wait_until(lambda: any(s.phase is Phase.DECODE for s in copier.scheduler.running), 10, "decode")
    slow = slow_peer(copier, 3.0)
    copying = threading.Thread(target=call, args=(copier.generate, PROMPT, 4))
    copying.start()
    wait_until(lambda: slow and slow[0].in_flight.is_set(), 10, "the copy to start")
    decoding = next(s for s in copier.scheduler.running if s.phase is Phase.DECODE)
    before = len(decoding.output)
    # Five decode steps while the copy is in flight (a copy on the serving thread would
    # hold them up until it returned).
    wait_until(
        lambda: len(decoding.output) >= before + 5 or slow[0].returned.is_set(),
        10,
        "decode steps, or the copy's return",
    )
    assert not slow[0].returned.is_set(), f"{len(decoding.output) - before} steps during the copy"
    assert any(s.phase is Phase.COPYING for s in copier.scheduler.running)
    copying.join(30)
    running.join(60)
    wait_until(lambda: no_pages_held(copier), 10, "every page released")


def test_a_worker_stopped_during_a_copy_releases_its_pages_when_the_copy_returns(pair):
    holder, copier, expected = pair
    slow = slow_peer(copier, 1.0)
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            copier.generate(PROMPT, 4)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: slow and slow[0].in_flight.is_set(), 10, "the copy to start")
    copier.serving.stop()
    thread.join(10)
    assert isinstance(outcome.get("error"), ServingStopped), outcome
    assert slow[0].returned.is_set() and no_pages_held(copier)


def test_set_peers_racing_copy_ins_never_fails_a_request(pair):
    holder, copier, expected = pair
    infos = [holder.info(), copier.info()]
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            copier.set_peers(infos[1:])  # the holder forgotten ...
            time.sleep(0.001)
            copier.set_peers(infos)  # ... and told again
            time.sleep(0.001)

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        outs = [call(copier.generate, PROMPT[: 13 + 2 * i], 4) for i in range(4)]
    finally:
        stop.set()
        thread.join(10)
    assert outs[0].stats.remote_hit_tokens == 12  # copied while the peers changed
    for i, out in enumerate(outs):
        reference = call(holder.generate, PROMPT[: 13 + 2 * i], 4)
        assert out.token_ids == reference.token_ids, i
