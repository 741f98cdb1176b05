"""Sending requests to workers, and running them again elsewhere when a worker dies: the
front door's one path for `generate`, `stream` and `chat`.

Every request goes through the same two steps:

    placed(request)     route it (the service runs the configured policy over its index;
                        without the service, this front door runs it over what it knows),
                        and count it in flight on the chosen worker while it runs
    failover(worker)    a worker that dies under a call (Ray's RayActorError) is marked
                        lost (routing skips it, the service drops its pages, its peers
                        forget it), one that refuses it (ServingStopped: its serving loop
                        failed) is left out of routing until it serves again; either
                        way the request is routed again, unless the caller named the
                        worker or a stream already handed tokens over: then MeshError

`generate` sends each worker the requests routed to it as one batch (queued together, they
share what they have in common) and gathers the outputs in order; `stream` runs one
request as a Ray streaming generator and yields the worker's items as they come.

Every request has a deadline (its `timeout_s`, from the call): each worker call carries
what is left of it (the worker ends the request there, with DeadlineExceeded naming the
phase), and the front door waits for a worker no longer than that and a grace: a worker
that has not answered by then is told to cancel, and the caller gets DeadlineExceeded. A
stream its caller leaves (closed, or collected) is cancelled on its worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import ray

from cache_service.routing import EstimatedTtft, RouteInputs, candidates_of, make_policy
from cluster.errors import DeadlineExceeded, MeshError, RequestEnded
from cluster.inflight import InFlight
from cluster.requests import FrontRequest
from cluster.roster import Roster
from workers.api import GenerateOutput, GenerateRequest, ServingStopped, StreamItem
from workers.service.client import ServiceClient, ServiceUnavailable

if TYPE_CHECKING:
    from cluster.config import KvmeshConfig

log = logging.getLogger(__name__)

# How long past a request's deadline the front door still waits for its worker's answer:
# the worker ends the request at its deadline (at its next step, or past its own grace,
# workers.worker.DEADLINE_GRACE_S) and its DeadlineExceeded, which names the phase, is
# worth a short wait; every request still ends within a second of its deadline.
ANSWER_GRACE_S = 0.75


class Deadline:
    """A request's deadline, from the call."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.at = time.monotonic() + timeout_s

    def left(self) -> float:
        """Seconds left; DeadlineExceeded when none are.

        Raises:
            DeadlineExceeded: the deadline passed before the request reached a worker.
        """
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(self.timeout_s, "queued", {"queued": self.timeout_s - left})
        return left

    def body(self, request: FrontRequest, estimate_s: float = 0.0) -> GenerateRequest:
        """What a worker gets: the request, with what is left of its deadline and the
        router's estimate of its time to first token (0: none)."""
        return dataclasses.replace(request.body, timeout_s=self.left(), route_estimate_s=estimate_s)

    def wait_s(self) -> float:
        """How long to wait for a worker's next answer."""
        return max(0.0, self.at - time.monotonic()) + ANSWER_GRACE_S

    def unanswered(self, worker: str) -> DeadlineExceeded:
        error = DeadlineExceeded(self.timeout_s, "unanswered", {})
        error.args = (f"{error.args[0]} (worker {worker!r} did not answer in time)",)
        return error


class Placement(NamedTuple):
    """Where a request runs, and the router's estimate of its time to first token there
    (0: none; only kvmesh's own policy estimates one)."""

    worker: str
    estimate_s: float = 0.0


class Route(NamedTuple):
    """The routing policy's choice: the worker, the prompt tokens it is expected to
    compute, and its estimate of the time to first token (0: none)."""

    worker: str
    computes: int
    estimate_s: float = 0.0


class Attempt:
    """One call to a worker; `started`: it handed something over (a stream's token)."""

    def __init__(self) -> None:
        self.started = False


