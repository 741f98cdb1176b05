"""A second front door on a running mesh: `cluster.connect()` attaches instead of starting.

One tiny-model mesh (two workers on the embedded 2-CPU Ray) serves the whole module. An
attached Mesh has the owner's workers, configuration and tenant secret (all of it read
through Ray), and its `shutdown()` only detaches. The owner's `stats()` and the `top`
views are checked on the same mesh. The last test kills a worker and checks that a new
front door refuses the incomplete mesh while the owner can still stop all of it; it
stops the module's mesh, so it must stay last in this file.
"""

from __future__ import annotations

import dataclasses
import io
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import ray
from rich.console import Console

import cluster
from cache_service.actor import RAY_NAMESPACE, get_service
from cluster.config import ModelConfig, config_from_dict
from cluster.errors import MeshError
from cluster.status import render, run_top, top_view
from tests.waiting import wait_until
from workers.store.segment_names import SHM_DIR

pytestmark = pytest.mark.slow

TINY = {
    "model": {"name": "tiny"},
    "store": {"num_pages": 64},
    "workers": {"count": 2, "threads": 1, "copy_policy": "always"},
}
PROMPT = list(range(3, 51))  # 48 tokens: exactly three 16-token pages
NEW_TOKENS = 4
STATS_KEYS = {
    "ray_address",
    "epoch",
    "service_address",
    "auth",
    "dashboard_url",
    "metrics_url",
    "engines",
    "quarantined",
    "hit_rate",
    "index_hit_rate",
    "prompt_tokens",
    "pages",
    "nodes",
    "workers",
    "tenants",
    "service",
    "tiers",
    "route_ttft_error",
}


def tiny_config(**workers):
    data = {**TINY, "workers": {**TINY["workers"], **workers}}
    return config_from_dict(data)


def kvmesh_actor_names() -> list[str]:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return sorted(name for name in names if name.startswith("kvmesh"))


def this_node() -> tuple[str, str]:
    """This node's id and its address as Ray reports it."""
    node_id = ray.get_runtime_context().get_node_id()
    (address,) = [n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id]
    return node_id, address


@pytest.fixture(scope="module")
def started(ray_local):
    """The module's mesh, and the names of its workers' page stores."""
    mesh = cluster.connect(tiny_config(), log=io.StringIO())
    stores = [ray.get(w.info.remote()).shm_name for w in mesh.workers.values()]
    yield mesh, stores
    mesh.shutdown()  # idempotent: the last test has already stopped it


@pytest.fixture(scope="module")
def owner(started):
    return started[0]


@pytest.fixture
def attached(owner):
    """A second front door in this process; detached again after the test."""
    mesh = cluster.connect(log=io.StringIO())
    yield mesh
    mesh.shutdown()


def test_connect_attaches_without_arguments_and_by_address(owner):
    assert owner.owned is True
    assert kvmesh_actor_names() == ["kvmesh-service", "kvmesh-worker-w0", "kvmesh-worker-w1"]
    log = io.StringIO()
    plain = cluster.connect(log=log)
    by_address = cluster.connect(address=ray.get_runtime_context().gcs_address, log=log)
    try:
        host = socket.gethostname()
        assert log.getvalue().splitlines() == [
            f"attached to the mesh started by connect on {host} (2 workers)",
            f"attached to the mesh started by connect on {host} (2 workers)",
        ]
        for mesh in (plain, by_address):
            assert mesh.owned is False
            assert list(mesh.workers) == list(owner.workers) == ["w0", "w1"]
            assert mesh.config == owner.config == tiny_config()
            # The tenant secret came from the service, through Ray.
            assert mesh.salt("acme") == owner.salt("acme")
            assert mesh.salt("acme") == ray.get(get_service().tenant_salt.remote("acme"))
            assert mesh.salt("acme") != mesh.salt("globex")
            # The same actors, not look-alikes: the same page stores.
            for worker_id in ("w0", "w1"):
                mine = ray.get(mesh.workers[worker_id].info.remote())
                theirs = ray.get(owner.workers[worker_id].info.remote())
                assert mine == theirs
                assert mine.worker_id == worker_id
        # Attaching started nothing.
        assert kvmesh_actor_names() == ["kvmesh-service", "kvmesh-worker-w0", "kvmesh-worker-w1"]
    finally:
        plain.shutdown()
        by_address.shutdown()


