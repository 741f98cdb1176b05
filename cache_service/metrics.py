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
the names the front door gave (never salts), as many as the index keeps tallies for
(`max_tenants`, the rest summed as "(other)").
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

# Seconds a match takes inside the service (decode to reply): tens of microseconds
# for a short prompt, a few milliseconds for a long one on a loaded index.
LOOKUP_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class HistogramCounts(NamedTuple):
    """A histogram's state: per-bucket counts (not cumulative; the last is +Inf), sum."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' form: (upper bound, observations <= it), ending with +Inf."""
        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class Histogram:
    """Fixed buckets, observed by one thread (the loop); `counts()` is a copy."""

    def __init__(self, bounds: Sequence[float]):
        assert list(bounds) == sorted(bounds) and len(set(bounds)) == len(bounds), bounds
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._total = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le).
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._total += value

    def counts(self) -> HistogramCounts:
        return HistogramCounts(self.bounds, tuple(self._counts), self._total)


class MetricsSnapshot(NamedTuple):
    """What one scrape reports, taken on the loop thread."""

    epoch: int
    workers_live: int
    resyncs: int  # resyncs the service applied
    # Per worker and per tenant: the index's tallies (tokens asked about / found cached).
    worker_queries: Mapping[str, Mapping[str, int]]
    tenant_queries: Mapping[str, Mapping[str, int]]
    pages_indexed: int
    lookup: HistogramCounts


def snapshot_from(stats: Mapping[str, Any], epoch: int, lookup: Histogram) -> MetricsSnapshot:
    """A snapshot from the index's `stats()` (on the thread that owns the index)."""
    return MetricsSnapshot(
        epoch=epoch,
        workers_live=stats["workers_live"],
        resyncs=stats["events"]["resyncs"],
        worker_queries={w: dict(c) for w, c in stats["workers"].items()},
        tenant_queries={t: dict(c) for t, c in stats["tenants"].items()},
        pages_indexed=stats["pages"],
        lookup=lookup.counts(),
    )


class SnapshotCollector(Collector):
    """Yields the latest published snapshot as Prometheus metric families."""

    def __init__(self) -> None:
        self._snapshot: MetricsSnapshot | None = None
        self._lock = threading.Lock()  # publish / read of one reference, kept obvious

    def publish(self, snapshot: MetricsSnapshot) -> None:
        with self._lock:
            self._snapshot = snapshot

    def latest(self) -> MetricsSnapshot | None:
        with self._lock:
            return self._snapshot

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
        lookup = HistogramMetricFamily(
            "kvmesh_lookup_seconds", "Time the service takes to answer a match.", unit=""
        )
        lookup.add_metric([], snap.lookup.cumulative(), snap.lookup.total)
        yield lookup


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


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
