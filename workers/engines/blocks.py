"""vLLM's KV blocks and kvmesh's pages: the layout of an engine's store, and the copies
between the two.

How a vLLM block maps to kvmesh pages: a block is `block_size / page_tokens` consecutive
pages. The mesh's index keys every page at one granularity (the service's page_tokens,
16 by default), so an engine's pages are cut at that size too, and its prompts are
walked, matched and counted exactly as a worker's. vLLM's caches come in the layouts of
`kv_layouts`, each read as a K and a V view `(num_blocks, kv_heads, block_tokens, head_dim)`
per layer (on CPU a block holds 128 tokens, on CUDA 16, one page); a kvmesh page holds
its tokens for every layer, `(num_layers, 2 [k, v], kv_heads, page_tokens, head_dim)`, so
moving a block is two strided copies per layer (`blocks_to_pages`, `pages_to_blocks`),
on the caches' device (`kv_copier` moves pages between it and the host). vLLM hits are
whole blocks: a match is rounded down to one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

from workers.engines.kv_layouts import LayerKV
from workers.store.layout import StoreLayout


def layer_order(names: Sequence[str]) -> list[str]:
    """Layer names in model order (by the layer number in each name, e.g.
    "model.layers.12.self_attn.attn")."""

    def number(name: str) -> int:
        found = re.findall(r"\d+", name)
        if not found:
            raise ValueError(f"no layer number in KV cache name {name!r}")
        return int(found[0])

    return sorted(names, key=number)


def engine_layout(
    layers: Sequence[LayerKV], block_size: int, page_tokens: int, num_blocks: int
) -> StoreLayout:
    """The page layout for an engine's KV caches (`kv_layouts.layer_views`): pages of the
    index's `page_tokens`, room for `num_blocks` vLLM blocks.

    Raises:
        ValueError: a block size, or the caches' (kernel) block, that is not a whole
            number of pages.
    """
    _, heads, block_tokens, head_dim = layers[0].k.shape
    if block_size % page_tokens or block_tokens % page_tokens:
        raise ValueError(
            f"vLLM's block of {block_size} tokens (held as blocks of {block_tokens}) is "
            f"not a whole number of the mesh's pages of {page_tokens}"
        )
    dtype = str(layers[0].k.dtype).removeprefix("torch.")
    pages = num_blocks * (block_size // page_tokens)
    return StoreLayout(pages, len(layers), heads, page_tokens, head_dim, dtype)


def tensor_block_ids(block_ids: Sequence[int], block_size: int, block_tokens: int) -> list[int]:
    """The caches' blocks that hold vLLM's blocks `block_ids`, in token order: vLLM may
    split each of its blocks of `block_size` tokens into kernel blocks of `block_tokens`
    (consecutive ids, as vLLM numbers them)."""
    ratio = block_size // block_tokens
    return [b * ratio + j for b in block_ids for j in range(ratio)]


def blocks_to_pages(
    layers: Sequence[LayerKV],
    block_ids: Sequence[int],
    page_tokens: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather the caches' blocks into pages, `(len(block_ids) * k, num_layers, 2, kv_heads,
    page_tokens, head_dim)` with k = block_tokens / page_tokens, in token order, on the
    caches' device (into `out` when given: at least that many pages, on that device; the
    rest is left alone). Block ids are the caches' own (see `tensor_block_ids`)."""
    first = layers[0].k
    n, (_, heads, block, head_dim) = len(block_ids), first.shape
    k = block // page_tokens
    index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    if out is None:
        shape = (n * k, len(layers), 2, heads, page_tokens, head_dim)
        out = torch.empty(shape, dtype=first.dtype, device=first.device)
    out = out[: n * k]
    for i, layer in enumerate(layers):
        for s, half in enumerate(layer):
            # (n, heads, k, p, hd) -> (n, k, heads, p, hd): the pages' order
            src = half.index_select(0, index).view(n, heads, k, page_tokens, head_dim)
            out[:, i, s].view(n, k, heads, page_tokens, head_dim).copy_(src.transpose(1, 2))
    return out


def pages_to_blocks(
    pages: torch.Tensor, layers: Sequence[LayerKV], block_ids: Sequence[int]
) -> None:
    """Scatter pages `(n * k, num_layers, 2, kv_heads, page_tokens, head_dim)`, in token
    order and on the caches' device, into n of the caches' blocks: two strided copies a
    layer (K and V) through the views' strides, no temporaries (on the request's critical
    path, a temporary's first-touch page faults cost more than the copy)."""
    first = layers[0].k
    n, (_, heads, block, head_dim) = len(block_ids), first.shape
    page_tokens = pages.shape[4]
    k = block // page_tokens
    index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    for i, layer in enumerate(layers):
        for s, half in enumerate(layer):
            dst = half.unflatten(2, (k, page_tokens))  # (blocks, heads, k, p, hd)
            src = pages[:, i, s].view(n, k, heads, page_tokens, head_dim)
            dst.index_copy_(0, index, src.transpose(1, 2))


def kv_layers(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's per-layer caches in model order."""
    return [kv_caches[name] for name in layer_order(list(kv_caches))]