def test_a_prompt_from_the_owner_is_a_local_hit_through_the_attached_front_door(owner, attached):
    first = owner.generate(PROMPT, NEW_TOKENS, tenant="acme", worker="w0")
    assert first.stats["computed_tokens"] == 48
    assert first.stats["local_hit_tokens"] == first.stats["remote_hit_tokens"] == 0
    assert first.stats["worker"] == "w0"
    assert len(first.token_ids) == NEW_TOKENS

    second = attached.generate(PROMPT, NEW_TOKENS, tenant="acme", worker="w0")
    # All three pages match, but the last prompt token is always computed (the model
    # needs its logits): 47 tokens come from w0's own cache, the last page's first 15
    # of them copied on write.
    assert second.stats["local_hit_tokens"] == 47
    assert second.stats["remote_hit_tokens"] == 0
    assert second.stats["computed_tokens"] == 1
    assert second.stats["prompt_tokens"] == 48
    assert second.stats["worker"] == "w0"
    assert second.token_ids == first.token_ids

    # The same tenant name means the same namespace on both front doors; another does not.
    other = attached.generate(PROMPT, NEW_TOKENS, tenant="initech", worker="w0")
    assert other.stats["local_hit_tokens"] == 0
    assert other.stats["computed_tokens"] == 48
    assert other.token_ids == first.token_ids


def test_detaching_leaves_the_mesh_running(owner):
    attached = cluster.connect(log=io.StringIO())
    attached.generate(PROMPT, 1, tenant="acme", worker="w1")
    attached.shutdown()
    attached.shutdown()  # idempotent
    attached.detach()
    with pytest.raises(RuntimeError, match="mesh is shut down"):
        attached.generate(PROMPT, 1, tenant="acme", worker="w0")

    assert ray.is_initialized()  # it joined no Ray, so it left none
    assert kvmesh_actor_names() == ["kvmesh-service", "kvmesh-worker-w0", "kvmesh-worker-w1"]
    after = owner.generate(PROMPT, 1, tenant="acme", worker="w1")
    assert after.stats["local_hit_tokens"] == 47  # what the detached front door left on w1
    workers = owner.stats()["workers"]
    assert sorted(workers) == ["w0", "w1"]
    assert workers["w0"]["alive"] is True and workers["w1"]["alive"] is True


def test_a_different_config_given_to_an_attaching_connect_is_ignored(owner, tmp_path):
    other = tiny_config(count=1)
    assert other != owner.config
    log = io.StringIO()
    mesh = cluster.connect(other, log=log)
    try:
        assert mesh.config == owner.config
        assert list(mesh.workers) == ["w0", "w1"]
        host = socket.gethostname()
        assert log.getvalue().splitlines() == [
            f"attaching to the mesh started by connect on {host}: its configuration is used, "
            "not the one given",
            f"attached to the mesh started by connect on {host} (2 workers)",
        ]
    finally:
        mesh.shutdown()

    # A YAML file that differs is ignored the same way.
    path = Path(tmp_path) / "other.yaml"
    path.write_text("model: {name: tiny}\nstore: {num_pages: 32}\n")
    log = io.StringIO()
    mesh = cluster.connect(path, log=log)
    try:
        assert mesh.config == owner.config
        assert mesh.config.store.num_pages == 64
        assert "its configuration is used" in log.getvalue()
    finally:
        mesh.shutdown()

    # The running configuration itself draws no remark.
    log = io.StringIO()
    mesh = cluster.connect(owner.config, log=log)
    try:
        assert "its configuration is used" not in log.getvalue()
        assert "attached to the mesh started by connect" in log.getvalue()
    finally:
        mesh.shutdown()


