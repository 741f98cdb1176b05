"""Helpers for the tests of a prefix cache with a tier of records below it (disk under host
memory, host memory under a device): prompts, the KV written for them, one request served."""

from __future__ import annotations

import torch

from cache_service.events import Namespace
from workers.cache.prefix_cache import PrefixCache
from workers.store.page_store import SharedPageStore

NS = Namespace("tiny")
P = 4  # tokens per page


def make_prompt(seed: int, pages: int) -> list[int]:
    """`pages` full pages of token ids, distinct per seed."""
    return [(seed * 31 + 7 * i) % 200 + 1 for i in range(pages * P)]


def expected_kv(tokens: list[int], page: int, page_shape: tuple[int, ...]) -> torch.Tensor:
    """The KV `serve` writes for page `page` of `tokens`: each token's slots hold its id."""
    values = torch.tensor(tokens[page * P : (page + 1) * P], dtype=torch.float32)
    return values.view(1, 1, 1, P, 1).expand(page_shape)


def serve(cache: PrefixCache, store: SharedPageStore, tokens: list[int]) -> list[int]:
    """Acquire, write KV that is a function of each token, publish, release; returns the
    allocation's pages."""
    allocation = cache.acquire(tokens, NS)
    assert allocation is not None
    for pos in range(allocation.cached_tokens, len(tokens)):
        store.page(allocation.pages[pos // P])[:, :, :, pos % P, :] = float(tokens[pos])
    allocation.publish(len(tokens))
    pages = list(allocation.pages)
    allocation.release()
    return pages
