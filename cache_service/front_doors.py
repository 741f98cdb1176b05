"""Every front door's requests in flight, as the service last heard them: so that front
doors routing at once do not herd. Pure: no Ray, no sockets, no clock of its own.

A front door counts its requests in flight that the workers' heartbeats do not count yet
(those sent within two publish intervals) and sends the count with each ROUTE (`loads`);
a worker's heartbeat brings the rest of its queue. Two front doors routing at once would
each see only their own requests, and the same idle worker would take a burst from both
of them (each door balancing only its own half). The service is
the one place every ROUTE passes, so it keeps each door's latest count, with the request
it just routed added, and a ROUTE from one door weighs the others' beside its own:

    queue(w) = own(w) + sum of other doors' loads(w)    (doors heard within FRESH_S)

and the policy adds the worker's own report. A door that stopped sending is forgotten
after FRESH_S: by then the heartbeats carry its requests, or they have ended. (Ray Serve's
KV-aware router broadcasts its replicas' reservations to one another for the same
reason.)

    door A: ROUTE(loads={w0: 0, w1: 0}) -> w0   kept: A {w0: 300, w1: 0}
    door B: ROUTE(loads={w0: 0, w1: 0})         weighed as {w0: 300, w1: 0} -> w1
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

from cache_service.messages import RouteDecision

# A door's count is weighed this long after its last ROUTE: two of the workers'
# heartbeat intervals (0.5 s by default), after which their queues carry its requests.
FRESH_S = 1.0
# Doors remembered at most (the stalest forgotten first): a bound on the state any
# number of clients can make the service keep.
MAX_DOORS = 64


class _Door(NamedTuple):
    heard_at: float  # when its last ROUTE came (the caller's clock)
    loads: dict[str, float]  # worker id -> prompt tokens in flight there


class FrontDoors:
    """The latest loads of each front door (by the id its ROUTEs carry)."""

    def __init__(self, fresh_s: float = FRESH_S, max_doors: int = MAX_DOORS):
        if not fresh_s > 0 or max_doors < 1:
            raise ValueError(f"fresh_s {fresh_s} must be > 0 and max_doors {max_doors} >= 1")
        self.fresh_s = fresh_s
        self.max_doors = max_doors
        self._doors: dict[str, _Door] = {}  # in the order they were last heard

    def route(
        self,
        door: str | None,
        loads: Mapping[str, float],
        pending: Mapping[str, float],
        prompt_tokens: int,
        now: float,
        choose: Callable[[dict[str, float]], RouteDecision],
    ) -> RouteDecision:
        """Route one prompt of door `door` by `choose` over the weighed loads, and keep the
        door's count with the routed request in it (what it computes, as the door counts
        it: the prompt less what the chosen worker holds or is computing of it)."""
        decision = choose(self.weighed(door, loads, now))
        held = max(decision.matched_tokens, int(pending.get(decision.worker_id, 0)))
        self.heard(door, loads, decision.worker_id, max(1, prompt_tokens - held), now)
        return decision

    def weighed(self, door: str | None, loads: Mapping[str, float], now: float) -> dict[str, float]:
        """`loads` of door `door` with every other fresh door's added, for the same workers
        (None: a caller that names no door; the others' loads are added all the same)."""
        out = dict(loads)
        for name, other in self._doors.items():
            if name == door or now - other.heard_at > self.fresh_s:
                continue
            for worker, tokens in other.loads.items():
                if worker in out:
                    out[worker] += tokens
        return out

    def heard(
        self,
        door: str | None,
        loads: Mapping[str, float],
        routed_to: str | None,
        tokens: int,
        now: float,
    ) -> None:
        """Door `door` sent `loads` and had a request computing `tokens` routed to
        `routed_to`: keep its count, that request included, until it routes again."""
        if door is None:
            return
        kept = {w: float(n) for w, n in loads.items()}
        if routed_to is not None:
            kept[routed_to] = kept.get(routed_to, 0.0) + max(0, tokens)
        self._doors.pop(door, None)
        self._doors[door] = _Door(now, kept)
        while len(self._doors) > self.max_doors:
            del self._doors[next(iter(self._doors))]  # the one heard longest ago
        self._forget(now)

    def _forget(self, now: float) -> None:
        for name in [n for n, d in self._doors.items() if now - d.heard_at > self.fresh_s]:
            del self._doors[name]

    def __len__(self) -> int:
        return len(self._doors)

    def check_integrity(self) -> None:
        """At most max_doors doors, kept in the order heard, no negative or non-finite
        loads (raises AssertionError)."""
        assert len(self._doors) <= self.max_doors, f"{len(self._doors)} > {self.max_doors} doors"
        times = [d.heard_at for d in self._doors.values()]
        assert times == sorted(times), f"doors out of the order heard: {times}"
        for name, door in self._doors.items():
            for worker, tokens in door.loads.items():
                assert 0 <= tokens < float("inf"), f"door {name}: {worker} has {tokens} tokens"
