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
from cache_service.front_doors import FrontDoors
from cache_service.routing import RouteInputs, candidates_of, make_policy
from cluster.dispatch import Deadline, Dispatcher
from cluster.inflight import InFlight
from cluster.requests import FrontRequest
from cluster.roster import Roster
from workers.api import GenerateRequest
from workers.service.client import ServiceUnavailable

NS = Namespace("m", "", "salt")
WORKERS = ("w0", "w1")
ROUND_TRIP_S = 0.02


class SlowService:
    """Answers ROUTE by running the named policy over the loads it is told, weighing other
    front doors' as the service does (`FrontDoors`, unless `doors` is False), after a
    round trip; one ROUTE at a time, as the service's loop; every worker on one node,
    nothing indexed."""

    def __init__(self, doors: bool = True) -> None:
        self.policies: dict[str, object] = {}
        self.doors = FrontDoors() if doors else None
        self._loop = threading.Lock()

    def route(self, namespace, tokens, loads, pending, policy, door=None):
        time.sleep(ROUND_TRIP_S)
        chosen = self.policies.setdefault(policy, make_policy(policy))
        nodes = dict.fromkeys(loads, "n1")

        def choose(weighed):
            inputs = RouteInputs(candidates_of(weighed, nodes), len(tokens), pending=pending)
            return chosen.choose(inputs)

        with self._loop:
            if self.doors is None:
                return choose(dict(loads))
            return self.doors.route(door, loads, pending, len(tokens), time.monotonic(), choose)


def dispatcher(policy: str, service: SlowService | None = None) -> Dispatcher:
    roster = Roster(dict.fromkeys(WORKERS), restarts=False, on_lost=lambda worker: None)
    return Dispatcher(roster, InFlight(16), service or SlowService(), policy)


def request(seed: int, tokens: int = 100) -> FrontRequest:
    body = GenerateRequest(tuple((seed * 7919 + i) % 30000 for i in range(tokens)))
    return FrontRequest(NS, body)


def place_at_once(front: Dispatcher | list[Dispatcher], requests: list[FrontRequest]) -> list:
    """Place every request from its own thread, all held in flight together; with several
    front doors, request i goes through door i modulo their number."""
    doors = front if isinstance(front, list) else [front]
    together = threading.Barrier(len(requests))
    placements: list = []
    lock = threading.Lock()

    def place(door: Dispatcher, one: FrontRequest) -> None:
        with door.placed(one) as placement:
            with lock:
                placements.append(placement)
            together.wait(timeout=30)

    threads = [
        threading.Thread(target=place, args=(doors[i % len(doors)], one))
        for i, one in enumerate(requests)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(placements) == len(requests)
    for door in doors:
        door.inflight.check_integrity()
        assert len(door.inflight) == 0  # every one counted out again
    return placements


@pytest.mark.parametrize("policy", ["kvmesh", "least-loaded"])
def test_a_burst_of_cold_prompts_from_many_threads_is_spread_not_herded(policy):
    # Each routing sees the requests routed before it in flight: without that, all eight
    # would see two idle workers and pick the same one.
    placements = place_at_once(dispatcher(policy), [request(seed) for seed in range(8)])
    assert Counter(p.worker for p in placements) == {"w0": 4, "w1": 4}


@pytest.mark.parametrize("policy", ["kvmesh", "least-loaded"])
def test_two_front_doors_routing_at_once_weigh_each_other(policy):
    # One request from each of two front doors at once: each door has nothing of its own
    # in flight, and the workers have not reported either request yet. The service
    # weighs the first door's request when it routes the second's.
    service = SlowService()
    doors = [dispatcher(policy, service), dispatcher(policy, service)]
    assert doors[0].door != doors[1].door
    placements = place_at_once(doors, [request(1), request(2)])
    assert Counter(p.worker for p in placements) == {"w0": 1, "w1": 1}
    # A burst of one prompt, four from each door: spread, not all on one worker.
    burst = place_at_once(doors, [request(5)] * 8)
    assert Counter(p.worker for p in burst) == {"w0": 4, "w1": 4}
    service.doors.check_integrity()
    assert len(service.doors) == 2


def test_without_the_service_weighing_them_two_front_doors_herd():
    # What the weighing prevents: each door sees only its own requests, both idle workers
    # look the same to both doors, and both requests land on the same one.
    service = SlowService(doors=False)
    doors = [dispatcher("least-loaded", service), dispatcher("least-loaded", service)]
    placements = place_at_once(doors, [request(1), request(2)])
    assert Counter(p.worker for p in placements) == {"w0": 2}


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


class RecordingService(SlowService):
    """A SlowService that keeps the loads each ROUTE carried, or is down (`down`)."""

    def __init__(self) -> None:
        super().__init__()
        self.routed: list[dict[str, float]] = []
        self.down = False

    def route(self, namespace, tokens, loads, pending, policy, door=None):
        if self.down:
            raise ServiceUnavailable("the service is down")
        self.routed.append(dict(loads))
        return super().route(namespace, tokens, loads, pending, policy, door)


def test_a_route_carries_only_the_requests_the_workers_reports_do_not_count_yet():
    # A request in flight longer than the reports take to count it (its prompt may be
    # computed, its decode steps running) is the workers' to report, not the door's:
    # the ROUTE carries only the requests sent since. Without the service, the door
    # weighs every request it has in flight.
    now = [50.0]
    service = RecordingService()
    roster = Roster(dict.fromkeys(WORKERS), restarts=False, on_lost=lambda worker: None)
    front = Dispatcher(
        roster, InFlight(16, clock=lambda: now[0]), service, "least-loaded", None, 1.0
    )
    with front.placed(request(1, tokens=300)) as first:
        assert service.routed[-1] == {"w0": 0.0, "w1": 0.0}
        now[0] = 50.5
        with front.placed(request(2, tokens=40)) as second:
            assert service.routed[-1] == {first.worker: 300.0, second.worker: 0.0}
            assert second.worker != first.worker
            now[0] = 51.2  # the first is in the reports now; the second not yet
            with front.placed(request(3, tokens=10)):
                assert service.routed[-1] == {first.worker: 0.0, second.worker: 40.0}
            service.down = True
            with front.placed(request(4, tokens=10)) as fourth:
                # Least-loaded over everything in flight here: 300 against 40.
                assert fourth.worker == second.worker
    front.inflight.check_integrity()
    assert len(front.inflight) == 0
    with pytest.raises(ValueError, match="reported_after_s must be positive"):
        Dispatcher(roster, InFlight(16), service, "least-loaded", None, 0.0)
