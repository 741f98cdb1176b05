"""The service's requests and replies as typed values, declared once.

The worker's client builds these, the codec (`cache_service.protocol`) puts them on the
wire and reads them back, the server hands their fields to the global index, and the
index returns the reply values itself. Nothing between them is a hand-built dict: a
field added here is added to every side at once (the codec's message table names each
field's wire kind and checks at import that it covers every field).

This module is below both the codec and the index and imports neither.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from cache_service.events import TIERS, KvEvent, Namespace, PagesStored

# ---- requests ------------------------------------------------------------------------------


class Register(NamedTuple):
    """A worker announces a new incarnation of itself (at start, after a service restart,
    or whenever the service no longer knows its epoch); the service issues the epoch."""

    worker_id: str
    node_id: str
    # The worker's kind of memory, e.g. "cpu" or "gpu": shown in its peer entry, nothing
    # more (match spans carry each page's own tier, from the events).
    tier: str
    address: str  # its page server, for peers on other nodes; "" if none
    shm_name: str  # its shared-memory page store, for peers on its node; "" if none
    page_key: bytes | None  # its page server's CurveZMQ public key (z85); None: no auth
    # Pages its page store holds: the most it may hold in the index at once (0: it did not
    # say; the service assumes a default, see `GlobalIndex.register`).
    capacity: int = 0


# Bucket bounds (seconds) of the histograms a worker reports; its counts follow them.
# TTFT: a few tens of ms for a short cached prompt on a GPU, seconds for a long cold
# prefill on a CPU. A copy: microseconds for a page over shared memory, up to a second
# for a long prefix across nodes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
COPY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.25, 1.0)
# A load back from a lower tier: tens of microseconds for a page in the OS page cache, a
# second or more for a long prefix read from a slow disk.
LOAD_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 0.25, 1.0, 2.5)
# How far a routed request's first token came from the router's estimate (either way):
# tens of ms when the estimate holds, seconds when a queue or a copy was misjudged.
ROUTE_ERROR_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Observed(NamedTuple):
    """A histogram's state: per-bucket counts (not cumulative; one more than the bounds,
    the last for +Inf) and the sum of every observed value."""

    counts: tuple[int, ...]
    total: float


class TenantTokens(NamedTuple):
    """A worker's prompt tokens for one tenant salt, by where their KV came from."""

    salt: str
    requests: int
    local_hit: int  # from the worker's own pages
    remote_hit: int  # copied from a peer (same node or not) and validated
    computed: int


class TierFigures(NamedTuple):
    """One tier of a worker's pages: what it holds now and what went through it since the
    worker started (cumulative, as the rest of the report)."""

    tier: str  # one of TIERS
    pages: int  # pages held in the tier now
    capacity: int  # pages it can hold
    bytes_written: int  # page bytes written into it (demotions, write-through)
    bytes_read: int  # page bytes read out of it (loads back, peers' reads)
    demotions: int  # pages that came down into it from the tier above
    # reason -> pages removed from it: "evicted", "demoted", "cleared", "aborted",
    # "compacted", "corrupt", "quarantined".
    evictions: Mapping[str, int]
    # Prompt tokens served from it; they are among the worker's local hits (TenantTokens).
    hit_tokens: int
    load_seconds: Observed  # LOAD_BUCKETS, one observation per request that loaded from it
    read_ns_per_token: int  # measured cost of loading one token's KV from it (0: not yet)
    accepting: int  # 1: it takes pages; 0: it stopped (full, or a failing disk)
    errors: int  # read and write failures
    # reason -> records dropped when verified: "corrupt", "truncated", "foreign",
    # "format", "orphan".
    dropped: Mapping[str, int]


