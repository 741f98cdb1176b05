"""`kvmesh bench tiers`: the disk tier under shared memory, with the real model.

Time to first token for a 1,024-token prefix (64-token suffixes, one worker, fresh tenant
each round):

- host:  the prefix in the worker's shared memory;
- disk:  the prefix only in its disk tier: every page of the worker's host memory evicted
         (written down, `write_back`), the data file's pages dropped from the page cache
         (fdatasync + POSIX_FADV_DONTNEED) so the load reads the disk, not memory;
- cold:  computed (a fresh prefix).

The disk lives under ~/.cache/kvmesh (a real filesystem; tmpfs would time memory).
Medians over the rounds; `ttft_disk_vs_cold` is the target's ratio (at most 0.5).

A worker restarted in a running mesh (SIGKILL, `workers.max_restarts`; `write_through`,
so everything it published is on disk): the share of prompt tokens of its own prompts it
reuses before the kill and after its new incarnation adopted the disk
(`hit_rate_before_restart`, `hit_rate_after_restart`). Two more prompts have a byte of
their first record flipped on disk while the worker runs; after the restart their
records must be dropped, never served: `corrupt_records_served` counts loads of a
flipped record (disk hits on those prompts' first page) and answers that differ from
the first, cold, answers.

The Mooncake conversation trace (../shared/traces) replayed through real tiers
(`benchmarks.replay_tiers`: 4 workers, kvmesh's routing, 4,000 host pages of 512 tokens
each, a small KV format so pages really move between shared memory and files), alone
(`hit_rate_host_only`) and with 32,000 disk pages each (`hit_rate_with_disk`); and
`vs_single_lru`: the host-only mesh against one LRU cache of the same 16,000 pages. The
workers evict the pages another worker has stored since first (`cache.cluster_eviction`,
the default); `vs_single_lru_local_eviction` is the same mesh with each worker evicting by
its own LRU alone.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

import cluster
from benchmarks.replay import load_trace
from benchmarks.replay_tiers import hit_rate as replay_hit_rate
from cache_service.events import Namespace
from cluster.config import config_from_dict
from workers.store.digests import page_digests

PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 64
ROUNDS = 5
RESTART_PROMPTS = 8  # each RESTART_PREFIX tokens + a suffix
CORRUPT_PROMPTS = 2
RESTART_PREFIX = 512
RESTART_TIMEOUT_S = 300.0
# The conversation trace beside the repository ($KVMESH_TRACE names another).
TRACE = Path(
    os.environ.get("KVMESH_TRACE")
    or Path(__file__).resolve().parents[2] / "shared/traces/mooncake_conversation_trace.jsonl"
)
REPLAY_HOST_PAGES = 4000  # per worker, 512-token pages
REPLAY_DISK_PAGES = 32_000


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40_000) for _ in range(n)]


def _config(directory: Path, num_pages: int, policy: str, max_restarts: int = 0):
    return config_from_dict(
        {
            "cache": {"page_tokens": 16},
            "store": {
                "num_pages": num_pages,
                "disk": {
                    "enabled": True,
                    "path": str(directory),
                    "pages": 1024,
                    "policy": policy,
                },
            },
            "workers": {"count": 1, "threads": 1, "max_restarts": max_restarts},
        }
    )


# -- run inside the worker's process (`__ray_call__`) ------------------------------------


def _demote_everything(actor) -> int:
    """Evict every unreferenced host page (down to the disk) and drop the disk file's
    pages from the page cache; returns the pages demoted."""
    member = actor.member
    before = member.disk.demotions
    member.cache.evict(member.store.num_pages)
    member.flush()
    member.disk.disk.drop_page_cache()
    return member.disk.demotions - before


def _first_record(actor, tokens: list[int], salt: str) -> tuple[str, int]:
    """(data file, byte offset) of the body of the first page of `tokens` on the disk."""
    member = actor.member
    namespace = Namespace(actor.model_name, "", salt)
    p = member.store.layout.page_tokens
    digest = page_digests(namespace, member.store.kv_format, tokens, p)[0]
    record = member.disk.disk.lookup(digest)
    assert record is not None, "the prompt's first page is not on disk"
    return str(member.disk.disk.data_path), member.disk.disk.body_offset(record.slot)


def _disk_stats(actor) -> dict:
    return actor.member.disk.stats()


# -- the parts ---------------------------------------------------------------------------


def _ttft(directory: Path, log) -> dict[str, float]:
    mesh = cluster.connect(_config(directory, 192, "write_back"), log=log)
    try:
        (worker_id,) = mesh.workers
        handle = mesh.workers[worker_id]
        rng = random.Random(0)
        host, disk, cold, loads = [], [], [], []
        for round_ in range(ROUNDS):
            print(f"ttft round {round_ + 1}/{ROUNDS}...", file=log)
            tenant = f"tiers-{round_}"
            prefix = _tokens(rng, PREFIX_TOKENS)
            a, b, c = (_tokens(rng, SUFFIX_TOKENS) for _ in range(3))
            first = mesh.generate(prefix + a, 1, tenant=tenant)
            assert first.stats["computed_tokens"] == PREFIX_TOKENS + SUFFIX_TOKENS
            hit = mesh.generate(prefix + b, 1, tenant=tenant)
            assert hit.stats["local_hit_tokens"] >= PREFIX_TOKENS
            demoted = ray.get(handle.__ray_call__.remote(_demote_everything))
            assert demoted >= PREFIX_TOKENS // 16, f"only {demoted} pages went to disk"
            loaded = mesh.generate(prefix + c, 1, tenant=tenant)
            cold.append(first.stats["ttft_s"])
            host.append(hit.stats["ttft_s"])
            disk.append(loaded.stats["ttft_s"])
            loads.append(loaded.stats["disk_hit_tokens"])
        stats = ray.get(handle.__ray_call__.remote(_disk_stats))
        mesh.check_integrity()
    finally:
        mesh.shutdown()
    host_s, disk_s, cold_s = (statistics.median(x) for x in (host, disk, cold))
    return {
        "prefix_tokens": PREFIX_TOKENS,
        "rounds": ROUNDS,
        "ttft_host_s": round(host_s, 4),
        "ttft_disk_s": round(disk_s, 4),
        "ttft_cold_s": round(cold_s, 4),
        "ttft_disk_vs_cold": round(disk_s / cold_s, 3),
        "ttft_disk_vs_host": round(disk_s / host_s, 3),
        "disk_hit_tokens_min": min(loads),
        "disk_read_bytes_per_s": round(stats["read_bytes_per_s"]),
    }


def _wait_restarted(mesh, worker_id: str, old_pid: int, log) -> None:
    handle = mesh.workers[worker_id]
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            back = ray.get(handle.process.remote(), timeout=10)[1] != old_pid
        except Exception:  # restarting: Ray answers with errors until it is back
            back = False
        if back and worker_id in mesh.live_workers():  # and the front door took it back
            return
        time.sleep(1.0)
    raise TimeoutError(f"{worker_id} did not come back within {RESTART_TIMEOUT_S:.0f} s")


def _hit_rate(results) -> float:
    hits = sum(r.stats["local_hit_tokens"] + r.stats["remote_hit_tokens"] for r in results)
    return hits / sum(r.stats["prompt_tokens"] for r in results)


def _restart(directory: Path, log) -> dict[str, float]:
    mesh = cluster.connect(_config(directory, 512, "write_through", max_restarts=1), log=log)
    try:
        (worker_id,) = mesh.workers
        handle = mesh.workers[worker_id]
        rng = random.Random(1)
        prompts = [_tokens(rng, RESTART_PREFIX) for _ in range(RESTART_PROMPTS + CORRUPT_PROMPTS)]
        tenant = "tiers-restart"
        print("restart: computing the prompts...", file=log)
        suffix = [_tokens(rng, 16) for _ in prompts]
        first = [
            mesh.generate(p + s, 4, tenant=tenant) for p, s in zip(prompts, suffix, strict=True)
        ]
        clean, flipped = prompts[:RESTART_PROMPTS], prompts[RESTART_PROMPTS:]
        before = [mesh.generate(p + _tokens(rng, 16), 1, tenant=tenant) for p in clean]
        salt = mesh.salt(tenant)
        for prompt in flipped:
            path, offset = ray.get(handle.__ray_call__.remote(_first_record, prompt, salt))
            with open(path, "r+b") as f:
                f.seek(offset + 100)
                byte = f.read(1)
                f.seek(offset + 100)
                f.write(bytes([byte[0] ^ 0xFF]))
        _, pid = ray.get(handle.process.remote())
        print("restart: killing the worker...", file=log)
        os.kill(pid, signal.SIGKILL)
        _wait_restarted(mesh, worker_id, pid, log)
        after = [mesh.generate(p + _tokens(rng, 16), 1, tenant=tenant) for p in clean]
        again = [
            mesh.generate(p + s, 4, tenant=tenant)
            for p, s in zip(flipped, suffix[RESTART_PROMPTS:], strict=True)
        ]
        stats = ray.get(handle.__ray_call__.remote(_disk_stats))
        mesh.check_integrity()
    finally:
        mesh.shutdown()
    served = sum(
        r.stats["disk_hit_tokens"] > 0 or r.token_ids != f.token_ids
        for r, f in zip(again, first[RESTART_PROMPTS:], strict=True)
    )
    return {
        "restart_policy": "write_through",
        "hit_rate_before_restart": round(_hit_rate(before), 4),
        "hit_rate_after_restart": round(_hit_rate(after), 4),
        "records_adopted": stats["adopted"],
        "records_dropped": stats["dropped"],
        "corrupt_records_served": served,
    }


def _replay(log) -> dict[str, float]:
    """The conversation trace through real tiers (`benchmarks.replay_tiers`)."""
    if not TRACE.is_file():
        print(f"replay: no trace at {TRACE} (set KVMESH_TRACE): not replayed", file=log)
        return {"replay_trace": f"not found: {TRACE}"}
    requests = load_trace(TRACE)
    print(f"replay: {len(requests)} requests, 4 x {REPLAY_HOST_PAGES} host pages...", file=log)
    host_only = replay_hit_rate(requests, 4, REPLAY_HOST_PAGES)
    print(f"replay: with {REPLAY_DISK_PAGES} disk pages each...", file=log)
    with_disk = replay_hit_rate(requests, 4, REPLAY_HOST_PAGES, REPLAY_DISK_PAGES)
    print("replay: host only, each worker evicting by its own LRU alone...", file=log)
    local_only = replay_hit_rate(requests, 4, REPLAY_HOST_PAGES, cluster_eviction=False)
    print(f"replay: one LRU cache of {4 * REPLAY_HOST_PAGES} pages...", file=log)
    single = replay_hit_rate(requests, 1, 4 * REPLAY_HOST_PAGES, routing="round-robin")
    return {
        "replay_requests": len(requests),
        "hit_rate_host_only": round(host_only, 4),
        "hit_rate_with_disk": round(with_disk, 4),
        "with_disk_vs_host_only": round(with_disk / host_only, 3),
        "hit_rate_single_lru": round(single, 4),
        "vs_single_lru": round(host_only / single, 3),
        "hit_rate_local_eviction": round(local_only, 4),
        "vs_single_lru_local_eviction": round(local_only / single, 3),
    }


def run(log=sys.stderr) -> dict[str, float]:
    """Run the benchmark; returns the named figures (also the JSON line of the CLI)."""
    root = Path.home() / ".cache" / "kvmesh"
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=root))
    try:
        figures = _ttft(scratch / "ttft", log)
        figures |= _restart(scratch / "restart", log)
        figures |= _replay(log)
    finally:
        ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
    return figures
