"""Keeps the service's view of one worker's cache right.

The publisher registers the worker, streams its prefix cache's KV events in numbered
batches, heartbeats, and repairs the service's view with a full resync (a snapshot of
every published page) whenever it may have diverged:

- the service asked for it (a sequence gap, an unknown parent page);
- a batch could not be delivered (its events are then lost to the service);
- the service restarted (its epoch changed) or no longer knows this worker.

A lost reply is harmless: the retry carries the same sequence number, and the service
ignores a batch it already applied. Epochs belong to the service: each registration gets a
new one, and every later message carries it.

Publishing is off the request path: a request only `nudge`s the publisher's thread, which
sends the new events a moment later; a failure to publish is logged and repaired by a
resync, never raised into a request. `sync()` (the worker's `flush`) publishes now and
says whether the service is up to date, for tests and benchmarks that must know.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from cache_service.messages import EMPTY_REPORT, EpochReply, WorkerReport
from workers.cache.prefix_cache import PrefixCache
from workers.service.client import ServiceClient, ServiceError, ServiceUnavailable

log = logging.getLogger(__name__)

# Events per batch: a batch is one frame, and a frame may hold at most
# `Limits.max_containers` lists and maps (an event is one or two).
MAX_EVENTS_PER_BATCH = 4096


class EventPublisher:
    """Publishes one worker's cache to the service (see module docstring).

    Args:
        client: the service client (its own socket: the publisher's thread uses it).
        cache: the worker's local prefix cache.
        worker_id, node_id, tier, address: how the worker registers; `address` is its
            page server, where peers on other nodes read pages.
        shm_name: its shared-memory page store, which peers on its node attach to.
        page_key: its page server's public key (z85); None when page reads are not
            authenticated. The service hands these to peers (`ServiceClient.peer`).
        capacity: pages the worker's store holds, the most the service lets it hold in the
            index; None: the cache's own page count (a cache over the store holds them all).
        load: the worker's current load, sent with each heartbeat.
        report: the worker's figures, sent with each heartbeat (for the service's metrics).
        on_new_service: called when a new service incarnation answered (its epoch changed),
            so the worker's other clients reconnect at once instead of timing out first.
    """

    def __init__(
        self,
        client: ServiceClient,
        cache: PrefixCache,
        worker_id: str,
        node_id: str,
        tier: str = "cpu",
        address: str = "",
        shm_name: str = "",
        page_key: bytes | None = None,
        capacity: int | None = None,
        load: Callable[[], float] = lambda: 0.0,
        report: Callable[[], WorkerReport] = lambda: EMPTY_REPORT,
        on_new_service: Callable[[], None] = lambda: None,
    ):
        self.client = client
        self.cache = cache
        self.worker_id = worker_id
        self.node_id = node_id
        self.tier = tier
        self.address = address
        self.shm_name = shm_name
        self.page_key = page_key
        self.capacity = int(cache.stats()["total_pages"]) if capacity is None else capacity
        self._load = load
        self._report = report
        self._on_new_service = on_new_service
        self.epoch = 0  # issued by the service at registration; 0: not registered
        self.seq = 0
        self.service_epoch: int | None = None
        self.quarantine_version = 0  # of the service's quarantine list, as last heard
        self.refused_code = ""  # the code of the last refusal, if any
        self.resyncs = 0
        self.batches = 0
        self.held_elsewhere = 0  # pages marked held elsewhere, from the heartbeats' replies
        self._needs_sync = True  # nothing registered yet
        self.up = False  # the last heartbeat got an answer
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by nudge(): events are waiting
        self._thread: threading.Thread | None = None

    def sync(self) -> bool:
        """Register if needed, then deliver pending events or a full resync.

        Returns:
            True when the service is now up to date with the cache; False when it could
            not be reached (the next call repairs it with a resync).
        """
        with self._lock:
            try:
                if self._needs_sync:
                    self._register_and_resync()
                else:
                    self._send_events()
                self.refused_code = ""
                return True
            except ServiceUnavailable as exc:
                log.warning("worker %s: service unavailable (%s)", self.worker_id, exc)
                self._needs_sync = True
                return False
            except ServiceError as exc:  # refused (e.g. a stale epoch): start over
                # In quarantine, every round is refused until an operator clears it: said
                # once, not twice a second.
                level = (
                    logging.DEBUG
                    if exc.code == self.refused_code == "quarantined"
                    else logging.WARNING
                )
                log.log(level, "worker %s: service refused an update (%s)", self.worker_id, exc)
                self.refused_code = exc.code
                self._needs_sync = True
                return False

    def heartbeat(self) -> bool:
        """Tell the service this worker is alive, with its load and figures; resync if the
        service restarted. Sets `up`: whether the service answered."""
        load, report = self._load(), self._report()
        with self._lock:
            try:
                reply = self.client.heartbeat(self.worker_id, self.epoch, load, report)
                epoch, self.quarantine_version = reply.service_epoch, reply.quarantine
                if reply.elsewhere_pages:
                    self._held_elsewhere(reply)
            except ServiceUnavailable:
                self._needs_sync = True
                self.up = False
                return False
            except ServiceError as exc:
                if exc.code != "unknown_worker":
                    raise
                epoch = None
            if epoch != self.service_epoch:
                log.info("worker %s: service epoch changed, resyncing", self.worker_id)
                self._needs_sync = True
        self.up = self.sync()
        return self.up

    def _held_elsewhere(self, reply: EpochReply) -> None:
        """Mark the pages the service says another worker has stored since (they go
        first when the cache must make room); a reply whose lists disagree is dropped."""
        pages, generations = reply.elsewhere_pages, reply.elsewhere_generations
        if len(pages) != len(generations):
            log.warning(
                "worker %s: heartbeat reply names %d pages held elsewhere and %d "
                "generations; ignored",
                self.worker_id,
                len(pages),
                len(generations),
            )
            return
        self.held_elsewhere += self.cache.held_elsewhere(pages, generations)

    def start(self, interval_s: float = 0.5, tick: Callable[[], None] | None = None) -> None:
        """Sync and heartbeat every `interval_s` from a daemon thread; `tick` (the worker's
        own housekeeping, e.g. keeping its page server up) runs each round too."""
        if self._thread is not None:
            raise RuntimeError("publisher already started")
        self._thread = threading.Thread(
            target=self._run,
            args=(interval_s, tick),
            name=f"kvmesh-publisher-{self.worker_id}",
            daemon=True,
        )
        self._thread.start()

    def nudge(self) -> None:
        """New events are waiting: the publisher's thread sends them now, then a
        heartbeat (without the caller waiting for it)."""
        self._wake.set()

    def stop(self, bye: bool = True) -> None:
        """Stop the thread; with `bye`, tell the service to drop this worker now."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        if bye and self.epoch:
            try:
                self.client.bye(self.worker_id, self.epoch)
            except (ServiceUnavailable, ServiceError) as exc:
                log.info("worker %s: bye not delivered (%s)", self.worker_id, exc)

    def _run(self, interval_s: float, tick: Callable[[], None] | None) -> None:
        """Heartbeat (which syncs) and tick every `interval_s`; sync and heartbeat at once
        when nudged."""
        next_beat = time.monotonic() + interval_s
        while True:
            self._wake.wait(max(0.0, next_beat - time.monotonic()))
            if self._stop.is_set():
                return
            self._wake.clear()
            if time.monotonic() >= next_beat:
                steps = (self.heartbeat, tick)
                next_beat = time.monotonic() + interval_s
            else:
                # Nudged (a request finished): its events first (the next request for its
                # prompt should find them), then the load as it is now, so routing does not
                # weigh a queue that is already gone.
                steps = (self.sync, self.heartbeat)
            for step in steps:
                if step is None:
                    continue
                try:
                    step()
                except Exception:  # keep publishing whatever one round ran into
                    self._needs_sync = True
                    log.exception("worker %s: publisher round failed", self.worker_id)

    def _register_and_resync(self) -> None:
        registered = self.client.register(
            self.worker_id,
            self.node_id,
            self.tier,
            self.address,
            self.shm_name,
            self.page_key,
            self.capacity,
        )
        moved = self.service_epoch is not None and registered.service_epoch != self.service_epoch
        self.service_epoch, self.epoch, self.seq = registered.service_epoch, registered.epoch, 0
        if moved:
            self._on_new_service()
        chains = self.cache.snapshot(drain_events=True)
        self.seq += 1
        self.client.resync(self.worker_id, self.epoch, self.seq, chains)
        self.resyncs += 1
        self._needs_sync = False

    def _send_events(self) -> None:
        events = self.cache.take_events()
        for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
            self.seq += 1
            batch = events[start : start + MAX_EVENTS_PER_BATCH]
            try:
                reply = self.client.publish_events(self.worker_id, self.epoch, self.seq, batch)
            except ServiceUnavailable:
                self._needs_sync = True  # these events are gone: a snapshot will cover them
                raise
            self.batches += 1
            if reply.needs_resync:
                log.info("worker %s: service asks for a resync (%s)", self.worker_id, reply.reason)
                self._register_and_resync()  # the snapshot covers the rest of the events
                return
