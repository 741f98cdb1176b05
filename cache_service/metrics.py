"""The mesh's Prometheus metrics, served by the service: one scrape target for the cluster.

Who reads what: the service's loop thread owns the index, so it alone turns the index's
figures (and its own timings) into a `MetricsSnapshot`, plain numbers, and hands it to
the `SnapshotCollector` by swapping one reference. A scrape, on the HTTP thread, reads
only that snapshot: it never touches the index, and it sees figures that were
consistent with each other when they were taken.

    loop thread:  index.stats() + timings --> MetricsSnapshot --publish--> collector
    HTTP thread:  GET /metrics --> registry --> collector.collect(latest snapshot)

Names follow vLLM's where vLLM has one (`kvmesh_prefix_cache_queries_total` and
`..._hits_total` count tokens, as `vllm:prefix_cache_queries` does). Tenant labels are
the names the front door gave (never salts), as many as the index keeps names for
(`max_tenants`); every salt without a name is summed as "(unnamed)".

Tiers: prompt tokens, pages and evictions carry a `tier` label ("device", "host",
"disk"; computed tokens "none"), and `kvmesh_tier_*` families show what went through each
tier a worker reports. A tier's hit rate is its hit tokens over all prompt tokens:

    sum by (tier) (rate(kvmesh_prompt_tokens_total{source=~"local_hit|remote_hit"}[1m]))
      / ignoring (tier) group_left sum(rate(kvmesh_prompt_tokens_total[1m]))
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from cache_service import dashboard_data
from cache_service.histograms import Histogram, HistogramCounts, summed
from cache_service.messages import (
    COPY_BUCKETS,
    LOAD_BUCKETS,
    ROUTE_ERROR_BUCKETS,
    TIERS,
    TTFT_BUCKETS,
    TierFigures,
)
from cache_service.reports import (
    REMOTE_TIER,
    TenantFigures,
    WorkerReports,
    store_tier,
)

# The tier label of computed tokens: no tier served them.
NO_TIER = "none"

# Seconds a match takes inside the service (decode to reply): tens of microseconds
# for a short prompt, a few milliseconds for a long one on a loaded index.
# Dashboard history: a point a second (the default metrics interval) for ten minutes.
HISTORY_POINTS = 600

LOOKUP_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class WorkerFiguresRow(NamedTuple):
    """One worker's own figures in a snapshot (from its latest heartbeat report)."""

    live: bool
    pages: Mapping[str, int]  # state ("free", "cached", "in_use") -> pages
    evictions: Mapping[str, int]  # reason -> pages
    copy_bytes: Mapping[str, int]  # kind ("same_node", "remote") -> bytes
    requests: Mapping[str, int] = {}  # "running" / "waiting" -> sequences now
    alignment_lost_tokens: int = 0  # cached tokens rounded off by chunk alignment
    serving: int = 1  # 1: its serving loop runs; 0: it failed (refusing requests)
    loop_restarts: int = 0
    ended: Mapping[str, int] = {}  # "deadline" / "cancelled" -> requests ended early
    spot_checks: Mapping[str, int] = {}  # "checked" / "failed" -> copied pages recomputed
    tiers: Sequence[TierFigures] = ()  # as the worker reported them, top down


class MetricsSnapshot(NamedTuple):
    """What one scrape reports, taken on the loop thread."""

    time: float  # unix seconds when it was taken
    epoch: int
    workers_live: int
    resyncs: int  # resyncs the service applied
    # Per worker and per tenant: the index's tallies (tokens asked about / found cached).
    worker_queries: Mapping[str, Mapping[str, int]]
    tenant_queries: Mapping[str, Mapping[str, int]]
    pages_indexed: int
    lookup: HistogramCounts
    # What the workers report: prompt tokens by (worker, tenant name), their pages,
    # evictions and copies, and the histograms summed over workers.
    served: Mapping[tuple[str, str], TenantFigures]
    workers: Mapping[str, WorkerFiguresRow]
    copy_seconds: HistogramCounts
    ttft: Mapping[str, HistogramCounts]  # "hit" / "miss"
    # Members in quarantine (`cache_service.quarantine`: holder, reporter, since,
    # evidence) and how many went in since the service started.
    quarantined: Sequence[Mapping[str, Any]] = ()
    quarantines: int = 0
    # Per tier: load-back times summed over workers, and its hits and figures summed over
    # them (`WorkerReports.tiers`).
    load_seconds: Mapping[str, HistogramCounts] = {}
    tiers: Mapping[str, Mapping[str, Any]] = {}
    # How far routed requests' first tokens came from the router's estimate.
    route_error: HistogramCounts | None = None


