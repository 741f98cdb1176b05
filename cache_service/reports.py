"""The latest report of each worker, as heartbeats bring them (kept by the service's loop).

Reports are cumulative, so the newest one of a worker replaces the one before. A worker
that leaves keeps its last report, marked not live, so the mesh's totals do not fall when
a worker goes; at most `max_departed` departed workers are kept (the oldest go first).
A worker that comes back under the same id starts from zero again: a counter reset.

Tenants: a report names salts; `by_name` (the index's names, given by the front door)
turns them into the names the metrics show. Salts the front door never named show as
UNNAMED, so the tenant labels are bounded by the names the index keeps.

Tiers: a report's local hits come by tenant, while each tier it reports counts the tokens
served from it for the worker as a whole (`TierFigures.hit_tokens`). The page store's tier
(`store_tier`: device memory on a GPU worker, else host memory) is what the report's own
page counts describe, and it served the local hits the other tiers did not. To show hits
by tenant and tier, each report's growth in another tier's hits is shared among the
tenants in proportion to their growth in local hits since the worker's previous report
(`_split`): so every figure only grows between restarts, as a counter must, the tenants'
shares add up to the tier's own count, and a worker with one tenant, or with one tier,
is split exactly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from cache_service.messages import (
    ROUTE_ERROR_BUCKETS,
    TIERS,
    Observed,
    TierFigures,
    WorkerReport,
)
from cache_service.routing import WorkerLoad

SOURCES = ("local_hit", "remote_hit", "computed")
# The tier remote hits count for: a peer's pages are copied out of its host memory.
REMOTE_TIER = "host"


def store_tier(tiers: Sequence[TierFigures]) -> str:
    """The tier of a worker's page store, whose pages the report's own counts are: device
    memory when it reports a device tier, else host memory."""
    return "device" if any(t.tier == "device" for t in tiers) else "host"


class TenantFigures(NamedTuple):
    requests: int
    local_hit: int
    remote_hit: int
    computed: int
    # local_hit by the tier that served it (they add up to local_hit).
    device_hit: int = 0
    host_hit: int = 0
    disk_hit: int = 0

    def plus(self, other: TenantFigures) -> TenantFigures:
        return TenantFigures(*(a + b for a, b in zip(self, other, strict=True)))

    def local_by_tier(self) -> dict[str, int]:
        return {"device": self.device_hit, "host": self.host_hit, "disk": self.disk_hit}

    def hits_by_tier(self) -> dict[str, int]:
        """Hit tokens, local and remote, by the tier that served them."""
        hits = self.local_by_tier()
        hits[REMOTE_TIER] += self.remote_hit
        return hits


NO_FIGURES = TenantFigures(0, 0, 0, 0)


class _Split(NamedTuple):
    """How a worker's tier hits were shared among its tenants, as of its latest report."""

    local: Mapping[str, int]  # salt -> its local hits in the report
    hits: Mapping[str, int]  # tier (not the store's) -> its hit tokens in the report
    given: Mapping[str, Mapping[str, int]]  # salt -> tier -> tokens given it


NO_SPLIT = _Split({}, {}, {})


