"""The service's ZMQ front: a ROUTER loop that answers workers from the global index.

One thread owns the socket and the index (the index is not thread-safe and needs no
lock this way). The loop polls with a timeout so housekeeping (expiring silent workers)
runs even when no request arrives. Every frame goes through the one codec
(`protocol.decode`); anything malformed is answered with an error reply naming what was
wrong, and the loop keeps serving.

Envelope on the socket: a client DEALER sends one frame, the payload; the ROUTER sees
[identity, payload] and replies [identity, reply]. A REQ client's empty delimiter frame
is accepted and echoed, so both kinds of client work.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from cache_service import protocol
from cache_service.index import GlobalIndex
from cache_service.protocol import ProtocolError

log = logging.getLogger(__name__)

# Server-side error codes, beside the codec's own.
UNKNOWN_WORKER = "unknown_worker"  # heartbeat from a worker the index does not know: register
REJECTED = "rejected"  # well-formed but refused by the index (e.g. an older epoch)


@dataclass(frozen=True)
class ServerConfig:
    """Where the service listens and how it keeps time."""

    # An address of this node, or loopback. Never "*" / 0.0.0.0: the index is an
    # unauthenticated metadata service unless CurveZMQ is on.
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port; the bound address is reported by `address`
    liveness_timeout_s: float = 10.0
    # How often the loop wakes up without traffic to expire silent workers.
    housekeeping_interval_s: float = 0.25
    page_tokens: int = 16
    load_weight: float = 0.5

    def __post_init__(self) -> None:
        if self.host in ("*", "0.0.0.0", "::", ""):
            raise ValueError(
                f"host {self.host!r} would listen on every interface; give this node's "
                "address or 127.0.0.1"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.liveness_timeout_s <= 0 or self.housekeeping_interval_s <= 0:
            raise ValueError("liveness_timeout_s and housekeeping_interval_s must be positive")
        if self.page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {self.page_tokens}")


@dataclass(frozen=True)
class CurveKeys:
    """CurveZMQ keys (z85 bytes) of the server, and the clients it accepts.

    With keys set, the socket is a CURVE server: traffic is encrypted and only clients
    that know the server's public key can talk to it; `allowed_clients`, when given,
    further limits it to those client public keys.
    """

    public: bytes
    secret: bytes
    allowed_clients: tuple[bytes, ...] | None = None

    @classmethod
    def generate(cls, allowed_clients: tuple[bytes, ...] | None = None) -> CurveKeys:
        public, secret = zmq.curve_keypair()
        return cls(public, secret, allowed_clients)


class ServiceServer:
    """Serves one GlobalIndex on a ROUTER socket from a background thread.

    Usage:
        server = ServiceServer(GlobalIndex(...), ServerConfig(...))
        address = server.start()   # "tcp://127.0.0.1:PORT"
        ...
        server.stop()
    """

    def __init__(
        self,
        index: GlobalIndex,
        config: ServerConfig | None = None,
        curve: CurveKeys | None = None,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.index = index
        self.config = config or ServerConfig()
        self.curve = curve
        self.limits = limits
        self._clock = clock
        # A new epoch for every start: workers that see it change re-register and resync.
        self.epoch = time.time_ns() // 1000
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._auth: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._address = ""
        self.requests = 0
        self.errors = 0
        self._handlers: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
            protocol.REGISTER: self._register,
            protocol.HEARTBEAT: self._heartbeat,
            protocol.EVENTS: self._events,
            protocol.RESYNC: self._resync,
            protocol.MATCH: self._match,
            protocol.ROUTE: self._route,
            protocol.STATS: self._stats,
            protocol.BYE: self._bye,
        }

    @property
    def address(self) -> str:
        """The bound endpoint, e.g. "tcp://127.0.0.1:40123" ("" before start)."""
        return self._address

    def start(self) -> str:
        """Bind and start serving in a daemon thread; returns the bound address."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        socket = self._context.socket(zmq.ROUTER)
        socket.linger = 0
        # ZMQ drops an oversized message before buffering it; the codec refuses it too.
        socket.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes + 4096)
        socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting client keeps its identity
        if self.curve is not None:
            self._start_curve(socket)
        host = self.config.host
        if self.config.port:
            socket.bind(f"tcp://{host}:{self.config.port}")
            port = self.config.port
        else:
            port = socket.bind_to_random_port(f"tcp://{host}")
        self._socket = socket
        self._address = f"tcp://{host}:{port}"
        self._thread = threading.Thread(target=self._loop, name="kvmesh-service", daemon=True)
        self._thread.start()
        log.info("kvmesh service epoch %d listening on %s", self.epoch, self._address)
        return self._address

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and close the socket (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def _start_curve(self, socket: zmq.Socket) -> None:
        if self.curve.allowed_clients is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self._context)
            self._auth.start()
            self._auth.configure_curve_callback(
                domain="*", credentials_provider=_AllowList(self.curve.allowed_clients)
            )
        socket.curve_secretkey = self.curve.secret
        socket.curve_publickey = self.curve.public
        socket.curve_server = True

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        socket = self._socket
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        interval_ms = int(self.config.housekeeping_interval_s * 1000)
        next_housekeeping = self._clock()
        try:
            while not self._stop.is_set():
                if poller.poll(interval_ms):
                    # Drain what is queued before looking at the clock again.
                    for _ in range(256):
                        try:
                            frames = socket.recv_multipart(zmq.NOBLOCK, copy=True)
                        except zmq.Again:
                            break
                        self._serve(socket, frames)
                now = self._clock()
                if now >= next_housekeeping:
                    self._housekeeping(now)
                    next_housekeeping = now + self.config.housekeeping_interval_s
        finally:
            socket.close(linger=0)

    def _housekeeping(self, now: float) -> None:
        expired = self.index.expire(now)
        if expired:
            log.warning(
                "workers silent past %.1fs removed: %s",
                self.config.liveness_timeout_s,
                ", ".join(expired),
            )

    def _serve(self, socket: zmq.Socket, frames: list[bytes]) -> None:
        identity, rest = frames[0], frames[1:]
        delimiter = [b""] if rest and rest[0] == b"" else []
        payload = rest[len(delimiter) :]
        reply = self.handle(payload)
        try:
            socket.send_multipart([identity, *delimiter, reply], zmq.NOBLOCK)
        except zmq.Again:  # the client is gone or not reading; it will retry
            log.debug("reply to a client that is not reading dropped")

    def handle(self, payload: list[bytes]) -> bytes:
        """One request's payload frames -> the encoded reply (never raises)."""
        self.requests += 1
        request_id = 0
        try:
            if len(payload) != 1:
                raise ProtocolError(
                    protocol.BAD_FRAME, f"expected 1 payload frame, got {len(payload)}"
                )
            request = protocol.decode(payload[0], "request", limits=self.limits)
            request_id = request.request_id
            body = self._handlers[request.type](request.body)
            reply = protocol.ok_reply(request, body)
            return protocol.encode(reply, limits=self.limits, check=False)
        except ProtocolError as exc:
            self.errors += 1
            reply = protocol.error_reply(exc.request_id or request_id, exc)
            return protocol.encode(reply, check=False)
        except (ValueError, TypeError) as exc:  # the index refused a well-formed request
            self.errors += 1
            error = ProtocolError(REJECTED, str(exc), request_id)
            return protocol.encode(protocol.error_reply(request_id, error), check=False)
        except Exception as exc:  # a bug here must not take the service down
            self.errors += 1
            log.exception("internal error serving request %d", request_id)
            return protocol.encode(protocol.error_reply(request_id, exc), check=False)

    # ------------------------------------------------------------------ handlers

    def _register(self, body: dict[str, Any]) -> dict[str, Any]:
        self.index.register(
            body["worker_id"], body["epoch"], body["node_id"], body["tier"], now=self._clock()
        )
        return {"service_epoch": self.epoch}

    def _heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        if not self.index.heartbeat(body["worker_id"], body["epoch"], now=self._clock()):
            raise ProtocolError(
                UNKNOWN_WORKER,
                f"worker {body['worker_id']!r} epoch {body['epoch']} is not registered "
                f"with service epoch {self.epoch}; register again",
            )
        return {"service_epoch": self.epoch}

    def _events(self, body: dict[str, Any]) -> dict[str, Any]:
        result = self.index.apply_events(
            body["worker_id"], body["epoch"], body["seq"], body["events"]
        )
        return {
            "applied": result.applied,
            "needs_resync": result.needs_resync,
            "reason": result.reason,
        }

    def _resync(self, body: dict[str, Any]) -> dict[str, Any]:
        self.index.resync(body["worker_id"], body["epoch"], body["seq"], body["chains"])
        info = self.index.worker_info(body["worker_id"])
        return {"pages": 0 if info is None else info.pages}

    def _match(self, body: dict[str, Any]) -> dict[str, Any]:
        # Packed spans go out as the bytes the index made; no ints built and repacked.
        result = self.index.match_packed(body["namespace"], body["tokens"], body["requester"])
        return {"matched_tokens": result.matched_tokens, "spans": list(result.spans)}

    def _route(self, body: dict[str, Any]) -> dict[str, Any]:
        decision = self.index.route(body["namespace"], body["tokens"], body["loads"])
        return {
            "worker_id": decision.worker_id,
            "matched_tokens": decision.matched_tokens,
            "score": decision.score,
            "reason": decision.reason,
        }

    def _stats(self, body: dict[str, Any]) -> dict[str, Any]:
        stats = self.index.stats()
        stats["service"] = {
            "epoch": self.epoch,
            "requests": self.requests,
            "errors": self.errors,
            "address": self._address,
        }
        return {"stats": stats}

    def _bye(self, body: dict[str, Any]) -> dict[str, Any]:
        self.index.remove_worker(body["worker_id"], "bye")
        return {}


class _AllowList:
    """ZAP credentials provider: accepts the listed z85 client public keys."""

    def __init__(self, keys: tuple[bytes, ...]):
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def make_server(config: ServerConfig, curve: CurveKeys | None = None) -> ServiceServer:
    """A server over a fresh index configured from `config`."""
    index = GlobalIndex(
        page_tokens=config.page_tokens,
        liveness_timeout_s=config.liveness_timeout_s,
        load_weight=config.load_weight,
    )
    return ServiceServer(index, config, curve)
