"""Helpers for model runner tests: a runner over a real store and prefix cache, reference
KV and reference greedy decoding computed without any paging."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from transformers import DynamicCache

from cache_service.events import Namespace
from workers.cache.prefix_cache import Allocation, PrefixCache, PrefixCacheConfig
from workers.serving.model_runner import ModelRunner, PrefillResult, store_layout_for
from workers.store.page_store import SharedPageStore

NS = Namespace("tiny-llama")


class Rig(NamedTuple):
    runner: ModelRunner
    cache: PrefixCache
    store: SharedPageStore

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        self.store.check_integrity()


@contextmanager
def make_rig(
    model, num_pages: int = 48, page_tokens: int = 4, tag: str = "runner"
) -> Iterator[Rig]:
    """A runner over a fresh store whose layout fits `model`, and a prefix cache over it.
    The store is closed (its segment unlinked) on exit."""
    store = SharedPageStore.create(store_layout_for(model, num_pages, page_tokens), tag=tag)
    try:
        cache = PrefixCache(store, PrefixCacheConfig(page_tokens=page_tokens))
        yield Rig(ModelRunner(model, store), cache, store)
    finally:
        store.close()


def make_prompt(n: int, seed: int = 0, low: int = 0, high: int = 200) -> list[int]:
    """`n` token ids drawn from [low, high): distinct prompts for distinct seeds."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=gen).tolist()


def compute(rig: Rig, tokens: list[int], release: bool = True) -> tuple[Allocation, PrefillResult]:
    """What a worker does with a prompt: acquire, prefill the uncached part, publish."""
    allocation = rig.cache.acquire(tokens, NS)
    assert allocation is not None, "store full"
    result = rig.runner.prefill(allocation.pages, allocation.tokens, allocation.cached_tokens)
    allocation.publish(allocation.num_tokens)
    if release:
        allocation.release()
    return allocation, result


def held_kv(store: SharedPageStore, pages: list[int], end: int) -> torch.Tensor:
    """KV of tokens [0, end) as the pages hold it: `(layers, 2, kv_heads, end, head_dim)`."""
    held = store.read_pages(pages)  # (n_pages, layers, 2, kv_heads, page_tokens, head_dim)
    layers, two, heads, _, head_dim = held.shape[1:]
    flat = held.permute(1, 2, 3, 0, 4, 5).reshape(layers, two, heads, -1, head_dim)
    return flat[:, :, :, :end]


def reference_kv(model, tokens: list[int]) -> torch.Tensor:
    """KV of a plain full forward through HF's own `DynamicCache`, stacked like a page:
    `(layers, 2, kv_heads, len(tokens), head_dim)`."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([tokens]), use_cache=True, cache=cache)
    assert out.cache is cache
    return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])


def reference_greedy(runner: ModelRunner, tokens: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by a full prefill per token: slow, and no cache of any kind."""
    tokens = list(tokens)
    out: list[int] = []
    for _ in range(max_new_tokens):
        out.append(int(torch.argmax(runner.full_prefill_logits(tokens))))
        tokens.append(out[-1])
    return out


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()
