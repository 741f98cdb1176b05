"""vLLM's KV blocks and kvmesh's pages: the layout of an engine's store, and the copies
between the two.

How a vLLM block maps to kvmesh pages: a block is `block_size / page_tokens` consecutive
pages. The mesh's index keys every page at one granularity (the service's page_tokens,
16 by default), so an engine's pages are cut at that size too, and its prompts are
walked, matched and counted exactly as a worker's. On CPU vLLM's block holds 128 tokens
and a layer's cache is `(num_blocks, kv_heads, block_size, 2 * head_dim)` (K and V side by
side); a kvmesh page holds its tokens for every layer, `(num_layers, 2 [k, v], kv_heads,
page_tokens, head_dim)`, so moving a block is a strided copy per layer (`blocks_to_pages`,
`pages_to_blocks`). vLLM hits are whole blocks: a match is rounded down to one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch

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
    layers: Sequence[torch.Tensor], block_size: int, page_tokens: int, num_blocks: int
) -> StoreLayout:
    """The page layout for an engine's per-layer KV caches: pages of the index's
    `page_tokens`, room for `num_blocks` blocks.

    Raises:
        ValueError: caches not of vLLM's CPU shape `(num_blocks, kv_heads, block_size,
            2 * head_dim)`, of different shapes or dtypes, or a block size that is not a
            multiple of page_tokens.
    """
    first = layers[0]
    for layer in layers:
        if layer.shape != first.shape or layer.dtype != first.dtype:
            raise ValueError(
                f"KV caches of different shapes: {tuple(layer.shape)} {layer.dtype} and "
                f"{tuple(first.shape)} {first.dtype}"
            )
    if first.dim() != 4 or first.shape[2] != block_size or first.shape[3] % 2:
        raise ValueError(
            f"a KV cache of shape {tuple(first.shape)}: expected (num_blocks, kv_heads, "
            f"{block_size}, 2 * head_dim)"
        )
    if block_size % page_tokens:
        raise ValueError(
            f"vLLM's block of {block_size} tokens is not a whole number of the mesh's "
            f"pages of {page_tokens}"
        )
    dtype = str(first.dtype).removeprefix("torch.")
    pages = num_blocks * (block_size // page_tokens)
    return StoreLayout(pages, len(layers), first.shape[1], page_tokens, first.shape[3] // 2, dtype)


def blocks_to_pages(
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    page_tokens: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather blocks into pages, `(len(block_ids) * k, num_layers, 2, kv_heads, page_tokens,
    head_dim)` with k = block_size / page_tokens, in token order (into `out` when given:
    at least that many pages; the rest is left alone)."""
    index = torch.tensor(block_ids, dtype=torch.long)
    n, (_, heads, block, width) = len(block_ids), layers[0].shape
    k, head_dim = block // page_tokens, width // 2
    if out is None:
        out = torch.empty(
            (n * k, len(layers), 2, heads, page_tokens, head_dim), dtype=layers[0].dtype
        )
    out = out[: n * k]
    for i, layer in enumerate(layers):
        src = layer.index_select(0, index).view(n, heads, k, page_tokens, width)
        src = src.permute(0, 2, 1, 3, 4).reshape(n * k, heads, page_tokens, width)
        out[:, i, 0] = src[..., :head_dim]
        out[:, i, 1] = src[..., head_dim:]
    return out


def pages_to_blocks(
    pages: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: Sequence[int]
) -> None:
    """Scatter pages `(n * k, num_layers, 2, kv_heads, page_tokens, head_dim)`, in token
    order, into n vLLM blocks: two strided copies a layer (K and V), no temporaries (on the
    request's critical path, a temporary's first-touch page faults cost more than the
    copy)."""
    index = torch.tensor(block_ids, dtype=torch.long)
    n, (num_blocks, heads, block, width) = len(block_ids), layers[0].shape
    page_tokens = pages.shape[4]
    k, head_dim = block // page_tokens, width // 2
    for i, layer in enumerate(layers):
        dst = layer.view(num_blocks, heads, k, page_tokens, width)
        src = pages[:, i].view(n, k, 2, heads, page_tokens, head_dim)
        # (n, k, heads, p, hd) -> (n, heads, k, p, hd): the block's token order
        dst[..., :head_dim].index_copy_(0, index, src[:, :, 0].permute(0, 2, 1, 3, 4))
        dst[..., head_dim:].index_copy_(0, index, src[:, :, 1].permute(0, 2, 1, 3, 4))


def kv_layers(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's per-layer caches in model order."""
    return [kv_caches[name] for name in layer_order(list(kv_caches))]
