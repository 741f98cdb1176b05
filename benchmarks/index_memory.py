"""The global index's memory per page, measured with tracemalloc (plus the bytes its
compiled structures report, which tracemalloc does not see).

`kvmesh bench lookup` reports the server process's RSS growth per page (allocator slack
included); this counts only what the index allocates, which is steadier and fast enough
for a test.
"""

from __future__ import annotations

import tracemalloc

import numpy as np

from cache_service.events import Namespace, PagesStored
from cache_service.index import GlobalIndex

VOCAB = 49_152  # a realistic vocabulary (SmolLM2's)
CHAIN_PAGES = 128


def measure_bytes_per_page(n_pages: int, page_tokens: int = 16) -> float:
    """Build an index of `n_pages` pages and measure its memory per page with tracemalloc.

    One worker stores chains of 128 pages of random token ids, each chain a distinct
    prompt, so every page is a node of its own.

    Args:
        n_pages: pages to index.
        page_tokens: tokens per page.

    Returns:
        Bytes held by the index (traced, and compiled), per indexed page.

    Raises:
        ValueError: n_pages not positive.
    """
    if n_pages <= 0:
        raise ValueError(f"n_pages must be positive, got {n_pages}")
    rng = np.random.default_rng(0)
    namespace = Namespace("measure")
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = GlobalIndex(page_tokens=page_tokens, max_capacity=n_pages)
        epoch = index.register("w0", node_id="n0", now=0.0, capacity=n_pages).epoch
        for seq, first in enumerate(range(0, n_pages, CHAIN_PAGES), start=1):
            count = min(CHAIN_PAGES, n_pages - first)
            event = PagesStored(
                namespace,
                None,
                tuple(range(first, first + count)),
                (0,) * count,
                tuple(rng.integers(0, VOCAB, size=count * page_tokens).tolist()),
            )
            index.apply_events("w0", epoch, seq, [event])
            del event
        assert index.num_pages == n_pages, f"{index.num_pages} pages indexed, {n_pages} stored"
        # tracemalloc sees Python's and numpy's allocations, not the compiled ones (the
        # key table and trie, the workers' page maps).
        page_maps = sum(worker.pages.nbytes for worker in index._registry.workers.values())
        compiled = index._nodes.compiled_nbytes() + page_maps
        used = tracemalloc.get_traced_memory()[0] - before + compiled
    finally:
        if started:
            tracemalloc.stop()
    return used / n_pages
