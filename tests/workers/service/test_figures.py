"""A worker's own figures: what it counts per request and reports with each heartbeat."""

from __future__ import annotations

import threading

import pytest

from cache_service import protocol
from cache_service.messages import (
    LOAD_BUCKETS,
    ROUTE_ERROR_BUCKETS,
    TTFT_BUCKETS,
    Observed,
    TenantTokens,
    TierFigures,
)
from cache_service.protocol import DEFAULT_LIMITS
from cache_service.protocol.report_wire import MAX_REPORT_REASONS, MAX_REPORT_TENANTS
from workers.service.figures import OTHER_REASON, OVERFLOW_SALT, TierCounters, WorkerFigures

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


def test_routed_requests_report_how_far_their_first_token_came_from_the_estimate():
    figures = WorkerFigures()
    assert figures.report(CACHE_STATS).route_error is None  # none routed: left off the wire
    figures.routed(observed_s=0.5, estimated_s=0.45)  # 50 ms late
    figures.routed(observed_s=0.2, estimated_s=1.2)  # a second early
    load = {"decode_steps": 14, "step_ns": 30_000_000, "pass_tokens": 4096}
    report = figures.report(CACHE_STATS, load)
    error = report.route_error
    assert error.counts[ROUTE_ERROR_BUCKETS.index(0.05)] == 1
    assert error.counts[ROUTE_ERROR_BUCKETS.index(1.0)] == 1
    assert sum(error.counts) == 2 and error.total == pytest.approx(1.05)
    assert (report.decode_steps, report.step_ns, report.pass_tokens, report.chunk_tokens) == (
        14,
        30_000_000,
        4096,
        0,
    )
    field = protocol.table.MESSAGES["heartbeat"].request.fields["report"]
    assert field.check(field.wire(report), "report", DEFAULT_LIMITS) == report
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


def test_a_tiers_counters_become_its_figures():
    disk = TierCounters()
    disk.wrote(3 * 4096)
    disk.demoted(3)
    disk.removed("evicted", 2)
    disk.removed("corrupt", 1)
    disk.removed("evicted", 1)
    disk.read(4096)
    disk.hit(16)
    disk.load_took(0.004)
    disk.failed()
    disk.dropped("truncated")
    disk.dropped("orphan", 2)
    figures = disk.figures("disk", pages=9, capacity=512, read_ns_per_token=900, accepting=False)
    assert figures == TierFigures(
        tier="disk",
        pages=9,
        capacity=512,
        bytes_written=3 * 4096,
        bytes_read=4096,
        demotions=3,
        evictions={"evicted": 3, "corrupt": 1},
        hit_tokens=16,
        # 0.004 s falls in the (2.5e-3, 5e-3] bucket
        load_seconds=Observed(
            tuple(int(i == LOAD_BUCKETS.index(5e-3)) for i in range(len(LOAD_BUCKETS) + 1)),
            pytest.approx(0.004),
        ),
        read_ns_per_token=900,
        accepting=0,
        errors=1,
        dropped={"truncated": 1, "orphan": 2},
    )
    # A report carries it, and the wire reads it back as it was.
    report = WorkerFigures().report(CACHE_STATS, tiers=[figures])
    assert report.tiers == (figures,)
    field = protocol.table.MESSAGES["heartbeat"].request.fields["report"]
    assert field.check(field.wire(report), "report", DEFAULT_LIMITS) == report
    disk.check_integrity()


def test_tier_counters_refuse_what_no_tier_counts():
    counters = TierCounters()
    with pytest.raises(ValueError, match=r"unknown tier 'ssd'; the tiers are \('device',"):
        counters.figures("ssd", pages=0, capacity=1)
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        counters.wrote(-1)
    with pytest.raises(ValueError, match="seconds must be >= 0, got -0.5"):
        counters.load_took(-0.5)
    assert counters.figures("host", 0, 8) == TierCounters().figures("host", 0, 8)  # unchanged
    counters.check_integrity()


def test_tier_reasons_beyond_the_report_limit_are_summed_apart():
    counters = TierCounters()
    for i in range(MAX_REPORT_REASONS + 2):
        counters.removed(f"reason-{i:02}", i + 1)
    evictions = counters.figures("disk", 0, 8).evictions
    assert len(evictions) == MAX_REPORT_REASONS
    assert evictions[OTHER_REASON] == 1 + 2 + 3  # the three smallest
    assert sum(evictions.values()) == sum(range(1, MAX_REPORT_REASONS + 3))
    counters.check_integrity()


def test_tier_counters_count_every_update_of_concurrent_threads():
    counters = TierCounters()

    def work():
        for _ in range(1000):
            counters.read(4096)
            counters.hit(16)
            counters.removed("evicted", 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    figures = counters.figures("host", 0, 8)
    assert (figures.bytes_read, figures.hit_tokens) == (4000 * 4096, 4000 * 16)
    assert figures.evictions == {"evicted": 4000}
    counters.check_integrity()
