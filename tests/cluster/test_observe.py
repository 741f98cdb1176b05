"""Watching a real mesh: its live dashboard in a real Chromium and its Grafana dashboard
through a real Prometheus, both against a workload whose figures are known exactly.

The workload, round by round on two workers (tiny model, 16-token pages), a fresh
40-token prompt each round (two full pages and 8 tokens), tenants taking turns:

    1. on w0, cold:          40 computed
    2. on w0 again:          32 local hits (its own two pages), 8 computed
    3. on w1:                32 remote hits (copied from w0, validated), 8 computed

so ROUNDS rounds make 3 * ROUNDS requests, 32 * ROUNDS local and remote hit tokens,
56 * ROUNDS computed: a cluster hit rate of 64 / 120. The stores are small enough that
later rounds evict the pages of earlier ones.
"""

from __future__ import annotations

import contextlib
import io
import time

import pytest
import ray

import cluster
from cluster.config import config_from_dict
from tests.browser import open_browser, save_screenshot, wait_for_js
from tests.cache_service.grafana import CLUSTER_HIT_RATE, grafana_expressions, load_dashboard
from tests.cache_service.prometheus_rig import PrometheusRig

pytestmark = pytest.mark.slow

ROUNDS = 16
PROMPT_TOKENS = 40
NEW_TOKENS = 4
TENANTS = ("acme", "globex")
CONFIG = {
    "model": {"name": "tiny"},
    "store": {"num_pages": 24},
    "workers": {"count": 2, "threads": 1, "copy_policy": "always"},
    # The figures by tenant are what this test watches, read by a Prometheus and a browser
    # without a token (none is set on loopback): the operator's switch lets them see them.
    "service": {"metrics_show_tenants": True},
}


def prompt(round_: int) -> list[int]:
    """A prompt of its own each round, in the tiny model's vocabulary (ids 1..255)."""
    start = round_ * PROMPT_TOKENS
    return [(start + i) % 255 + 1 for i in range(PROMPT_TOKENS)]


def expected_figures() -> dict:
    """What the workload must show, by the mesh, by worker and by tenant."""
    per_tenant = {tenant: len(range(i, ROUNDS, len(TENANTS))) for i, tenant in enumerate(TENANTS)}
    return {
        "totals": {
            "requests": 3 * ROUNDS,
            "local_hit": 32 * ROUNDS,
            "remote_hit": 32 * ROUNDS,
            "computed": 56 * ROUNDS,
        },
        "workers": {
            "w0": {"requests": 2 * ROUNDS, "local_hit": 32 * ROUNDS, "remote_hit": 0,
                   "computed": 48 * ROUNDS},
            "w1": {"requests": ROUNDS, "local_hit": 0, "remote_hit": 32 * ROUNDS,
                   "computed": 8 * ROUNDS},
        },
        "tenants": {
            tenant: {"requests": 3 * n, "local_hit": 32 * n, "remote_hit": 32 * n,
                     "computed": 56 * n}
            for tenant, n in per_tenant.items()
        },
    }  # fmt: skip


def run_workload(mesh) -> dict[str, int]:
    """The rounds above, paced over several seconds so that Prometheus scrapes them as
    they happen; returns the figures the workers answered with, summed."""
    sums = {"requests": 0, "local_hit": 0, "remote_hit": 0, "computed": 0}
    for round_ in range(ROUNDS):
        tenant = TENANTS[round_ % len(TENANTS)]
        for worker in ("w0", "w0", "w1"):
            stats = mesh.generate(prompt(round_), NEW_TOKENS, tenant=tenant, worker=worker).stats
            mesh.flush()  # the pages in the index before the next step looks for them
            sums["requests"] += 1
            sums["local_hit"] += stats["local_hit_tokens"]
            sums["remote_hit"] += stats["remote_hit_tokens"]
            sums["computed"] += stats["computed_tokens"]
        time.sleep(0.4)
    return sums


