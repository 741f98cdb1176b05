"""The worker's client of the kvmesh service (ZMQ DEALER, msgpack frames).

Requests follow the Lazy Pirate pattern: send, wait up to `timeout_s` for the reply with
the same request id, and on a timeout throw the socket away (with whatever it still had
queued), reconnect (re-resolving the service's address, which changes when the service
restarts) and try again. A reply that arrives late for an earlier request is recognised by
its id and dropped, so a lost reply never wedges the socket. After `retries` more tries
the call raises `ServiceUnavailable`, which callers treat as a cache miss.

A circuit breaker (on when `backoff_s` > 0) keeps an outage from costing every request
those timeouts again: a request must not wait seconds on a service that is down. After a
call ends in `ServiceUnavailable` the breaker opens, and for the next `backoff` seconds
every call raises `ServiceSkipped` at once, without touching the network. The first call
after that is a probe of one try: a reply (an error reply too: the service answered)
closes the breaker, no reply opens it again for twice as long, up to `max_backoff_s`. The
probe is how recovery is noticed; while it is in flight the other callers are skipped.
"""

from __future__ import annotations

import itertools
import logging
import math
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
    EpochReply,
    GetPeer,
    GetPeers,
    GetQuarantine,
    GetStats,
    Heartbeat,
    Match,
    MatchResult,
    NameTenant,
    PeerEntry,
    PublishEvents,
    Register,
    Registered,
    Reply,
    ReportDead,
    ReportHolder,
    Request,
    Resync,
    Route,
    RouteDecision,
    WorkerReport,
)
from cache_service.protocol import Message, ProtocolError
from cache_service.protocol.fields import MAX_DIGESTS
from cache_service.routing import DEFAULT_POLICY
from cache_service.tokens import TokenInput

log = logging.getLogger(__name__)


# After the service failed to answer, a mesh member's clients skip it for this long
# (doubling while it stays down, up to 8 times as long); the publisher's heartbeats probe
# for its return, so requests never wait on a service that is down.
SERVICE_BACKOFF_S = 1.0


class ServiceUnavailable(RuntimeError):
    """The service did not answer in time (down, restarting or unreachable)."""


