"""The Grafana dashboard's shape, and the rig that runs a real Prometheus for the end-to-end
test: a scrape with a bearer token, exact values back, PromQL errors, no process left."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cache_service.web import WebServer
from tests.cache_service.grafana import (
    CLUSTER_HIT_RATE,
    grafana_expressions,
    load_dashboard,
    metric_names,
    panels,
    substitute,
)
from tests.cache_service.prometheus_rig import PrometheusError, PrometheusRig, QueryError

# The service's metric families, as exposed (counters with _total); the dashboard may use
# no other.
COUNTERS = {
    "kvmesh_prompt_tokens_total",
    "kvmesh_requests_total",
    "kvmesh_prefix_cache_queries_total",
    "kvmesh_prefix_cache_hits_total",
    "kvmesh_evictions_total",
    "kvmesh_copy_bytes_total",
    "kvmesh_resyncs_total",
    "kvmesh_index_worker_queried_tokens_total",
    "kvmesh_index_worker_hit_tokens_total",
    "kvmesh_index_tenant_queried_tokens_total",
    "kvmesh_index_tenant_hit_tokens_total",
    "kvmesh_alignment_lost_tokens_total",
    "kvmesh_tier_written_bytes_total",
    "kvmesh_tier_read_bytes_total",
    "kvmesh_tier_demotions_total",
    "kvmesh_tier_errors_total",
    "kvmesh_tier_dropped_records_total",
}
GAUGES = {
    "kvmesh_pages",
    "kvmesh_workers_live",
    "kvmesh_service_epoch",
    "kvmesh_index_pages",
    "kvmesh_num_requests_running",
    "kvmesh_num_requests_waiting",
    "kvmesh_tier_capacity_pages",
    "kvmesh_tier_accepting",
}
HISTOGRAMS = {
    "kvmesh_lookup_seconds",
    "kvmesh_copy_seconds",
    "kvmesh_ttft_seconds",
    "kvmesh_tier_load_seconds",
}
FAMILIES = COUNTERS | GAUGES | HISTOGRAMS
UNITS = {"percentunit", "short", "s", "bytes", "Bps", "reqps"}
GRID_WIDTH = 24
DS_PROMETHEUS = "${DS_PROMETHEUS}"
TOKEN = "scrape-token-of-the-test"


def family(name: str) -> str:
    """The family a sample name belongs to: a histogram's _bucket/_sum/_count are its own."""
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name.removesuffix(suffix) in HISTOGRAMS:
            return name.removesuffix(suffix)
    return name


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return load_dashboard()


# -- the dashboard ------------------------------------------------------------------------


def test_the_dashboard_is_importable_with_a_prometheus_input(dashboard):
    assert (dashboard["uid"], dashboard["title"]) == ("kvmesh", "kvmesh")
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["time"] == {"from": "now-15m", "to": "now"}
    assert dashboard["refresh"] == "5s"
    assert [(i["name"], i["type"], i["pluginId"]) for i in dashboard["__inputs"]] == [
        ("DS_PROMETHEUS", "datasource", "prometheus")
    ]


def test_panels_have_unique_ids_a_datasource_targets_and_a_unit(dashboard):
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {ids}"
    for panel in panels(dashboard):
        where = f"panel {panel['id']} {panel['title']!r}"
        assert panel["datasource"] == {"type": "prometheus", "uid": DS_PROMETHEUS}, where
        assert panel["targets"], where
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), where
        for target in panel["targets"]:
            assert target["expr"].strip(), where
            assert target["datasource"]["uid"] == DS_PROMETHEUS, where
        assert panel["fieldConfig"]["defaults"]["unit"] in UNITS, where


def test_panels_lie_on_the_grid_without_overlapping(dashboard):
    boxes = []
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        x, y, w, h = grid["x"], grid["y"], grid["w"], grid["h"]
        assert all(isinstance(v, int) for v in (x, y, w, h)), panel["title"]
        assert x >= 0 and y >= 0 and w > 0 and h > 0 and x + w <= GRID_WIDTH, panel["title"]
        boxes.append((panel["title"], x, y, w, h))
    for i, (a, ax, ay, aw, ah) in enumerate(boxes):
        for b, bx, by, bw, bh in boxes[i + 1 :]:
            apart = ax + aw <= bx or bx + bw <= ax or ay + ah <= by or by + bh <= ay
            assert apart, f"panels {a!r} and {b!r} overlap"


