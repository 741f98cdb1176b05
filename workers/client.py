"""The worker's client of the kvmesh service (ZMQ DEALER, msgpack frames).

Requests follow the Lazy Pirate pattern: send, wait up to `timeout_s` for the reply with
the same request id, and on a timeout throw the socket away (with whatever it still had
queued), reconnect (re-resolving the service's address, which changes when the service
restarts) and try again. A reply that arrives late for an earlier request is recognised by
its id and dropped, so a lost reply never wedges the socket. After `retries` more tries
the call raises `ServiceUnavailable`, which callers treat as a cache miss.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import zmq

from cache_service import protocol
from cache_service.events import KvEvent, Namespace, PagesStored
from cache_service.messages import (
    EMPTY_REPORT,
    ApplyResult,
    Bye,
    GetStats,
    Heartbeat,
    Match,
    MatchResult,
    NameTenant,
    PublishEvents,
    Register,
    Registered,
    Reply,
    ReportDead,
    Request,
    Resync,
    Route,
    RouteDecision,
    WorkerReport,
)
from cache_service.protocol import Message, ProtocolError
from cache_service.tokens import TokenInput

log = logging.getLogger(__name__)


class ServiceUnavailable(RuntimeError):
    """The service did not answer in time (down, restarting or unreachable)."""


class ServiceError(RuntimeError):
    """The service answered with an error reply.

    Attributes:
        code: the error code (protocol codes, or the server's, e.g. "unknown_worker").
    """

    def __init__(self, code: str, message: str):
        # Both in args so the exception survives pickling (Ray ships exceptions).
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class ServiceEndpoint(NamedTuple):
    """Where the service listens, and its CurveZMQ public key (z85) if it requires one."""

    address: str
    server_key: bytes | None = None


class ServiceClient:
    """Blocking, thread-safe client of one service.

    Args:
        endpoint: a ServiceEndpoint, or a callable returning the current one (asked again
            after every timeout, so a restarted service at a new address is found).
        timeout_s: how long one try waits for its reply.
        retries: further tries after the first times out.
        limits: bounds applied to every reply read.
        client_keys: this client's CurveZMQ key pair (`KeyPair` or (public, secret) z85),
            bound to its identity in the mesh; a fresh pair per connection otherwise (which
            a service with authentication on refuses).
    """

    def __init__(
        self,
        endpoint: ServiceEndpoint | Callable[[], ServiceEndpoint],
        timeout_s: float = 1.0,
        retries: int = 2,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        client_keys: tuple[bytes, bytes] | None = None,
    ):
        if timeout_s <= 0 or retries < 0:
            raise ValueError(f"timeout_s must be > 0 and retries >= 0: {timeout_s}, {retries}")
        self._resolve = endpoint if callable(endpoint) else (lambda: endpoint)
        self.timeout_s = timeout_s
        self.retries = retries
        self.limits = limits
        self._client_keys = client_keys
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._endpoint: ServiceEndpoint | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.reconnects = 0

    # ------------------------------------------------------------------ requests

    def register(
        self, worker_id: str, node_id: str, tier: str = "cpu", address: str = ""
    ) -> Registered:
        """Register a new incarnation of this worker.

        Returns:
            Registered(service_epoch, epoch): the epoch to carry on every later message.
        """
        return self.call(Register(worker_id, node_id, tier, address))

    def heartbeat(
        self, worker_id: str, epoch: int, load: float = 0.0, report: WorkerReport = EMPTY_REPORT
    ) -> int:
        """Mark this worker alive, with its load and figures; returns the service's epoch.

        Raises:
            ServiceError: code "unknown_worker" when the service does not know this
                incarnation (it restarted or expired us): register and resync.
        """
        return self.call(Heartbeat(worker_id, epoch, float(load), report)).service_epoch

    def publish_events(
        self, worker_id: str, epoch: int, seq: int, events: Sequence[KvEvent]
    ) -> ApplyResult:
        """Send one numbered batch of KV events."""
        return self.call(PublishEvents(worker_id, epoch, seq, list(events)))

    def resync(self, worker_id: str, epoch: int, seq: int, chains: Sequence[PagesStored]) -> int:
        """Replace everything the service knows of this worker; returns pages indexed."""
        return self.call(Resync(worker_id, epoch, seq, list(chains))).pages

    def match(
        self, namespace: Namespace, tokens: TokenInput, requester: str | None = None
    ) -> MatchResult:
        """The longest cached prefix of `tokens` anywhere, with its holders.

        Returns:
            MatchResult(matched_tokens, spans): HolderSpans, one per holding worker.
        """
        return self.call(Match(namespace, tokens, requester))

    def route(
        self, namespace: Namespace, tokens: TokenInput, loads: Mapping[str, float]
    ) -> RouteDecision:
        """Which worker should take this prompt (most of it cached, weighed against load)."""
        loads = {worker: float(load) for worker, load in loads.items()}
        return self.call(Route(namespace, tokens, loads))

    def stats(self) -> dict[str, Any]:
        """Cluster, per-worker and per-tenant statistics of the service."""
        return self.call(GetStats()).stats

    def bye(self, worker_id: str, epoch: int) -> None:
        """Leave: the service drops this worker's holdings at once.

        Raises:
            ServiceError: code "stale_epoch" when `epoch` is not the worker's current one.
        """
        self.call(Bye(worker_id, epoch))

    def report_dead(self, worker_id: str) -> None:
        """(Front door) a worker died: the service drops it and its holdings at once."""
        self.call(ReportDead(worker_id))

    def name_tenant(self, salt: str, name: str) -> None:
        """(Front door) the service shows `salt`'s statistics under `name`."""
        self.call(NameTenant(salt, name))

    # ------------------------------------------------------------------ transport

    def call(self, body: Request) -> Reply:
        """Send one request and return its ok reply's typed body.

        Raises:
            ServiceUnavailable: no reply after all tries.
            ServiceError: the service answered with an error.
            ProtocolError: the request itself is malformed (nothing was sent).
        """
        with self._lock:
            tries = self.retries + 1
            for _ in range(tries):
                socket = self._socket or self._connect()
                if socket is None:
                    time.sleep(min(self.timeout_s, 0.2))  # no address yet: the service is starting
                    continue
                request_id = next(self._ids)
                frame = protocol.encode(protocol.request(request_id, body), limits=self.limits)
                socket.send(frame)
                reply = self._await(socket, request_id)
                if reply is not None:
                    if reply.type == protocol.ERROR:
                        raise ServiceError(reply.body.code, reply.body.message)
                    return reply.body
                self._reset()  # Lazy Pirate: a fresh socket, nothing stale left queued
            where = self._endpoint.address if self._endpoint else "the service"
            kind = protocol.KIND_OF.get(type(body), type(body).__name__)
            raise ServiceUnavailable(
                f"no reply from {where} to {kind!r} after {tries} tries of {self.timeout_s}s"
            )

    def _await(self, socket: zmq.Socket, request_id: int) -> Message | None:
        deadline = time.monotonic() + self.timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if not socket.poll(max(1, int(remaining * 1000))):
                return None
            try:
                reply = protocol.decode(socket.recv(), "reply", limits=self.limits)
            except ProtocolError:
                return None  # a garbled reply counts as no reply: retry on a fresh socket
            if reply.request_id == request_id:
                return reply
            # A late reply to an earlier try: drop it and keep waiting for ours.
        return None

    def _connect(self) -> zmq.Socket | None:
        try:
            endpoint = self._resolve()
        except Exception as exc:  # the resolver (e.g. a Ray call) failed: the service is not up
            log.debug("service endpoint not resolved: %s", exc)
            return None
        socket = self._context.socket(zmq.DEALER)
        socket.linger = 0
        socket.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes + 4096)
        if endpoint.server_key is not None:
            public, secret = self._client_keys or zmq.curve_keypair()
            socket.curve_serverkey = endpoint.server_key
            socket.curve_publickey = public
            socket.curve_secretkey = secret
        socket.connect(endpoint.address)
        self._socket, self._endpoint = socket, endpoint
        return socket

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
            self.reconnects += 1

    def close(self) -> None:
        """Close the socket (idempotent)."""
        with self._lock:
            if self._socket is not None:
                self._socket.close(linger=0)
                self._socket = None

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ray_resolver(timeout_s: float = 5.0) -> Callable[[], ServiceEndpoint]:
    """An endpoint resolver that asks the service's Ray actor (at every reconnect)."""

    def resolve() -> ServiceEndpoint:
        import ray

        from cache_service.actor import get_service

        info = ray.get(get_service().endpoint.remote(), timeout=timeout_s)
        return ServiceEndpoint(info["address"], info["server_key"])

    return resolve
