"""The service's Prometheus metrics: histograms, the snapshot collector, /metrics over HTTP."""

from __future__ import annotations

import re
import socket
import time
import urllib.error
import urllib.request

import pytest
import zmq
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cache_service import protocol
from cache_service.histograms import Histogram, HistogramCounts
from cache_service.messages import (
    COPY_BUCKETS,
    EMPTY_REPORT,
    LOAD_BUCKETS,
    TTFT_BUCKETS,
    Heartbeat,
    Observed,
    TenantTokens,
    TierFigures,
    no_observations,
)
from cache_service.metrics import (
    MetricsSnapshot,
    SnapshotCollector,
    WorkerFiguresRow,
)
from cache_service.protocol.report_wire import MAX_REPORT_REASONS
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


def test_the_routing_estimates_error_is_a_histogram_summed_over_workers():
    from cache_service.messages import EMPTY_REPORT, ROUTE_ERROR_BUCKETS, Observed
    from cache_service.metrics import snapshot_from
    from cache_service.reports import WorkerReports

    reports = WorkerReports()
    twelve = len(ROUTE_ERROR_BUCKETS) + 1
    reports.update("a", EMPTY_REPORT._replace(route_error=Observed((3, *[0] * (twelve - 1)), 0.02)))
    reports.update("b", EMPTY_REPORT._replace(route_error=Observed((*[0] * 6, 1, *[0] * 5), 0.8)))
    reports.update("c", EMPTY_REPORT)  # routed nothing with an estimate
    assert reports.stats()["route_ttft_error"] == {
        "requests": 4,
        "mean_s": pytest.approx(0.82 / 4),
        "p50_within_s": 0.01,
        "p90_within_s": 1.0,
    }
    stats = {
        "workers_live": 3,
        "events": {"resyncs": 0},
        "workers": {},
        "tenants": {},
        "pages": 0,
    }
    snap = snapshot_from(stats, 1, Histogram((0.001,)), reports, str, 1000.0)
    collector = SnapshotCollector()
    collector.publish(snap)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    got = samples(generate_latest(registry).decode())
    assert got[("kvmesh_route_ttft_error_seconds_bucket", (("le", "0.01"),))] == 3
    assert got[("kvmesh_route_ttft_error_seconds_bucket", (("le", "1.0"),))] == 4
    assert got[("kvmesh_route_ttft_error_seconds_count", ())] == 4
    assert got[("kvmesh_route_ttft_error_seconds_sum", ())] == pytest.approx(0.82)


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
            tier = {"computed": "none"}.get(source, "host")  # workers without tiers
            labels = (("source", source), ("tenant", tenant), ("tier", tier), ("worker", worker))
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
        host = ("tier", "host")
        assert got[("kvmesh_pages", (("state", "cached"), host, ("worker", "w0")))] == 10
        assert got[("kvmesh_pages", (("state", "free"), host, ("worker", "w1")))] == 64
        assert got[("kvmesh_evictions_total", (("reason", "evicted"), host, ("worker", "w0")))] == 6
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
        assert ("kvmesh_pages", (("state", "free"), host, ("worker", "w1"))) not in got
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
    labels = (("reason", "quarantined"), ("tier", "host"), ("worker", "w1"))
    assert got[("kvmesh_evictions_total", labels)] == 10
    assert collector.dashboard()["quarantined"] == [record]
    collector.publish(snapshot())
    assert collector.dashboard()["quarantined"] == []
    assert not [
        k for k in samples(generate_latest(registry).decode()) if k[0] == "kvmesh_quarantined"
    ]


# ---- tiers -----------------------------------------------------------------------------


def tier(name: str, **figures) -> TierFigures:
    """A tier's figures: zeros, an accepting tier, but for `figures`."""
    base = TierFigures(
        tier=name,
        pages=0,
        capacity=0,
        bytes_written=0,
        bytes_read=0,
        demotions=0,
        evictions={},
        hit_tokens=0,
        load_seconds=no_observations(LOAD_BUCKETS),
        read_ns_per_token=0,
        accepting=1,
        errors=0,
        dropped={},
    )
    return base._replace(**figures)


