"""The service's ZMQ front: a ROUTER loop that answers workers from the global index.

One thread, the loop, owns the socket and the index (the index refuses calls from any
other thread while the loop runs, and needs no lock this way). The loop polls with a
timeout so housekeeping (expiring silent workers, publishing the metrics) runs even when
no request arrives. Each request's frames go to `cache_service.handlers`: the one codec
decodes them into a typed request, its handler passes the fields to the index and returns
the typed reply the codec encodes. Anything malformed is answered with an error reply
naming what was wrong, and the loop keeps serving.

Callers in other threads (the Ray actor, tests, later the metrics exporter) reach the
index through the loop: `stats()`, `check_integrity()` and `run_housekeeping()` queue a
call that the loop runs between requests (woken at once through an inproc socket), and
wait for its result. Before `start` and after `stop` they run in the caller's thread.

With keys (`cache_service.auth.ServerKeys`), the socket is a CURVE server: only the
mesh's keys get through (the ZAP handler of `cache_service.zap`), and each request is
checked against the identity its key is bound to before it reaches the index: a worker
speaks only for itself, the front door never publishes (`cache_service.auth.allowed`,
applied by the handlers).
Without keys the same epoch rules and bounds hold, for anyone who can reach the socket.

Envelope on the socket: a client DEALER sends one frame, the payload; the ROUTER sees
[identity, payload] and replies [identity, reply]. A REQ client's empty delimiter frame
is accepted and echoed, so both kinds of client work.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import zmq
from prometheus_client import CollectorRegistry

from cache_service import metrics, protocol, zap
from cache_service.addresses import check_bind_host
from cache_service.auth import ServerKeys
from cache_service.handlers import RequestHandlers
from cache_service.histograms import Histogram
from cache_service.index import GlobalIndex
from cache_service.quarantine import Quarantine
from cache_service.reports import WorkerReports
from cache_service.web import WebServer

log = logging.getLogger(__name__)
T = TypeVar("T")

# Requests answered per wakeup before the loop looks at its clock and control queue again.
_DRAIN = 256
_servers = itertools.count()


@dataclass(frozen=True)
class ServerConfig:
    """Where the service listens and how it keeps time."""

    # An address of this node, or loopback. Never a wildcard: see cache_service.addresses.
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; the bound address is reported by `address`
    liveness_timeout_s: float = 10.0
    # How often the loop wakes up without traffic to expire silent workers.
    housekeeping_interval_s: float = 0.25
    page_tokens: int = 16
    load_weight: float = 1.0
    # Bounds on what clients can make the service hold (see GlobalIndex): registrations,
    # tenants with figures of their own, holders named per match.
    max_workers: int = 1024
    max_tenants: int = 256
    max_spans: int = 16
    # The most pages one worker may hold in the index (the capacity it registers is
    # refused beyond it): 1M pages, 16M tokens at 16 a page, some 270 MiB of index.
    max_capacity: int = 1 << 20
    # The HTTP port for Prometheus (/metrics): loopback unless told otherwise, and beyond
    # loopback only with an access token. None: no HTTP port.
    metrics_host: str | None = "127.0.0.1"
    metrics_port: int = 0
    metrics_token: str = ""
    # Whether clients without a token see figures by tenant (see cache_service.web).
    metrics_show_tenants: bool = False
    # How often the loop publishes a fresh metrics snapshot.
    metrics_interval_s: float = 1.0

    def __post_init__(self) -> None:
        check_bind_host(self.host)
        if self.metrics_host is not None:
            check_bind_host(self.metrics_host, "metrics_host")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.metrics_interval_s <= 0:
            raise ValueError("metrics_interval_s must be positive")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.liveness_timeout_s <= 0 or self.housekeeping_interval_s <= 0:
            raise ValueError("liveness_timeout_s and housekeeping_interval_s must be positive")
        if self.page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {self.page_tokens}")


class ServiceServer:
    """Serves one GlobalIndex on a ROUTER socket from a background thread.

    Usage:
        server = ServiceServer(GlobalIndex(...), ServerConfig(...))
        address = server.start()   # "tcp://127.0.0.1:PORT"
        server.stats()             # through the loop
        server.stop()

    Args:
        index: the index to serve; the loop thread owns it while the server runs.
        config: where to listen, liveness and housekeeping.
        keys: the service's CURVE keys and the identities of the keys it admits; None
            serves anyone, in plain text.
        limits: bounds on every frame.
        clock: seconds, monotonic; liveness is judged by it (tests inject their own).
    """

    def __init__(
        self,
        index: GlobalIndex,
        config: ServerConfig | None = None,
        keys: ServerKeys | None = None,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        clock: Callable[[], float] = time.monotonic,
        quarantine: Quarantine | None = None,
    ):
        self.index = index
        self.config = config or ServerConfig()
        self.keys = keys
        self.limits = limits
        self._clock = clock
        # A new epoch for every start: workers that see it change re-register and resync.
        self.epoch = time.time_ns() // 1000
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._zap_domain = ""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._address = ""
        # Metrics: the loop times matches and publishes snapshots; the web thread serves.
        self._lookup = Histogram(metrics.LOOKUP_BUCKETS)
        self._collector = metrics.SnapshotCollector()
        self.reports = WorkerReports()  # the workers' own figures, from their heartbeats
        self._web: WebServer | None = None
        self._next_metrics = 0.0
        # Calls from other threads, run by the loop; `_running` and the queue change
        # together under `_calls_lock`, so no call is queued after the loop stopped.
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._calls_lock = threading.Lock()
        self._running = False
        self._wake_address = f"inproc://kvmesh-service-control-{next(_servers)}"
        self._wake: zmq.Socket | None = None
        self._wake_lock = threading.Lock()
        # Each request's answer, on the loop thread: the index's, under the identity rules.
        self._handlers = RequestHandlers(
            index,
            self.epoch,
            self.reports,
            self._lookup,
            self._stats_snapshot,
            keys,
            limits,
            clock,
            quarantine,
        )

    @property
    def requests(self) -> int:
        """Requests answered since the server was made, malformed ones included."""
        return self._handlers.requests

    @property
    def errors(self) -> int:
        """Requests answered with an error reply."""
        return self._handlers.errors

    @property
    def address(self) -> str:
        """The bound endpoint, e.g. "tcp://127.0.0.1:40123" ("" before start)."""
        return self._address

    @property
    def metrics_url(self) -> str | None:
        """Where Prometheus scrapes, e.g. "http://127.0.0.1:40125/metrics" (None: no port)."""
        return None if self._web is None else f"{self._web.url}/metrics"

    @property
    def dashboard_url(self) -> str | None:
        """The live dashboard page, on the metrics port (None: no port). Beyond loopback,
        open it once with `?token=<service.metrics_token>`."""
        return None if self._web is None else f"{self._web.url}/dashboard"

    def start(self) -> str:
        """Bind and start serving in a daemon thread; returns the bound address."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        if self._stop.is_set():
            raise RuntimeError("a stopped server does not start again: make a new one")
        socket = self._context.socket(zmq.ROUTER)
        socket.linger = 0
        # ZMQ drops an oversized message before buffering it; the codec refuses it too.
        socket.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes + 4096)
        # No ROUTER_HANDOVER: it would let a client that names its routing id take over
        # another connection's replies.
        if self.keys is not None:
            socket.curve_secretkey = self.keys.keypair.secret
            socket.curve_publickey = self.keys.keypair.public
            socket.curve_server = True
            self._zap_domain = zap.open_domain(self.keys.clients.keys(), self._context)
            socket.zap_domain = self._zap_domain.encode()
        host = self.config.host
        if self.config.port:
            socket.bind(f"tcp://{host}:{self.config.port}")
            port = self.config.port
        else:
            port = socket.bind_to_random_port(f"tcp://{host}")
        self._socket = socket
        self._address = f"tcp://{host}:{port}"
        control = self._context.socket(zmq.PAIR)
        control.linger = 0
        control.bind(self._wake_address)
        self._wake = self._context.socket(zmq.PAIR)
        self._wake.linger = 0
        self._wake.connect(self._wake_address)
        if self.config.metrics_host is not None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(self._collector)
            self._web = WebServer(
                registry,
                self.config.metrics_host,
                self.config.metrics_port,
                self.config.metrics_token,
                dashboard=self._collector.dashboard,
                show_tenants=self.config.metrics_show_tenants,
            )
            self._web.start()
        self.index.hand_off()  # the loop thread takes it on its first call
        self._running = True
        self._thread = threading.Thread(
            target=self._loop, args=(control,), name="kvmesh-service", daemon=True
        )
        self._thread.start()
        log.info("kvmesh service epoch %d listening on %s", self.epoch, self._address)
        return self._address

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and close the sockets (idempotent); the index is then free for the
        caller's thread."""
        self._stop.set()
        if self._thread is not None:
            self._poke()
            self._thread.join(timeout_s)
            self._thread = None
        with self._wake_lock:
            if self._wake is not None:
                self._wake.close(linger=0)
                self._wake = None
        if self._zap_domain:
            zap.close_domain(self._zap_domain)
            self._zap_domain = ""
        if self._web is not None:
            self._web.stop()

    # ------------------------------------------------------------------ calls into the loop

    def stats(self) -> dict[str, Any]:
        """The index's statistics and the server's own figures (what STATS answers)."""
        return self._in_loop(self._stats_snapshot)

    def check_integrity(self) -> None:
        """Check the index's and the reports' invariants (raises AssertionError), from the
        loop."""
        self._in_loop(self._check_integrity)

    def _check_integrity(self) -> None:
        self.index.check_integrity()
        self.reports.check_integrity()
        self._handlers.quarantine.check()
        self._handlers.front_doors.check_integrity()

    def quarantined(self) -> list[dict[str, Any]]:
        """The members in quarantine: holder, reporter, since (unix seconds), evidence."""
        return self._in_loop(self._handlers.quarantine.records)

    def in_quarantine(self, worker_id: str) -> bool:
        return self._in_loop(lambda: self._handlers.quarantine.holds(worker_id))

    def clear_quarantine(self, worker_id: str) -> bool:
        """Let `worker_id` register again; False when it was not in quarantine."""
        return self._in_loop(lambda: self._handlers.quarantine.clear(worker_id))

    def admit_worker(self, worker_id: str, public_key: bytes) -> None:
        """Admit a worker that joined after the mesh started (a vLLM engine), bound to
        `worker_id`, from now on. Idempotent for the same key.

        Raises:
            RuntimeError: the server has no keys (it admits anyone already).
            ValueError: `worker_id` is bound to another key, or the key to another identity.
        """
        if self.keys is None:
            raise RuntimeError("this server serves without keys: there is nobody to admit")
        self._in_loop(lambda: self._admit_worker(worker_id, public_key))

    def _admit_worker(self, worker_id: str, public_key: bytes) -> None:
        self._handlers.admit_worker(worker_id, public_key)  # raises before ZAP admits it
        if self._zap_domain:
            zap.admit(self._zap_domain, public_key)

    def run_housekeeping(self) -> list[str]:
        """Expire silent workers now, by the server's clock; the expired worker ids."""
        return self._in_loop(lambda: self._housekeeping(self._clock()))

    def _in_loop(self, call: Callable[[], T], timeout_s: float = 30.0) -> T:
        """Run `call` on the loop thread and return its result (or raise what it raised);
        in the caller's thread when the loop is not running."""
        if threading.current_thread() is self._thread:
            return call()
        future: Future = Future()
        with self._calls_lock:
            queued = self._running
            if queued:
                self._calls.put((call, future))
        if not queued:
            return call()
        self._poke()
        return future.result(timeout_s)

    def _poke(self) -> None:
        """Wake the loop up (a byte on its control socket)."""
        with self._wake_lock:
            if self._wake is not None:
                with contextlib.suppress(zmq.Again):  # wake-ups are queued already
                    self._wake.send(b"", zmq.NOBLOCK)

    def _run_calls(self) -> None:
        while True:
            try:
                call, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # handed to the caller, whatever it is
                future.set_exception(exc)

    # ------------------------------------------------------------------ the loop

    def _loop(self, control: zmq.Socket) -> None:
        socket = self._socket
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(control, zmq.POLLIN)
        interval_ms = int(self.config.housekeeping_interval_s * 1000)
        next_housekeeping = self._clock()
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(interval_ms))
                if socket in ready:
                    # Drain what is queued before looking at the clock again.
                    for _ in range(_DRAIN):
                        try:
                            frames = self._receive(socket)
                        except zmq.Again:
                            break
                        self._serve(socket, *frames)
                if control in ready:
                    while control.poll(0):
                        control.recv()
                    self._run_calls()
                now = self._clock()
                if now >= next_housekeeping:
                    self._housekeeping(now)
                    next_housekeeping = now + self.config.housekeeping_interval_s
        finally:
            socket.close(linger=0)
            control.close(linger=0)
            with self._calls_lock:  # callers wait here, then run their calls themselves
                self._running = False
                self._run_calls()  # what was queued before the loop stopped still runs
                self.index.hand_off()

    def _housekeeping(self, now: float) -> list[str]:
        expired = self.index.expire(now)
        for worker_id in expired:
            self.reports.departed(worker_id)
        if expired:
            log.warning(
                "workers silent past %.1fs removed: %s",
                self.config.liveness_timeout_s,
                ", ".join(expired),
            )
        if self._web is not None and (expired or now >= self._next_metrics):
            self.publish_metrics()
            self._next_metrics = now + self.config.metrics_interval_s
        return expired

    def publish_metrics(self) -> None:
        """Hand the web thread a fresh snapshot of the figures (on the loop thread, which
        owns the index; from any other thread the call is queued to the loop)."""
        self._in_loop(
            lambda: self._collector.publish(
                metrics.snapshot_from(
                    self.index.stats(),
                    self.epoch,
                    self._lookup,
                    self.reports,
                    self.index.tenant_name,
                    now=time.time(),
                    quarantine=self._handlers.quarantine.stats(),
                )
            )
        )

    def _receive(self, socket: zmq.Socket) -> tuple[list[bytes], bytes | None]:
        """A message's frames and the z85 key the ZAP handler admitted (None without keys):
        the routing id as bytes, the rest as zmq frames, whose User-Id is the key (cheaper
        than recv_multipart's RCVMORE after each frame). zmq.Again: nothing queued."""
        frames, more = [socket.recv(zmq.NOBLOCK)], socket.getsockopt(zmq.RCVMORE)
        while more:
            frame = socket.recv(zmq.NOBLOCK, copy=False)
            frames.append(frame.bytes)
            more = frame.more
        keyed = self.keys is not None and len(frames) > 1
        return frames, frame.get("User-Id").encode() if keyed else None

    def _serve(self, socket: zmq.Socket, frames: list[bytes], sender: bytes | None) -> None:
        identity, rest = frames[0], frames[1:]
        delimiter = [b""] if rest and rest[0] == b"" else []
        payload = rest[len(delimiter) :]
        reply = self._handlers.answer(payload, sender)
        try:
            socket.send_multipart([identity, *delimiter, reply], zmq.NOBLOCK)
        except zmq.Again:  # the client is gone or not reading; it will retry
            log.debug("reply to a client that is not reading dropped")

    # ------------------------------------------------------------------ figures

    def _stats_snapshot(self) -> dict[str, Any]:
        """The index's figures and the server's, cut to fit a reply frame if need be."""
        stats = self.index.stats()
        # What the workers report they served: the mesh's hit rate, as /metrics shows it.
        stats["served"] = self.reports.stats()
        stats["service"] = {
            "epoch": self.epoch,
            "requests": self._handlers.requests,
            "errors": self._handlers.errors,
            "address": self._address,
            "metrics_url": self.metrics_url,
            "dashboard_url": self.dashboard_url,
        }
        stats["quarantine"] = self._handlers.quarantine.stats()
        return _fitted(stats, self.limits.max_frame_bytes - 1024)