class WorkerReport(NamedTuple):
    """A worker's own figures since it started, sent with every heartbeat.

    Counters are cumulative, so a lost heartbeat loses nothing, and a restarted worker
    starts again from zero (a counter reset, as Prometheus expects). A hit is counted
    once, when the request is admitted; tokens recomputed after a refused copy count as
    computed, never as hits.
    """

    pages_free: int
    pages_cached: int  # published, unreferenced: evictable
    pages_in_use: int  # referenced by running requests
    evictions: Mapping[str, int]  # reason -> pages
    copy_bytes_same_node: int
    copy_bytes_remote: int
    tenants: Sequence[TenantTokens]
    copy_seconds: Observed  # COPY_BUCKETS, one observation per request that copied
    ttft_hit: Observed  # TTFT_BUCKETS, requests that reused cached tokens
    ttft_miss: Observed  # TTFT_BUCKETS, requests that computed their whole prompt
    alignment_lost_tokens: int  # cached, but rounded off by chunk alignment: computed
    # Its load now: what routing weighs (see `cache_service.routing`).
    running: int  # sequences in prefill or decode
    waiting: int  # requests queued, not yet admitted
    queued_tokens: int  # prompt tokens of those, not yet computed
    # What it measured (0: not yet): nanoseconds to compute one prompt token, and to copy
    # one token's KV from a holder on its node and from one on another.
    prefill_ns: int
    copy_ns_same_node: int
    copy_ns_remote: int
    # Its health: whether its serving loop runs now (1) or failed (0: it refuses requests
    # until the loop is back), how often the loop was restarted, and requests ended early.
    serving: int
    loop_restarts: int
    deadline_exceeded: int  # requests that passed their deadline there
    cancelled: int  # requests their callers left (streams closed or abandoned)
    # Copied pages it recomputed to check them, and those that failed (its holder was
    # reported): `workers.transfer.spot_check`.
    spot_checks: int
    spot_check_failures: int
    # Its tiers, top down (each at most once); () from a worker that reports none, whose
    # pages are all in host memory. The page counts and evictions above are its page
    # store's: device memory when it reports a device tier, else host memory.
    tiers: Sequence[TierFigures] = ()
    # What its running and queued sequences still have to decode, for routing (0: unknown,
    # as from a worker before these fields): the most decode steps any of them has left
    # (their remaining `max_new_tokens`), the measured time of a decode pass, and how
    # many tokens one forward pass takes at most, and one prompt's chunk (0: no chunking).
    decode_steps: int = 0
    step_ns: int = 0
    pass_tokens: int = 0
    chunk_tokens: int = 0
    # |observed - estimated| time to first token of its requests that came with the
    # router's estimate (ROUTE_ERROR_BUCKETS; None: as no observations).
    route_error: Observed | None = None


# The report's optional fields after the tiers, each sent only with those before it.
DECODE_FIELDS = ("decode_steps", "step_ns", "pass_tokens", "chunk_tokens")

# The report's load fields: what routing weighs (`cache_service.routing`).
LOAD_FIELDS = (
    "running",
    "waiting",
    "queued_tokens",
    "prefill_ns",
    "copy_ns_same_node",
    "copy_ns_remote",
)
# The report's health fields (a worker without a serving loop of its own reports serving).
HEALTH_FIELDS = (
    "serving",
    "loop_restarts",
    "deadline_exceeded",
    "cancelled",
    "spot_checks",
    "spot_check_failures",
)
HEALTHY = {
    "serving": 1,
    "loop_restarts": 0,
    "deadline_exceeded": 0,
    "cancelled": 0,
    "spot_checks": 0,
    "spot_check_failures": 0,
}


def no_observations(bounds: Sequence[float]) -> Observed:
    return Observed((0,) * (len(bounds) + 1), 0.0)


# What a worker reports before its first request.
EMPTY_REPORT = WorkerReport(
    pages_free=0,
    pages_cached=0,
    pages_in_use=0,
    evictions={},
    copy_bytes_same_node=0,
    copy_bytes_remote=0,
    tenants=(),
    copy_seconds=no_observations(COPY_BUCKETS),
    ttft_hit=no_observations(TTFT_BUCKETS),
    ttft_miss=no_observations(TTFT_BUCKETS),
    alignment_lost_tokens=0,
    **dict.fromkeys(LOAD_FIELDS, 0),
    **HEALTHY,
)


class Heartbeat(NamedTuple):
    """A worker is alive, with its current load and its figures."""

    worker_id: str
    epoch: int  # as the service issued it at Register
    load: float
    report: WorkerReport


class PublishEvents(NamedTuple):
    """One numbered batch of a worker's KV events (see `cache_service.events`)."""

    worker_id: str
    epoch: int
    seq: int  # batches are numbered per worker from 1 after registration
    events: Sequence[KvEvent]