def loads(*seconds: float) -> Observed:
    histogram = Histogram(LOAD_BUCKETS)
    for value in seconds:
        histogram.observe(value)
    return histogram.observed()


# w0 keeps pages in host memory and on disk; its disk served 24 of its 64 local hits, of
# which acme had 48 and another tenant (never named) 16: acme's share 24 * 48/64 = 18, the
# other's 6. w1 reports no tiers (a worker from before them): all in host memory.
W0_TENANTS = (TenantTokens("salt-acme", 4, 48, 16, 32), TenantTokens("salt-x", 1, 16, 0, 8))
W0 = EMPTY_REPORT._replace(
    pages_free=20,
    pages_cached=40,
    pages_in_use=4,
    evictions={"demoted": 40, "evicted": 3},
    tenants=W0_TENANTS,
    tiers=(
        tier("host", pages=44, capacity=64, bytes_read=8192, hit_tokens=40),
        tier(
            "disk",
            pages=40,
            capacity=1000,
            bytes_written=40 * 4096,
            bytes_read=24 * 4096,
            demotions=40,
            evictions={"evicted": 5, "corrupt": 1},
            hit_tokens=24,
            load_seconds=loads(0.004, 0.02),
            read_ns_per_token=1500,
            errors=2,
            dropped={"truncated": 1},
        ),
    ),
)
W1 = EMPTY_REPORT._replace(
    pages_free=60, pages_cached=4, tenants=(TenantTokens("salt-acme", 2, 8, 0, 8),)
)


def tokens(got: dict, source: str, tier_name: str, worker: str, tenant: str | None) -> float:
    labels = {"source": source, "tier": tier_name, "worker": worker}
    if tenant is not None:
        labels["tenant"] = tenant
    return got[("kvmesh_prompt_tokens_total", tuple(sorted(labels.items())))]


