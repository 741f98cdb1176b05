"""The latest report of each worker, as heartbeats bring them (kept by the service's loop).

Reports are cumulative, so the newest one of a worker replaces the one before. A worker
that leaves keeps its last report, marked not live, so the mesh's totals do not fall when
a worker goes; at most `max_departed` departed workers are kept (the oldest go first).
A worker that comes back under the same id starts from zero again: a counter reset.

Tenants: a report names salts; `by_name` (the index's names, given by the front door)
turns them into the names the metrics show. Salts the front door never named show as
UNNAMED, so the tenant labels are bounded by the names the index keeps.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from cache_service.messages import WorkerReport
from cache_service.routing import WorkerLoad

SOURCES = ("local_hit", "remote_hit", "computed")


class TenantFigures(NamedTuple):
    requests: int
    local_hit: int
    remote_hit: int
    computed: int

    def plus(self, other: TenantFigures) -> TenantFigures:
        return TenantFigures(*(a + b for a, b in zip(self, other, strict=True)))


NO_FIGURES = TenantFigures(0, 0, 0, 0)


class WorkerReports:
    """Worker id -> (its latest report, live or not)."""

    def __init__(self, max_departed: int = 256):
        if max_departed < 0:
            raise ValueError(f"max_departed must be >= 0, got {max_departed}")
        self.max_departed = max_departed
        self._live: dict[str, WorkerReport] = {}
        self._departed: OrderedDict[str, WorkerReport] = OrderedDict()

    def update(self, worker_id: str, report: WorkerReport) -> None:
        """The newest report of a live worker."""
        self._departed.pop(worker_id, None)
        self._live[worker_id] = report

    def departed(self, worker_id: str) -> None:
        """The worker left (bye, expiry, reported dead): keep its last figures."""
        report = self._live.pop(worker_id, None)
        if report is None:
            return
        self._departed[worker_id] = report
        self._departed.move_to_end(worker_id)
        while len(self._departed) > self.max_departed:
            self._departed.popitem(last=False)

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
            out[worker_id] = WorkerLoad(
                queued_tokens=report.queued_tokens,
                running=report.running,
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
            for row in report.tenants:
                key = (worker_id, by_name(row.salt))
                figures = TenantFigures(row.requests, row.local_hit, row.remote_hit, row.computed)
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

    def stats(self) -> dict[str, Any]:
        tokens = self.prompt_tokens()
        served = sum(tokens.values())
        return {
            "prompt_tokens": tokens,
            "hit_rate": (tokens["local_hit"] + tokens["remote_hit"]) / served if served else 0.0,
            "reporting_workers": len(self._live),
            "departed_workers": len(self._departed),
        }

    def check_integrity(self) -> None:
        assert not set(self._live) & set(self._departed), "a worker both live and departed"
        assert len(self._departed) <= self.max_departed, (len(self._departed), self.max_departed)
