"""A worker's own figures: prompt tokens by source and tenant, copies, TTFT, and what went
through each of its tiers.

The worker records each request once, when it is admitted (its hits are known once the
local match and the copies are done; what follows is computed), and the publisher sends
`report()` to the service with every heartbeat. The service turns the reports of all
workers into the mesh's metrics, so nobody scrapes the workers.

Tenants are reported by salt (what the worker knows); the service shows them by the names
the front door gave it, never by salt. At most MAX_REPORT_TENANTS salts have figures of
their own; later ones are summed under OVERFLOW_SALT.

Each tier (device, host, disk) has a TierCounters that its owner updates as pages are
written, read, demoted, removed and loaded back; `figures()` turns it into the report's
TierFigures, with what the tier knows now (pages held, capacity, measured cost).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from cache_service.histograms import Histogram
from cache_service.messages import (
    COPY_BUCKETS,
    DECODE_FIELDS,
    HEALTH_FIELDS,
    HEALTHY,
    LOAD_BUCKETS,
    LOAD_FIELDS,
    ROUTE_ERROR_BUCKETS,
    TIERS,
    TTFT_BUCKETS,
    TenantTokens,
    TierFigures,
    WorkerReport,
)
from cache_service.protocol.report_wire import MAX_REPORT_REASONS, MAX_REPORT_TENANTS

OVERFLOW_SALT = "(other)"  # no tenant salt looks like this (salts are hex digests)
OTHER_REASON = "(other)"  # reasons past MAX_REPORT_REASONS are summed under this
SOURCES = ("local_hit", "remote_hit", "computed")


class WorkerFigures:
    """Counters and histograms of one worker; thread-safe (requests run concurrently)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # salt -> [requests, local_hit, remote_hit, computed]
        self._tenants: dict[str, list[int]] = {}
        self.copy_bytes = {"same_node": 0, "remote": 0}
        self._copy_seconds = Histogram(COPY_BUCKETS)
        self._ttft = {"hit": Histogram(TTFT_BUCKETS), "miss": Histogram(TTFT_BUCKETS)}
        self._route_error = Histogram(ROUTE_ERROR_BUCKETS)

    def admitted(self, salt: str, local_hit: int, remote_hit: int, computed: int) -> None:
        """One request's prompt tokens, by where their KV comes from."""
        with self._lock:
            row = self._tenants.get(salt)
            if row is None:
                if len(self._tenants) >= MAX_REPORT_TENANTS - (OVERFLOW_SALT not in self._tenants):
                    salt = OVERFLOW_SALT
                row = self._tenants.setdefault(salt, [0, 0, 0, 0])
            row[0] += 1
            row[1] += local_hit
            row[2] += remote_hit
            row[3] += computed

    def routed(self, observed_s: float, estimated_s: float) -> None:
        """A routed request's first token came `observed_s` after it arrived; the router
        had estimated `estimated_s`."""
        with self._lock:
            self._route_error.observe(abs(observed_s - estimated_s))

    def copied(self, nbytes: int, remote: bool) -> None:
        """Page bytes moved in from a peer (refused pages too: they moved)."""
        with self._lock:
            self.copy_bytes["remote" if remote else "same_node"] += nbytes

    def copy_took(self, seconds: float) -> None:
        """The time one request spent copying pages in (only requests that copied)."""
        with self._lock:
            self._copy_seconds.observe(seconds)

    def first_token(self, seconds: float, reused: bool) -> None:
        """One request's time to first token, with or without reused tokens."""
        with self._lock:
            self._ttft["hit" if reused else "miss"].observe(seconds)

    def prompt_tokens(self) -> dict[str, int]:
        """Prompt tokens by source, over all tenants."""
        with self._lock:
            rows = list(self._tenants.values())
        return {source: sum(row[i + 1] for row in rows) for i, source in enumerate(SOURCES)}

    def copy_bytes_now(self) -> dict[str, int]:
        with self._lock:
            return dict(self.copy_bytes)

    def requests(self) -> int:
        with self._lock:
            return sum(row[0] for row in self._tenants.values())

    def check_integrity(self) -> None:
        """Counts are never negative and the salts stay within the report's bound."""
        with self._lock:
            assert len(self._tenants) <= MAX_REPORT_TENANTS, len(self._tenants)
            for salt, row in self._tenants.items():
                assert len(row) == 4 and min(row) >= 0, (salt, row)
            assert min(self.copy_bytes.values()) >= 0, self.copy_bytes
            for histogram in (self._copy_seconds, *self._ttft.values(), self._route_error):
                counts = histogram.counts()
                assert min(counts.counts) >= 0 and counts.total >= 0, counts

    def report(
        self,
        cache_stats: Mapping[str, Any],
        load: Mapping[str, int] | None = None,
        tiers: Sequence[TierFigures] = (),
    ) -> WorkerReport:
        """The report for the service, with the page counts of `cache_stats` (the prefix
        cache's `stats()`) and the worker's load and measured costs (`load`: the
        report's running, waiting, queued_tokens and *_ns fields and its decode figures,
        absent: 0, unknown; and its health fields, absent: healthy), and its `tiers` top
        down (each one's `TierCounters.figures()`; none: a worker whose pages are all in
        host memory)."""
        load = dict(load or {})
        evictions = bounded_reasons(cache_stats["evictions"])
        with self._lock:
            route_error = self._route_error.observed()
            return WorkerReport(
                pages_free=cache_stats["free_pages"],
                pages_cached=cache_stats["cached_pages"],
                pages_in_use=cache_stats["in_use_pages"],
                evictions=evictions,
                copy_bytes_same_node=self.copy_bytes["same_node"],
                copy_bytes_remote=self.copy_bytes["remote"],
                tenants=tuple(TenantTokens(salt, *row) for salt, row in self._tenants.items()),
                copy_seconds=self._copy_seconds.observed(),
                ttft_hit=self._ttft["hit"].observed(),
                ttft_miss=self._ttft["miss"].observed(),
                alignment_lost_tokens=cache_stats.get("alignment_lost_tokens", 0),
                **{name: int(load.get(name, 0)) for name in LOAD_FIELDS},
                **{name: int(load.get(name, HEALTHY[name])) for name in HEALTH_FIELDS},
                tiers=tuple(tiers),
                **{name: int(load.get(name, 0)) for name in DECODE_FIELDS},
                route_error=route_error if any(route_error.counts) else None,
            )