def test_tiers_of_two_workers_become_tier_labelled_metrics_and_stats():
    rig = ServiceRig(auth=True, metrics_show_tenants=True)
    try:
        _, w0 = rig.worker("w0")
        _, w1 = rig.worker("w1")
        rig.client("front_door").name_tenant("salt-acme", "acme")
        w0._report, w1._report = (lambda: W0), (lambda: W1)
        assert w0.heartbeat() and w1.heartbeat()
        rig.server.publish_metrics()
        got = samples(scrape(rig.server.metrics_url))

        # Prompt tokens by source and tier: w0's disk hits shared by its tenants' local hits.
        assert tokens(got, "local_hit", "host", "w0", "acme") == 30
        assert tokens(got, "local_hit", "disk", "w0", "acme") == 18
        assert tokens(got, "local_hit", "host", "w0", "(unnamed)") == 10
        assert tokens(got, "local_hit", "disk", "w0", "(unnamed)") == 6
        assert tokens(got, "remote_hit", "host", "w0", "acme") == 16
        assert tokens(got, "computed", "none", "w0", "acme") == 32
        assert tokens(got, "local_hit", "host", "w1", "acme") == 8
        assert tokens(got, "computed", "none", "w1", "acme") == 8
        tiers_of_w1 = {
            dict(labels)["tier"]
            for name, labels in got
            if name == "kvmesh_prompt_tokens_total" and ("worker", "w1") in labels
        }
        assert tiers_of_w1 == {"host", "none"}  # no disk: it reports none

        def value(name, worker="w0", **labels):
            return got[(name, tuple(sorted({**labels, "worker": worker}.items())))]

        assert value("kvmesh_pages", state="cached", tier="host") == 40
        assert value("kvmesh_pages", state="cached", tier="disk") == 40
        assert value("kvmesh_pages", state="free", tier="disk") == 960
        assert value("kvmesh_pages", "w1", state="free", tier="host") == 60
        assert value("kvmesh_evictions_total", reason="demoted", tier="host") == 40
        assert value("kvmesh_evictions_total", reason="evicted", tier="disk") == 5
        assert value("kvmesh_evictions_total", reason="corrupt", tier="disk") == 1
        assert value("kvmesh_tier_capacity_pages", tier="host") == 64  # its page store
        assert value("kvmesh_tier_capacity_pages", tier="disk") == 1000
        assert value("kvmesh_tier_capacity_pages", "w1", tier="host") == 64
        assert value("kvmesh_tier_written_bytes_total", tier="disk") == 40 * 4096
        assert value("kvmesh_tier_read_bytes_total", tier="disk") == 24 * 4096
        assert value("kvmesh_tier_read_bytes_total", tier="host") == 8192  # peers' reads
        assert value("kvmesh_tier_demotions_total", tier="disk") == 40
        assert value("kvmesh_tier_errors_total", tier="disk") == 2
        assert value("kvmesh_tier_dropped_records_total", reason="truncated", tier="disk") == 1
        assert value("kvmesh_tier_accepting", tier="disk") == 1
        assert ("kvmesh_tier_accepting", (("tier", "host"), ("worker", "w1"))) not in got
        load = (("le", "0.005"), ("tier", "disk"))
        assert got[("kvmesh_tier_load_seconds_bucket", load)] == 1
        assert got[("kvmesh_tier_load_seconds_count", (("tier", "disk"),))] == 2
        assert got[("kvmesh_tier_load_seconds_sum", (("tier", "disk"),))] == pytest.approx(0.024)

        # A tier's hit rate over all prompt tokens, as a PromQL ratio would take it; the
        # service's stats give the same figures, their denominator with them.
        all_tokens = sum(v for (n, _), v in got.items() if n == "kvmesh_prompt_tokens_total")
        hits = {}
        for (name, labels), count in got.items():
            found = dict(labels)
            if name == "kvmesh_prompt_tokens_total" and found["source"] != "computed":
                hits[found["tier"]] = hits.get(found["tier"], 0) + count
        assert (all_tokens, hits) == (136, {"host": 64, "disk": 24})
        served = rig.server.stats()["served"]
        assert served["prompt_tokens_total"] == 136
        assert served["hit_rate"] == pytest.approx(88 / 136)
        host, disk = served["tiers"]["host"], served["tiers"]["disk"]
        assert list(served["tiers"]) == ["host", "disk"]
        assert (host["hit_tokens"], host["hit_rate"]) == (64, pytest.approx(64 / 136))
        assert (disk["hit_tokens"], disk["hit_rate"]) == (24, pytest.approx(24 / 136))
        assert (host["pages"], host["capacity"]) == (44 + 4, 64 + 64)
        assert host["evictions"] == {"demoted": 40, "evicted": 3}
        assert (host["workers"], host["accepting"], host["bytes_read"]) == (1, 1, 8192)
        assert disk == {
            "hit_tokens": 24,
            "hit_rate": pytest.approx(24 / 136),
            "pages": 40,
            "capacity": 1000,
            "evictions": {"evicted": 5, "corrupt": 1},
            "workers": 1,
            "accepting": 1,
            "bytes_written": 40 * 4096,
            "bytes_read": 24 * 4096,
            "demotions": 40,
            "errors": 2,
            "dropped": {"truncated": 1},
        }
    finally:
        rig.close()


def test_without_tenants_shown_a_tier_split_is_the_workers_own():
    rig = ServiceRig(auth=True)  # no token, tenants not shown: summed over tenants
    try:
        _, w0 = rig.worker("w0")
        w0._report = lambda: W0
        assert w0.heartbeat()
        rig.server.publish_metrics()
        got = samples(scrape(rig.server.metrics_url))
        assert tokens(got, "local_hit", "disk", "w0", None) == 24
        assert tokens(got, "local_hit", "host", "w0", None) == 40
        assert tokens(got, "remote_hit", "host", "w0", None) == 16
    finally:
        rig.close()