def test_every_expression_uses_only_the_service_metric_families(dashboard):
    used = set()
    for panel in panels(dashboard):
        for target in panel["targets"]:
            names = {family(name) for name in metric_names(target["expr"])}
            assert names, f"{panel['title']!r}: {target['expr']!r} reads no kvmesh_ metric"
            assert names <= FAMILIES, f"{panel['title']!r} reads unknown {names - FAMILIES}"
            used |= names
    # Every family the service exposes has a place on the dashboard.
    assert used == FAMILIES, f"not on the dashboard: {sorted(FAMILIES - used)}"


def test_worker_and_tenant_variables_default_to_all(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"worker", "tenant"}
    for name, variable in variables.items():
        query = variable["query"]
        text = query["query"] if isinstance(query, dict) else query
        assert text == f"label_values(kvmesh_prompt_tokens_total, {name})"
        assert variable["datasource"]["uid"] == DS_PROMETHEUS
        assert (variable["includeAll"], variable["allValue"]) == (True, ".*")


def test_expressions_come_with_the_variables_on_all(dashboard):
    expressions = grafana_expressions(dashboard)
    assert len(expressions) == sum(len(p["targets"]) for p in panels(dashboard))
    assert all("$" not in expr and "[[" not in expr for _, expr in expressions)
    by_title = dict(expressions)
    assert by_title[CLUSTER_HIT_RATE] == (
        'sum(kvmesh_prompt_tokens_total{source=~"local_hit|remote_hit"}) '
        "/ sum(kvmesh_prompt_tokens_total)"
    )
    assert by_title["Hit rate over time"] == (
        'sum(rate(kvmesh_prompt_tokens_total{source=~"local_hit|remote_hit", worker=~".*", '
        'tenant=~".*"}[15s])) / sum(rate(kvmesh_prompt_tokens_total{worker=~".*", '
        'tenant=~".*"}[15s]))'
    )
    hit_rate_panel = next(p for p in panels(dashboard) if p["title"] == CLUSTER_HIT_RATE)
    assert (hit_rate_panel["id"], hit_rate_panel["type"]) == (1, "stat")
    assert hit_rate_panel["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_substitute_knows_each_variable_spelling_and_refuses_unknown_ones():
    values = {"worker": ".*", "__rate_interval": "15s"}
    assert substitute('x{w=~"$worker"}[$__rate_interval]', values) == 'x{w=~".*"}[15s]'
    assert substitute('x{w=~"${worker:regex}"}[${__rate_interval}]', values) == ('x{w=~".*"}[15s]')
    assert substitute('x{w=~"[[worker]]", v=~"a$"}', values) == 'x{w=~".*", v=~"a$"}'
    with pytest.raises(KeyError, match=r"\$node"):
        substitute('x{n="$node"}', values)


# -- the rig, without Prometheus ----------------------------------------------------------


def rig_processes(workdir: Path) -> list[int]:
    """Pids of the processes whose command line names `workdir` (the rig's Prometheus)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if str(workdir).encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def fake_prometheus(tmp_path: Path, body: str) -> str:
    """An executable standing in for Prometheus: Python running `body`."""
    script = tmp_path / "fake-prometheus"
    script.write_text(f"#!{sys.executable}\n{body}\n")
    script.chmod(0o755)
    return str(script)


def test_the_config_scrapes_the_target_path_with_the_token():
    rig = PrometheusRig("http://127.0.0.1:40125/metrics", token="t", scrape_interval_s=0.5)
    config = rig.config()
    assert config["global"] == {
        "scrape_interval": "1s",
        "scrape_timeout": "1s",
        "evaluation_interval": "1s",
    }
    assert config["scrape_configs"] == [
        {
            "job_name": "kvmesh",
            "scheme": "http",
            "metrics_path": "/metrics",
            "scrape_interval": "500ms",
            "scrape_timeout": "500ms",
            "static_configs": [{"targets": ["127.0.0.1:40125"]}],
            "authorization": {"type": "Bearer", "credentials": "t"},
        }
    ]
    assert "authorization" not in PrometheusRig("http://[::1]:9/").config()["scrape_configs"][0]
    assert PrometheusRig("http://[::1]:9").metrics_path == "/metrics"
    assert PrometheusRig("http://[::1]:9").target == "[::1]:9"


@pytest.mark.parametrize(
    "url",
    ["127.0.0.1:9/metrics", "ftp://127.0.0.1:9/metrics", "http://host/metrics", "http://h:9/m?x=1"],
)
def test_a_target_url_without_scheme_host_and_port_is_refused(url):
    with pytest.raises(ValueError, match="scrape target"):
        PrometheusRig(url)


def test_a_missing_binary_names_the_debian_package(tmp_path):
    rig = PrometheusRig("http://127.0.0.1:9/metrics", binary=str(tmp_path / "prometheus"))
    with pytest.raises(PrometheusError, match="Debian's 'prometheus' package"), rig:
        pass
    assert rig.workdir is None  # nothing was created


def test_a_prometheus_that_exits_at_once_is_reported_with_its_log(tmp_path):
    body = "import sys\nprint('err: bad flag', flush=True)\nsys.exit(3)"
    rig = PrometheusRig("http://127.0.0.1:9/metrics", binary=fake_prometheus(tmp_path, body))
    with pytest.raises(PrometheusError, match=r"(?s)exited with status 3.*err: bad flag"), rig:
        pass
    assert not rig.workdir.exists()


def test_a_prometheus_that_never_gets_ready_is_killed_even_if_it_ignores_sigterm(tmp_path):
    body = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)"
    rig = PrometheusRig(
        "http://127.0.0.1:9/metrics",
        binary=fake_prometheus(tmp_path, body),
        ready_timeout_s=0.5,
        stop_timeout_s=0.5,
    )
    started = time.monotonic()
    with pytest.raises(PrometheusError, match="not ready .* after 0.5 s"), rig:
        pass
    assert time.monotonic() - started < 10
    assert rig_processes(rig.workdir) == []
    assert not rig.workdir.exists()


# -- the rig against a real Prometheus ----------------------------------------------------

LOCAL_HIT, REMOTE_HIT, COMPUTED = 30, 10, 60
DISK_HIT = 12  # of the local hits
LOOKUPS = (0.0004, 0.003, 0.2)
# A tier's share of prompt tokens, as the Grafana panel takes it, without its rate().
TIER_HIT_RATE = (
    'sum by (tier) (kvmesh_prompt_tokens_total{source=~"local_hit|remote_hit"}) '
    "/ ignoring (tier) group_left sum(kvmesh_prompt_tokens_total)"
)


def registry_of_test_series() -> CollectorRegistry:
    """A few kvmesh_ series with known values (names as the service exposes them)."""
    registry = CollectorRegistry()
    tokens = Counter(
        "kvmesh_prompt_tokens",
        "prompt tokens by where their KV came from",
        ["source", "tier", "worker", "tenant"],
        registry=registry,
    )
    tokens.labels("local_hit", "host", "w0", "t0").inc(LOCAL_HIT - DISK_HIT)
    tokens.labels("local_hit", "disk", "w0", "t0").inc(DISK_HIT)
    tokens.labels("remote_hit", "host", "w0", "t0").inc(REMOTE_HIT)
    tokens.labels("computed", "none", "w1", "t0").inc(COMPUTED)
    pages = Gauge("kvmesh_pages", "pages by state", ["state", "tier", "worker"], registry=registry)
    pages.labels("free", "host", "w0").set(12)
    pages.labels("cached", "host", "w0").set(3)
    pages.labels("in_use", "host", "w0").set(1)
    pages.labels("cached", "disk", "w0").set(40)
    Gauge("kvmesh_workers_live", "live workers", registry=registry).set(2)
    lookup = Histogram(
        "kvmesh_lookup_seconds", "lookup latency", buckets=(0.001, 0.01, 0.1), registry=registry
    )
    for seconds in LOOKUPS:
        lookup.observe(seconds)
    return registry


@pytest.fixture(scope="module")
def exporter() -> Iterator[str]:
    """The service's own /metrics server over the test series, demanding TOKEN; its URL."""
    server = WebServer(registry_of_test_series(), "127.0.0.1", token=TOKEN)
    try:
        yield server.start() + "/metrics"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prometheus(exporter) -> Iterator[PrometheusRig]:
    with PrometheusRig(exporter, token=TOKEN) as rig:
        rig.wait_for_samples("kvmesh_workers_live")
        yield rig


@pytest.mark.slow
def test_the_scraped_values_come_back_exactly(prometheus, exporter):
    tokens = prometheus.values("kvmesh_prompt_tokens_total")
    instance = exporter.removeprefix("http://").removesuffix("/metrics")
    common = {("job", "kvmesh"), ("instance", instance), ("__name__", "kvmesh_prompt_tokens_total")}

    def labels(source, tier, worker):
        tenant = {("source", source), ("tier", tier), ("worker", worker), ("tenant", "t0")}
        return frozenset(common | tenant)

    assert tokens == {
        labels("local_hit", "host", "w0"): LOCAL_HIT - DISK_HIT,
        labels("local_hit", "disk", "w0"): DISK_HIT,
        labels("remote_hit", "host", "w0"): REMOTE_HIT,
        labels("computed", "none", "w1"): COMPUTED,
    }
    pages = prometheus.values("kvmesh_pages")
    assert sorted((dict(k)["tier"], dict(k)["state"], v) for k, v in pages.items()) == [
        ("disk", "cached", 40),
        ("host", "cached", 3),
        ("host", "free", 12),
        ("host", "in_use", 1),
    ]
    assert prometheus.value("kvmesh_lookup_seconds_count") == len(LOOKUPS)
    assert prometheus.value("kvmesh_lookup_seconds_sum") == sum(LOOKUPS)
    buckets = prometheus.values("kvmesh_lookup_seconds_bucket")
    assert sorted((float(dict(k)["le"]), v) for k, v in buckets.items()) == [
        (0.001, 1),
        (0.01, 2),
        (0.1, 2),
        (math.inf, 3),
    ]


@pytest.mark.slow
def test_the_dashboard_hit_rate_is_the_share_of_cached_tokens(prometheus, dashboard):
    expr = dict(grafana_expressions(dashboard))[CLUSTER_HIT_RATE]
    expected = (LOCAL_HIT + REMOTE_HIT) / (LOCAL_HIT + REMOTE_HIT + COMPUTED)
    assert prometheus.value(expr) == expected


@pytest.mark.slow
def test_a_tiers_hit_rate_is_its_hits_over_all_prompt_tokens(prometheus, dashboard):
    total = LOCAL_HIT + REMOTE_HIT + COMPUTED
    shares = prometheus.values(TIER_HIT_RATE)
    assert {dict(labels)["tier"]: v for labels, v in shares.items()} == {
        "host": (LOCAL_HIT - DISK_HIT + REMOTE_HIT) / total,
        "disk": DISK_HIT / total,
    }
    # The panel takes the same ratio of the two sides' rates.
    assert dict(grafana_expressions(dashboard))["Hit rate per tier"] == (
        'sum by (tier) (rate(kvmesh_prompt_tokens_total{source=~"local_hit|remote_hit", '
        'worker=~".*", tenant=~".*"}[15s])) / ignoring (tier) group_left '
        'sum(rate(kvmesh_prompt_tokens_total{worker=~".*", tenant=~".*"}[15s]))'
    )


@pytest.mark.slow
def test_every_dashboard_expression_is_valid_promql(prometheus, dashboard):
    for _, expr in grafana_expressions(dashboard):
        prometheus.query(expr)  # raises QueryError, with Prometheus's reason, if it is not


@pytest.mark.slow
def test_a_bad_expression_raises_with_prometheus_s_message(prometheus):
    with pytest.raises(QueryError, match="parse error: unclosed left parenthesis"):
        prometheus.query("sum(kvmesh_pages")
    with pytest.raises(QueryError, match="parse error"):
        prometheus.wait_for_samples("rate(kvmesh_pages[)", timeout_s=30)  # at once, not in 30 s


@pytest.mark.slow
def test_the_target_is_up_and_a_fresh_scrape_can_be_awaited(prometheus, exporter):
    [target] = prometheus.targets()
    assert (target["scrapeUrl"], target["health"], target["lastError"]) == (exporter, "up", "")
    since = time.time()
    assert prometheus.wait_for_scrape(since, timeout_s=5) > since


@pytest.mark.slow
def test_a_wrong_token_leaves_the_target_down_and_the_wait_says_so(exporter):
    with PrometheusRig(exporter, token="not-the-token") as rig:
        deadline = time.monotonic() + 15  # the first scrape comes within ~6 s of the start
        while [t["health"] for t in rig.targets()] != ["down"] and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(PrometheusError, match=r"is down .*401 Unauthorized"):
            rig.wait_for_samples("kvmesh_workers_live", timeout_s=0.5)


@pytest.mark.slow
def test_no_prometheus_process_or_directory_is_left_after_the_block(exporter):
    with PrometheusRig(exporter, token=TOKEN) as rig:
        pids = rig_processes(rig.workdir)
        assert len(pids) == 1 and os.path.exists(f"/proc/{pids[0]}")
        assert rig.url.startswith("http://127.0.0.1:")
    assert rig_processes(rig.workdir) == []
    assert not rig.workdir.exists()
