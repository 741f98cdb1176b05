"""A worker's own figures: what it counts per request and reports with each heartbeat."""

from __future__ import annotations

import pytest

from cache_service.messages import TTFT_BUCKETS, TenantTokens
from cache_service.protocol.report_wire import MAX_REPORT_TENANTS
from workers.service.figures import OVERFLOW_SALT, WorkerFigures

CACHE_STATS = {
    "free_pages": 40,
    "cached_pages": 20,
    "in_use_pages": 4,
    "evictions": {"evicted": 7},
}


def test_a_request_is_counted_once_by_tenant_and_source():
    figures = WorkerFigures()
    figures.admitted("salt-a", local_hit=32, remote_hit=0, computed=16)
    figures.admitted("salt-a", local_hit=0, remote_hit=48, computed=1)
    figures.admitted("salt-b", local_hit=0, remote_hit=0, computed=20)
    figures.copied(8192, remote=False)
    figures.copied(4096, remote=True)
    figures.copy_took(0.0004)
    figures.first_token(0.03, reused=True)
    figures.first_token(0.7, reused=False)
    assert figures.prompt_tokens() == {"local_hit": 32, "remote_hit": 48, "computed": 37}
    assert figures.requests() == 3
    report = figures.report(CACHE_STATS)
    assert report.tenants == (
        TenantTokens("salt-a", 2, 32, 48, 17),
        TenantTokens("salt-b", 1, 0, 0, 20),
    )
    assert (report.pages_free, report.pages_cached, report.pages_in_use) == (40, 20, 4)
    assert report.evictions == {"evicted": 7}
    assert (report.copy_bytes_same_node, report.copy_bytes_remote) == (8192, 4096)
    assert sum(report.copy_seconds.counts) == 1
    assert report.copy_seconds.total == pytest.approx(0.0004)
    # 0.03 s falls in the (0.025, 0.05] bucket, 0.7 s in (0.5, 1.0].
    assert report.ttft_hit.counts[TTFT_BUCKETS.index(0.05)] == 1
    assert report.ttft_miss.counts[TTFT_BUCKETS.index(1.0)] == 1
    assert sum(report.ttft_hit.counts) == sum(report.ttft_miss.counts) == 1
    figures.check_integrity()


def test_salts_beyond_the_report_limit_are_summed_apart():
    figures = WorkerFigures()
    for i in range(MAX_REPORT_TENANTS + 5):
        figures.admitted(f"salt-{i}", 0, 0, 1)
    report = figures.report(CACHE_STATS)
    assert len(report.tenants) == MAX_REPORT_TENANTS
    (overflow,) = [row for row in report.tenants if row.salt == OVERFLOW_SALT]
    assert overflow == TenantTokens(OVERFLOW_SALT, 6, 0, 0, 6)
    assert sum(row.requests for row in report.tenants) == MAX_REPORT_TENANTS + 5
    figures.check_integrity()