class WorkerReports:
    """Worker id -> (its latest report, live or not)."""

    def __init__(self, max_departed: int = 256):
        if max_departed < 0:
            raise ValueError(f"max_departed must be >= 0, got {max_departed}")
        self.max_departed = max_departed
        self._live: dict[str, WorkerReport] = {}
        self._departed: OrderedDict[str, WorkerReport] = OrderedDict()
        self._splits: dict[str, _Split] = {}  # of every worker kept, live or departed

    def update(self, worker_id: str, report: WorkerReport) -> None:
        """The newest report of a live worker."""
        self._departed.pop(worker_id, None)
        self._live[worker_id] = report
        self._splits[worker_id] = _split(report, self._splits.get(worker_id, NO_SPLIT))

    def departed(self, worker_id: str) -> None:
        """The worker left (bye, expiry, reported dead): keep its last figures."""
        report = self._live.pop(worker_id, None)
        if report is None:
            return
        self._departed[worker_id] = report
        self._departed.move_to_end(worker_id)
        while len(self._departed) > self.max_departed:
            gone, _ = self._departed.popitem(last=False)
            del self._splits[gone]

    def loads(self) -> dict[str, WorkerLoad]:
        """Live worker id -> its load and measured costs (defaults where it measured
        nothing yet), for routing."""
        out = {}
        for worker_id, report in self._live.items():
            measured = {
                "prefill_s": report.prefill_ns,
                "copy_s_same_node": report.copy_ns_same_node,
                "copy_s_remote": report.copy_ns_remote,
            }
            disk = [t.read_ns_per_token for t in report.tiers if t.tier == "disk"]
            measured["disk_s"] = disk[0] if disk else 0
            measured["step_s"] = report.step_ns
            out[worker_id] = WorkerLoad(
                queued_tokens=report.queued_tokens,
                running=report.running,
                decode_steps=report.decode_steps,
                pass_tokens=report.pass_tokens,
                chunk_tokens=report.chunk_tokens,
                **{name: ns * 1e-9 for name, ns in measured.items() if ns > 0},
            )
        return out

    def items(self) -> list[tuple[str, WorkerReport, bool]]:
        """(worker id, report, live) for every worker with a report, sorted by id."""
        rows = [(w, r, True) for w, r in self._live.items()]
        rows += [(w, r, False) for w, r in self._departed.items()]
        return sorted(rows, key=lambda row: row[0])

    def tenant_figures(self, by_name: Callable[[str], str]) -> dict[tuple[str, str], TenantFigures]:
        """(worker id, tenant name) -> figures, salts resolved by `by_name`."""
        out: dict[tuple[str, str], TenantFigures] = {}
        for worker_id, report, _live in self.items():
            given = self._splits[worker_id].given
            store = store_tier(report.tiers)
            for row in report.tenants:
                key = (worker_id, by_name(row.salt))
                local = dict.fromkeys(TIERS, 0) | given.get(row.salt, {})
                local[store] = row.local_hit - sum(local.values())
                figures = TenantFigures(
                    row.requests,
                    row.local_hit,
                    row.remote_hit,
                    row.computed,
                    *(local[tier] for tier in TIERS),
                )
                out[key] = out.get(key, NO_FIGURES).plus(figures)
        return out

    def prompt_tokens(self) -> dict[str, int]:
        """Prompt tokens by source over every worker's report: the mesh's own figure."""
        totals = dict.fromkeys(SOURCES, 0)
        for _worker, report, _live in self.items():
            for row in report.tenants:
                totals["local_hit"] += row.local_hit
                totals["remote_hit"] += row.remote_hit
                totals["computed"] += row.computed
        return totals

    def hits_by_tier(self) -> dict[str, int]:
        """Hit tokens by the tier that served them, over every worker's report (remote hits
        count for REMOTE_TIER)."""
        totals = dict.fromkeys(TIERS, 0)
        for figures in self.tenant_figures(str).values():
            for tier, tokens in figures.hits_by_tier().items():
                totals[tier] += tokens
        return totals

    def tiers(self) -> dict[str, dict[str, Any]]:
        """Per tier, top down: its hit tokens, their share of all prompt tokens (the shares
        add up to the mesh's hit rate), and its figures over the workers (`tier_totals`).

            {tier: {"hit_tokens", "hit_rate", "pages", "capacity", ...}}
        """
        served = sum(self.prompt_tokens().values())
        hits = self.hits_by_tier()
        return {
            tier: {
                "hit_tokens": hits[tier],
                "hit_rate": hits[tier] / served if served else 0.0,
                **figures,
            }
            for tier, figures in tier_totals(self.items()).items()
        }

    def route_errors(self) -> Observed:
        """How far the routed requests' first tokens came from the router's estimate, on
        ROUTE_ERROR_BUCKETS, summed over every worker's report (the metric's histogram)."""
        counts = [0] * (len(ROUTE_ERROR_BUCKETS) + 1)
        total = 0.0
        for _worker, report, _live in self.items():
            if report.route_error is not None:
                counts = [a + b for a, b in zip(counts, report.route_error.counts, strict=True)]
                total += report.route_error.total
        return Observed(tuple(counts), total)

    def route_error(self) -> dict[str, Any]:
        """`route_errors` in brief: how many, the mean, and the bucket bound that half and
        nine in ten of them were within (None: past the largest bound)."""
        counts, total = self.route_errors()
        requests = sum(counts)

        def within(share: float) -> float | None:
            seen = 0
            for bound, count in zip((*ROUTE_ERROR_BUCKETS, None), counts, strict=True):
                seen += count
                if seen >= share * requests:
                    return bound
            return None

        return {
            "requests": requests,
            "mean_s": total / requests if requests else 0.0,
            "p50_within_s": within(0.5) if requests else 0.0,
            "p90_within_s": within(0.9) if requests else 0.0,
        }

    def stats(self) -> dict[str, Any]:
        tokens = self.prompt_tokens()
        served = sum(tokens.values())
        return {
            "prompt_tokens": tokens,
            "prompt_tokens_total": served,  # the denominator of every hit rate here
            "hit_rate": (tokens["local_hit"] + tokens["remote_hit"]) / served if served else 0.0,
            "tiers": self.tiers(),
            "route_ttft_error": self.route_error(),
            "reporting_workers": len(self._live),
            "departed_workers": len(self._departed),
        }

    def check_integrity(self) -> None:
        assert not set(self._live) & set(self._departed), "a worker both live and departed"
        assert len(self._departed) <= self.max_departed, (len(self._departed), self.max_departed)
        assert self._splits.keys() == self._live.keys() | self._departed.keys(), "splits kept"
        for worker_id, split in self._splits.items():
            for salt, given in split.given.items():
                assert sum(given.values()) <= split.local[salt], (worker_id, salt, split)
            for tier, hits in split.hits.items():
                shared = sum(given.get(tier, 0) for given in split.given.values())
                assert shared <= hits, (worker_id, tier, split)


