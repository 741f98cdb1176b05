"""The front door's requests in flight (`cluster.inflight.InFlight`): the queue it counts
on each worker and the prefixes being computed there, for routing."""

from __future__ import annotations

import pytest

from cache_service.events import Namespace
from cluster.inflight import InFlight, _common_bytes

NS = Namespace("m", "", "salt-a")
OTHER = Namespace("m", "", "salt-b")
P = 4


def test_loads_count_the_tokens_in_flight_per_worker_until_removed():
    flight = InFlight(P)
    one = flight.add("w0", NS, list(range(20)), 12)
    flight.add("w0", NS, list(range(30)), 30)
    flight.add("w1", NS, list(range(8)), 8)
    assert flight.loads(["w0", "w1", "w2"]) == {"w0": 42.0, "w1": 8.0, "w2": 0.0}
    flight.remove(one)
    flight.remove(one)  # twice: nothing more
    assert flight.loads(["w0", "w1"]) == {"w0": 30.0, "w1": 8.0}
    assert len(flight) == 2
    flight.check_integrity()


def test_loads_within_a_window_count_only_the_requests_sent_in_it():
    # What the workers' reports cannot count yet: the requests sent in the last second.
    now = [100.0]
    flight = InFlight(P, clock=lambda: now[0])
    flight.add("w0", NS, list(range(20)), 12)  # sent at 100.0
    now[0] = 100.6
    flight.add("w0", NS, list(range(30)), 30)
    flight.add("w1", NS, list(range(8)), 8)
    now[0] = 101.2
    assert flight.loads(["w0", "w1"], within_s=1.0) == {"w0": 30.0, "w1": 8.0}
    assert flight.loads(["w0", "w1"]) == {"w0": 42.0, "w1": 8.0}  # every one in flight
    now[0] = 101.7
    assert flight.loads(["w0", "w1"], within_s=1.0) == {"w0": 0.0, "w1": 0.0}
    assert flight.loads(["w0", "w1"]) == {"w0": 42.0, "w1": 8.0}
    flight.check_integrity()


def test_check_integrity_catches_a_broken_entry():
    flight = InFlight(P)
    handle = flight.add("w0", NS, list(range(8)), 8)
    flight.check_integrity()
    flight._entries[handle] = flight._entries[handle]._replace(tokens=-1)
    with pytest.raises(AssertionError, match="-1 tokens"):
        flight.check_integrity()


def test_pending_is_the_whole_pages_shared_with_a_prompt_in_flight_in_its_namespace():
    flight = InFlight(P)
    prompt = list(range(100, 130))
    flight.add("w0", NS, prompt[:22] + [1, 2, 3], 25)  # shares 22 tokens: 5 whole pages
    flight.add("w1", NS, prompt[:9] + [7], 10)  # shares 9: 2 pages
    flight.add("w2", OTHER, prompt, 30)  # another tenant's: never counted
    assert flight.pending(NS, prompt) == {"w0": 20.0, "w1": 8.0}
    assert flight.pending(NS, [5, 6, 7, 8, 9]) == {}
    assert flight.pending(OTHER, prompt) == {"w2": 28.0}  # 30 tokens: 7 whole pages
    flight.check_integrity()


def test_common_bytes():
    assert _common_bytes(b"abcdef", b"abcxyz") == 3
    assert _common_bytes(b"abc", b"abcdef") == 3
    assert _common_bytes(b"", b"abc") == 0
    assert _common_bytes(b"xbc", b"abc") == 0
    assert _common_bytes(b"abcdef", b"abcdef") == 6