class TierCounters:
    """What went through one tier of a worker since the worker started; thread-safe (loads,
    demotions and peers' reads run on different threads).

    The tier's owner calls each method as the thing happens, and `figures()` for every
    report. Counts only grow: a restarted worker starts from zero, as the report expects.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes_written = 0
        self._bytes_read = 0
        self._demotions = 0
        self._hit_tokens = 0
        self._errors = 0
        self._evictions: dict[str, int] = {}
        self._dropped: dict[str, int] = {}
        self._load_seconds = Histogram(LOAD_BUCKETS)

    def wrote(self, nbytes: int) -> None:
        """Page bytes written into the tier (a demotion, a write-through)."""
        with self._lock:
            self._bytes_written += _non_negative(nbytes, "nbytes")

    def read(self, nbytes: int) -> None:
        """Page bytes read out of it (a load back, a peer's read)."""
        with self._lock:
            self._bytes_read += _non_negative(nbytes, "nbytes")

    def demoted(self, pages: int) -> None:
        """Pages that came down into it from the tier above (their bytes: `wrote`)."""
        with self._lock:
            self._demotions += _non_negative(pages, "pages")

    def removed(self, reason: str, pages: int) -> None:
        """Pages that left it, for `reason` ("evicted", "demoted", "cleared", ...)."""
        with self._lock:
            self._evictions[reason] = self._evictions.get(reason, 0) + _non_negative(pages, "pages")

    def hit(self, tokens: int) -> None:
        """Prompt tokens of one request served from it; the same tokens are among the
        request's local hits (`WorkerFigures.admitted`)."""
        with self._lock:
            self._hit_tokens += _non_negative(tokens, "tokens")

    def load_took(self, seconds: float) -> None:
        """The time one request spent loading pages back from it (requests that did)."""
        with self._lock:
            self._load_seconds.observe(_non_negative(seconds, "seconds"))

    def failed(self, count: int = 1) -> None:
        """Reads or writes of it that failed."""
        with self._lock:
            self._errors += _non_negative(count, "count")

    def dropped(self, reason: str, records: int = 1) -> None:
        """Records dropped when verified, for `reason` ("corrupt", "truncated", "foreign",
        "format", "orphan")."""
        with self._lock:
            self._dropped[reason] = self._dropped.get(reason, 0) + _non_negative(records, "records")

    def figures(
        self,
        tier: str,
        pages: int,
        capacity: int,
        read_ns_per_token: int = 0,
        accepting: bool = True,
    ) -> TierFigures:
        """The tier's figures for a report.

        Args:
            tier: its name, one of `cache_service.messages.TIERS`.
            pages: pages it holds now.
            capacity: pages it can hold.
            read_ns_per_token: the measured cost of loading one token's KV from it (0: not
                measured yet).
            accepting: whether it takes pages now (False: full, or a failing disk).
        Raises:
            ValueError: an unknown tier, or a negative count.
        """
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; the tiers are {TIERS}")
        with self._lock:
            return TierFigures(
                tier=tier,
                pages=_non_negative(pages, "pages"),
                capacity=_non_negative(capacity, "capacity"),
                bytes_written=self._bytes_written,
                bytes_read=self._bytes_read,
                demotions=self._demotions,
                evictions=bounded_reasons(self._evictions),
                hit_tokens=self._hit_tokens,
                load_seconds=self._load_seconds.observed(),
                read_ns_per_token=_non_negative(int(read_ns_per_token), "read_ns_per_token"),
                accepting=int(bool(accepting)),
                errors=self._errors,
                dropped=bounded_reasons(self._dropped),
            )

    def check_integrity(self) -> None:
        """Counts are never negative and the load histogram adds up."""
        with self._lock:
            scalars = (
                self._bytes_written,
                self._bytes_read,
                self._demotions,
                self._hit_tokens,
                self._errors,
            )
            assert min(scalars) >= 0, scalars
            for counts in (self._evictions, self._dropped):
                assert all(n >= 0 for n in counts.values()), counts
            observed = self._load_seconds.counts()
            assert min(observed.counts) >= 0 and observed.total >= 0, observed


def bounded_reasons(counts: Mapping[str, int]) -> dict[str, int]:
    """`counts` by reason as a report may carry them: at most MAX_REPORT_REASONS reasons,
    the smallest beyond that summed under OTHER_REASON (reasons come from our code: never
    so many)."""
    counts = dict(counts)
    if len(counts) <= MAX_REPORT_REASONS:
        return counts
    kept = sorted(counts, key=counts.get, reverse=True)[: MAX_REPORT_REASONS - 1]
    return {r: counts[r] for r in kept} | {
        OTHER_REASON: sum(n for r, n in counts.items() if r not in kept)
    }


_N = TypeVar("_N", int, float)


def _non_negative(value: _N, name: str) -> _N:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value