class Dispatcher:
    """Routes, sends and fails over this front door's requests. Thread-safe.

    Args:
        roster: the workers, alive or dead, with their actor handles.
        inflight: this front door's requests in flight (routing weighs them).
        client: the service client routing asks (it skips the service while it is down).
        policy: the routing policy's name (`cache_service.routing.POLICIES`).
        door: this front door's id in its ROUTEs (default: a new random one): the service
            weighs other front doors' requests in flight beside this one's.
        reported_after_s: how soon the workers' reports count a request sent to them
            (their heartbeat interval and a margin): a ROUTE carries only this front
            door's requests sent within it, the service adds the workers' reports.
    """

    def __init__(
        self,
        roster: Roster,
        inflight: InFlight,
        client: ServiceClient,
        policy: str,
        door: str | None = None,
        reported_after_s: float = 1.0,
    ):
        if not reported_after_s > 0:
            raise ValueError(f"reported_after_s must be positive, got {reported_after_s}")
        self.roster = roster
        self.reported_after_s = reported_after_s
        self.inflight = inflight
        self.client = client
        self.policy = policy
        self.door = door or f"door-{secrets.token_hex(6)}"
        # Without the service, the same policy runs here on what this front door knows
        # (its own requests in flight), or least-loaded for a policy that needs the index.
        local = make_policy(policy)
        self._fallback = local if not local.uses_holdings else make_policy("least-loaded")
        # Routing a request and counting it in flight are one step: requests routed at
        # once from several threads would otherwise each see the others' workers idle
        # and herd onto the same one (a burst of cold prompts, all on one worker).
        self._routing = threading.Lock()

    @classmethod
    def of(cls, cfg: KvmeshConfig, roster: Roster, client: ServiceClient) -> Dispatcher:
        """The dispatcher of a mesh's front door: the mesh's policy and page size, and its
        ROUTEs carry the requests sent within the last two of the workers' heartbeat
        intervals (a heartbeat counts a request sent within one; the second is a margin)."""
        inflight = InFlight(cfg.cache.page_tokens)
        after_s = 2 * cfg.workers.publish_interval_s
        return cls(roster, inflight, client, cfg.routing.policy, reported_after_s=after_s)

    # -- the two steps -----------------------------------------------------------------

    @contextlib.contextmanager
    def placed(self, request: FrontRequest, worker: str | None = None) -> Iterator[Placement]:
        """Route a request (to `worker` when one is named) and count it in flight there
        while the block runs, for the routing of the requests after it; yields where it
        runs.

        Raises:
            MeshError: every worker is dead, or the named one is.
        """
        with self._routing:
            route = self.route(request) if worker is None else Route(worker, len(request.tokens))
            chosen = route.worker
            if self.roster.is_dead(chosen):
                raise MeshError(f"worker {chosen!r} is dead")
            handle = self.inflight.add(chosen, request.namespace, request.tokens, route.computes)
        try:
            with self.roster.running(chosen):
                yield Placement(chosen, route.estimate_s)
        finally:
            self.inflight.remove(handle)

    @contextlib.contextmanager
    def failover(self, worker: str, pinned: bool) -> Iterator[Attempt]:
        """Run a call to `worker`; if the worker dies under it, mark it lost, or if it
        stopped serving, leave it out of routing, and return normally (the caller routes
        the request again); or raise MeshError when it cannot run again: the caller
        named the worker (`pinned`), or the call handed something over already (the
        caller set the attempt's `started`)."""
        attempt = Attempt()
        try:
            yield attempt
        except ray.exceptions.RayActorError as exc:
            self.roster.lost(worker, exc)
            if pinned or attempt.started:
                raise MeshError(f"worker {worker!r} died during the request: {exc}") from None
        except ServingStopped as exc:  # Ray's error for it is a ServingStopped too
            why = str(getattr(exc, "cause", None) or exc).strip().splitlines()[-1]
            self.roster.stopped_serving(worker, why)
            if pinned or attempt.started:
                raise MeshError(f"worker {worker!r} stopped serving: {why}") from None

    def route(self, request: FrontRequest) -> Route:
        """The live worker the routing policy chooses, the prompt tokens it is expected
        to compute, and the policy's estimate of the time to first token (kvmesh's own,
        run by the service; 0 otherwise).

        Raises:
            MeshError: every worker is dead.
        """
        live = self.roster.routable()
        if not live:
            down = [f"{w} ({why})" for w, why in self.roster.not_serving().items()]
            raise MeshError(
                f"no live worker serves now (dead: {', '.join(self.roster.dead()) or 'none'}; "
                f"not serving: {', '.join(down) or 'none'})"
            )
        namespace, tokens = request.namespace, request.tokens
        # The workers' reports count the rest of this door's requests in flight.
        recent = self.inflight.loads(live, self.reported_after_s)
        pending = self.inflight.pending(namespace, tokens)
        estimates = self.policy == EstimatedTtft.name
        try:
            decision = self.client.route(namespace, tokens, recent, pending, self.policy, self.door)
        except ServiceUnavailable:
            estimates = False
            # Without the index or the reports: every request this front door has there.
            loads = self.inflight.loads(live)
            nodes = dict.fromkeys(live, "")
            inputs = RouteInputs(candidates_of(loads, nodes), len(tokens), pending=pending)
            decision = self._fallback.choose(inputs)
        if decision.worker_id not in recent:  # the service knows none of the live ones yet
            estimates = False
            loads = self.inflight.loads(live)
            decision = make_policy("least-loaded").choose(
                RouteInputs(candidates_of(loads, dict.fromkeys(live, "")), len(tokens))
            )
        held = max(decision.matched_tokens, int(pending.get(decision.worker_id, 0)))
        estimate_s = float(decision.score) if estimates else 0.0
        if not (math.isfinite(estimate_s) and estimate_s > 0):
            estimate_s = 0.0  # none to report against
        return Route(decision.worker_id, max(1, len(tokens) - held), estimate_s)

    # -- requests ----------------------------------------------------------------------

    def generate(
        self, requests: Sequence[FrontRequest], worker: str | None = None
    ) -> list[GenerateOutput]:
        """Route each request, send each worker its requests as one batch, gather the
        outputs in order; requests whose worker died run again on live workers.

        Raises:
            MeshError: no live worker is left, or the named `worker` died.
        """
        outputs: list[GenerateOutput | None] = [None] * len(requests)
        pending = dict(enumerate(requests))
        deadline = Deadline(max(request.body.timeout_s for request in requests))
        while pending:
            with contextlib.ExitStack() as running:
                by_worker: dict[str, list[int]] = {}
                estimates: dict[int, float] = {}
                for i, request in pending.items():
                    placement = running.enter_context(self.placed(request, worker))
                    by_worker.setdefault(placement.worker, []).append(i)
                    estimates[i] = placement.estimate_s
                calls = {
                    chosen: self.handle(chosen).generate_batch.remote(
                        [deadline.body(pending[i], estimates[i]) for i in indexes]
                    )
                    for chosen, indexes in by_worker.items()
                }
                for chosen, call in calls.items():
                    ids = [pending[i].body.request_id for i in by_worker[chosen]]
                    with self.failover(chosen, pinned=worker is not None):
                        answer = self._answer(call, chosen, ids, deadline)
                        for i, output in zip(by_worker[chosen], answer, strict=True):
                            outputs[i] = output
                            del pending[i]
        return outputs

    def _answer(self, call: Any, worker: str, ids: list[str], deadline: Deadline) -> Any:
        """A worker call's answer, waited for until the deadline and its grace.

        Raises:
            DeadlineExceeded: the worker ended the requests at their deadline, or did not
                answer by then (they are cancelled there).
            RequestEnded: the worker ended them otherwise (as the worker raised it).
        """
        ready, _ = ray.wait([call], timeout=deadline.wait_s())
        if not ready:
            self.cancel(worker, ids)
            raise deadline.unanswered(worker)
        return _get(call)

    def cancel(self, worker: str, ids: list[str]) -> None:
        """Tell a worker to end these requests (their callers left); nothing waits."""
        try:
            self.handle(worker).cancel.remote(ids)
        except Exception:  # a worker gone cannot hold them either
            log.debug("could not cancel %s on %s", ids, worker, exc_info=True)

    def stream(self, request: FrontRequest, worker: str | None = None) -> Iterator[StreamItem]:
        """The worker's stream items as they come: each sampled token, then the output.
        A routed request whose worker dies before its first token runs again on a live
        worker.

        Raises:
            MeshError: no live worker is left, the named `worker` died, or the worker
                died after handing tokens over.
        """
        deadline = Deadline(request.body.timeout_s)
        while True:
            with (
                self.placed(request, worker) as (chosen, estimate_s),
                self.failover(chosen, pinned=worker is not None) as attempt,
            ):
                call = self.handle(chosen).stream.options(num_returns="streaming")
                items = call.remote(deadline.body(request, estimate_s))
                try:
                    while True:
                        ready, _ = ray.wait([items], timeout=deadline.wait_s())
                        if not ready:
                            raise deadline.unanswered(chosen)
                        item = _get(self._next(items))
                        yield item
                        if item.last:
                            return
                        attempt.started = True
                except (ray.exceptions.RayActorError, ServingStopped):
                    raise  # nothing left there to cancel
                except BaseException:  # a deadline, or the caller left (GeneratorExit)
                    self.cancel(chosen, [request.body.request_id])
                    raise

    @staticmethod
    def _next(items: Any) -> Any:
        """The next item's reference of a worker's stream (its end is an error: a stream
        ends with its output)."""
        try:
            return next(items)
        except StopIteration:
            raise MeshError("a worker's stream ended without its output") from None

    def handle(self, worker_id: str) -> Any:
        """The actor handle of a worker."""
        return self.roster.handles[worker_id]


def _get(ref: Any) -> Any:
    """A worker call's value; a request the worker ended raises its own error (Ray's
    wrapper of it is one too, with the worker's traceback: the caller gets the cause)."""
    try:
        return ray.get(ref)
    except RequestEnded as exc:
        raise getattr(exc, "cause", None) or exc from None
