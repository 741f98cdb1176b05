"""The front door's dispatcher (`cluster.dispatch.Dispatcher`): routing and counting in
flight as one step, and the router's estimate handed to the worker with the request.

The service is a double around the real policies (`cache_service.routing`), answering
after a round trip's delay as the service would with an empty index; the roster and the
requests in flight are the front door's own."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from cache_service.events import Namespace
from cache_service.routing import RouteInputs, candidates_of, make_policy
from cluster.dispatch import Deadline, Dispatcher
from cluster.inflight import InFlight
from cluster.requests import FrontRequest
from cluster.roster import Roster
from workers.api import GenerateRequest

NS = Namespace("m", "", "salt")
WORKERS = ("w0", "w1")
ROUND_TRIP_S = 0.02


class SlowService:
    """Answers ROUTE by running the named policy over the loads it is told, after a round
    trip (every worker on one node, nothing indexed)."""

    def __init__(self) -> None:
        self.policies: dict[str, object] = {}

    def route(self, namespace, tokens, loads, pending, policy):
        time.sleep(ROUND_TRIP_S)
        chosen = self.policies.setdefault(policy, make_policy(policy))
        nodes = dict.fromkeys(loads, "n1")
        return chosen.choose(RouteInputs(candidates_of(loads, nodes), len(tokens), pending=pending))


def dispatcher(policy: str) -> Dispatcher:
    roster = Roster(dict.fromkeys(WORKERS), restarts=False, on_lost=lambda worker: None)
    return Dispatcher(roster, InFlight(16), SlowService(), policy)


def request(seed: int, tokens: int = 100) -> FrontRequest:
    body = GenerateRequest(tuple((seed * 7919 + i) % 30000 for i in range(tokens)))
    return FrontRequest(NS, body)


def place_at_once(front: Dispatcher, requests: list[FrontRequest]) -> list:
    """Place every request from its own thread, all held in flight together."""
    together = threading.Barrier(len(requests))
    placements: list = []
    lock = threading.Lock()

    def place(one: FrontRequest) -> None:
        with front.placed(one) as placement:
            with lock:
                placements.append(placement)
            together.wait(timeout=30)

    threads = [threading.Thread(target=place, args=(one,)) for one in requests]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(placements) == len(requests)
    front.inflight.check_integrity()
    assert len(front.inflight) == 0  # every one counted out again
    return placements


@pytest.mark.parametrize("policy", ["kvmesh", "least-loaded"])
def test_a_burst_of_cold_prompts_from_many_threads_is_spread_not_herded(policy):
    # Each routing sees the requests routed before it in flight: without that, all eight
    # would see two idle workers and pick the same one.
    placements = place_at_once(dispatcher(policy), [request(seed) for seed in range(8)])
    assert Counter(p.worker for p in placements) == {"w0": 4, "w1": 4}


def test_kvmesh_hands_its_estimate_to_the_worker_and_the_baselines_none():
    front = dispatcher("kvmesh")
    one = request(1)
    with front.placed(one) as placement:
        # An idle worker computing 100 tokens at the default 2 ms a token.
        assert placement.estimate_s == pytest.approx(0.2)
        body = Deadline(30).body(one, placement.estimate_s)
        assert body.route_estimate_s == pytest.approx(0.2) and body.tokens == one.tokens
    for policy in ("round-robin", "least-loaded", "prefix-affinity"):
        with dispatcher(policy).placed(one) as placement:
            assert placement.estimate_s == 0.0
    with front.placed(one, worker="w1") as named:  # a named worker is not routed
        assert named == ("w1", 0.0)


def test_a_negative_or_infinite_estimate_is_refused_by_the_request():
    for bad in (-0.1, float("inf"), float("nan"), "1", True):
        with pytest.raises(ValueError, match="route_estimate_s"):
            GenerateRequest((1, 2, 3), route_estimate_s=bad)
