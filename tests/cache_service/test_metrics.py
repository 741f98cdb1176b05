"""The service's Prometheus metrics: histograms, the snapshot collector, /metrics over HTTP."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cache_service.messages import (
    COPY_BUCKETS,
    EMPTY_REPORT,
    TTFT_BUCKETS,
    Observed,
    TenantTokens,
)
from cache_service.metrics import (
    Histogram,
    HistogramCounts,
    MetricsSnapshot,
    SnapshotCollector,
    WorkerFiguresRow,
)
from cache_service.web import HEADER_DEADLINE_S, MAX_CONNECTIONS, WebServer
from tests.security.service_rig import NS, P, ServiceRig, serve


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(url: str, token: str | None = None) -> str:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=5) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        return reply.read().decode()


def test_a_value_on_a_bound_falls_in_that_bucket():
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 3.0):
        histogram.observe(value)
    counts = histogram.counts()
    assert counts == HistogramCounts((0.1, 1.0), (2, 2, 1), pytest.approx(4.65))
    assert counts.cumulative() == [("0.1", 2), ("1.0", 4), ("+Inf", 5)]


def test_unsorted_bounds_are_refused():
    with pytest.raises(AssertionError):
        Histogram((1.0, 0.1))


def no_counts(bounds) -> HistogramCounts:
    return HistogramCounts(tuple(bounds), (0,) * (len(bounds) + 1), 0.0)


def snapshot(**changes) -> MetricsSnapshot:
    base = MetricsSnapshot(
        time=1000.0,
        epoch=17,
        workers_live=2,
        resyncs=3,
        worker_queries={"w0": {"queried_tokens": 40, "hit_tokens": 32}},
        tenant_queries={"acme": {"queried_tokens": 40, "hit_tokens": 32}},
        pages_indexed=8,
        lookup=HistogramCounts((0.001,), (4, 1), 0.0125),
        served={},
        workers={},
        copy_seconds=no_counts(COPY_BUCKETS),
        ttft={"hit": no_counts(TTFT_BUCKETS), "miss": no_counts(TTFT_BUCKETS)},
    )
    return base._replace(**changes)


def test_the_collector_reports_the_latest_snapshot_only():
    collector = SnapshotCollector()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    assert not [n for n, _ in samples(generate_latest(registry).decode()) if "kvmesh" in n]
    collector.publish(snapshot())
    collector.publish(snapshot(workers_live=5))
    got = samples(generate_latest(registry).decode())
    assert got[("kvmesh_workers_live", ())] == 5
    assert got[("kvmesh_service_epoch", ())] == 17
    assert got[("kvmesh_resyncs_total", ())] == 3
    assert got[("kvmesh_index_pages", ())] == 8
    assert got[("kvmesh_index_worker_queried_tokens_total", (("worker", "w0"),))] == 40
    assert got[("kvmesh_index_tenant_hit_tokens_total", (("tenant", "acme"),))] == 32
    assert got[("kvmesh_lookup_seconds_bucket", (("le", "0.001"),))] == 4
    assert got[("kvmesh_lookup_seconds_bucket", (("le", "+Inf"),))] == 5
    assert got[("kvmesh_lookup_seconds_count", ())] == 5
    assert got[("kvmesh_lookup_seconds_sum", ())] == pytest.approx(0.0125)


def test_beyond_loopback_a_token_is_required():
    registry = CollectorRegistry()
    with pytest.raises(ValueError, match="access token"):
        WebServer(registry, "192.0.2.1")
    with pytest.raises(ValueError, match="every interface"):
        WebServer(registry, "0.0.0.0", token="t")


def test_a_token_is_checked_when_set():
    collector = SnapshotCollector()
    collector.publish(snapshot())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    web = WebServer(registry, "127.0.0.1", token="s3cret")
    url = web.start() + "/metrics"
    try:
        for wrong in (None, "guess"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                scrape(url, wrong)
            assert refused.value.code == 401
        assert samples(scrape(url, "s3cret"))[("kvmesh_workers_live", ())] == 2
        with pytest.raises(urllib.error.HTTPError) as missing:
            scrape(web.url + "/nothing", "s3cret")
        assert missing.value.code == 404
    finally:
        web.stop()


def test_the_service_serves_what_its_index_holds():
    # Figures by tenant name are what this reads: a client without a token (none is set)
    # sees them only where the operator allows (service.metrics_show_tenants).
    rig = ServiceRig(auth=True, metrics_interval_s=0.05, metrics_show_tenants=True)
    try:
        url = rig.server.metrics_url
        assert url is not None and url.startswith("http://127.0.0.1:")
        cache, publisher = rig.worker("w0")
        prompt = list(range(1, 1 + 5 * P))  # five full pages
        serve(cache, prompt)
        assert publisher.sync()
        rig.client("front_door").name_tenant(NS.salt, "acme")
        worker = rig.client("w1")
        rig.worker("w1")
        matched, _ = worker.match(NS, prompt + [99], requester="w1")
        assert matched == 5 * P
        rig.server.publish_metrics()
        got = samples(scrape(url))
        assert got[("kvmesh_workers_live", ())] == 2
        assert got[("kvmesh_service_epoch", ())] == rig.server.epoch
        assert got[("kvmesh_index_pages", ())] == 5
        assert got[("kvmesh_index_tenant_queried_tokens_total", (("tenant", "acme"),))] == 21
        assert got[("kvmesh_index_tenant_hit_tokens_total", (("tenant", "acme"),))] == 20
        assert got[("kvmesh_index_worker_hit_tokens_total", (("worker", "w1"),))] == 20
        assert got[("kvmesh_lookup_seconds_count", ())] == 1
        assert got[("kvmesh_lookup_seconds_sum", ())] > 0
        assert rig.server.stats()["service"]["metrics_url"] == url
    finally:
        rig.close()
    with pytest.raises(urllib.error.URLError):
        scrape(url)  # the port closes with the service


def test_idle_connections_cannot_take_every_slot_for_long():
    """Idle clients (they connect and send nothing) never shut a scraper out: the oldest
    still sending headers make room, and each is closed within HEADER_DEADLINE_S."""
    collector = SnapshotCollector()
    collector.publish(snapshot())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    web = WebServer(registry, "127.0.0.1")
    url = web.start() + "/metrics"
    host, port = web.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(MAX_CONNECTIONS)]
    try:
        for _ in range(3):  # answered at once, every time
            assert samples(scrape(url))[("kvmesh_workers_live", ())] == 2
        last = idle[-1]  # never dropped to make room: it was the newest
        last.settimeout(HEADER_DEADLINE_S + 10)
        start = time.monotonic()
        assert last.recv(1) == b""  # closed by the server, unanswered
        assert time.monotonic() - start < HEADER_DEADLINE_S + 5
    finally:
        for connection in idle:
            connection.close()
        web.stop()


def ttft(*counts: int, total: float) -> Observed:
    return Observed(tuple(counts) + (0,) * (len(TTFT_BUCKETS) + 1 - len(counts)), total)


def test_workers_reports_become_the_mesh_metrics():
    """Heartbeat reports -> vLLM-named families by worker and tenant name (never salt); a
    worker that leaves keeps its counters but no longer shows pages."""
    # Figures by tenant name are what this reads: a client without a token (none is set)
    # sees them only where the operator allows (service.metrics_show_tenants).
    rig = ServiceRig(auth=True, metrics_show_tenants=True)
    try:
        _, w0 = rig.worker("w0")
        _, w1 = rig.worker("w1")
        rig.client("front_door").name_tenant("salt-acme", "acme")
        w0._report = lambda: EMPTY_REPORT._replace(
            pages_free=50,
            pages_cached=10,
            pages_in_use=4,
            evictions={"evicted": 6},
            copy_bytes_same_node=4096,
            tenants=(TenantTokens("salt-acme", 3, 32, 16, 48), TenantTokens("salt-x", 1, 0, 0, 8)),
            ttft_hit=ttft(0, 2, total=0.03),
            ttft_miss=ttft(0, 0, 0, 0, 1, total=0.2),
            deadline_exceeded=2,
            cancelled=5,
        )
        w1._report = lambda: EMPTY_REPORT._replace(
            pages_free=64,
            tenants=(TenantTokens("salt-acme", 1, 0, 8, 0),),
            serving=0,
            loop_restarts=1,
        )
        assert w0.heartbeat() and w1.heartbeat()
        rig.server.publish_metrics()
        got = samples(scrape(rig.server.metrics_url))

        def tokens(source, worker, tenant):
            labels = (("source", source), ("tenant", tenant), ("worker", worker))
            return got[("kvmesh_prompt_tokens_total", labels)]

        assert tokens("local_hit", "w0", "acme") == 32
        assert tokens("remote_hit", "w0", "acme") == 16
        assert tokens("computed", "w0", "acme") == 48
        assert tokens("computed", "w0", "(unnamed)") == 8  # salts never show
        assert tokens("remote_hit", "w1", "acme") == 8
        assert not [labels for name, labels in got if ("tenant", "salt-acme") in labels]
        pair = (("tenant", "acme"), ("worker", "w0"))
        assert got[("kvmesh_prefix_cache_queries_total", pair)] == 96
        assert got[("kvmesh_prefix_cache_hits_total", pair)] == 48
        assert got[("kvmesh_requests_total", pair)] == 3
        assert got[("kvmesh_pages", (("state", "cached"), ("worker", "w0")))] == 10
        assert got[("kvmesh_pages", (("state", "free"), ("worker", "w1")))] == 64
        assert got[("kvmesh_evictions_total", (("reason", "evicted"), ("worker", "w0")))] == 6
        assert got[("kvmesh_copy_bytes_total", (("kind", "same_node"), ("worker", "w0")))] == 4096
        assert got[("kvmesh_worker_serving", (("worker", "w0"),))] == 1
        assert got[("kvmesh_worker_serving", (("worker", "w1"),))] == 0  # its loop failed
        assert got[("kvmesh_serving_loop_restarts_total", (("worker", "w1"),))] == 1
        ended = {"deadline": 2, "cancelled": 5}
        for reason, count in ended.items():
            labels = (("reason", reason), ("worker", "w0"))
            assert got[("kvmesh_requests_ended_total", labels)] == count
        assert got[("kvmesh_ttft_seconds_count", (("cache", "hit"),))] == 2
        assert got[("kvmesh_ttft_seconds_bucket", (("cache", "hit"), ("le", "0.025")))] == 2
        assert got[("kvmesh_ttft_seconds_count", (("cache", "miss"),))] == 1
        assert got[("kvmesh_ttft_seconds_sum", (("cache", "miss"),))] == pytest.approx(0.2)
        served = rig.server.stats()["served"]
        assert served["prompt_tokens"] == {"local_hit": 32, "remote_hit": 24, "computed": 56}
        assert served["hit_rate"] == pytest.approx(56 / 112)

        w1.stop(bye=True)
        rig.server.publish_metrics()
        got = samples(scrape(rig.server.metrics_url))
        assert tokens("remote_hit", "w1", "acme") == 8  # its counters stay
        assert ("kvmesh_pages", (("state", "free"), ("worker", "w1"))) not in got
        assert rig.server.stats()["served"]["departed_workers"] == 1
    finally:
        rig.close()


def test_a_report_that_breaks_the_bounds_is_refused_and_changes_nothing():
    rig = ServiceRig(auth=True)
    try:
        _, w0 = rig.worker("w0")
        too_many = tuple(TenantTokens(f"s{i}", 1, 0, 0, 1) for i in range(1025))
        w0._report = lambda: EMPTY_REPORT._replace(tenants=too_many)
        with pytest.raises(Exception, match="1025 tenants exceeds the limit 1024"):
            w0.heartbeat()
        assert rig.server.stats()["served"]["reporting_workers"] == 0
    finally:
        rig.close()


def test_tenant_labels_are_bounded_by_the_names_the_index_keeps():
    # Figures by tenant name are what this reads: a client without a token (none is set)
    # sees them only where the operator allows (service.metrics_show_tenants).
    rig = ServiceRig(auth=True, max_tenants=2, metrics_show_tenants=True)
    try:
        _, w0 = rig.worker("w0")
        front = rig.client("front_door")
        for i in range(4):
            front.name_tenant(f"salt-{i}", f"tenant-{i}")
        rows = tuple(TenantTokens(f"salt-{i}", 1, 0, 0, 4) for i in range(4))
        w0._report = lambda: EMPTY_REPORT._replace(tenants=rows)
        assert w0.heartbeat()
        rig.server.publish_metrics()
        got = samples(scrape(rig.server.metrics_url))
        tenants = {
            dict(labels)["tenant"]: value
            for (name, labels), value in got.items()
            if name == "kvmesh_requests_total"
        }
        # Two names kept; the later tenants' figures still count, under one label.
        assert tenants == {"tenant-0": 1, "tenant-1": 1, "(unnamed)": 2}
    finally:
        rig.close()


def test_spot_checks_and_quarantined_members_are_metrics_and_on_the_dashboard():
    collector = SnapshotCollector()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    record = {"holder": "w0", "reporter": "w1", "since": 1000.0, "evidence": "page 3: 0.8"}
    row = WorkerFiguresRow(
        live=True,
        pages={"free": 1, "cached": 0, "in_use": 0},
        evictions={"quarantined": 10},
        copy_bytes={},
        requests={"running": 0, "waiting": 0},
        spot_checks={"checked": 5, "failed": 1},
    )
    collector.publish(snapshot(workers={"w1": row}, quarantined=(record,), quarantines=2))
    got = samples(generate_latest(registry).decode())
    assert got[("kvmesh_spot_checks_total", (("result", "passed"), ("worker", "w1")))] == 4
    assert got[("kvmesh_spot_checks_total", (("result", "failed"), ("worker", "w1")))] == 1
    assert got[("kvmesh_quarantined", (("reporter", "w1"), ("worker", "w0")))] == 1
    assert got[("kvmesh_quarantines_total", ())] == 2
    assert got[("kvmesh_evictions_total", (("reason", "quarantined"), ("worker", "w1")))] == 10
    assert collector.dashboard()["quarantined"] == [record]
    collector.publish(snapshot())
    assert collector.dashboard()["quarantined"] == []
    assert not [
        k for k in samples(generate_latest(registry).decode()) if k[0] == "kvmesh_quarantined"
    ]