def snapshot_from(
    stats: Mapping[str, Any],
    epoch: int,
    lookup: Histogram,
    reports: WorkerReports,
    tenant_name: Callable[[str], str],
    now: float,
    quarantine: Mapping[str, Any] | None = None,
) -> MetricsSnapshot:
    """A snapshot from the index's `stats()` and the workers' reports (on the thread that
    owns both); `tenant_name` turns a report's salts into the names shown."""
    rows = reports.items()
    workers = {
        worker_id: WorkerFiguresRow(
            live=live,
            pages={
                "free": report.pages_free,
                "cached": report.pages_cached,
                "in_use": report.pages_in_use,
            },
            evictions=dict(report.evictions),
            copy_bytes={
                "same_node": report.copy_bytes_same_node,
                "remote": report.copy_bytes_remote,
            },
            requests={"running": report.running, "waiting": report.waiting},
            alignment_lost_tokens=report.alignment_lost_tokens,
            serving=report.serving,
            loop_restarts=report.loop_restarts,
            ended={"deadline": report.deadline_exceeded, "cancelled": report.cancelled},
            spot_checks={"checked": report.spot_checks, "failed": report.spot_check_failures},
            tiers=tuple(report.tiers),
        )
        for worker_id, report, live in rows
    }
    reported = [report for _, report, _ in rows]
    tiers = [tier for report in reported for tier in report.tiers]
    return MetricsSnapshot(
        time=now,
        epoch=epoch,
        workers_live=stats["workers_live"],
        resyncs=stats["events"]["resyncs"],
        worker_queries={w: dict(c) for w, c in stats["workers"].items()},
        tenant_queries={t: dict(c) for t, c in stats["tenants"].items()},
        pages_indexed=stats["pages"],
        lookup=lookup.counts(),
        served=reports.tenant_figures(tenant_name),
        workers=workers,
        copy_seconds=summed(COPY_BUCKETS, [r.copy_seconds for r in reported]),
        ttft={
            "hit": summed(TTFT_BUCKETS, [r.ttft_hit for r in reported]),
            "miss": summed(TTFT_BUCKETS, [r.ttft_miss for r in reported]),
        },
        quarantined=tuple((quarantine or {}).get("members", ())),
        quarantines=(quarantine or {}).get("quarantines", 0),
        load_seconds={
            name: summed(LOAD_BUCKETS, [t.load_seconds for t in tiers if t.tier == name])
            for name in TIERS
            if any(t.tier == name for t in tiers)
        },
        tiers=reports.tiers(),
        route_error=HistogramCounts(ROUTE_ERROR_BUCKETS, *reports.route_errors()),
    )


