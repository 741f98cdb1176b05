"""`kvmesh bench ttft`: time to first token with the real model, cold, local and remote.

A 1,024-token shared prefix and 64-token suffixes, on two simulated Ray nodes and three
workers, through the front door: `near` and `asker` share a node, `far` is alone on the
other. Each round uses a fresh tenant, so nothing carries over between rounds:

- cold:    near, prefix + suffix A, nothing cached;
- local:   near, prefix + suffix B, the prefix in near's own cache;
- remote:  far, prefix + suffix C, the prefix copied from near over its page server;
- several: asker, prefix + suffix D, the prefix held by near (same node: shared memory)
           and far (its page server), copied from both at once.

`suffix_only_s` is the model's own time for the 64-token suffix with the prefix already
in its cache (the forward pass of the local run). Medians over the rounds.

What the spot checks cost a remote hit (`workers.transfer.spot_check`), side by side in
each round: two more prefixes (fresh tenants) near computes and far copies, one with
far's copies always checked and one with none checked, in alternating order. The figures
above run at the configured rate (`workers.spot_check_rate`); `spot_check_cost` is what
one check adds to a remote hit's TTFT, `spot_check_cost_at_rate` that times the rate (a
holder's first copy is always checked: the first round's remote hit above is one).
A local hit copies nothing and checks nothing.
"""

from __future__ import annotations

import random
import statistics
import sys

import ray
from ray.cluster_utils import Cluster

import cluster
from cluster.config import WorkersConfig, config_from_dict

RATE = WorkersConfig().spot_check_rate  # the configured default
PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 64
ROUNDS = 5


def _tokens(rng: random.Random, n: int) -> list[int]:
    # Ordinary vocabulary ids (SmolLM2's specials sit at the start of its vocabulary).
    return [rng.randrange(1000, 40_000) for _ in range(n)]


def _roles(mesh) -> tuple[str, str, str]:
    """(near, asker, far): near and asker share a node, far is alone on the other."""
    by_node: dict[str, list[str]] = {}
    for info in ray.get([w.info.remote() for w in mesh.workers.values()]):
        by_node.setdefault(info.node_id, []).append(info.worker_id)
    pairs = [sorted(ids) for ids in by_node.values() if len(ids) == 2]
    alone = [ids[0] for ids in by_node.values() if len(ids) == 1]
    if len(pairs) != 1 or len(alone) != 1:
        raise RuntimeError(f"the workers were not spread 2 + 1 over the nodes: {by_node}")
    return pairs[0][0], pairs[0][1], alone[0]


def _copy_bytes(mesh, worker: str) -> dict[str, int]:
    return ray.get(mesh.workers[worker].stats.remote()).copy_bytes


def _set_spot_check_rate(worker, rate: float) -> None:
    """In a worker's process: check copies at `rate` from now on."""
    worker.member.spot_checks.rate = rate


def _checked_and_not(mesh, near: str, far: str, rng: random.Random, round_: int):
    """(TTFT of a remote hit whose copy far checks, of one it does not), in one round."""
    times = {}
    order = (1.0, 0.0) if round_ % 2 == 0 else (0.0, 1.0)
    for rate in order:
        tenant = f"bench-check-{rate}-{round_}"
        prefix = _tokens(rng, PREFIX_TOKENS)
        mesh.generate(prefix + _tokens(rng, SUFFIX_TOKENS), 1, tenant=tenant, worker=near)
        mesh.flush()
        ray.get(mesh.workers[far].__ray_call__.remote(_set_spot_check_rate, rate))
        copied = mesh.generate(prefix + _tokens(rng, SUFFIX_TOKENS), 1, tenant=tenant, worker=far)
        assert copied.stats["remote_hit_tokens"] == PREFIX_TOKENS
        times[rate] = copied.stats["ttft_s"]
    ray.get(mesh.workers[far].__ray_call__.remote(_set_spot_check_rate, RATE))
    return times[1.0], times[0.0]