class Resync(NamedTuple):
    """A full snapshot of a worker's shareable pages, replacing what the index holds."""

    worker_id: str
    epoch: int
    seq: int  # the seq of the last batch the snapshot includes
    chains: Sequence[PagesStored]  # parents before children


class Match(NamedTuple):
    """Which prefix of a prompt is cached where."""

    namespace: Namespace
    tokens: Any  # packed int32 bytes (as decoded), or token ids to pack on encode
    requester: str | None  # the asking worker: its own pages count as local hits


class Route(NamedTuple):
    """Which worker should take a prompt, by the routing policy named (see
    `cache_service.routing`)."""

    namespace: Namespace
    tokens: Any
    # The front door's view: worker id -> prompt tokens of its requests in flight there,
    # not yet computed as far as it knows (>= 0); the candidates are these workers.
    loads: Mapping[str, float]
    # worker id -> tokens of this prompt it is computing for a request in flight.
    pending: Mapping[str, float] = {}
    policy: str = "kvmesh"  # a name of cache_service.routing.POLICIES
    # The front door asking (an id it makes at start): the service weighs the other
    # doors' requests in flight beside its own (`cache_service.front_doors`).
    door: str | None = None


class GetStats(NamedTuple):
    """The service's statistics."""


class Bye(NamedTuple):
    """A worker leaves: its holdings are dropped at once (only with its current epoch)."""

    worker_id: str
    epoch: int


class ReportDead(NamedTuple):
    """The front door saw a worker die: drop it and its holdings at once."""

    worker_id: str


class GetPeer(NamedTuple):
    """How to reach a live worker's pages: its entry as it registered (see PeerEntry)."""

    worker_id: str


class GetPeers(NamedTuple):
    """One page of the live workers' entries, in worker id order, after `after` ("": from
    the first)."""

    after: str


class ReportHolder(NamedTuple):
    """A worker found pages it copied from `holder` not holding what their digests claim
    (a spot check: `workers.transfer.spot_check`), or dropped its copies of a quarantined
    holder's pages: the service quarantines `holder` and tells every member `digests`,
    whose copies they then drop (see `cache_service.index.quarantine`)."""

    worker_id: str  # the reporter (speaks only for itself)
    epoch: int
    holder: str
    digests: bytes  # 16-byte page digests back to back: the pages copied from it
    evidence: str  # what the check found, for the operator


class GetQuarantine(NamedTuple):
    """The members in quarantine and the digests of the pages copied from them."""


class NameTenant(NamedTuple):
    """The front door tells the service the name of a tenant's salt, for the statistics
    (which show names, never salts)."""

    salt: str
    name: str


# ---- replies -------------------------------------------------------------------------------


class Registered(NamedTuple):
    """The answer to Register: the epoch of this incarnation, to carry on every later
    message of the worker, and the service's own epoch."""

    service_epoch: int  # a new one on every service start: re-register and resync on change
    epoch: int


class EpochReply(NamedTuple):
    """The answer to Heartbeat."""

    service_epoch: int
    quarantine: int = 0  # its quarantine list's version (a member behind asks: GetQuarantine)
    elsewhere_pages: Sequence[int] = ()  # `GlobalIndex.held_elsewhere`: evicted first
    elsewhere_generations: Sequence[int] = ()


class ApplyResult(NamedTuple):
    """The outcome of a PublishEvents (or of the index's `resync`).

    `reason` is one of: "applied", "resynced", "duplicate" (seq == last applied: ignored),
    "stale" (seq < last applied: ignored), "gap" (a batch went missing), "unknown_worker"
    (not registered, or removed: register again, then resync), "epoch_mismatch",
    "unknown_parent" (a chain hangs under a page the index does not know), "page_conflict"
    (a page id reported twice on one path), "over_capacity" (a chain would take the worker
    past the capacity it registered), "awaiting_resync" (an earlier batch failed).
    `last_seq` is the last seq the index applied for the worker (0 when unknown).
    """

    applied: bool
    needs_resync: bool
    reason: str
    last_seq: int


class ResyncReply(NamedTuple):
    """The answer to Resync."""

    pages: int  # pages of the worker now in the index


