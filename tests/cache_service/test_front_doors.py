"""The service's view of every front door's requests in flight (`FrontDoors`): a door's
ROUTE weighs the others' fresh counts beside its own, never its own twice, and the
state stays bounded whatever the doors send."""

from __future__ import annotations

import pytest

from cache_service.front_doors import FrontDoors
from cache_service.messages import RouteDecision

IDLE = {"w0": 0.0, "w1": 0.0}


def decide(worker: str, matched: int = 0):
    """A policy that always picks `worker`, recording the loads it was shown."""
    seen: list[dict[str, float]] = []

    def choose(weighed: dict[str, float]) -> RouteDecision:
        seen.append(weighed)
        return RouteDecision(worker, matched, 0.1, "test")

    return choose, seen


def test_a_door_sees_the_others_requests_with_the_one_just_routed():
    doors = FrontDoors(fresh_s=1.0)
    choose, seen = decide("w0", matched=32)
    doors.route("a", {"w0": 100.0, "w1": 0.0}, {}, 300, now=10.0, choose=choose)
    assert seen == [IDLE | {"w0": 100.0}]  # nothing else known yet
    # b's view: a's 100 tokens at w0 and the 268 it just routed there (300 less 32 held).
    assert doors.weighed("b", IDLE, now=10.5) == {"w0": 368.0, "w1": 0.0}
    # a never sees itself twice: its own loads are the ones it sends.
    assert doors.weighed("a", {"w0": 5.0, "w1": 0.0}, now=10.5) == {"w0": 5.0, "w1": 0.0}
    # A caller naming no door sees every door's, and is not kept.
    assert doors.weighed(None, IDLE, now=10.5) == {"w0": 368.0, "w1": 0.0}
    doors.heard(None, {"w0": 7.0}, "w0", 1, now=10.5)
    assert len(doors) == 1
    doors.check_integrity()


def test_a_pending_prefix_counts_as_held_and_a_request_computes_one_token_at_least():
    doors = FrontDoors()
    choose, _ = decide("w1", matched=0)
    doors.route("a", IDLE, {"w1": 299.0}, 300, now=0.0, choose=choose)
    assert doors.weighed("b", IDLE, now=0.1) == {"w0": 0.0, "w1": 1.0}


def test_a_door_not_heard_for_fresh_s_is_forgotten():
    doors = FrontDoors(fresh_s=1.0)
    doors.heard("a", {"w0": 50.0}, "w0", 10, now=0.0)
    assert doors.weighed("b", IDLE, now=1.0)["w0"] == 60.0
    assert doors.weighed("b", IDLE, now=1.01)["w0"] == 0.0  # stale: not weighed
    doors.heard("b", IDLE, "w1", 10, now=1.01)  # and dropped when another door is heard
    assert len(doors) == 1
    # A door's latest ROUTE replaces its count (its requests ended meanwhile).
    doors.heard("b", IDLE, None, 10, now=1.2)
    assert doors.weighed("c", IDLE, now=1.3) == IDLE
    doors.check_integrity()


def test_workers_the_asking_door_does_not_route_to_are_not_added():
    doors = FrontDoors()
    doors.heard("a", {"w0": 5.0, "w9": 40.0}, "w9", 10, now=0.0)
    assert doors.weighed("b", {"w0": 1.0}, now=0.0) == {"w0": 6.0}


def test_the_doors_kept_are_bounded_the_longest_unheard_dropped_first():
    doors = FrontDoors(fresh_s=100.0, max_doors=3)
    for i in range(5):
        doors.heard(f"d{i}", {"w0": 1.0}, "w0", 1, now=float(i))
    assert len(doors) == 3
    assert doors.weighed(None, {"w0": 0.0}, now=5.0) == {"w0": 6.0}  # d2, d3, d4: 2 each
    doors.heard("d2", {"w0": 0.0}, None, 1, now=6.0)  # heard again: now the newest
    doors.heard("d5", {"w0": 0.0}, None, 1, now=7.0)  # drops d3, the longest unheard
    assert doors.weighed(None, {"w0": 0.0}, now=7.0) == {"w0": 2.0}  # d4's
    doors.check_integrity()


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="fresh_s"):
        FrontDoors(fresh_s=0)
    with pytest.raises(ValueError, match="max_doors"):
        FrontDoors(max_doors=0)
