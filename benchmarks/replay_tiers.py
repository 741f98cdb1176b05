"""The trace replay of `benchmarks.replay` through real tiers: shared memory and disk files.

Each simulated worker holds real KV bytes in a real `SharedPageStore` of a small KV format
(one layer, one KV head, head_dim 1: 4 KiB a 512-token page, so that 4,000 pages are
16 MiB of shared memory), optionally over a real `DiskTier` in a directory of its own,
wired as a worker wires them (`workers.disk_link`): pages shared memory evicts are
written down, stay findable, and come back on a hit.

One request, as `benchmarks.replay` serves it, plus the disk:

    acquire     the worker's host pages match its local prefix
    load back   the full pages its disk holds beyond that (by the prompt's page digests)
                are read into the request's pages, each record verified
    copy in     full pages other workers hold beyond both, per the index's match
    publish     the whole prompt; its events (stored, demoted, removed) go to the index

Accounting: local = host hits + disk hits (a disk hit is the worker's own), remote as in
`benchmarks.replay`. The load back always happens (no model, no timings here: the TTFT
side of a disk hit is `kvmesh bench tiers`' ttft figures).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.replay import (
    NAMESPACE,
    TRACE_BLOCK_TOKENS,
    TraceRequest,
    _Cluster,
    _routing,
    _run,
    _Totals,
)
from cache_service.index import GlobalIndex
from workers.cache.disk_settings import mesh_key
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.disk_link import DiskLink
from workers.store.digests import page_digests
from workers.store.disk_tier import DiskTier
from workers.store.page_store import SharedPageStore, StoreLayout

KEY = mesh_key(b"replay" * 6)


class TieredCluster(_Cluster):
    """N simulated workers, each a real store (and disk tier), fed by the same index."""

    def __init__(
        self,
        workers: int,
        pages_per_worker: int,
        disk_pages: int,
        directory: Path,
        page_tokens: int = TRACE_BLOCK_TOKENS,
        load_window: int = 64,
        cluster_eviction: bool = True,
    ) -> None:
        super().__init__(workers, pages_per_worker, page_tokens, load_window, cluster_eviction)
        self.layout = StoreLayout(
            num_pages=pages_per_worker,
            num_layers=1,
            num_kv_heads=1,
            page_tokens=page_tokens,
            head_dim=1,
            dtype="float32",
        )
        config = PrefixCacheConfig(
            page_tokens=page_tokens,
            publish_decode_pages=False,
            cluster_eviction=cluster_eviction,
        )
        # An index whose holders may hold both tiers' pages.
        capacity = pages_per_worker + disk_pages
        self.index = GlobalIndex(page_tokens=page_tokens, max_capacity=capacity)
        self.stores: dict[str, SharedPageStore] = {}
        self.links: dict[str, DiskLink] = {}
        self.disk_hits = 0
        for worker_id in self.worker_ids:
            store = self.stores[worker_id] = SharedPageStore.create(self.layout)
            link = None
            if disk_pages:
                disk = DiskTier.open(directory / worker_id, self.layout, disk_pages, KEY)
                link = self.links[worker_id] = DiskLink(disk, store, "write_back", worker_id)
            self.caches[worker_id] = PrefixCache(store, config, lower=link)
            self.epochs[worker_id] = self.index.register(
                worker_id, node_id="replay", now=0.0, capacity=capacity
            ).epoch

    def _own_prefix(self, worker_id: str, allocation, packed: bytes, n: int) -> int:
        local = allocation.cached_tokens
        link = self.links.get(worker_id)
        if link is not None:
            local = max(local, self._load_back(link, allocation, packed, n))
        return local

    def _load_back(self, link: DiskLink, allocation, packed: bytes, n: int) -> int:
        """Read what the disk holds past the host match into the request's pages; returns
        where the usable prefix ends, in tokens (at most n - 1)."""
        p = self.layout.page_tokens
        first, end = allocation.cached_tokens // p, (n - 1) // p
        if end <= first:
            return 0
        digests = page_digests(NAMESPACE, self.layout.kv_format, packed[: end * p * 4], p)
        span = link.span(digests, first)
        if span is None:
            return 0
        ids, gens = span.page_ids[first:end], span.generations[first:end]
        targets = allocation.pages[first : first + len(ids)]
        expected = digests[first : first + len(ids)]
        valid = link.source().fetch(ids, gens, expected, targets, link.host)
        loaded = valid.index(False) if False in valid else len(valid)
        if not loaded:
            return 0
        self.disk_hits += 1
        return min((first + loaded) * p, n - 1)

    def check_integrity(self) -> None:
        super().check_integrity()
        for link in self.links.values():
            link.check_integrity()

    def close(self) -> None:
        for link in self.links.values():
            link.disk.close(remove_files=True)
        for store in self.stores.values():
            store.close()


def hit_rate(
    requests: Sequence[TraceRequest],
    workers: int,
    pages_per_worker: int,
    disk_pages: int = 0,
    routing: str = "prefix",
    cluster_eviction: bool = True,
) -> float:
    """The replay's hit rate (hit tokens / prompt tokens) through real tiers."""
    directory = Path(tempfile.mkdtemp(prefix="replay-tiers-", dir=_scratch_root()))
    cluster = TieredCluster(
        workers, pages_per_worker, disk_pages, directory, cluster_eviction=cluster_eviction
    )
    try:
        totals: _Totals = _run(cluster, requests, _routing(routing), "replay", None)
    finally:
        cluster.close()
        shutil.rmtree(directory, ignore_errors=True)
    return totals.rate(totals.hit)


def _scratch_root() -> Path:
    root = Path.home() / ".cache" / "kvmesh"
    root.mkdir(parents=True, exist_ok=True)
    return root
