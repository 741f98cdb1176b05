"""GPU check of a worker's device tier: the prefix cache over device pages, host memory below.

`run(device, quick)` builds what a GPU worker's member builds (`workers.tier_setup`): a
prefix cache whose pages are on `device`, and a host tier below it (`HostTier`,
`HostLink`) over a host shared-memory store, with SmolLM2-135M's page layout. Then:

- prompts are served into device pages (random KV, published with their digests) and
  evicted: every page goes down (PagesDemoted to tier "host"), and each host page holds
  exactly the bytes its device page held;
- the prompts come back: `span` names their host records and `source` loads them into
  fresh device pages, validated and byte-exact; a host page rewritten behind its record
  is refused, and every page after it;
- rates: demotion (each page written down validated, one by one as eviction offers them)
  and load-back (in bulk), against plain device-to-host and host-to-device copies of the
  same bytes, as ratios.

It raises AssertionError on any correctness failure and returns a dict of figures. With
device="cpu" a store in private memory stands in for the device.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from benchmarks.gpu_checks.store import checksums, rate, smollm2_layout, synchronizer
from cache_service.events import Namespace, PagesDemoted, PagesStored
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.host_link import HostLink
from workers.store.digests import page_digests
from workers.store.host_tier import HostTier
from workers.store.page_store import SharedPageStore

NS = Namespace("smollm2-135m")


def run(device: str, quick: bool) -> dict[str, Any]:
    prompts = 2 if quick else 16
    pages_each = 4 if quick else 64  # 64 pages of 16 tokens: 1,024-token prompts
    repeat = 3 if quick else 5
    n = prompts * pages_each
    layout = smollm2_layout(n + pages_each + 1)
    with (
        SharedPageStore.create(layout, device=device, pages_in_segment=False) as top,
        SharedPageStore.create(replace(layout, num_pages=n + 1)) as host,
    ):
        tier = HostTier(top, host)
        link = HostLink(tier, "check/host")
        cache = PrefixCache(top, PrefixCacheConfig(page_tokens=16), lower=link, tier="device")
        tokens = [[(p * 7919 + i * 31) % 49000 + 1 for i in range(pages_each * 16)]
                  for p in range(prompts)]  # fmt: skip
        sums = {}
        for prompt in tokens:
            sums.update(serve(cache, top, prompt))
        stored = cache.take_events()
        assert all(isinstance(e, PagesStored) and e.tier == "device" for e in stored), stored
        sync = synchronizer(top.device)
        started = time.perf_counter()
        assert cache.evict(n) == n
        sync()
        demote_s = time.perf_counter() - started
        (demoted,) = cache.take_events()
        assert isinstance(demoted, PagesDemoted) and demoted.tier == "host", demoted
        slots = [page - top.num_pages for page in demoted.new_page_ids]
        assert checksums(host.read_pages(slots)) == [sums[p] for p in demoted.page_ids]
        figures: dict[str, Any] = {"device": str(top.device), "pages": n,
                                   "bytes": n * layout.page_bytes}  # fmt: skip
        figures.update(check_load_back(cache, link, top, host, tokens, repeat))
        nbytes = n * layout.page_bytes
        src = top.page_range(0, n)
        pinned = torch.empty(src.shape, dtype=src.dtype, pin_memory=top.device.type == "cuda")
        figures["demote_bps"] = nbytes / demote_s
        figures["plain_d2h_bps"] = rate(nbytes, repeat, sync, lambda: pinned.copy_(src))
        figures["demote_ratio"] = figures["demote_bps"] / figures["plain_d2h_bps"]
        figures["plain_h2d_bps"] = rate(nbytes, repeat, sync, lambda: src.copy_(pinned))
        figures["load_back_ratio"] = figures["load_back_bps"] / figures["plain_h2d_bps"]
        cache.check_integrity()
        link.check_integrity()
        top.check_integrity()
        host.check_integrity()
    return figures


def serve(cache: PrefixCache, store: SharedPageStore, prompt: list[int]) -> dict[int, int]:
    """Acquire, fill with random KV, publish and release one prompt (all full pages);
    returns each page's checksum."""
    allocation = cache.acquire(prompt + [1], NS)
    assert allocation is not None and allocation.cached_tokens == 0
    pages = allocation.pages[: len(prompt) // 16]
    kv = torch.randn((len(pages), *store.layout.page_shape), device=store.device)
    store.page_range(0, store.num_pages)[torch.tensor(pages, device=store.device)] = kv.to(
        store.layout.torch_dtype
    )
    allocation.publish(len(prompt))
    allocation.release()
    return dict(zip(pages, checksums(store.read_pages(pages)), strict=True))


def check_load_back(cache, link, top, host, tokens, repeat) -> dict[str, Any]:
    """Load every prompt back from host memory, byte-exact; a rewritten host page refused;
    the load-back rate."""
    p = 16
    kv_format = top.layout.kv_format
    plans = []
    for prompt in tokens:
        digests = page_digests(NS, kv_format, prompt, p)
        span = link.span(digests, 0)
        assert span is not None and span.tier == "host" and len(span.page_ids) == len(digests)
        plans.append((digests, span))
    targets = top.allocate(len(tokens[0]) // p)
    assert targets is not None
    source = link.source()
    for digests, span in plans:
        valid = source.fetch(span.page_ids, span.generations, digests, targets, top)
        assert valid == [True] * len(valid), valid
        slots = [page - top.num_pages for page in span.page_ids]
        assert checksums(top.read_pages(targets)) == checksums(host.read_pages(slots))
    # Timed: the first prompt loaded back again and again (each a bulk, validated copy).
    digests, span = plans[0]
    nbytes = len(targets) * top.layout.page_bytes
    sync = synchronizer(top.device)

    def load() -> None:
        assert all(source.fetch(span.page_ids, span.generations, digests, targets, top))

    figures = {"load_back_bps": rate(nbytes, repeat, sync, load)}
    # A host page rewritten behind its record: it and every page after it are refused.
    second = span.page_ids[1] - top.num_pages
    host.write_page(second, host.read_pages([second])[0])
    valid = source.fetch(span.page_ids, span.generations, digests, targets, top)
    assert valid == [True] + [False] * (len(valid) - 1), valid
    link.dropped([digests[1]], "check")  # the record no longer holds its page: gone
    top.free(targets)
    cache.take_events()
    return figures