def run(log=sys.stderr) -> dict[str, float]:
    """Run the benchmark; returns the named figures (also the JSON line of the CLI)."""
    sim = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    sim.add_node(num_cpus=1)
    sim.wait_for_nodes()
    cfg = config_from_dict(
        {
            "cache": {"page_tokens": 16},
            "store": {"num_pages": 512},
            "workers": {"count": 3, "threads": 1},
        }
    )
    mesh = cluster.connect(cfg, address=sim.address, log=log)
    try:
        near, asker, far = _roles(mesh)
        rng = random.Random(0)
        cold, local, remote, suffix_only, copy = [], [], [], [], []
        several, several_copy = [], []
        checked, unchecked = [], []
        shares = {"same_node": 0, "remote": 0}  # bytes the asker copied, by kind
        for round_ in range(ROUNDS):
            print(f"round {round_ + 1}/{ROUNDS}...", file=log)
            tenant = f"bench-{round_}"
            prefix = _tokens(rng, PREFIX_TOKENS)
            a, b, c, d = (_tokens(rng, SUFFIX_TOKENS) for _ in range(4))
            first = mesh.generate(prefix + a, 1, tenant=tenant, worker=near)
            mesh.flush()  # near's pages in the index before far asks for them
            assert first.stats["computed_tokens"] == PREFIX_TOKENS + SUFFIX_TOKENS
            hit = mesh.generate(prefix + b, 1, tenant=tenant, worker=near)
            assert hit.stats["local_hit_tokens"] == PREFIX_TOKENS
            copied = mesh.generate(prefix + c, 1, tenant=tenant, worker=far)
            assert copied.stats["remote_hit_tokens"] == PREFIX_TOKENS
            mesh.flush()  # far holds the prefix too now
            before = _copy_bytes(mesh, asker)
            both = mesh.generate(prefix + d, 1, tenant=tenant, worker=asker)
            assert both.stats["remote_hit_tokens"] == PREFIX_TOKENS
            after = _copy_bytes(mesh, asker)
            for kind in shares:
                shares[kind] += after.get(kind, 0) - before.get(kind, 0)
            several.append(both.stats["ttft_s"])
            several_copy.append(both.stats["copy_s"])
            cold.append(first.stats["ttft_s"])
            local.append(hit.stats["ttft_s"])
            remote.append(copied.stats["ttft_s"])
            suffix_only.append(hit.stats["prefill_forward_s"])
            copy.append(copied.stats["copy_s"])
            with_check, without = _checked_and_not(mesh, near, far, rng, round_)
            checked.append(with_check)
            unchecked.append(without)
        checks = ray.get(mesh.workers[far].stats.remote()).trust
        mesh.check_integrity()
    finally:
        mesh.shutdown()
        ray.shutdown()
        sim.shutdown()
    cold_s, local_s = statistics.median(cold), statistics.median(local)
    remote_s, suffix_s = statistics.median(remote), statistics.median(suffix_only)
    several_s = statistics.median(several)
    cost = statistics.median(c / u for c, u in zip(checked, unchecked, strict=True)) - 1
    return {
        "prefix_tokens": PREFIX_TOKENS,
        "suffix_tokens": SUFFIX_TOKENS,
        "rounds": ROUNDS,
        "ttft_cold_s": round(cold_s, 4),
        "ttft_local_s": round(local_s, 4),
        "ttft_remote_s": round(remote_s, 4),
        "suffix_only_s": round(suffix_s, 4),
        "ttft_several_s": round(several_s, 4),
        "remote_copy_s": round(statistics.median(copy), 4),
        "several_copy_s": round(statistics.median(several_copy), 4),
        # of the bytes the asker copied in the several rounds: near's share (shared memory)
        # and far's (its page server)
        "several_same_node_bytes": shares["same_node"],
        "several_remote_bytes": shares["remote"],
        "local_vs_suffix_only": round(local_s / suffix_s, 3),
        "remote_vs_local": round(remote_s / local_s, 3),
        "several_vs_local": round(several_s / local_s, 3),
        "speedup_local": round(cold_s / local_s, 2),
        "spot_check_rate": RATE,
        "ttft_remote_checked_s": round(statistics.median(checked), 4),
        "ttft_remote_unchecked_s": round(statistics.median(unchecked), 4),
        # per round, checked over unchecked, then the median: one check's share of a hit
        "spot_check_cost": round(cost, 4),
        "spot_check_cost_at_rate": round(cost * RATE, 4),
        "far_spot_checks": checks["checks"],
        "far_spot_check_failures": checks["failures"],
    }