def test_a_restarted_worker_starts_its_tier_figures_from_zero():
    """Figures only grow while a worker runs, however its tenants' hits come; a worker that
    comes back under its id reports from zero again, and so do its series (a counter reset,
    as Prometheus reads it)."""
    rig = ServiceRig(auth=True, metrics_show_tenants=True)
    try:
        _, w0 = rig.worker("w0")
        rig.client("front_door").name_tenant("salt-acme", "acme")
        w0._report = lambda: W0
        assert w0.heartbeat()
        # Then 20 more local hits, all acme's, 10 of them from disk: all 10 are acme's.
        acme, other = W0_TENANTS
        later = W0._replace(
            tenants=(acme._replace(local_hit=68), other),
            tiers=(W0.tiers[0], W0.tiers[1]._replace(hit_tokens=34, bytes_read=34 * 4096)),
        )
        w0._report = lambda: later
        assert w0.heartbeat()
        rig.server.publish_metrics()
        got = samples(scrape(rig.server.metrics_url))
        assert tokens(got, "local_hit", "disk", "w0", "acme") == 18 + 10
        assert tokens(got, "local_hit", "host", "w0", "acme") == 30 + 10
        assert tokens(got, "local_hit", "disk", "w0", "(unnamed)") == 6  # unchanged
        disk_read = ("kvmesh_tier_read_bytes_total", (("tier", "disk"), ("worker", "w0")))
        assert got[disk_read] == 34 * 4096

        _, again = rig.worker("w0")  # a new incarnation: registered anew
        fresh = EMPTY_REPORT._replace(
            tenants=(TenantTokens("salt-acme", 1, 4, 0, 4),),
            tiers=(tier("disk", pages=1, capacity=1000, hit_tokens=4, bytes_read=4096),),
        )
        again._report = lambda: fresh
        assert again.heartbeat()
        rig.server.publish_metrics()
        got = samples(scrape(rig.server.metrics_url))
        assert tokens(got, "local_hit", "disk", "w0", "acme") == 4
        assert tokens(got, "local_hit", "host", "w0", "acme") == 0
        assert got[disk_read] == 4096
        assert ("kvmesh_tier_read_bytes_total", (("tier", "host"), ("worker", "w0"))) not in got
        served = rig.server.stats()["served"]
        assert served["tiers"]["disk"]["hit_tokens"] == 4
        assert served["prompt_tokens_total"] == 8
    finally:
        rig.close()  # checks the service's integrity, the reports' tier split with it


@pytest.mark.parametrize(
    "bad_tiers, code, message",
    [
        (
            (tier("ssd"),),
            "bad_field",
            r"heartbeat\.report\.tiers\[0\]\.tier: expected one of \('device', 'host', 'disk'\)",
        ),
        (
            (tier("device"), tier("host"), tier("disk"), tier("disk")),
            "too_large",
            r"heartbeat\.report\.tiers: 4 tiers exceeds the limit 3",
        ),
        (
            (tier("disk", dropped={f"r{i}": 1 for i in range(MAX_REPORT_REASONS + 1)}),),
            "too_large",
            rf"tiers\[0\]\.dropped: {MAX_REPORT_REASONS + 1} reasons exceeds the limit",
        ),
    ],
)
def test_a_report_with_bad_tiers_is_refused_and_the_service_serves_on(bad_tiers, code, message):
    rig = ServiceRig(auth=False)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.linger, dealer.rcvtimeo = 0, 5000
    try:
        _, w0 = rig.worker("w0")
        w0._report = lambda: W0
        assert w0.heartbeat()
        # As a worker whose code is not ours might send it: unchecked at the sender.
        bad = Heartbeat("w0", w0.epoch, 0.0, W0._replace(tiers=bad_tiers))
        dealer.connect(rig.server.address)
        dealer.send(protocol.encode(protocol.request(9, bad), check=False))
        reply = protocol.decode(dealer.recv(), "reply")
        assert (reply.type, reply.request_id, reply.body.code) == (protocol.ERROR, 9, code)
        assert re.search(message, reply.body.message), reply.body.message
        served = rig.server.stats()["served"]  # it answers, and kept the last good report
        assert served["tiers"]["disk"]["hit_tokens"] == 24
        w0._report = lambda: W1
        assert w0.heartbeat()
        assert "disk" not in rig.server.stats()["served"]["tiers"]
    finally:
        dealer.close(linger=0)
        rig.close()