def _fitted(stats: dict[str, Any], budget: int) -> dict[str, Any]:
    """`stats` with a "truncated" flag, its per-worker and per-tenant sections cut (totals
    kept whole) until it packs within `budget` bytes."""
    stats["truncated"] = False
    if len(msgpack.packb(stats)) <= budget:
        return stats
    stats["truncated"] = True
    for section in ("workers", "tenants"):
        entries = list(stats[section].items())
        while entries and len(msgpack.packb(stats)) > budget:
            entries = entries[: len(entries) // 2]
            stats[section] = dict(entries)
    return stats


def make_server(
    config: ServerConfig,
    keys: ServerKeys | None = None,
    clock: Callable[[], float] = time.monotonic,
    limits: protocol.Limits = protocol.DEFAULT_LIMITS,
    quarantine: Quarantine | None = None,
) -> ServiceServer:
    """A server over a fresh index configured from `config` (and the members in
    `quarantine`, a restarted service's)."""
    index = GlobalIndex(
        page_tokens=config.page_tokens,
        liveness_timeout_s=config.liveness_timeout_s,
        load_weight=config.load_weight,
        max_workers=config.max_workers,
        max_tenants=config.max_tenants,
        max_spans=config.max_spans,
        max_capacity=config.max_capacity,
    )
    return ServiceServer(index, config, keys, limits=limits, clock=clock, quarantine=quarantine)
