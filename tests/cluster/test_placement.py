"""Where the workers run: the bundle each reserves, whether the bundles fit, and what a
start that cannot be placed leaves behind (nothing).

The pure functions are checked without Ray; the rest on the embedded 2-CPU Ray, where
two workers of one CPU fit exactly and a third never does.
"""

from __future__ import annotations

import io
import time

import pytest
import ray

import cluster
from cluster.config import WorkersConfig, config_from_dict
from cluster.errors import KvmeshError, PlacementError
from cluster.placement import (
    PLACEMENT_GROUP_NAME,
    NodeResources,
    bundle_nodes,
    check_fits,
    find_group,
    fits_on,
    worker_bundle,
)

NODE_A = "a" * 8 + "1" * 48
NODE_B = "b" * 8 + "2" * 48


def tiny_config(**workers):
    return config_from_dict(
        {
            "model": {"name": "tiny"},
            "store": {"num_pages": 64},
            "workers": {"threads": 1, **workers},
        }
    )


# ---------------------------------------------------------------- worker_bundle


def test_bundle_takes_one_gpu_when_the_cluster_has_gpus():
    assert worker_bundle(WorkersConfig(), cluster_gpus=4) == {"CPU": 1.0, "GPU": 1.0}
    assert worker_bundle(WorkersConfig(), cluster_gpus=0.5) == {"CPU": 1.0, "GPU": 1.0}


def test_bundle_takes_no_gpu_on_a_cpu_cluster():
    bundle = worker_bundle(WorkersConfig(), cluster_gpus=0)
    assert bundle == {"CPU": 1.0}
    assert "GPU" not in bundle


def test_bundle_with_an_explicit_gpu_share():
    assert worker_bundle(WorkersConfig(num_gpus=0.5), cluster_gpus=2) == {"CPU": 1.0, "GPU": 0.5}
    # Explicit is explicit: the share is asked for even where Ray reports no GPU.
    assert worker_bundle(WorkersConfig(num_gpus=0.5), cluster_gpus=0) == {"CPU": 1.0, "GPU": 0.5}
    # An explicit 0 turns the automatic GPU off.
    assert worker_bundle(WorkersConfig(num_gpus=0), cluster_gpus=8) == {"CPU": 1.0}


def test_bundle_cpu_value():
    bundle = worker_bundle(WorkersConfig(num_cpus=2), cluster_gpus=0)
    assert bundle == {"CPU": 2.0}
    assert type(bundle["CPU"]) is float
    assert worker_bundle(WorkersConfig(num_cpus=0.25), cluster_gpus=0) == {"CPU": 0.25}
    assert worker_bundle(WorkersConfig(num_cpus=0, num_gpus=1), cluster_gpus=1) == {
        "CPU": 0.0,
        "GPU": 1.0,
    }


# ---------------------------------------------------------------- fits_on


def test_fits_on_counts_whole_bundles():
    assert fits_on({"CPU": 1.0}, {"CPU": 2.0}) == 2
    assert fits_on({"CPU": 1.0}, {"CPU": 2.5}) == 2
    assert fits_on({"CPU": 1.5}, {"CPU": 2.0}) == 1
    assert fits_on({"CPU": 2.0}, {"CPU": 1.0}) == 0
    assert fits_on({"CPU": 1.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 2.0}) == 2
    assert fits_on({"CPU": 4.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 4.0}) == 2  # CPU-bound
    assert fits_on({"CPU": 0.5, "GPU": 0.5}, {"CPU": 8.0, "GPU": 2.0}) == 4  # GPU-bound


def test_fits_on_tolerates_float_rounding():
    assert 0.3 / 0.1 < 3 and 0.7 / 0.1 < 7  # 2.9999999999999996, 6.999999999999999
    assert fits_on({"CPU": 0.1}, {"CPU": 0.3}) == 3
    assert fits_on({"CPU": 0.1}, {"CPU": 0.7}) == 7
    assert fits_on({"CPU": 0.2}, {"CPU": 0.6}) == 3


def test_fits_on_a_node_without_the_resource():
    assert fits_on({"CPU": 1.0, "GPU": 1.0}, {"CPU": 8.0}) == 0
    assert fits_on({"CPU": 1.0}, {"GPU": 8.0}) == 0
    assert fits_on({"CPU": 1.0}, {}) == 0