def test_connect_to_another_ray_is_refused_and_changes_nothing(owner):
    current = ray.get_runtime_context().gcs_address
    log = io.StringIO()
    with pytest.raises(ValueError) as refused:
        cluster.connect(address="10.255.255.1:6379", log=log)
    assert str(refused.value) == (
        f"this process is already connected to Ray at {current}; it cannot join "
        "10.255.255.1:6379 too"
    )
    assert log.getvalue() == ""
    assert ray.is_initialized()
    assert ray.get_runtime_context().gcs_address == current
    assert kvmesh_actor_names() == ["kvmesh-service", "kvmesh-worker-w0", "kvmesh-worker-w1"]
    out = owner.generate(PROMPT, 1, tenant="acme", worker="w0")
    assert out.stats["local_hit_tokens"] == 47


def test_stats_of_the_owner(owner):
    before = owner.stats()
    prompt = [(7 * i + 5) % 250 for i in range(40)]  # 40 tokens: two pages and 8 tokens
    cold = owner.generate(prompt, NEW_TOKENS, tenant="globex", worker="w1")
    owner.flush()  # the index has the cold request's pages (published after it answered)
    warm = owner.generate(prompt, NEW_TOKENS, tenant="globex", worker="w1")
    assert cold.stats["computed_tokens"] == 40
    assert warm.stats["local_hit_tokens"] == 32  # two full pages; the rest is not shared
    assert warm.stats["computed_tokens"] == 8
    stats = owner.stats()

    assert set(stats) == STATS_KEYS
    assert stats["engines"] == {}  # no vLLM engine joined this mesh
    assert stats["quarantined"] == []  # no member failed a spot check
    # Requests sent to a named worker carry no routing estimate: none was judged.
    assert stats["route_ttft_error"]["requests"] == before["route_ttft_error"]["requests"]
    assert stats["ray_address"] == ray.get_runtime_context().gcs_address
    assert isinstance(stats["epoch"], int) and not isinstance(stats["epoch"], bool)
    assert stats["epoch"] == ray.get(get_service().endpoint.remote())["epoch"]
    assert stats["auth"] is True
    # The live dashboard page on the same port.
    assert stats["dashboard_url"] == stats["metrics_url"].removesuffix("/metrics") + "/dashboard"
    # One scrape target for the mesh, on loopback: the service's /metrics.
    assert stats["metrics_url"].startswith("http://127.0.0.1:")
    assert stats["metrics_url"].endswith("/metrics")

    def workers_live() -> list[str]:
        with urllib.request.urlopen(stats["metrics_url"], timeout=5) as reply:
            text = reply.read().decode()
        return [line for line in text.splitlines() if line.startswith("kvmesh_workers_live ")]

    # The service's registry, as its last snapshot (a second old at most) shows it. On a
    # loaded machine a worker has been seen missing from it here, and back soon after
    # (cause not yet known): wait past the 10 s liveness timeout rather than read once.
    wait_until(lambda: workers_live() == ["kvmesh_workers_live 2.0"], 15, "both workers live")

    # Pages: 64 per worker, none in use between requests.
    assert stats["pages"]["total"] == 2 * 64
    assert stats["pages"]["in_use"] == 0
    assert stats["pages"]["free"] + stats["pages"]["cached"] == 128
    for worker_id in ("w0", "w1"):
        pages = stats["workers"][worker_id]["pages"]
        assert pages["total"] == 64
        assert pages["free"] + pages["cached"] + pages["in_use"] == 64
    assert sum(w["pages"]["cached"] for w in stats["workers"].values()) == stats["pages"]["cached"]

    # One node, this one, with both workers.
    node_id, address = this_node()
    assert stats["nodes"] == {node_id: {"address": address, "workers": ["w0", "w1"]}}
    for worker_id in ("w0", "w1"):
        assert stats["workers"][worker_id]["node"] == node_id
        assert stats["workers"][worker_id]["alive"] is True
        assert stats["workers"][worker_id]["worker"] == worker_id

    # Prompt tokens: the cluster's are the sum of the workers'; the two requests above
    # added exactly their own figures to w1's, nothing to w0's.
    totals = stats["prompt_tokens"]
    for source in ("local_hit", "remote_hit", "computed"):
        assert totals[source] == sum(w["prompt_tokens"][source] for w in stats["workers"].values())
    w1_before, w1 = before["workers"]["w1"], stats["workers"]["w1"]
    assert {k: w1["prompt_tokens"][k] - w1_before["prompt_tokens"][k] for k in totals} == {
        "local_hit": 32,
        "remote_hit": 0,
        "computed": 48,
    }
    assert w1["requests"] - w1_before["requests"] == 2
    assert stats["workers"]["w0"]["prompt_tokens"] == before["workers"]["w0"]["prompt_tokens"]
    assert stats["workers"]["w0"]["requests"] == before["workers"]["w0"]["requests"]
    served = totals["local_hit"] + totals["remote_hit"]
    assert stats["hit_rate"] == served / sum(totals.values())
    assert 0 < stats["hit_rate"] < 1
    tokens = w1["prompt_tokens"]
    assert w1["hit_rate"] == (tokens["local_hit"] + tokens["remote_hit"]) / sum(tokens.values())

    # Tenants by name, never by salt. globex asked the index twice, 40 tokens each: cold,
    # nothing was cached; warm, after w1 had published the pages of the cold request
    # (flushed above), its own two pages. Each time the 8 tokens
    # past the last full page are lost to page alignment.
    assert "globex" in stats["tenants"] and "acme" in stats["tenants"]
    assert owner.salt("globex") not in stats["tenants"]
    assert stats["tenants"]["globex"] == {
        "queries": 2,
        "queried_tokens": 80,
        "hit_tokens": 32,
        "local_hit_tokens": 32,
        "remote_hit_tokens": 0,
        "miss_tokens": 32,
        "alignment_lost_tokens": 16,
        "hit_rate": 0.4,
    }
    cluster_tally = stats["service"]["cluster"]
    assert stats["index_hit_rate"] == cluster_tally["hit_tokens"] / cluster_tally["queried_tokens"]