class ServiceSkipped(ServiceUnavailable):
    """The client did not ask: the service gave no reply lately and its backoff runs on.

    Attributes:
        retry_in_s: seconds until the next call probes the service again.
    """

    def __init__(self, message: str, retry_in_s: float):
        # Both in args so the exception survives pickling (Ray ships exceptions).
        super().__init__(message, retry_in_s)
        self.message = message
        self.retry_in_s = retry_in_s

    def __str__(self) -> str:
        return self.message


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
        backoff_s: how long calls are skipped after one got no reply (the circuit breaker);
            0 turns the breaker off: every call tries the network.
        max_backoff_s: the longest skip, reached by doubling after each failed probe;
            None: 8 x backoff_s.
        clock: seconds, monotonic; the breaker's time (tests move their own). The tries'
            own timeouts run on the real clock.
        probe: whether a call probes the service once the backoff has passed. False (for
            clients on a request path): calls are skipped until `reconnect()`, which the
            owner calls when something off the request path (a heartbeat) has seen the
            service answer; a request then never waits on a probe.

    Raises:
        ValueError: timeout_s <= 0, retries < 0, backoff_s < 0 or not finite, or
            max_backoff_s < backoff_s or not finite.
    """

    def __init__(
        self,
        endpoint: ServiceEndpoint | Callable[[], ServiceEndpoint],
        timeout_s: float = 1.0,
        retries: int = 2,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        client_keys: tuple[bytes, bytes] | None = None,
        backoff_s: float = 0.0,
        max_backoff_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        probe: bool = True,
    ):
        if timeout_s <= 0 or retries < 0:
            raise ValueError(f"timeout_s must be > 0 and retries >= 0: {timeout_s}, {retries}")
        if not (math.isfinite(backoff_s) and backoff_s >= 0):
            raise ValueError(f"backoff_s must be finite and >= 0, got {backoff_s}")
        if max_backoff_s is None:
            max_backoff_s = 8 * backoff_s
        if not (math.isfinite(max_backoff_s) and max_backoff_s >= backoff_s):
            raise ValueError(
                f"max_backoff_s must be finite and >= backoff_s ({backoff_s}), got {max_backoff_s}"
            )
        self._resolve = endpoint if callable(endpoint) else (lambda: endpoint)
        self.timeout_s = timeout_s
        self.retries = retries
        self.limits = limits
        self._client_keys = client_keys
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._endpoint: ServiceEndpoint | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the socket: held for a whole call, network waits too
        self.reconnects = 0
        # The circuit breaker, closed while `_open_until` is None. Its own lock is never held
        # across a network wait, so a skipped call does not queue behind a probe in flight.
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.probe = probe
        self._clock = clock
        self._breaker_lock = threading.Lock()
        self._open_until: float | None = None
        self._backoff = backoff_s  # the length of the current skip, or of the next one
        self._probing = False  # one call has claimed the probe: the others are skipped
        self._outage = ""  # what the last call without a reply asked, for the skip message
        self._skipped = 0
        self._outages = 0
        self._probes = 0

    # ------------------------------------------------------------------ the breaker's state

    @property
    def circuit_open(self) -> bool:
        """Whether a call made now would be skipped (False once a probe is due)."""
        with self._breaker_lock:
            return self._open_until is not None and (
                self._probing or not self.probe or self._clock() < self._open_until
            )

    @property
    def current_backoff_s(self) -> float:
        """The length of the current skip (backoff_s while the breaker is closed)."""
        with self._breaker_lock:
            return self._backoff

    @property
    def skipped(self) -> int:
        """Calls refused at once while the breaker was open."""
        return self._skipped

    @property
    def outages(self) -> int:
        """Times the breaker opened from closed (a failed probe re-opens the same outage)."""
        return self._outages

    @property
    def probes(self) -> int:
        """Single tries made after a backoff ran out, whether answered or not."""
        return self._probes

    # ------------------------------------------------------------------ requests

    def register(
        self,
        worker_id: str,
        node_id: str,
        tier: str = "cpu",
        address: str = "",
        shm_name: str = "",
        page_key: bytes | None = None,
        capacity: int = 0,
    ) -> Registered:
        """Register a new incarnation of this worker, with how its peers reach its pages.

        Args:
            worker_id, node_id, tier: who and where it is, and where its pages live.
            address: its page server, for peers on other nodes ("" if none).
            shm_name: its shared-memory page store, for peers on its node ("" if none).
            page_key: its page server's CurveZMQ public key (z85, as `KeyPair.public`);
                None when page reads are not authenticated.
            capacity: pages its page store holds, the most the service lets it hold in
                the index (0: the service's default).

        Returns:
            Registered(service_epoch, epoch): the epoch to carry on every later message.

        Raises:
            ServiceError: code "forbidden" when the service authenticates and `page_key`
                is not this worker's own key.
        """
        return self.call(Register(worker_id, node_id, tier, address, shm_name, page_key, capacity))

    def heartbeat(
        self, worker_id: str, epoch: int, load: float = 0.0, report: WorkerReport = EMPTY_REPORT
    ) -> EpochReply:
        """Mark this worker alive, with its load and figures; returns the service's epoch
        and its quarantine list's version.

        Raises:
            ServiceError: code "unknown_worker" when the service does not know this
                incarnation (it restarted or expired us): register and resync.
        """
        return self.call(Heartbeat(worker_id, epoch, float(load), report))

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
        self,
        namespace: Namespace,
        tokens: TokenInput,
        loads: Mapping[str, float],
        pending: Mapping[str, float] | None = None,
        policy: str = DEFAULT_POLICY,
        door: str | None = None,
    ) -> RouteDecision:
        """Which worker should take this prompt, by the routing policy named (the
        default, kvmesh's: the soonest first token, from what each worker holds, would
        copy and compute, against its queue; see `cache_service.routing`).

        Args:
            loads: worker id -> prompt tokens this caller has in flight there (the
                candidates are these workers).
            pending: worker id -> tokens of this prompt it computes for a request in
                flight.
            policy: a name of `cache_service.routing.POLICIES`.
            door: this front door's id: the service then weighs the requests in flight
                of other front doors beside `loads` (`cache_service.front_doors`).
        """
        loads = {worker: float(load) for worker, load in loads.items()}
        pending = {worker: float(n) for worker, n in (pending or {}).items()}
        return self.call(Route(namespace, tokens, loads, pending, policy, door))

    def stats(self) -> dict[str, Any]:
        """Cluster, per-worker and per-tenant statistics of the service."""
        return self.call(GetStats()).stats

    def bye(self, worker_id: str, epoch: int) -> None:
        """Leave: the service drops this worker's holdings at once.

        Raises:
            ServiceError: code "stale_epoch" when `epoch` is not the worker's current one.
        """
        self.call(Bye(worker_id, epoch))

    def peer(self, worker_id: str) -> PeerEntry | None:
        """How to reach a worker's pages, as its current incarnation registered.

        Returns:
            Its PeerEntry, or None when the service knows no live worker of that id
            (never registered, or left, died or went silent).
        """
        try:
            return self.call(GetPeer(worker_id))
        except ServiceError as exc:
            if exc.code == "unknown_worker":
                return None
            raise

    def peers(self) -> list[PeerEntry]:
        """Every live worker's entry, in worker id order (asked for a page at a time)."""
        entries: list[PeerEntry] = []
        after = ""
        while True:
            page = self.call(GetPeers(after))
            entries.extend(page.peers)
            if not page.more or not page.peers:
                return entries
            after = page.peers[-1].worker_id

    def report_dead(self, worker_id: str) -> None:
        """(Front door) a worker died: the service drops it and its holdings at once."""
        self.call(ReportDead(worker_id))

    def report_holder(
        self, worker_id: str, epoch: int, holder: str, digests: Sequence[bytes], evidence: str
    ) -> None:
        """Report `holder` for pages that failed a spot check (or copies of a quarantined
        holder's pages dropped here), with the digests of the pages copied from it (at
        most MAX_DIGESTS: the first ones)."""
        packed = b"".join(bytes(d) for d in digests[:MAX_DIGESTS])
        self.call(ReportHolder(worker_id, epoch, holder, packed, evidence[:1024]))

    def quarantine(self) -> tuple[tuple[str, ...], list[bytes]]:
        """(holders in quarantine, digests of the pages copied from them)."""
        reply = self.call(GetQuarantine())
        raw = reply.digests
        return reply.holders, [raw[i : i + 16] for i in range(0, len(raw), 16)]

    def name_tenant(self, salt: str, name: str) -> None:
        """(Front door) the service shows `salt`'s statistics under `name`."""
        self.call(NameTenant(salt, name))

    # ------------------------------------------------------------------ calls

    def call(self, body: Request) -> Reply:
        """Send one request and return its ok reply's typed body.

        Raises:
            ServiceSkipped: the breaker is open (a recent call got no reply); nothing was
                sent.
            ServiceUnavailable: no reply after all tries (one try when the call probes the
                service after a backoff); the breaker opens.
            ServiceError: the service answered with an error (the breaker closes).
            ProtocolError: the request itself is malformed (nothing was sent).
        """
        probe = self._admit()  # first outside the socket's lock: a skip waits on nothing
        try:
            with self._lock:
                probe = probe or self._admit()  # it may have opened while this call waited
                tries = 1 if probe else self.retries + 1
                try:
                    reply = self._exchange(body, tries)
                except ServiceError:
                    self._answered()
                    raise
                except ServiceUnavailable:
                    self._no_reply(body, tries)
                    raise
                self._answered()
                return reply
        finally:
            if probe:
                with self._breaker_lock:
                    self._probing = False

    def _admit(self) -> bool:
        """Whether this call is the probe; raises ServiceSkipped while the breaker is open."""
        with self._breaker_lock:
            if self._open_until is None:
                return False
            remaining = self._open_until - self._clock()
            if remaining > 0 or self._probing or not self.probe:
                self._skipped += 1
                if not self.probe:
                    when = "until it is seen answering again"
                elif remaining > 0:
                    when = f"for {remaining:.3g}s more"
                else:
                    when = "while a probe runs"
                raise ServiceSkipped(
                    f"service skipped {when} after no reply from {self._outage}",
                    max(remaining, 0.0),
                )
            self._probing = True
            self._probes += 1
            return True

    def _answered(self) -> None:
        with self._breaker_lock:
            if self._open_until is not None:
                log.info("service at %s answers again: calls go through", self._where())
            self._open_until = None
            self._backoff = self.backoff_s

    def _no_reply(self, body: Request, tries: int) -> None:
        if not self.backoff_s:
            return  # the breaker is off
        with self._breaker_lock:
            # Only a probe runs while the breaker is open (calls hold the socket's lock).
            if self._open_until is None:
                self._outages += 1
                self._backoff = self.backoff_s
            else:
                self._backoff = min(2 * self._backoff, self.max_backoff_s)
            self._open_until = self._clock() + self._backoff
            self._outage = f"{self._where()} ({_describe(body, tries, self.timeout_s)})"
            log.warning("service skipped for %.3gs: no reply from %s", self._backoff, self._outage)

    # ------------------------------------------------------------------ transport

    def _exchange(self, body: Request, tries: int) -> Reply:
        """Up to `tries` tries of one request, each on a fresh socket (the socket's lock held)."""
        for _ in range(tries):
            socket = self._socket or self._connect()
            if socket is None:
                time.sleep(min(self.timeout_s, 0.2))  # no address yet: the service is starting
                continue
            request_id = next(self._ids)
            frame = protocol.encode(protocol.request(request_id, body), limits=self.limits)
            try:
                socket.send(frame)
            except zmq.Again:  # no connection took it in time (a handshake that failed)
                self._reset()
                continue
            reply = self._await(socket, request_id)
            if reply is not None:
                if reply.type == protocol.ERROR:
                    raise ServiceError(reply.body.code, reply.body.message)
                return reply.body
            self._reset()  # Lazy Pirate: a fresh socket, nothing stale left queued
        raise ServiceUnavailable(
            f"no reply from {self._where()} to {_describe(body, tries, self.timeout_s)}"
        )

    def _where(self) -> str:
        return self._endpoint.address if self._endpoint else "the service"

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
        # A send waits for a connection at most a try's timeout: a DEALER with no pipe (its
        # handshake refused, say for a key the service does not know) blocks a send forever.
        socket.sndtimeo = max(1, round(1000 * self.timeout_s))
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

    def reconnect(self) -> None:
        """The service moved (a new incarnation, a new address): drop the connection and
        close the breaker, so the next call resolves the endpoint and tries at once."""
        with self._lock:
            self._reset()
        with self._breaker_lock:
            self._open_until = None
            self._backoff = self.backoff_s

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


def _describe(body: Request, tries: int, timeout_s: float) -> str:
    """E.g. "'match' after 2 tries of 0.5s"."""
    kind = protocol.KIND_OF.get(type(body), type(body).__name__)
    return f"{kind!r} after {tries} {'try' if tries == 1 else 'tries'} of {timeout_s}s"


def ray_resolver(timeout_s: float = 5.0) -> Callable[[], ServiceEndpoint]:
    """An endpoint resolver that asks the service's Ray actor (at every reconnect)."""

    def resolve() -> ServiceEndpoint:
        import ray

        from cache_service.actor import get_service

        info = ray.get(get_service().endpoint.remote(), timeout=timeout_s)
        return ServiceEndpoint(info["address"], info["server_key"])

    return resolve


def recover(client: ServiceClient, prober: ServiceClient) -> bool:
    """While `client` skips the service (its breaker is open and it never probes: a
    request must not wait on a probe), ask the service through `prober`, a client of its
    own, off the request path; once it answers (an error reply too), `client` asks it
    again. Returns whether `client` calls the service now."""
    if not client.circuit_open:
        return True
    try:
        prober.route(Namespace("", "", ""), b"", {})
    except ServiceUnavailable:
        return False
    except ServiceError:
        pass  # an answer all the same
    client.reconnect()
    return True