def test_fits_on_ignores_zero_needs():
    assert fits_on({"CPU": 0.0, "GPU": 1.0}, {"CPU": 8.0, "GPU": 3.0}) == 3
    assert fits_on({"CPU": 0.0, "GPU": 1.0}, {"GPU": 3.0}) == 3
    assert fits_on({}, {"CPU": 8.0}) == 0


# ---------------------------------------------------------------- check_fits


def test_check_fits_passes_when_the_capacities_add_up():
    nodes = [
        NodeResources(NODE_A, "10.0.0.1", {"CPU": 1.0}),
        NodeResources(NODE_B, "10.0.0.2", {"CPU": 1.0}),
    ]
    assert check_fits({"CPU": 1.0}, 2, nodes) is None
    assert check_fits({"CPU": 1.0}, 1, nodes) is None
    one_big = [NodeResources(NODE_A, "10.0.0.1", {"CPU": 3.0})]
    assert check_fits({"CPU": 1.0}, 3, one_big) is None  # SPREAD may share a node


def test_check_fits_names_what_is_missing():
    nodes = [
        NodeResources(NODE_A, "10.0.0.1", {"CPU": 1.0, "memory": 1e9}),
        NodeResources(NODE_B, "10.0.0.2", {"CPU": 1.0}),
    ]
    with pytest.raises(PlacementError) as refused:
        check_fits({"CPU": 1.0}, 3, nodes)
    assert isinstance(refused.value, KvmeshError)
    message = str(refused.value)
    assert "cannot place 3 workers" in message
    assert "missing CPU 1" in message
    for short_id, address in (("aaaaaaaa", "10.0.0.1"), ("bbbbbbbb", "10.0.0.2")):
        assert f"node {short_id} ({address})" in message
    assert NODE_A not in message  # short ids only
    assert message == (
        "cannot place 3 workers of CPU 1 each: the cluster holds 2 (node aaaaaaaa "
        "(10.0.0.1): CPU 1 -> 1 worker(s); node bbbbbbbb (10.0.0.2): CPU 1 -> 1 worker(s)); "
        "missing CPU 1 for 1 more worker(s). Lower workers.count or workers.num_cpus, or "
        "add nodes."
    )


def test_check_fits_counts_whole_bundles_per_node():
    # 3 CPUs in all, but one-CPU bundles cannot straddle nodes: only two fit.
    nodes = [
        NodeResources(NODE_A, "10.0.0.1", {"CPU": 1.5}),
        NodeResources(NODE_B, "10.0.0.2", {"CPU": 1.5}),
    ]
    with pytest.raises(PlacementError, match=r"the cluster holds 2 .*missing CPU 1 for 1 more"):
        check_fits({"CPU": 1.0}, 3, nodes)


def test_check_fits_with_gpus_and_no_nodes():
    nodes = [
        NodeResources(NODE_A, "10.0.0.1", {"CPU": 8.0, "GPU": 2.0}),
        NodeResources(NODE_B, "10.0.0.2", {"CPU": 8.0}),
    ]
    with pytest.raises(PlacementError) as refused:
        check_fits({"CPU": 1.0, "GPU": 1.0}, 3, nodes)
    message = str(refused.value)
    assert message.startswith("cannot place 3 workers of CPU 1, GPU 1 each: the cluster holds 2")
    assert "node aaaaaaaa (10.0.0.1): CPU 8, GPU 2 -> 2 worker(s)" in message
    assert "node bbbbbbbb (10.0.0.2): CPU 8, GPU 0 -> 0 worker(s)" in message
    assert "for 1 more worker(s)" in message

    with pytest.raises(PlacementError) as refused:
        check_fits({"CPU": 1.0}, 2, [])
    assert str(refused.value).startswith(
        "cannot place 2 workers of CPU 1 each: the cluster holds 0 (no live nodes); "
        "missing CPU 2 for 2 more worker(s)."
    )


# ---------------------------------------------------------------- on Ray


def kvmesh_actor_names() -> list[str]:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return sorted(name for name in names if name.startswith("kvmesh"))


def kvmesh_group_states() -> list[str]:
    """The states of every placement group named like the mesh's (REMOVED ones too)."""
    return [
        group["state"]
        for group in ray.util.placement_group_table().values()
        if group["name"] == PLACEMENT_GROUP_NAME
    ]