def test_top_renders_the_mesh(owner):
    for tenant in ("acme", "globex"):  # the tables show them, whichever tests ran before
        owner.generate(PROMPT, 1, tenant=tenant, worker="w1")
    stats = owner.stats()
    node_id, address = this_node()
    text = render(top_view(stats))
    assert address in text and node_id[:8] in text
    for expected in ("w0", "w1", "hit rate", "acme", "globex", "workers by node"):
        assert expected in text, expected
    assert f"ray {stats['ray_address']}" in text
    assert f"epoch {stats['epoch']}" in text
    assert "auth on" in text
    pages = stats["pages"]
    assert f"pages 0 in use, {pages['cached']} cached, {pages['free']} free of 128" in text, text
    assert "not alive" not in text

    out = io.StringIO()
    calls = []

    def fetch():
        calls.append(1)
        return owner.stats()

    run_top(fetch, interval_s=0.01, console=Console(file=out, width=120), iterations=2)
    assert len(calls) == 2
    drawn = out.getvalue()
    assert "w0" in drawn and "w1" in drawn and "globex" in drawn


def test_two_front_doors_sending_a_burst_of_one_prefix_at_once_use_both_workers(owner, attached):
    # A cold prefix (a tenant nothing else uses), four requests from each front door, all
    # sent at once: neither door has the other's requests in flight, and the workers'
    # heartbeats have not told of them yet; the service weighs each door's routed
    # requests when it routes the other's.
    prefix = list(range(100, 164))  # four pages
    doors = [owner, attached]
    together = threading.Barrier(8)
    workers: list[str] = []
    lock = threading.Lock()

    def send(i: int) -> None:
        together.wait(timeout=30)
        result = doors[i % 2].generate(prefix + [170 + i], 16, tenant="burst", ignore_eos=True)
        with lock:
            workers.append(result.stats["worker"])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(workers) == 8
    assert set(workers) == {"w0", "w1"}, workers
    assert owner.dispatcher.door != attached.dispatcher.door
    owner.check_integrity()


