"""Small helpers for prefix cache tests: token makers, a pool that records page contents."""

from __future__ import annotations

from cache_service.events import Namespace
from workers.cache.prefix_cache import Allocation, PrefixCache, PrefixCacheConfig
from workers.store.page_pool import PagePool

NS = Namespace("test-model")
PAGE = 4


def make_tokens(*runs: tuple[int, int]) -> list[int]:
    """Concatenate runs (start, count) of consecutive token ids: make_tokens((0, 8))."""
    out: list[int] = []
    for start, count in runs:
        out.extend(range(start, start + count))
    return out


class RecordingPool(PagePool):
    """A page pool that remembers which token each KV slot was computed for.

    It plays the page store's role for the trie tests: `write` is what the model does,
    `copy_page` what the copy-on-write does, and `read` lets a test check that every slot
    a hit reuses holds the KV of exactly the right token.
    """

    def __init__(self, num_pages: int, page_tokens: int = PAGE):
        super().__init__(num_pages)
        self.page_tokens = page_tokens
        self.slots: dict[int, list[int | None]] = {}
        self.copies: list[tuple[int, int, int]] = []

    def free(self, pages) -> None:
        pages = list(pages)
        super().free(pages)
        for page in pages:
            self.slots.pop(page, None)

    def copy_page(self, src: int, dst: int, num_tokens: int) -> None:
        self.copies.append((src, dst, num_tokens))
        data = self.slots.get(src, [None] * self.page_tokens)
        self.slots[dst] = data[:num_tokens] + [None] * (self.page_tokens - num_tokens)

    def write(self, allocation: Allocation, start: int, end: int) -> None:
        """Compute tokens [start, end) of the allocation into its pages."""
        p = self.page_tokens
        for pos in range(start, end):
            page = allocation.pages[pos // p]
            self.slots.setdefault(page, [None] * p)[pos % p] = allocation.tokens[pos]

    def assert_holds(self, allocation: Allocation, end: int) -> None:
        """Every slot in [0, end) holds the KV of the allocation's own token there."""
        p = self.page_tokens
        for pos in range(end):
            page = allocation.pages[pos // p]
            got = self.slots.get(page, [None] * p)[pos % p]
            assert got == allocation.tokens[pos], (
                f"slot {pos} (page {page}) holds token {got}, expected {allocation.tokens[pos]}"
            )


def make_cache(
    num_pages: int = 32, page_tokens: int = PAGE, **config
) -> tuple[PrefixCache, RecordingPool]:
    pool = RecordingPool(num_pages, page_tokens)
    cache = PrefixCache(pool, PrefixCacheConfig(page_tokens=page_tokens, **config))
    return cache, pool


def run_request(cache: PrefixCache, pool: RecordingPool, tokens, ns=NS, release=True):
    """Acquire, check the reused KV, compute the rest, publish, optionally release."""
    allocation = cache.acquire(tokens, ns)
    assert allocation is not None
    pool.assert_holds(allocation, allocation.cached_tokens)
    pool.write(allocation, allocation.cached_tokens, allocation.num_tokens)
    allocation.publish(allocation.num_tokens)
    if release:
        allocation.release()
    return allocation