@pytest.fixture(scope="module")
def observed(ray_local):
    """A fresh mesh, a Prometheus scraping it and a browser on its dashboard, all started
    before the workload (so both watch it happen), and what was seen before it ran."""
    with contextlib.ExitStack() as stack:
        mesh = cluster.connect(config_from_dict(CONFIG), log=io.StringIO())
        stack.callback(mesh.shutdown)
        status = mesh.stats()
        prometheus = stack.enter_context(PrometheusRig(status["metrics_url"]))
        prometheus.wait_for_samples("kvmesh_workers_live")
        driver = stack.enter_context(open_browser())
        driver.get(status["dashboard_url"])
        wait_for_js(driver, "window.kvmeshDashboard && window.kvmeshDashboard.updates >= 1")
        before = driver.execute_script("return window.kvmeshDashboard.last.totals.requests")
        answered = run_workload(mesh)
        yield {
            "mesh": mesh,
            "prometheus": prometheus,
            "driver": driver,
            "requests_before": before,
            "answered": answered,
        }
        mesh.check_integrity()


def test_the_workers_answered_the_designed_figures(observed):
    assert observed["answered"] == expected_figures()["totals"]
    served = observed["mesh"].stats()["service"]["served"]
    # The heartbeats bring every request's figures to the service.
    deadline = time.monotonic() + 10
    while served["prompt_tokens"]["computed"] < 56 * ROUNDS and time.monotonic() < deadline:
        time.sleep(0.2)
        served = observed["mesh"].stats()["service"]["served"]
    totals = expected_figures()["totals"]
    assert served["prompt_tokens"] == {
        k: totals[k] for k in ("local_hit", "remote_hit", "computed")
    }
    assert served["hit_rate"] == pytest.approx(64 / 120)


def test_the_dashboard_shows_the_figures_live(observed):
    driver = observed["driver"]
    expected = expected_figures()
    total = expected["totals"]["requests"]
    # Loaded before the workload; it shows the end of it without a reload.
    assert observed["requests_before"] == 0
    wait_for_js(driver, f"window.kvmeshDashboard.last.totals.requests === {total}", 20)
    wait_for_js(driver, f"document.getElementById('requests').textContent === '{total}'", 5)
    text = {
        key: driver.execute_script(f"return document.getElementById('{key}').textContent")
        for key in ("requests", "hit-rate", "local-hit-tokens", "remote-hit-tokens",
                    "computed-tokens", "workers-live")
    }  # fmt: skip
    assert text == {
        "requests": str(total),
        "hit-rate": "53.3%",
        "local-hit-tokens": str(expected["totals"]["local_hit"]),
        "remote-hit-tokens": str(expected["totals"]["remote_hit"]),
        "computed-tokens": str(expected["totals"]["computed"]),
        "workers-live": "2",
    }
    for table, key in (("tenants", "tenant"), ("workers", "worker")):
        rows = driver.execute_script(
            f"""return Array.from(document.querySelectorAll('#{table} tbody tr')).map(tr => [
                tr.dataset.{key},
                ...['requests', 'local-hit', 'remote-hit', 'computed'].map(
                    c => tr.querySelector('.' + c).textContent)])"""
        )
        want = [
            [name, *(str(f[k]) for k in ("requests", "local_hit", "remote_hit", "computed"))]
            for name, f in sorted(expected[table].items())
        ]
        assert rows == want, table
    # The charts draw the same figures: per-worker hit rates, and history up to the total.
    worker_rates = driver.execute_script(
        "return document.getElementById('chart-workers').data[0].y"
    )
    assert worker_rates == pytest.approx([32 / 80, 32 / 40])
    history = driver.execute_script("return window.kvmeshDashboard.last.history")
    requests = [point["requests"] for point in history]
    assert requests == sorted(requests) and requests[-1] == total and requests[0] < total
    assert len({n for n in requests if 0 < n < total}) >= 2, "the workload was seen under way"
    evictions = driver.execute_script("return window.kvmeshDashboard.last.evictions")
    assert evictions.get("evicted", 0) > 0
    # Every hit came from host memory (the workers report no other tier), local or copied.
    tiers = driver.execute_script("return window.kvmeshDashboard.last.tiers")
    assert [(t["tier"], t["hit_tokens"]) for t in tiers] == [("host", 64 * ROUNDS)]
    assert driver.execute_script("return document.getElementById('tiers-card').hidden") is False
    save_screenshot(driver, "dashboard.png")