def tier_totals(rows: list[tuple[str, WorkerReport, bool]]) -> dict[str, dict[str, Any]]:
    """Each tier's figures summed over the workers' reports (`WorkerReports.items()`), top
    down: host always, the others once a worker reports them.

    Pages, capacity and accepting are now, so over live workers only; the rest are
    counters, over every worker kept. A page store's pages, capacity and evictions are
    the report's own counts (a worker without tiers has them too); figures only
    TierFigures carry are None for a tier no worker reported figures of.

        {tier: {"pages", "capacity", "evictions": {reason: pages}, "workers" (live ones
                reporting it), "accepting" (of those, how many take pages),
                "bytes_written", "bytes_read", "demotions", "errors",
                "dropped": {reason: records}}}
    """
    totals: dict[str, dict[str, Any]] = {"host": _no_tier_figures()}
    for _, report, live in rows:
        store = store_tier(report.tiers)
        reported = {t.tier: t for t in report.tiers}
        for tier in TIERS:
            if tier != store and tier not in reported:
                continue
            figures = totals.setdefault(tier, _no_tier_figures())
            if tier == store:
                pages = report.pages_cached + report.pages_in_use
                capacity, evictions = pages + report.pages_free, report.evictions
            else:
                pages, capacity = reported[tier].pages, reported[tier].capacity
                evictions = reported[tier].evictions
            if live:
                figures["pages"] += pages
                figures["capacity"] += capacity
            _add_counts(figures["evictions"], evictions)
            if tier in reported:
                _add_figures(figures, reported[tier], live)
    return {tier: totals[tier] for tier in TIERS if tier in totals}


def _no_tier_figures() -> dict[str, Any]:
    return {
        "pages": 0,
        "capacity": 0,
        "evictions": {},
        "workers": 0,
        "accepting": 0,
        **dict.fromkeys(_TIER_COUNTERS),
        "dropped": None,
    }


_TIER_COUNTERS = ("bytes_written", "bytes_read", "demotions", "errors")


def _add_figures(figures: dict[str, Any], tier: TierFigures, live: bool) -> None:
    """`tier`'s own figures added to `figures` (one of tier_totals' rows)."""
    figures["workers"] += live
    figures["accepting"] += tier.accepting if live else 0
    for name in _TIER_COUNTERS:
        figures[name] = (figures[name] or 0) + getattr(tier, name)
    figures["dropped"] = _add_counts(figures["dropped"] or {}, tier.dropped)


def _add_counts(into: dict[str, int], counts: Mapping[str, int]) -> dict[str, int]:
    for key, count in counts.items():
        into[key] = into.get(key, 0) + count
    return into


def _split(report: WorkerReport, before: _Split) -> _Split:
    """`before` carried on to `report`: each split tier's hits not yet given to a tenant are
    shared among the tenants in proportion to their new local hits (see the module's
    docstring). A figure that went down means the worker restarted (or its reports came
    out of order): the sharing starts over from its figures."""
    local = {row.salt: row.local_hit for row in report.tenants}
    store = store_tier(report.tiers)
    hits = {t.tier: t.hit_tokens for t in report.tiers if t.tier != store}
    went_down = any(local.get(salt, -1) < n for salt, n in before.local.items()) or any(
        hits.get(tier, -1) < n for tier, n in before.hits.items()
    )
    if went_down:
        before = NO_SPLIT
    given = {salt: dict(before.given.get(salt, {})) for salt in local}
    growth = {salt: n - before.local.get(salt, 0) for salt, n in local.items()}
    for tier, total in hits.items():
        owed = total - sum(tiers.get(tier, 0) for tiers in given.values())
        for salt, tokens in _shares(owed, growth).items():
            given[salt][tier] = given[salt].get(tier, 0) + tokens
            growth[salt] -= tokens
    return _Split(local, hits, given)


def _shares(owed: int, weights: Mapping[str, int]) -> dict[str, int]:
    """`owed` shared in proportion to `weights`, each share at most its weight: in whole
    tokens, the remainders going to the largest fractions (ties: by salt). What the
    weights cannot take stays owed."""
    total = sum(weights.values())
    if owed <= 0 or total <= 0:
        return {}
    if owed >= total:
        return dict(weights)
    shares = {salt: owed * weight // total for salt, weight in weights.items()}
    left = owed - sum(shares.values())
    by_fraction = sorted(weights, key=lambda salt: (-(owed * weights[salt] % total), salt))
    for salt in by_fraction[:left]:
        shares[salt] += 1
    return shares
