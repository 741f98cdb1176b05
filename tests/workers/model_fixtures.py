"""Helpers for tests that run a model over pages: the batch runner over a real store and
prefix cache, and references computed by HF alone, without any paging."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from transformers import DynamicCache

from cache_service.events import Namespace
from workers.cache.prefix_cache import Allocation, PrefixCache, PrefixCacheConfig
from workers.serving.batch_runner import BatchRunner, Chunk
from workers.serving.model_loader import store_layout_for
from workers.store.page_store import SharedPageStore

NS = Namespace("tiny-llama")


class Rig(NamedTuple):
    runner: BatchRunner
    cache: PrefixCache
    store: SharedPageStore

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        self.store.check_integrity()


@contextmanager
def make_rig(
    model, num_pages: int = 48, page_tokens: int = 4, tag: str = "runner"
) -> Iterator[Rig]:
    """A batch runner over a fresh store whose layout fits `model`, and a prefix cache
    over it. The store is closed (its segment unlinked) on exit."""
    store = SharedPageStore.create(store_layout_for(model, num_pages, page_tokens), tag=tag)
    try:
        cache = PrefixCache(store, PrefixCacheConfig(page_tokens=page_tokens))
        yield Rig(BatchRunner(model, store), cache, store)
    finally:
        store.close()


def make_prompt(n: int, seed: int = 0, low: int = 0, high: int = 200) -> list[int]:
    """`n` token ids drawn from [low, high): distinct prompts for distinct seeds."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, (n,), generator=gen).tolist()


def compute(rig: Rig, tokens: list[int], release: bool = True) -> tuple[Allocation, torch.Tensor]:
    """What a worker does with a prompt: acquire, run the uncached part in one pass,
    publish. Returns the allocation and the last token's logits `(vocab,)`."""
    allocation = rig.cache.acquire(tokens, NS)
    assert allocation is not None, "store full"
    cached = allocation.cached_tokens
    (logits,) = rig.runner.forward([Chunk(allocation.pages, tokens[cached:], cached)])
    allocation.publish(allocation.num_tokens)
    if release:
        allocation.release()
    return allocation, logits


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


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    """The last token's logits `(vocab,)` of HF's plain forward over all of `tokens`."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1].float()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """HF's own greedy `generate` (its DynamicCache, no pages): the new tokens. `kwargs`
    go to `generate` (`eos_token_id=None` runs to `max_new_tokens`)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()
