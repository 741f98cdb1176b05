"""The front door's roster of workers: which are alive, what each is running, how they reach
each other, and the watchdog that keeps it current.

Ray tells us at once when a worker's actor is gone: any call to it raises `RayActorError`
(a request's, or the watchdog's ping every WATCH_INTERVAL_S). A worker is then marked dead:
routing skips it, `on_lost` runs (the mesh reports it to the service, which drops its
holdings at once), and the live workers get the new list of their peers (they detach its
store and close their page clients to it). A worker that does not answer is not dead: a
busy actor only answers its ping late, and one behind a network cut answers once the link
is back (the service's liveness expiry takes its pages out of routing meanwhile).

A worker that is alive but does not serve (its serving loop failed and restarts, or
stays down: `workers.serving.loop`) is left out of routing while its `health` says so, or
while queued work has waited STALL_S for a pass; its pages stay available to its peers.
The watchdog's ping is that `health` call, so it takes the worker back once it serves.

With `workers.max_restarts`, Ray restarts a dead worker with a fresh store; the watchdog
asks dead workers for their `info` every REVIVAL_PROBE_S and takes back those that answer,
telling the others where the new store is.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import ray

from workers.api import ServingHealth, WorkerInfo

REVIVAL_PROBE_S = 1.0  # how often a dead worker is asked whether Ray restarted it
WATCH_INTERVAL_S = 0.5  # how often the front door checks that its workers are alive
# Queued work that no pass has served for this long means a stuck loop (the longest pass,
# a whole-context prefill of the real model on two cores, takes a few seconds).
STALL_S = 60.0


class Roster:
    """The workers of one mesh (Ray actor handles by id), as this front door knows them.

    Thread-safe: requests, the watchdog and `stats` use it at once.

    Args:
        workers: worker id -> actor handle.
        restarts: whether Ray restarts dead workers (`workers.max_restarts` != 0).
        on_lost: called once with the id of each worker found dead.
    """

    def __init__(
        self, workers: dict[str, Any], restarts: bool, on_lost: Callable[[str], None]
    ) -> None:
        self.handles = workers
        self._restarts = restarts
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self._dead: set[str] = set()  # workers whose actors Ray reported gone
        self._not_serving: dict[str, str] = {}  # alive, not serving: worker -> why
        self._inflight: Counter[str] = Counter()  # requests running on each worker
        self._infos: dict[str, WorkerInfo] = {}  # how workers reach each other
        self._probes: dict[str, Any] = {}  # dead worker -> its pending `info` call
        self._next_probe = 0.0
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ state

    def live(self) -> list[str]:
        """The workers not known to be dead, by id."""
        with self._lock:
            return [w for w in self.handles if w not in self._dead]

    def routable(self) -> list[str]:
        """The live workers that serve requests now, by id."""
        with self._lock:
            return [w for w in self.handles if w not in self._dead and w not in self._not_serving]

    def not_serving(self) -> dict[str, str]:
        """Live workers that do not serve now: worker -> why."""
        with self._lock:
            return dict(self._not_serving)

    def stopped_serving(self, worker_id: str, reason: str) -> None:
        """`worker_id` is alive but refuses requests: route around it until its health
        says it serves again."""
        with self._lock:
            if worker_id in self._dead or worker_id in self._not_serving:
                return
            self._not_serving[worker_id] = reason
        print(
            f"kvmesh: worker {worker_id} is not serving ({reason}); routing around it",
            file=sys.stderr,
        )

    def _serving_again(self, worker_id: str) -> None:
        with self._lock:
            if self._not_serving.pop(worker_id, None) is None:
                return
        print(f"kvmesh: worker {worker_id} serves again", file=sys.stderr)

    def is_dead(self, worker_id: str) -> bool:
        with self._lock:
            return worker_id in self._dead

    def dead(self) -> list[str]:
        with self._lock:
            return sorted(self._dead)

    def loads(self) -> dict[str, float]:
        """live worker -> its share of the requests in flight (0 when none runs)."""
        with self._lock:
            inflight = {w: self._inflight[w] for w in self.handles if w not in self._dead}
        total = sum(inflight.values()) or 1
        return {w: n / total for w, n in inflight.items()}

    @contextlib.contextmanager
    def running(self, worker_id: str, requests: int = 1) -> Iterator[None]:
        """Count `requests` as in flight on `worker_id` while the block runs."""
        with self._lock:
            self._inflight[worker_id] += requests
        try:
            yield
        finally:
            with self._lock:
                self._inflight[worker_id] -= requests

    def met(self, infos: dict[str, WorkerInfo], dead: set[str] = frozenset()) -> None:
        """Record the workers' `info` (and those already found dead, when attaching)."""
        with self._lock:
            self._infos.update(infos)
            self._dead |= set(dead)

    def lost(self, worker_id: str, reason: BaseException) -> None:
        """Ray says `worker_id`'s actor is gone: route around it from now on, run
        `on_lost`, and tell the other workers to forget it."""
        with self._lock:
            if worker_id in self._dead:
                return
            self._dead.add(worker_id)
            self._not_serving.pop(worker_id, None)
        print(
            f"kvmesh: worker {worker_id} is gone ({type(reason).__name__}); routing around it",
            file=sys.stderr,
        )
        self._on_lost(worker_id)
        self.tell_peers()

    def tell_peers(self) -> None:
        """Every live worker gets the current list of its peers (not awaited)."""
        live = self.live()
        with self._lock:
            peers = [self._infos[w] for w in live if w in self._infos]
        for worker_id in live:
            self.handles[worker_id].set_peers.remote(peers)

    # ------------------------------------------------------------------ watchdog

    def start_watchdog(self, each_round: Callable[[], None]) -> None:
        """Watch the workers from a thread of our own; `each_round` runs every round too
        (the mesh probes the service there)."""
        self._watchdog = threading.Thread(
            target=self._watch, args=(each_round,), name="kvmesh-watchdog", daemon=True
        )
        self._watchdog.start()

    def stop_watchdog(self) -> None:
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.join(10.0)
            self._watchdog = None

    def _watch(self, each_round: Callable[[], None]) -> None:
        """Ask every live worker for its health every WATCH_INTERVAL_S (a ping still
        unanswered is not sent again), take back restarted ones, then run `each_round`."""
        pings: dict[str, Any] = {}
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                for worker_id in self.live():
                    if worker_id not in pings:
                        pings[worker_id] = self.handles[worker_id].health.remote()
                if pings:
                    ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=0)
                    done = set(ready)
                    for worker_id, ping in list(pings.items()):
                        if ping in done:
                            del pings[worker_id]
                            self._answered(worker_id, ping)
                self._check_revived()
                each_round()
            except Exception as exc:  # the watchdog must outlive whatever one round hit
                if self._stop.is_set():
                    return
                print(f"kvmesh: worker watchdog round failed: {exc!r}", file=sys.stderr)

    def _answered(self, worker_id: str, ping: Any) -> None:
        try:
            health: ServingHealth = ray.get(ping, timeout=0)
        except ray.exceptions.RayActorError as exc:
            self.lost(worker_id, exc)
            return
        except ray.exceptions.RayError:
            return  # not a death: asked again next round
        if not health.serving:
            self.stopped_serving(worker_id, f"its serving loop failed: {health.last_failure}")
        elif health.stalled_s > STALL_S:
            self.stopped_serving(
                worker_id, f"queued work has waited {health.stalled_s:.0f}s for a pass"
            )
        else:
            self._serving_again(worker_id)

    def _check_revived(self) -> None:
        """Take back dead workers that Ray restarted: each is a new incarnation with an
        empty store, and the others learn where its pages now are. Probes at most every
        REVIVAL_PROBE_S, without waiting for an answer."""
        if not self._restarts or not self.dead():
            return
        now = time.monotonic()
        if now < self._next_probe:
            return
        self._next_probe = now + REVIVAL_PROBE_S
        for worker_id in self.dead():
            probe = self._probes.get(worker_id)
            if probe is None:
                probe = self._probes[worker_id] = self.handles[worker_id].info.remote()
            ready, _ = ray.wait([probe], timeout=0)
            if not ready:
                continue  # restarting: ask again later
            del self._probes[worker_id]
            try:
                info = ray.get(probe)
            except ray.exceptions.RayActorError:
                continue  # dead for good, or died again before answering
            with self._lock:
                self._infos[worker_id] = info
                self._dead.discard(worker_id)
            print(f"kvmesh: worker {worker_id} is back (restarted, empty)", file=sys.stderr)
            self.tell_peers()
