"""A worker's own figures: prompt tokens by source and tenant, copies, TTFT.

The worker records each request once, when it is admitted (its hits are known once the
local match and the copies are done; what follows is computed), and the publisher sends
`report()` to the service with every heartbeat. The service turns the reports of all
workers into the mesh's metrics, so nobody scrapes the workers.

Tenants are reported by salt (what the worker knows); the service shows them by the names
the front door gave it, never by salt. At most MAX_REPORT_TENANTS salts have figures of
their own; later ones are summed under OVERFLOW_SALT.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from cache_service.messages import (
    COPY_BUCKETS,
    HEALTH_FIELDS,
    HEALTHY,
    LOAD_FIELDS,
    TTFT_BUCKETS,
    TenantTokens,
    WorkerReport,
)
from cache_service.metrics import Histogram
from cache_service.protocol.report_wire import MAX_REPORT_REASONS, MAX_REPORT_TENANTS

OVERFLOW_SALT = "(other)"  # no tenant salt looks like this (salts are hex digests)
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
            for histogram in (self._copy_seconds, *self._ttft.values()):
                counts = histogram.counts()
                assert min(counts.counts) >= 0 and counts.total >= 0, counts

    def report(
        self, cache_stats: Mapping[str, Any], load: Mapping[str, int] | None = None
    ) -> WorkerReport:
        """The report for the service, with the page counts of `cache_stats` (the prefix
        cache's `stats()`) and the worker's load and measured costs (`load`: the
        report's running, waiting, queued_tokens and *_ns fields, absent: 0, unknown; and
        its health fields, absent: healthy)."""
        load = dict(load or {})
        evictions = dict(cache_stats["evictions"])
        if len(evictions) > MAX_REPORT_REASONS:  # reasons come from our code: never so many
            kept = sorted(evictions, key=evictions.get, reverse=True)[: MAX_REPORT_REASONS - 1]
            evictions = {r: evictions[r] for r in kept} | {
                "(other)": sum(n for r, n in evictions.items() if r not in kept)
            }
        with self._lock:
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
            )
