"""Where the workers run: one placement-group bundle per worker, spread over the nodes.

Each worker reserves real resources (`workers.num_cpus`, and one GPU on GPU clusters)
through a placement group with the SPREAD strategy: Ray places the bundles on as many
distinct nodes as it can, and the resources stay reserved while the mesh runs, so other
Ray work cannot crowd a worker out of its CPU slot.

A start that can never be placed (the cluster's nodes, even empty, do not fit the
bundles) fails at once with what is missing; one that could be placed but is not within
`workers.placement_timeout_s` (the resources are taken by other work) fails then, and
either way the placement group is removed: nothing is left reserved.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import ray
from ray.util import placement_group, placement_group_table, remove_placement_group

from cluster.config import WorkersConfig
from cluster.errors import PlacementError

PLACEMENT_GROUP_NAME = "kvmesh-workers"
STRATEGY = "SPREAD"


class NodeResources(NamedTuple):
    node_id: str
    address: str
    resources: Mapping[str, float]  # the node's totals, as Ray reports them


def worker_bundle(workers: WorkersConfig, cluster_gpus: float) -> dict[str, float]:
    """The resources one worker reserves: `num_cpus`, and `num_gpus` (auto: one GPU per
    worker when the cluster has GPUs, none otherwise)."""
    gpus = workers.num_gpus
    if gpus is None:
        gpus = 1.0 if cluster_gpus > 0 else 0.0
    bundle = {"CPU": float(workers.num_cpus)}
    if gpus > 0:
        bundle["GPU"] = float(gpus)
    return bundle


def fits_on(bundle: Mapping[str, float], resources: Mapping[str, float]) -> int:
    """How many bundles one node holds when empty."""
    counts = [
        math.floor(resources.get(name, 0.0) / need + 1e-9)
        for name, need in bundle.items()
        if need > 0
    ]
    return min(counts) if counts else 0


def check_fits(bundle: Mapping[str, float], count: int, nodes: Sequence[NodeResources]) -> None:
    """Raise PlacementError unless `count` bundles fit on the nodes' total resources.

    SPREAD is a preference, not a constraint, so bundles may share a node: the workers
    fit when the per-node capacities add up to `count`.
    """
    capacity = {node.node_id: fits_on(bundle, node.resources) for node in nodes}
    if sum(capacity.values()) >= count:
        return
    short = count - sum(capacity.values())
    missing = ", ".join(f"{name} {need * short:g}" for name, need in bundle.items())
    per_node = "; ".join(
        f"node {node.node_id[:8]} ({node.address}): "
        + ", ".join(f"{name} {node.resources.get(name, 0.0):g}" for name in bundle)
        + f" -> {capacity[node.node_id]} worker(s)"
        for node in nodes
    )
    raise PlacementError(
        f"cannot place {count} workers of {_describe(bundle)} each: the cluster holds "
        f"{count - short} ({per_node or 'no live nodes'}); missing {missing} for "
        f"{short} more worker(s). Lower workers.count or workers.num_cpus, or add nodes."
    )


def live_nodes() -> list[NodeResources]:
    """The cluster's live nodes, head first, then by id (a deterministic order)."""
    alive = [n for n in ray.nodes() if n["Alive"]]
    alive.sort(key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeID"]))
    return [NodeResources(n["NodeID"], n["NodeManagerAddress"], n["Resources"]) for n in alive]


def reserve(workers: WorkersConfig, detached: bool, log) -> Any:
    """Create the workers' placement group and wait until every bundle is placed.

    Args:
        workers: the workers' section (count, num_cpus, num_gpus, placement_timeout_s).
        detached: the group outlives this driver (for `kvmesh up`).
        log: where progress goes.
    Returns:
        The ready PlacementGroup; bundle i is worker i's.
    Raises:
        PlacementError: the bundles cannot be placed (nothing is left reserved).
    """
    nodes = live_nodes()
    cluster_gpus = sum(node.resources.get("GPU", 0.0) for node in nodes)
    bundle = worker_bundle(workers, cluster_gpus)
    check_fits(bundle, workers.count, nodes)
    group = placement_group(
        [dict(bundle) for _ in range(workers.count)],
        strategy=STRATEGY,
        name=PLACEMENT_GROUP_NAME,
        lifetime="detached" if detached else None,
    )
    start = time.monotonic()
    deadline = start + workers.placement_timeout_s
    while not group.wait(timeout_seconds=min(5.0, max(0.1, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            state = placement_group_table(group).get("stats", {}).get("scheduling_state", "?")
            remove_placement_group(group)
            free = ray.available_resources()
            raise PlacementError(
                f"{workers.count} workers of {_describe(bundle)} were not placed within "
                f"{workers.placement_timeout_s:g}s (Ray: {state}); free now: "
                + ", ".join(f"{name} {free.get(name, 0.0):g}" for name in bundle)
                + ". Other work holds the resources; free them or lower workers.count."
            )
        print(
            f"placing {workers.count} workers ({_describe(bundle)} each): waiting for "
            f"resources ({time.monotonic() - start:.0f}s)",
            file=log,
        )
    return group


def bundle_nodes(group: Any) -> dict[int, str]:
    """Which node each bundle of a placed group is on."""
    return dict(placement_group_table(group)["bundles_to_node_id"])


def release(group: Any) -> None:
    """Remove a placement group (its reserved resources return to the cluster)."""
    remove_placement_group(group)


def find_group() -> Any | None:
    """The mesh's placement group in this cluster, if one exists."""
    try:
        return ray.util.get_placement_group(PLACEMENT_GROUP_NAME)
    except ValueError:
        return None


def _describe(bundle: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {need:g}" for name, need in bundle.items())