def test_an_attached_front_door_loads_its_tokenizer_once_however_many_threads_ask(
    attached, monkeypatch
):
    # As a front door of a real model's mesh: the first requests of several client
    # threads all want the tokenizer at once.
    loads: list[str] = []

    def slow_tokenizer(name: str) -> object:
        loads.append(name)
        time.sleep(0.2)
        return object()

    monkeypatch.setattr("cluster.mesh.model_tokenizer", slow_tokenizer)
    monkeypatch.setattr(
        attached, "config", dataclasses.replace(attached.config, model=ModelConfig())
    )
    together = threading.Barrier(6)
    got: list[object] = []

    def ask() -> None:
        together.wait(timeout=30)
        got.append(attached.tokenizer)

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert loads == ["smollm2-135m"]
    assert len(got) == 6 and all(one is got[0] for one in got)


def test_integrity_after_use(owner):
    owner.check_integrity()


def test_a_lost_worker_is_refused(owner):
    # This test and the next one kill a worker and stop the module's mesh: keep them last.
    ray.kill(ray.get_actor("kvmesh-worker-w1", namespace=RAY_NAMESPACE), no_restart=True)
    wait_until(lambda: "kvmesh-worker-w1" not in kvmesh_actor_names(), 15, "w1's name released")

    log = io.StringIO()
    with pytest.raises(MeshError) as lost:
        cluster.connect(log=log)
    assert str(lost.value) == (
        "the mesh in this Ray cluster has lost workers w1 (of w0, w1); stop it with "
        "`kvmesh down` and start it again"
    )
    assert "attached" not in log.getvalue()
    assert ray.is_initialized()
    assert kvmesh_actor_names() == ["kvmesh-service", "kvmesh-worker-w0"]

    # The owner reports the loss and still serves on the worker it has left.
    stats = owner.stats()
    assert stats["workers"]["w1"]["alive"] is False
    assert "killed by `ray.kill`" in stats["workers"]["w1"]["error"]
    assert stats["workers"]["w0"]["alive"] is True
    node_id, address = this_node()
    assert stats["nodes"] == {node_id: {"address": address, "workers": ["w0"]}}
    assert stats["pages"]["total"] == 64
    assert "not alive" in render(top_view(stats))
    assert owner.generate(PROMPT, 1, tenant="acme", worker="w0").stats["local_hit_tokens"] == 47


def test_the_owner_still_stops_everything(started):
    owner, stores = started
    assert [name.rsplit("-", 1)[1] for name in stores] == ["w0", "w1"]
    # The live w0's store is there; the killed w1's may already be gone, reclaimed by
    # w0's housekeeping (a worker unlinks the segments of dead workers on its node).
    assert (Path(SHM_DIR) / stores[0]).exists()

    owner.stop()
    owner.stop()  # idempotent
    wait_until(lambda: not kvmesh_actor_names(), 15, "the kvmesh actors to go")
    assert ray.is_initialized()
    with pytest.raises(RuntimeError, match="mesh is shut down"):
        owner.generate(PROMPT, 1, worker="w0")
    # Both page stores are gone: the live w0's unlinked by w0 as it shut down, the killed
    # w1's reclaimed by w0's housekeeping or by `stop`.
    deadline = time.monotonic() + 10.0
    while (left := [n for n in stores if (Path(SHM_DIR) / n).exists()]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert left == []
