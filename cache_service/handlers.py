"""What the service answers to each request: who may send it, and the index's answer.

`RequestHandlers.answer` turns one request's payload frames into the encoded reply and
never raises. The codec decodes the frame into a typed request (`protocol.decode`); with
keys, the sender's identity is checked against it (`check_allowed`, and a worker
advertises only its own key for its page server); the handler of its type passes the
fields to the index and returns the typed reply; the codec encodes it. What the index
refuses becomes an error reply with a code of its own (below), and anything unexpected is
logged and answered as an internal error: the service keeps serving.

Who each admitted key is lives here too: the launcher's keys, and workers enrolled since
(`admit_worker`). Everything in here runs on the server's loop thread, which owns the
index (see `cache_service.server`); nothing locks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from cache_service import protocol
from cache_service.auth import WORKER, Identity, ServerKeys, allowed
from cache_service.front_doors import FrontDoors
from cache_service.histograms import Histogram
from cache_service.index import GlobalIndex, PeerAddress, RegistryFull, StaleEpoch
from cache_service.messages import (
    Ack,
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
    PeerList,
    PublishEvents,
    QuarantineList,
    Register,
    Registered,
    Reply,
    ReportDead,
    ReportHolder,
    Request,
    Resync,
    ResyncReply,
    Route,
    RouteDecision,
    StatsReply,
)
from cache_service.protocol import ProtocolError
from cache_service.quarantine import Quarantine
from cache_service.reports import WorkerReports

log = logging.getLogger(__name__)

# Server-side error codes, beside the codec's own.
# A heartbeat from a worker the index does not know (register), or GetPeer of one.
UNKNOWN_WORKER = "unknown_worker"
REJECTED = "rejected"  # well-formed but refused by the index (e.g. a capacity too large)
FORBIDDEN = "forbidden"  # the sender's identity may not send this request
STALE_EPOCH = "stale_epoch"  # BYE with another epoch than the worker's current one
REGISTRY_FULL = "registry_full"  # max_workers registered, each holding pages
QUARANTINED = "quarantined"  # the worker is in quarantine until an operator clears it

# Entries per GetPeers reply: a few hundred KiB at most, well inside a frame's bounds.
PEERS_PER_PAGE = 256


class RequestHandlers:
    """One handler per request type, over one index; `answer` serves a request's frames.

    Args:
        index: the index the requests read and change; the calling thread owns it.
        epoch: the service's epoch, told to workers in replies.
        reports: where heartbeats leave the workers' own figures.
        lookup: the histogram of match latencies (seconds).
        stats: the figures GetStats answers (the server's snapshot, fitted to a frame).
        keys: the service's CURVE keys and the identities of the keys it admits; None:
            anyone, with no identity checks.
        limits: bounds on every frame.
        clock: seconds, monotonic; liveness is judged by it.
    """

    def __init__(
        self,
        index: GlobalIndex,
        epoch: int,
        reports: WorkerReports,
        lookup: Histogram,
        stats: Callable[[], dict[str, Any]],
        keys: ServerKeys | None = None,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        clock: Callable[[], float] = time.monotonic,
        quarantine: Quarantine | None = None,
    ):
        self.index = index
        self.quarantine = Quarantine() if quarantine is None else quarantine
        self.front_doors = FrontDoors()  # every front door's requests in flight
        self.epoch = epoch
        self.reports = reports
        self.keys = keys
        self.limits = limits
        self._lookup = lookup
        self._stats = stats
        self._clock = clock
        self.requests = 0  # answered, malformed ones included
        self.errors = 0  # answered with an error reply
        self._handlers: dict[type, Callable[[Any], Reply]] = {
            Register: self._register,
            Heartbeat: self._heartbeat,
            PublishEvents: self._events,
            Resync: self._resync,
            Match: self._match,
            Route: self._route,
            GetStats: self._get_stats,
            Bye: self._bye,
            ReportDead: self._report_dead,
            NameTenant: self._name_tenant,
            GetPeer: self._peer,
            GetPeers: self._peers,
            ReportHolder: self._report_holder,
            GetQuarantine: self._get_quarantine,
        }
        # A worker's page server uses the worker's key pair: the key a worker may
        # advertise for it (see `_register`).
        self._worker_keys = (
            {}
            if keys is None
            else {who.worker_id: key for key, who in keys.clients.items() if who.worker_id}
        )
        # Who each admitted key is: the launcher's keys, and engines enrolled since
        # (`admit_worker`).
        self._clients: dict[bytes, Identity] = {} if keys is None else dict(keys.clients)

    def admit_worker(self, worker_id: str, public_key: bytes) -> None:
        """Take `public_key` as worker `worker_id`'s from now on (idempotent for the same key).

        Raises:
            ValueError: `worker_id` is bound to another key, or the key to another identity.
        """
        known = self._worker_keys.get(worker_id)
        if known not in (None, public_key):
            raise ValueError(f"worker id {worker_id!r} is already bound to another key")
        who = self._clients.get(public_key)
        if who not in (None, Identity(WORKER, worker_id)):
            raise ValueError(f"that key already speaks as {who}")
        self._clients[public_key] = Identity(WORKER, worker_id)
        self._worker_keys[worker_id] = public_key

    def answer(self, payload: list[bytes], sender: bytes | None = None) -> bytes:
        """One request's payload frames -> the encoded reply (never raises).

        Args:
            payload: the frames after the envelope; exactly one is a request.
            sender: the z85 public key the request came with (its User-Id); None without
                keys.
        """
        self.requests += 1
        request_id = 0
        try:
            if len(payload) != 1:
                raise ProtocolError(
                    protocol.BAD_FRAME, f"expected 1 payload frame, got {len(payload)}"
                )
            request = protocol.decode(payload[0], "request", limits=self.limits)
            request_id = request.request_id
            if self.keys is not None:
                check_allowed(self._clients.get(sender), request.body)
            reply = protocol.ok_reply(request, self._handlers[type(request.body)](request.body))
            return protocol.encode(reply, limits=self.limits, check=False)
        except ProtocolError as exc:
            self.errors += 1
            reply = protocol.error_reply(exc.request_id or request_id, exc)
            return protocol.encode(reply, check=False)
        except StaleEpoch as exc:
            self.errors += 1
            error = ProtocolError(STALE_EPOCH, str(exc), request_id)
            return protocol.encode(protocol.error_reply(request_id, error), check=False)
        except RegistryFull as exc:
            self.errors += 1
            error = ProtocolError(REGISTRY_FULL, str(exc), request_id)
            return protocol.encode(protocol.error_reply(request_id, error), check=False)
        except (ValueError, TypeError) as exc:  # the index refused a well-formed request
            self.errors += 1
            error = ProtocolError(REJECTED, str(exc), request_id)
            return protocol.encode(protocol.error_reply(request_id, error), check=False)
        except Exception as exc:  # a bug here must not take the service down
            self.errors += 1
            log.exception("internal error serving request %d", request_id)
            return protocol.encode(protocol.error_reply(request_id, exc), check=False)

    # ------------------------------------------------------------------ one per request

    def _register(self, request: Register) -> Registered:
        if self.quarantine.holds(request.worker_id):
            raise ProtocolError(
                QUARANTINED,
                f"worker {request.worker_id!r} is in quarantine: its pages failed a spot "
                "check; an operator clears it with `kvmesh quarantine --clear`",
            )
        if self.keys is not None and request.page_key not in (
            None,
            self._worker_keys.get(request.worker_id),
        ):
            # Peers would trust this key as the worker's page server: only its own will do.
            raise ProtocolError(
                FORBIDDEN,
                f"worker {request.worker_id!r} may advertise only its own key for its page server",
            )
        peer = PeerAddress(request.address, request.shm_name, request.page_key)
        registration = self.index.register(
            request.worker_id,
            request.node_id,
            request.tier,
            now=self._clock(),
            peer=peer,
            capacity=request.capacity,
        )
        return Registered(self.epoch, registration.epoch)

    def _heartbeat(self, request: Heartbeat) -> EpochReply:
        if not self.index.heartbeat(request.worker_id, request.epoch, now=self._clock()):
            raise ProtocolError(
                UNKNOWN_WORKER,
                f"worker {request.worker_id!r} epoch {request.epoch} is not registered "
                f"with service epoch {self.epoch}; register again",
            )
        self.reports.update(request.worker_id, request.report)
        pages, generations = self.index.held_elsewhere(request.worker_id, request.epoch)
        return EpochReply(self.epoch, self.quarantine.version, pages, generations)

    def _events(self, request: PublishEvents) -> ApplyResult:
        result = self.index.apply_events(
            request.worker_id, request.epoch, request.seq, request.events
        )
        if result.reason == "over_capacity":
            log.warning(
                "worker %r claimed pages past the capacity it registered: batch %d refused",
                request.worker_id,
                request.seq,
            )
        return result

    def _resync(self, request: Resync) -> ResyncReply:
        self.index.resync(request.worker_id, request.epoch, request.seq, request.chains)
        info = self.index.worker_info(request.worker_id)
        return ResyncReply(0 if info is None else info.pages)

    def _match(self, request: Match) -> MatchResult:
        start = time.perf_counter()
        # Packed spans go out as the bytes the index made; no ints built and repacked.
        result = self.index.match_packed(request.namespace, request.tokens, request.requester)
        self._lookup.observe(time.perf_counter() - start)
        return result

    def _route(self, request: Route) -> RouteDecision:
        # A member in quarantine takes no requests: its own cache may hold the poison.
        loads = {w: n for w, n in request.loads.items() if not self.quarantine.holds(w)}
        return self.front_doors.route(
            request.door,
            loads,
            request.pending,
            len(request.tokens) // 4,  # decoded: packed int32 bytes
            self._clock(),
            lambda weighed: self.index.route(
                request.namespace,
                request.tokens,
                weighed,
                request.pending,
                self.reports.loads(),
                request.policy,
            ),
        )

    def _get_stats(self, request: GetStats) -> StatsReply:
        return StatsReply(self._stats())

    def _bye(self, request: Bye) -> Ack:
        self.index.remove_worker(request.worker_id, "bye", epoch=request.epoch)
        self.reports.departed(request.worker_id)
        return Ack()

    def _report_dead(self, request: ReportDead) -> Ack:
        self.index.remove_worker(request.worker_id, "reported_dead")
        self.reports.departed(request.worker_id)
        return Ack()

    def _name_tenant(self, request: NameTenant) -> Ack:
        self.index.name_tenant(request.salt, request.name)
        return Ack()

    def _peer(self, request: GetPeer) -> PeerEntry:
        entry = self.index.peer(request.worker_id)
        if entry is None:
            raise ProtocolError(
                UNKNOWN_WORKER, f"worker {request.worker_id!r} is not registered (or left)"
            )
        return entry

    def _peers(self, request: GetPeers) -> PeerList:
        entries, more = self.index.peers(request.after, PEERS_PER_PAGE)
        return PeerList(tuple(entries), more)

    def _report_holder(self, request: ReportHolder) -> Ack:
        if self.index.worker_info(request.worker_id) is None:
            raise ProtocolError(UNKNOWN_WORKER, f"worker {request.worker_id!r} is not registered")
        new = self.quarantine.report(
            request.worker_id, request.holder, request.digests, request.evidence
        )
        if new:
            log.warning(
                "%s put %s in quarantine: %s", request.worker_id, request.holder, request.evidence
            )
            self.index.remove_worker(request.holder, "quarantined")
            self.reports.departed(request.holder)
        return Ack()

    def _get_quarantine(self, request: GetQuarantine) -> QuarantineList:
        q = self.quarantine
        return QuarantineList(q.holders(), q.digests(), q.version)


def check_allowed(speaker: Identity | None, request: Request) -> None:
    """Raise FORBIDDEN unless `speaker` may send `request` (see `auth.allowed`)."""
    if speaker is None:  # the ZAP handler admitted a key the server does not know
        raise ProtocolError(FORBIDDEN, "this key has no identity in the mesh")
    if not allowed(speaker, request):
        target = getattr(request, "worker_id", None) or getattr(request, "requester", None)
        raise ProtocolError(
            FORBIDDEN,
            f"{speaker.role} {speaker.worker_id!r} may not send {type(request).__name__}"
            + (f" for {target!r}" if target else ""),
        )