def assert_nothing_left(timeout_s: float = 10.0) -> None:
    """No kvmesh actor, no live mesh placement group, both CPUs free (removal is
    asynchronous in Ray, so wait for it to settle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        actors = kvmesh_actor_names()
        groups = [state for state in kvmesh_group_states() if state != "REMOVED"]
        cpus = ray.available_resources().get("CPU", 0.0)
        if (not actors and not groups and cpus == 2.0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert actors == []
    assert groups == []
    assert cpus == 2.0
    assert find_group() is None


@pytest.mark.slow
def test_a_mesh_that_can_never_fit_fails_at_once_and_leaves_nothing(ray_local):
    assert_nothing_left()
    node_id = ray.get_runtime_context().get_node_id()
    log = io.StringIO()
    start = time.monotonic()
    with pytest.raises(PlacementError) as refused:
        cluster.connect(tiny_config(count=3, num_cpus=1), log=log)
    elapsed = time.monotonic() - start
    assert elapsed < 5.0  # no waiting for resources that can never come
    (address,) = [n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id]
    assert str(refused.value) == (
        f"cannot place 3 workers of CPU 1 each: the cluster holds 2 (node {node_id[:8]} "
        f"({address}): CPU 2 -> 2 worker(s)); missing CPU 1 for 1 more worker(s). Lower "
        "workers.count or workers.num_cpus, or add nodes."
    )
    assert "starting the service" not in log.getvalue()
    assert ray.is_initialized()  # the process's own Ray connection is left as it was
    assert_nothing_left()


@pytest.mark.slow
def test_resources_taken_by_other_work_time_out_and_leave_nothing(ray_local):
    assert_nothing_left()
    other = ray.util.placement_group([{"CPU": 2}])
    assert other.wait(timeout_seconds=30)
    try:
        assert ray.available_resources().get("CPU", 0.0) == 0.0
        log = io.StringIO()
        start = time.monotonic()
        with pytest.raises(PlacementError) as refused:
            cluster.connect(tiny_config(count=1, num_cpus=1, placement_timeout_s=1.0), log=log)
        elapsed = time.monotonic() - start
        assert 1.0 <= elapsed < 10.0
        assert str(refused.value) == (
            "1 workers of CPU 1 were not placed within 1s (Ray: NO_RESOURCES); free now: "
            "CPU 0. Other work holds the resources; free them or lower workers.count."
        )
        assert "starting the service" not in log.getvalue()
        # The mesh's group is gone at once; ours is untouched.
        assert kvmesh_actor_names() == []
        assert [s for s in kvmesh_group_states() if s != "REMOVED"] == []
        assert ray.util.placement_group_table(other)["state"] == "CREATED"
    finally:
        ray.util.remove_placement_group(other)
    assert_nothing_left()


@pytest.mark.slow
def test_a_running_mesh_reserves_its_workers_resources(ray_local):
    assert_nothing_left()
    mesh = cluster.connect(tiny_config(count=2, num_cpus=1), log=io.StringIO())
    try:
        assert ray.available_resources().get("CPU", 0.0) == 0.0
        live = [
            group
            for group in ray.util.placement_group_table().values()
            if group["name"] == PLACEMENT_GROUP_NAME and group["state"] != "REMOVED"
        ]
        assert len(live) == 1
        (group,) = live
        assert group["state"] == "CREATED"
        assert group["strategy"] == "SPREAD"
        assert group["bundles"] == {0: {"CPU": 1.0}, 1: {"CPU": 1.0}}
        node_id = ray.get_runtime_context().get_node_id()
        assert bundle_nodes(find_group()) == {0: node_id, 1: node_id}
        # Each worker runs in its bundle, on that node.
        infos = ray.get([w.info.remote() for w in mesh.workers.values()])
        assert [info.node_id for info in infos] == [node_id, node_id]
        out = mesh.generate(list(range(3, 40)), 2, worker="w1")
        assert out.stats["computed_tokens"] == 37
        mesh.check_integrity()
    finally:
        mesh.shutdown()
    assert_nothing_left()
    assert kvmesh_group_states() != []  # there was one: it is REMOVED now
    assert set(kvmesh_group_states()) == {"REMOVED"}