class HolderSpan(NamedTuple):
    """One worker's copy of the first pages of a match: where to fetch them, how to check.

    The worker holds prompt pages 0 .. len(page_ids) - 1; `page_ids[i]` is prompt page i in
    the worker's own page store, `generations[i]` its generation when it was published.
    `tier` is the tier (a name of `events.TIERS`) of the span's first page; `tiers` is
    empty when every page of the span is in that tier, else one byte per page, its tier's
    index into TIERS (`tier_of`):

        page_ids   (10, 11, 12, 907)
        tier       "host"
        tiers      b""                  every page in host memory
        tiers      bytes((1, 1, 1, 2))  pages 0-2 in host memory, page 3 on disk
    """

    worker_id: str
    tier: str
    page_ids: tuple[int, ...]
    generations: tuple[int, ...]  # same length as page_ids
    tiers: bytes = b""

    def tier_of(self, i: int) -> str:
        """The tier of page i of the span."""
        return TIERS[self.tiers[i]] if self.tiers else self.tier


class PackedSpan(NamedTuple):
    """A HolderSpan with its page ids and generations packed as on the wire: little-endian
    int32 and int64 bytes. The server sends the index's bytes as they are, where a
    HolderSpan's ints would be made and then packed again (about 4 us a 128-page span)."""

    worker_id: str
    tier: str
    page_ids: bytes
    generations: bytes
    tiers: bytes = b""  # as HolderSpan's


class MatchResult(NamedTuple):
    """The longest cached prefix of full pages and who holds it (the answer to Match).

    `spans` has one entry per live holder of at least page 0, longest first, then by
    worker id; the longest covers all `matched_tokens` (page_tokens * its length). They
    are HolderSpans as decoded and as `GlobalIndex.match` returns them, PackedSpans as
    `GlobalIndex.match_packed` returns them for the server to send.
    """

    matched_tokens: int
    spans: tuple[HolderSpan, ...] | tuple[PackedSpan, ...]


class RouteDecision(NamedTuple):
    """Which worker should take a prompt (the answer to Route); `worker_id` is None when no
    candidate is live.

    `reason` says why, in the policy's terms: "prefix" (the chosen worker holds a prefix
    of the prompt), "pending" (it is computing one), "copy" (it copies one in),
    "least_loaded", "round_robin", "balance" (the loads were imbalanced), or
    "no_live_worker" (worker_id None).
    """

    worker_id: str | None
    matched_tokens: int  # tokens the chosen worker holds locally, as a contiguous prefix
    score: float
    reason: str


class StatsReply(NamedTuple):
    """The answer to GetStats: free-form figures (str keys; numbers, str, lists, maps)."""

    stats: dict[str, Any]


class Ack(NamedTuple):
    """The answer to Bye, ReportDead and NameTenant: done."""


class PeerEntry(NamedTuple):
    """A live worker as its peers reach it (the answer to GetPeer): what its current
    incarnation sent at Register, under the epoch the service issued it. A worker that
    restarts registers again, and its entry is replaced; one that leaves, dies or goes
    silent has none."""

    worker_id: str
    epoch: int
    node_id: str
    tier: str  # as it registered (see Register)
    address: str  # its page server; "" if none
    shm_name: str  # its shared-memory page store; "" if none
    page_key: bytes | None  # its page server's public key (z85); None: no auth


class PeerList(NamedTuple):
    """The answer to GetPeers: up to a page of entries in worker id order; `more` when
    entries after the last one are left for the next GetPeers (after its worker id)."""

    peers: tuple[PeerEntry, ...]
    more: bool


class QuarantineList(NamedTuple):
    """The answer to GetQuarantine: the holders in quarantine (none is copied from, none
    may register), and the digests of the pages copied from them (copies dropped)."""

    holders: tuple[str, ...]
    digests: bytes  # 16-byte digests back to back
    version: int


class ErrorReply(NamedTuple):
    """The answer to a request that failed: a code for programs, a message for people."""

    code: str
    message: str


Request = (
    Register
    | Heartbeat
    | PublishEvents
    | Resync
    | Match
    | Route
    | GetStats
    | Bye
    | ReportDead
    | NameTenant
    | GetPeer
    | GetPeers
    | ReportHolder
    | GetQuarantine
)
Reply = (
    Registered
    | EpochReply
    | ApplyResult
    | ResyncReply
    | MatchResult
    | RouteDecision
    | StatsReply
    | Ack
    | PeerEntry
    | PeerList
    | QuarantineList
    | ErrorReply
)