class SnapshotCollector(Collector):
    """Yields the latest published snapshot as Prometheus metric families, and keeps the
    recent history the dashboard draws (one point per snapshot, at most HISTORY_POINTS)."""

    def __init__(self) -> None:
        self._snapshot: MetricsSnapshot | None = None
        self._history: deque[dict[str, Any]] = deque(maxlen=HISTORY_POINTS)
        self._lock = threading.Lock()  # publish / read of the references, kept obvious

    def publish(self, snapshot: MetricsSnapshot) -> None:
        point = dashboard_data.history_point(snapshot)
        with self._lock:
            self._snapshot = snapshot
            self._history.append(point)

    def latest(self) -> MetricsSnapshot | None:
        with self._lock:
            return self._snapshot

    def dashboard(self) -> dict[str, Any]:
        """What the dashboard page fetches (see cache_service.dashboard_data)."""
        with self._lock:
            snapshot, history = self._snapshot, list(self._history)
        return dashboard_data.dashboard_json(snapshot, history)

    def collect(self) -> Iterator[Metric]:
        snap = self.latest()
        if snap is None:
            return
        yield _gauge("kvmesh_service_epoch", "The service's current epoch.", snap.epoch)
        yield _gauge("kvmesh_workers_live", "Workers registered and alive.", snap.workers_live)
        yield _gauge("kvmesh_index_pages", "Pages in the global index.", snap.pages_indexed)
        resyncs = CounterMetricFamily("kvmesh_resyncs", "Full resyncs the service applied.")
        resyncs.add_metric([], snap.resyncs)
        yield resyncs
        yield from _query_families("worker", snap.worker_queries)
        yield from _query_families("tenant", snap.tenant_queries)
        yield from _served_families(snap.served, snap.workers)
        yield from _worker_families(snap.workers)
        yield from _tier_families(snap.workers)
        yield _histogram(
            "kvmesh_lookup_seconds", "Time the service takes to answer a match.", snap.lookup
        )
        yield _histogram(
            "kvmesh_copy_seconds",
            "Time a request spends copying pages in from peers (requests that copied).",
            snap.copy_seconds,
        )
        if snap.route_error is not None:
            yield _histogram(
                "kvmesh_route_ttft_error_seconds",
                "How far a routed request's time to first token was from the router's "
                "estimate, either way (requests the kvmesh policy routed).",
                snap.route_error,
            )
        ttft = HistogramMetricFamily(
            "kvmesh_ttft_seconds",
            "Time to first token; cache=hit when the request reused cached tokens.",
            labels=["cache"],
        )
        for cache, counts in sorted(snap.ttft.items()):
            ttft.add_metric([cache], counts.cumulative(), counts.total)
        yield ttft
        load = HistogramMetricFamily(
            "kvmesh_tier_load_seconds",
            "Time a request spends loading pages back from a tier (requests that did).",
            labels=["tier"],
        )
        for tier, counts in snap.load_seconds.items():
            load.add_metric([tier], counts.cumulative(), counts.total)
        yield load
        quarantined = GaugeMetricFamily(
            "kvmesh_quarantined",
            "1 for each member in quarantine: its pages failed a spot check; it may not "
            "register until an operator clears it (`kvmesh quarantine --clear`).",
            labels=["worker", "reporter"],
        )
        for record in snap.quarantined:
            quarantined.add_metric([record["holder"], record["reporter"]], 1)
        yield quarantined
        quarantines = CounterMetricFamily(
            "kvmesh_quarantines", "Members put in quarantine since the service started."
        )
        quarantines.add_metric([], snap.quarantines)
        yield quarantines


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _histogram(name: str, doc: str, counts: HistogramCounts) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc)
    family.add_metric([], counts.cumulative(), counts.total)
    return family


def _served_families(
    served: Mapping[tuple[str, str], TenantFigures], workers: Mapping[str, WorkerFiguresRow]
) -> Iterator[Metric]:
    """Prompt tokens by source and tier, requests, and vLLM's prefix-cache queries / hits
    (tokens), by worker and tenant, as the workers reported them."""
    labels = ["worker", "tenant"]
    tokens = CounterMetricFamily(
        "kvmesh_prompt_tokens",
        "Prompt tokens by where their KV came from: local_hit (the worker's own pages), "
        "remote_hit (copied from a peer and validated), computed; tier: the tier that "
        "served them (remote hits: host, the peer's; computed: none). A worker's hits from "
        "tiers other than its page store's are shared among its tenants by local hits.",
        labels=["source", "tier", *labels],
    )
    requests = CounterMetricFamily("kvmesh_requests", "Requests admitted.", labels=labels)
    queries = CounterMetricFamily(
        "kvmesh_prefix_cache_queries", "Prompt tokens looked up in the caches.", labels=labels
    )
    hits = CounterMetricFamily(
        "kvmesh_prefix_cache_hits",
        "Prompt tokens found cached (local or copied; recomputed tokens never count).",
        labels=labels,
    )
    for (worker, tenant), figures in sorted(served.items()):
        row = workers.get(worker)
        tiers = row.tiers if row is not None else ()
        shown = {store_tier(tiers)} | {t.tier for t in tiers}  # the tiers it has
        for tier, count in figures.local_by_tier().items():
            if tier in shown or count:
                tokens.add_metric(["local_hit", tier, worker, tenant], count)
        tokens.add_metric(["remote_hit", REMOTE_TIER, worker, tenant], figures.remote_hit)
        tokens.add_metric(["computed", NO_TIER, worker, tenant], figures.computed)
        requests.add_metric([worker, tenant], figures.requests)
        queries.add_metric(
            [worker, tenant], figures.local_hit + figures.remote_hit + figures.computed
        )
        hits.add_metric([worker, tenant], figures.local_hit + figures.remote_hit)
    yield from (tokens, requests, queries, hits)


