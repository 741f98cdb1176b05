"""`kvmesh bench ttft`: time to first token with the real model, cold, local and remote.

A 1,024-token shared prefix and 64-token suffixes, on two simulated Ray nodes with one
worker each (w0 on the head node, w1 on the other), through the front door. Each round
uses a fresh tenant, so nothing carries over between rounds:

- cold:   w0, prefix + suffix A, nothing cached;
- local:  w0, prefix + suffix B, the prefix in w0's own cache;
- remote: w1, prefix + suffix C, the prefix copied from w0 over its page server.

`suffix_only_s` is the model's own time for the 64-token suffix with the prefix already
in its cache (the forward pass of the local run). Medians over the rounds.
"""

from __future__ import annotations

import random
import statistics
import sys

import ray
from ray.cluster_utils import Cluster

import cluster
from cluster.config import config_from_dict

PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 64
ROUNDS = 5


def _tokens(rng: random.Random, n: int) -> list[int]:
    # Ordinary vocabulary ids (SmolLM2's specials sit at the start of its vocabulary).
    return [rng.randrange(1000, 40_000) for _ in range(n)]


def run(log=sys.stderr) -> dict[str, float]:
    """Run the benchmark; returns the named figures (also the JSON line of the CLI)."""
    sim = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    sim.add_node(num_cpus=1)
    sim.wait_for_nodes()
    cfg = config_from_dict(
        {
            "cache": {"page_tokens": 16},
            "store": {"num_pages": 512},
            "workers": {"count": 2, "threads": 1},
        }
    )
    mesh = cluster.connect(cfg, address=sim.address, log=log)
    try:
        rng = random.Random(0)
        cold, local, remote, suffix_only, copy = [], [], [], [], []
        for round_ in range(ROUNDS):
            print(f"round {round_ + 1}/{ROUNDS}...", file=log)
            tenant = f"bench-{round_}"
            prefix = _tokens(rng, PREFIX_TOKENS)
            a, b, c = (_tokens(rng, SUFFIX_TOKENS) for _ in range(3))
            first = mesh.generate(prefix + a, 1, tenant=tenant, worker="w0")
            mesh.flush()  # w0's pages in the index before w1 asks for them
            assert first.stats["computed_tokens"] == PREFIX_TOKENS + SUFFIX_TOKENS
            hit = mesh.generate(prefix + b, 1, tenant=tenant, worker="w0")
            assert hit.stats["local_hit_tokens"] == PREFIX_TOKENS
            copied = mesh.generate(prefix + c, 1, tenant=tenant, worker="w1")
            assert copied.stats["remote_hit_tokens"] == PREFIX_TOKENS
            cold.append(first.stats["ttft_s"])
            local.append(hit.stats["ttft_s"])
            remote.append(copied.stats["ttft_s"])
            suffix_only.append(hit.stats["prefill_forward_s"])
            copy.append(copied.stats["copy_s"])
        mesh.check_integrity()
    finally:
        mesh.shutdown()
        ray.shutdown()
        sim.shutdown()
    cold_s, local_s = statistics.median(cold), statistics.median(local)
    remote_s, suffix_s = statistics.median(remote), statistics.median(suffix_only)
    return {
        "prefix_tokens": PREFIX_TOKENS,
        "suffix_tokens": SUFFIX_TOKENS,
        "rounds": ROUNDS,
        "ttft_cold_s": round(cold_s, 4),
        "ttft_local_s": round(local_s, 4),
        "ttft_remote_s": round(remote_s, 4),
        "suffix_only_s": round(suffix_s, 4),
        "remote_copy_s": round(statistics.median(copy), 4),
        "local_vs_suffix_only": round(local_s / suffix_s, 3),
        "remote_vs_local": round(remote_s / local_s, 3),
        "speedup_local": round(cold_s / local_s, 2),
    }
