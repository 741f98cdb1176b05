"""`kvmesh bench local`: the local prefix cache against an allocator that shares nothing.

Workload: 64 requests of 2,048 tokens sharing a 1,536-token system prompt (16-token
pages), issued one by one and again as one batch, on the real prefix cache over a real
shared-memory page store. The store's pages are tiny (one layer, one head, head dim 8):
this benchmark measures page accounting and trie work, not KV bytes.

The warm requests are timed twice: on a store with room for every suffix
(`us_per_request`), and on a store of exactly one request's pages (`us_per_request_evicting`),
where the system prompt stays cached and every request evicts the suffix before it: the
steady state of a worker whose cache is full.
"""

from __future__ import annotations

import random
import sys
import time

from cache_service.events import Namespace
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.store.page_store import SharedPageStore, StoreLayout

PAGE_TOKENS = 16
REQUESTS = 64
PROMPT_TOKENS = 2048
PREFIX_TOKENS = 1536
TIMED_REQUESTS = 256
VOCAB = 49_152  # SmolLM2's vocabulary size
NAMESPACE = Namespace("bench-local")


def make_prompts(count: int, suffix_seed: int) -> list[list[int]]:
    """`count` prompts: one shared system prompt, then a distinct suffix each."""
    prefix_rng, rng = random.Random(0), random.Random(suffix_seed)
    prefix = [prefix_rng.randrange(VOCAB) for _ in range(PREFIX_TOKENS)]
    suffix = PROMPT_TOKENS - PREFIX_TOKENS
    return [prefix + [rng.randrange(VOCAB) for _ in range(suffix)] for _ in range(count)]


def _store(num_pages: int, tag: str) -> SharedPageStore:
    layout = StoreLayout(
        num_pages, num_layers=1, num_kv_heads=1, page_tokens=PAGE_TOKENS, head_dim=8
    )
    return SharedPageStore.create(layout, tag=tag)


def _run_shared(cache: PrefixCache, prompts: list[list[int]]) -> None:
    for prompt in prompts:
        allocation = cache.acquire(prompt, NAMESPACE)
        assert allocation is not None, "store too small for the benchmark"
        allocation.publish(len(prompt))
        allocation.release()


def _run_base(store: SharedPageStore, prompts: list[list[int]]) -> int:
    """The base allocator: every request gets its own pages, nothing is shared."""
    allocated = 0
    for prompt in prompts:
        pages = store.allocate(-(-len(prompt) // PAGE_TOKENS))
        assert pages is not None, "store too small for the benchmark"
        allocated += len(pages)
        store.free(pages)
    return allocated


def _timed(fn, prompts: list[list[int]]) -> float:
    start = time.perf_counter()
    fn(prompts)
    return (time.perf_counter() - start) / len(prompts) * 1e6


def run(log=sys.stderr) -> dict[str, float]:
    """Run the benchmark; returns the named figures (also the JSON line of the CLI)."""
    prompts = make_prompts(REQUESTS, suffix_seed=1)
    pages_per_request = PROMPT_TOKENS // PAGE_TOKENS
    num_pages = REQUESTS * pages_per_request + 64
    with _store(num_pages, "bench") as store, _store(pages_per_request, "bench_base") as base_store:
        cache = PrefixCache(store, PrefixCacheConfig(page_tokens=PAGE_TOKENS))
        print(f"one by one: {REQUESTS} requests of {PROMPT_TOKENS} tokens...", file=log)
        _run_shared(cache, prompts)
        shared_pages = cache.stats()["allocated_pages"]
        base_pages = _run_base(base_store, prompts)

        # Warm cache: the system prompt is cached, every suffix is new (once the store
        # fills up, old suffixes are evicted: the steady state of a busy worker).
        timed = make_prompts(TIMED_REQUESTS, suffix_seed=2)
        print(f"timing {TIMED_REQUESTS} requests on a warm cache...", file=log)
        before = cache.stats()
        us_per_request = _timed(lambda ps: _run_shared(cache, ps), timed)
        base_us = _timed(lambda ps: _run_base(base_store, ps), timed)
        after = cache.stats()
        hits = after["hit_tokens"] - before["hit_tokens"]
        hit_rate = hits / (after["queried_tokens"] - before["queried_tokens"])
        cache.check_integrity()

    with _store(pages_per_request, "bench_evict") as store:
        cache = PrefixCache(store, PrefixCacheConfig(page_tokens=PAGE_TOKENS))
        _run_shared(cache, prompts[:1])  # the system prompt cached, the store full
        print(f"timing {TIMED_REQUESTS} requests on a full cache (each one evicts)...", file=log)
        before = cache.stats()["evictions"].get("evicted", 0)
        us_evicting = _timed(lambda ps: _run_shared(cache, ps), timed)
        evicted = cache.stats()["evictions"].get("evicted", 0) - before
        suffix_pages = (PROMPT_TOKENS - PREFIX_TOKENS) // PAGE_TOKENS
        assert evicted == TIMED_REQUESTS * suffix_pages, (
            f"{evicted} pages evicted by {TIMED_REQUESTS} requests, expected {suffix_pages} each"
        )
        cache.check_integrity()

    with _store(num_pages, "bench_batch") as store:
        cache = PrefixCache(store, PrefixCacheConfig(page_tokens=PAGE_TOKENS))
        print(f"one batch of {REQUESTS} requests...", file=log)
        start = time.perf_counter()
        plan = cache.acquire_batch(prompts, NAMESPACE)
        batch_us = (time.perf_counter() - start) * 1e6
        assert plan is not None, "store too small for the batch"
        computed = sum(len(p) - entry.compute_from for p, entry in zip(prompts, plan, strict=True))
        batch_pages = cache.stats()["allocated_pages"]
        for prompt, entry in zip(prompts, plan, strict=True):
            entry.allocation.publish(len(prompt))
        for entry in plan:
            entry.allocation.release()
        cache.check_integrity()

    shared_fraction = PREFIX_TOKENS / PROMPT_TOKENS
    return {
        "requests": REQUESTS,
        "prompt_tokens": PROMPT_TOKENS,
        "page_tokens": PAGE_TOKENS,
        "pages_shared": shared_pages,
        "pages_base": base_pages,
        "pages_ratio": round(shared_pages / base_pages, 4),
        "pages_ratio_ideal": round(1 - shared_fraction + shared_fraction / REQUESTS, 4),
        "batch_pages_ratio": round(batch_pages / base_pages, 4),
        "batch_computed_ratio": round(computed / (REQUESTS * PROMPT_TOKENS), 4),
        "batch_plan_us": round(batch_us, 1),
        "us_per_request": round(us_per_request, 1),
        "us_per_request_evicting": round(us_evicting, 1),
        "base_us_per_request": round(base_us, 1),
        "warm_hit_rate": round(hit_rate, 4),
    }
