"""What the live dashboard page fetches (`/api/dashboard`): JSON from the metrics snapshots.

The loop thread publishes a snapshot every metrics interval; each adds one history point
(cumulative counters, so the page draws rates from the differences of consecutive
points). The HTTP thread builds the reply from the latest snapshot and the history, which
nobody changes once published.

    {"now", "epoch", "workers_live",
     "totals":   {"requests", "local_hit", "remote_hit", "computed", "hit_rate"},
     "history":  [{"t", "requests", "local_hit", "remote_hit", "computed",
                   "ttft_hit": {"count", "sum"}, "ttft_miss": {...}, "evictions"}, ...],
     "workers":  [{"worker", "live", "requests", <sources>, "hit_rate",
                   "pages": {"free", "cached", "in_use"}, "evictions": {reason: pages}}],
     "tenants":  [{"tenant", "requests", <sources>, "hit_rate"}],
     "evictions": {reason: pages},
     "ttft":     {"hit" | "miss": {"count", "sum", "buckets": [[le, cumulative], ...]}},
     "tiers":    [{"tier", "hit_tokens", "hit_rate" (of all prompt tokens), "pages",
                   "capacity", "evictions": {reason: pages}, "workers", "accepting",
                   "bytes_written", "bytes_read", "demotions", "errors",
                   "dropped": {reason: records}}]   top down (`WorkerReports.tiers`);
                   the figures only a tier's own report carries are null where no worker
                   reported that tier}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cache_service.reports import NO_FIGURES, SOURCES, TenantFigures

if TYPE_CHECKING:
    from cache_service.histograms import HistogramCounts
    from cache_service.metrics import MetricsSnapshot


def history_point(snapshot: MetricsSnapshot) -> dict[str, Any]:
    """One point of the dashboard's history: the mesh's cumulative figures now."""
    totals = _total(snapshot.served.values())
    return {
        "t": snapshot.time,
        **_figures(totals),
        "ttft_hit": _moments(snapshot.ttft["hit"]),
        "ttft_miss": _moments(snapshot.ttft["miss"]),
        "evictions": sum(sum(row.evictions.values()) for row in snapshot.workers.values()),
    }


def dashboard_json(
    snapshot: MetricsSnapshot | None, history: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """The whole reply; before the first snapshot, empty figures."""
    if snapshot is None:
        return {
            "now": None,
            "epoch": None,
            "workers_live": 0,
            "totals": _with_rate(NO_FIGURES),
            "history": [],
            "workers": [],
            "tenants": [],
            "evictions": {},
            "ttft": {},
            "quarantined": [],
            "tiers": [],
        }
    by_worker: dict[str, TenantFigures] = {}
    by_tenant: dict[str, TenantFigures] = {}
    for (worker, tenant), figures in snapshot.served.items():
        by_worker[worker] = by_worker.get(worker, NO_FIGURES).plus(figures)
        by_tenant[tenant] = by_tenant.get(tenant, NO_FIGURES).plus(figures)
    evictions: dict[str, int] = {}
    for row in snapshot.workers.values():
        for reason, pages in row.evictions.items():
            evictions[reason] = evictions.get(reason, 0) + pages
    return {
        "now": snapshot.time,
        "epoch": snapshot.epoch,
        "workers_live": snapshot.workers_live,
        "totals": _with_rate(_total(snapshot.served.values())),
        "history": list(history),
        "workers": [
            {
                "worker": worker,
                "live": row.live,
                **_with_rate(by_worker.get(worker, NO_FIGURES)),
                "pages": dict(row.pages),
                "evictions": dict(row.evictions),
            }
            for worker, row in sorted(snapshot.workers.items())
        ],
        "tenants": [
            {"tenant": tenant, **_with_rate(figures)}
            for tenant, figures in sorted(by_tenant.items())
        ],
        "evictions": evictions,
        "ttft": {
            cache: {**_moments(counts), "buckets": counts.cumulative()}
            for cache, counts in sorted(snapshot.ttft.items())
        },
        "quarantined": [dict(record) for record in snapshot.quarantined],
        "tiers": [{"tier": tier, **figures} for tier, figures in snapshot.tiers.items()],
    }


def _total(figures: Iterable[TenantFigures]) -> TenantFigures:
    total = NO_FIGURES
    for item in figures:
        total = total.plus(item)
    return total


def _figures(figures: TenantFigures) -> dict[str, int]:
    return {"requests": figures.requests, **{s: getattr(figures, s) for s in SOURCES}}


def _with_rate(figures: TenantFigures) -> dict[str, Any]:
    served = figures.local_hit + figures.remote_hit + figures.computed
    hits = figures.local_hit + figures.remote_hit
    return {**_figures(figures), "hit_rate": hits / served if served else 0.0}


def _moments(counts: HistogramCounts) -> dict[str, float]:
    return {"count": counts.count, "sum": counts.total}