def _worker_families(workers: Mapping[str, WorkerFiguresRow]) -> Iterator[Metric]:
    """Pages by state and tier (live workers only), evictions and copied bytes by worker."""
    pages = GaugeMetricFamily(
        "kvmesh_pages",
        "Pages of a worker's tiers by state: its page store's (host memory, or device "
        "memory on a GPU) free, cached or in_use; another tier's free or cached (held).",
        labels=["state", "tier", "worker"],
    )
    evictions = CounterMetricFamily(
        "kvmesh_evictions",
        "Pages removed from a worker's tier, by reason.",
        labels=["reason", "tier", "worker"],
    )
    copied = CounterMetricFamily(
        "kvmesh_copy_bytes",
        "Page bytes copied in from peers: same_node (shared memory) or remote (page server).",
        labels=["kind", "worker"],
    )
    # As vLLM's num_requests_running / num_requests_waiting, per worker.
    running = GaugeMetricFamily(
        "kvmesh_num_requests_running",
        "Sequences a worker runs now (in prefill or decode).",
        labels=["worker"],
    )
    waiting = GaugeMetricFamily(
        "kvmesh_num_requests_waiting",
        "Requests queued in a worker, not yet admitted.",
        labels=["worker"],
    )
    aligned = CounterMetricFamily(
        "kvmesh_alignment_lost_tokens",
        "Prompt tokens cached but computed again because chunk alignment rounded the "
        "match down to a chunk boundary.",
        labels=["worker"],
    )
    serving = GaugeMetricFamily(
        "kvmesh_worker_serving",
        "1 while a live worker's serving loop runs; 0 while it failed (the worker refuses "
        "requests and the front door routes around it).",
        labels=["worker"],
    )
    restarts = CounterMetricFamily(
        "kvmesh_serving_loop_restarts",
        "Times a worker's serving loop failed and was started again.",
        labels=["worker"],
    )
    ended = CounterMetricFamily(
        "kvmesh_requests_ended",
        "Requests a worker ended early: deadline (passed it) or cancelled (the caller left).",
        labels=["reason", "worker"],
    )
    spot = CounterMetricFamily(
        "kvmesh_spot_checks",
        "Copied pages a worker recomputed to check them: result=passed, or failed (the "
        "holder was reported and the copy dropped).",
        labels=["result", "worker"],
    )
    for worker, row in sorted(workers.items()):
        store = store_tier(row.tiers)  # the report's own page counts are its store's
        others = [t for t in row.tiers if t.tier != store]
        if row.live:
            for state, count in row.pages.items():
                pages.add_metric([state, store, worker], count)
            for tier in others:
                pages.add_metric(["free", tier.tier, worker], max(tier.capacity - tier.pages, 0))
                pages.add_metric(["cached", tier.tier, worker], tier.pages)
            running.add_metric([worker], row.requests.get("running", 0))
            waiting.add_metric([worker], row.requests.get("waiting", 0))
            serving.add_metric([worker], row.serving)
        for reason, count in sorted(row.evictions.items()):
            evictions.add_metric([reason, store, worker], count)
        for tier in others:
            for reason, count in sorted(tier.evictions.items()):
                evictions.add_metric([reason, tier.tier, worker], count)
        for kind, count in row.copy_bytes.items():
            copied.add_metric([kind, worker], count)
        aligned.add_metric([worker], row.alignment_lost_tokens)
        restarts.add_metric([worker], row.loop_restarts)
        for reason, count in sorted(row.ended.items()):
            ended.add_metric([reason, worker], count)
        if row.spot_checks:
            failed = row.spot_checks["failed"]
            spot.add_metric(["passed", worker], row.spot_checks["checked"] - failed)
            spot.add_metric(["failed", worker], failed)
    yield from (pages, evictions, copied, running, waiting, aligned, serving, restarts, ended)
    yield spot


