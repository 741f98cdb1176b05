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
- rates: demotion (a batch of evicted pages written down validated, in bulk copies) and
  load-back (in bulk), against plain device-to-host and host-to-device copies of the same
  bytes, as ratios;
- the chain device -> host -> disk (a disk tier in a temporary directory under host
  memory of half the pages): evicting everything sends host memory's oldest records on
  to the disk (PagesDemoted to tier "disk"), and every prompt loads back byte-exact from
  host memory and the disk in turn, the disk's records landing in device pages through a
  host row.

It raises AssertionError on any correctness failure and returns a dict of figures. With
device="cpu" a store in private memory stands in for the device.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_checks.store import checksums, rate, smollm2_layout, synchronizer
from cache_service.events import Namespace, PagesDemoted, PagesStored
from workers.cache.disk_settings import mesh_key
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.disk_link import DiskLink
from workers.host_link import HostLink
from workers.store.digests import page_digests
from workers.store.disk_tier import DiskTier
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
    figures.update(check_chain(device, prompts, pages_each))
    return figures


def check_chain(device: str, prompts: int, pages_each: int) -> dict[str, Any]:
    """Device -> host -> disk: evict everything, load every prompt back from both."""
    n = prompts * pages_each
    layout = smollm2_layout(n + pages_each + 1)
    with (
        tempfile.TemporaryDirectory() as directory,
        SharedPageStore.create(layout, device=device, pages_in_segment=False) as top,
        SharedPageStore.create(replace(layout, num_pages=n // 2)) as host,
    ):
        records = DiskTier.open(Path(directory) / "disk", host.layout, n, mesh_key(b"k" * 32))
        disk = DiskLink(records, host, "write_back", "check/disk", id_base=top.num_pages + n // 2)
        link = HostLink(HostTier(top, host), "check/host", disk)
        cache = PrefixCache(top, PrefixCacheConfig(page_tokens=16), lower=link, tier="device")
        tokens = [[(p * 7907 + i * 37) % 49000 + 1 for i in range(pages_each * 16)]
                  for p in range(prompts)]  # fmt: skip
        sums = {}
        for prompt in tokens:
            by_page = serve(cache, top, prompt)
            digests = page_digests(NS, top.layout.kv_format, prompt, 16)
            sums.update(zip(digests, (by_page[p] for p in sorted(by_page)), strict=True))
        assert cache.evict(n) == n  # one batch, more than host memory holds
        tiers = {e.tier for e in cache.take_events() if isinstance(e, PagesDemoted)}
        assert tiers == {"host", "disk"}, tiers
        on_disk = records.stats()["pages"]
        targets = top.allocate(pages_each)
        assert targets is not None
        for prompt in tokens:
            digests = page_digests(NS, top.layout.kv_format, prompt, 16)
            reach = 0
            for tier in link.chain():
                span = tier.span(digests, reach)
                if span is None:
                    continue
                got = tier.source().fetch(span.page_ids[reach:], span.generations[reach:],
                                          digests[reach:len(span.page_ids)],
                                          targets[reach:len(span.page_ids)], top)  # fmt: skip
                assert all(got), got
                reach = len(span.page_ids)
            assert reach == pages_each, f"prompt back to page {reach} of {pages_each}"
            assert checksums(top.read_pages(targets)) == [sums[d] for d in digests]
        top.free(targets)
        cache.check_integrity()
        link.check_integrity()
        link.close()
    return {"chain_pages_on_disk": on_disk, "chain_prompts_back": prompts}


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