# Panels whose figures are 0 once this workload has finished (nothing runs or waits, and
# no chunk alignment is configured): for these, each worker's series must be there.
AT_REST = {"Requests running and waiting per worker", "Tokens lost to chunk alignment"}
# Panels that read only the figures workers report of their tiers (`TierFigures`): these
# workers keep their pages in host memory and report none, so the panels are empty here
# (tests/cache_service/test_metrics.py holds those families to known values).
TIER_FIGURES = {
    "Bytes per tier",
    "Load-back time per tier",
    "Tier demotions, drops and errors",
    "Workers whose tier takes pages",
}


def test_every_grafana_expression_has_a_non_zero_series_through_prometheus(observed):
    prometheus = observed["prometheus"]
    prometheus.wait_for_scrape(since=time.time() + 2.0)  # after the last heartbeat landed
    empty = []
    for title, expr in grafana_expressions(load_dashboard()):
        series = prometheus.query(expr)
        values = [float(s["value"][1]) for s in series]
        if title in TIER_FIGURES:
            continue
        if title in AT_REST:
            workers = sorted(s["metric"].get("worker") for s in series)
            if workers != ["w0", "w1"] or any(v != v for v in values):
                empty.append((title, expr, workers))
        elif not any(v != 0 and v == v for v in values):  # v == v: not NaN
            empty.append((title, expr, values))
    assert not empty, f"expressions with no non-zero series: {empty}"
    (hit_rate,) = [expr for title, expr in grafana_expressions(load_dashboard())
                   if title == CLUSTER_HIT_RATE]  # fmt: skip
    served = observed["mesh"].stats()["service"]["served"]
    assert prometheus.value(hit_rate) == pytest.approx(served["hit_rate"], rel=0.01)
    assert prometheus.value(hit_rate) == pytest.approx(64 / 120, rel=0.01)


def test_every_family_reaches_prometheus_with_its_labels(observed):
    prometheus = observed["prometheus"]
    sources = prometheus.values("sum by (source) (kvmesh_prompt_tokens_total)")
    assert {dict(labels)["source"]: v for labels, v in sources.items()} == {
        "local_hit": 32 * ROUNDS,
        "remote_hit": 32 * ROUNDS,
        "computed": 56 * ROUNDS,
    }
    tiers = prometheus.values("sum by (tier) (kvmesh_prompt_tokens_total)")
    assert {dict(labels)["tier"]: v for labels, v in tiers.items()} == {
        "host": 64 * ROUNDS,
        "none": 56 * ROUNDS,  # computed
    }
    tenants = prometheus.values("sum by (tenant) (kvmesh_requests_total)")
    assert {dict(labels)["tenant"]: v for labels, v in tenants.items()} == {
        tenant: f["requests"] for tenant, f in expected_figures()["tenants"].items()
    }
    kinds = prometheus.values("sum by (kind) (kvmesh_copy_bytes_total)")
    assert {dict(labels)["kind"] for labels in kinds} == {"same_node", "remote"}
    page_bytes = ray.get(observed["mesh"].workers["w1"].stats.remote()).copy_bytes
    assert {dict(labels)["kind"]: v for labels, v in kinds.items()} == page_bytes
    hits = prometheus.value('sum(kvmesh_ttft_seconds_count{cache="hit"})')
    misses = prometheus.value('sum(kvmesh_ttft_seconds_count{cache="miss"})')
    assert (hits, misses) == (2 * ROUNDS, ROUNDS)