def _tier_families(workers: Mapping[str, WorkerFiguresRow]) -> Iterator[Metric]:
    """What went through each tier a worker reports: bytes, demotions, errors, records
    dropped (counters, kept for departed workers), capacity and whether it takes pages
    (gauges, live workers only)."""
    labels = ["tier", "worker"]
    capacity = GaugeMetricFamily(
        "kvmesh_tier_capacity_pages",
        "Pages a worker's tier can hold.",
        labels=labels,
    )
    accepting = GaugeMetricFamily(
        "kvmesh_tier_accepting",
        "1 while a worker's tier takes pages; 0 while it stopped (full, or a failing disk).",
        labels=labels,
    )
    written = CounterMetricFamily(
        "kvmesh_tier_written_bytes",
        "Page bytes written into a worker's tier (demotions, write-through).",
        labels=labels,
    )
    read = CounterMetricFamily(
        "kvmesh_tier_read_bytes",
        "Page bytes read out of a worker's tier (loads back, peers' reads).",
        labels=labels,
    )
    demotions = CounterMetricFamily(
        "kvmesh_tier_demotions",
        "Pages that came down into a worker's tier from the tier above.",
        labels=labels,
    )
    errors = CounterMetricFamily(
        "kvmesh_tier_errors", "Reads and writes of a worker's tier that failed.", labels=labels
    )
    dropped = CounterMetricFamily(
        "kvmesh_tier_dropped_records",
        "Records of a worker's tier dropped when verified, by reason (corrupt, truncated, "
        "foreign, format, orphan).",
        labels=["reason", *labels],
    )
    for worker, row in sorted(workers.items()):
        if row.live:
            store = store_tier(row.tiers)  # its capacity: the report's own page counts
            capacity.add_metric([store, worker], sum(row.pages.values()))
            for tier in row.tiers:
                if tier.tier != store:
                    capacity.add_metric([tier.tier, worker], tier.capacity)
                accepting.add_metric([tier.tier, worker], tier.accepting)
        for tier in row.tiers:
            written.add_metric([tier.tier, worker], tier.bytes_written)
            read.add_metric([tier.tier, worker], tier.bytes_read)
            demotions.add_metric([tier.tier, worker], tier.demotions)
            errors.add_metric([tier.tier, worker], tier.errors)
            for reason, count in sorted(tier.dropped.items()):
                dropped.add_metric([reason, tier.tier, worker], count)
    yield from (capacity, accepting, written, read, demotions, errors, dropped)


def _query_families(label: str, tallies: Mapping[str, Mapping[str, int]]) -> Iterator[Metric]:
    """Index queries and hits in tokens, by `label` (worker or tenant)."""
    queries = CounterMetricFamily(
        f"kvmesh_index_{label}_queried_tokens",
        f"Prompt tokens the index was asked about, by {label}.",
        labels=[label],
    )
    hits = CounterMetricFamily(
        f"kvmesh_index_{label}_hit_tokens",
        f"Prompt tokens the index found cached, by {label}.",
        labels=[label],
    )
    for name, counters in sorted(tallies.items()):
        queries.add_metric([name], counters["queried_tokens"])
        hits.add_metric([name], counters["hit_tokens"])
    yield queries
    yield hits
