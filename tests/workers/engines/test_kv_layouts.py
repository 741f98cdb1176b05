"""vLLM's KV layouts (`workers.engines.kv_layouts`): detected from the tensors and the
backend's name, refused when unknown or ambiguous, and copied to and from pages bit for
bit in every layout and stride order, against a reference that walks the tokens one by
one (`benchmarks.gpu_checks.layouts`, the GPU check's own, run here on the CPU)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu_checks import layouts as gpu_check
from benchmarks.gpu_checks.layouts import (
    CASES,
    Case,
    check_case,
    make_caches,
    reference_blocks,
    reference_pages,
)
from workers.engines.blocks import engine_layout, tensor_block_ids
from workers.engines.kv_copier import KVCopier
from workers.engines.kv_layouts import (
    LAYOUTS,
    KVLayout,
    KVLayoutError,
    detect_layout,
    layer_views,
    layout_named,
    layout_of_shape_fn,
)

LAYERS, HEADS, HEAD_DIM = 2, 3, 8


def caches_of(case: Case, block: int = 16, blocks: int = 5, **kw) -> list[torch.Tensor]:
    return make_caches(case, LAYERS, blocks, HEADS, block, HEAD_DIM, torch.float32, **kw)


# ---- copies, every layout and stride order --------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.layout}-{c.physical}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block,page_tokens", [(16, 16), (16, 4), (128, 32)])
def test_blocks_and_pages_match_the_reference_bit_for_bit(case, dtype, block, page_tokens):
    check_case(case, dtype, "cpu", LAYERS, HEADS, HEAD_DIM, block, page_tokens, blocks=5)


def test_the_reference_tells_the_layouts_apart():
    """Reading one layout's caches as another's moves other values (so each case's
    reference checks its own layout)."""
    for case in (Case("cpu_attn", "BHNC"), Case("flash_attn", "SBNHD")):
        caches = caches_of(case)
        right = reference_pages(case.layout, caches, [1], 4)
        other = "per_token_kv" if case.layout == "cpu_attn" else "blocks_first"
        assert not torch.equal(reference_pages(other, caches, [1], 4), right)


def test_a_shared_buffer_is_written_only_in_the_blocks_asked():
    case = Case("per_token_kv", "BLNHC")  # every layer's block b side by side
    caches = caches_of(case)
    buffer_before = caches[0].untyped_storage()
    pages = reference_pages(case.layout, caches, [2], 8)
    views = layer_views(caches, LAYOUTS[case.layout], HEAD_DIM)
    before = [cache.clone() for cache in caches]
    expected = reference_blocks(case.layout, pages, caches, [4])
    KVCopier("cpu", pages.shape[1:], torch.float32, 16).scatter(pages, views, [4])
    assert caches[0].untyped_storage().data_ptr() == buffer_before.data_ptr()
    for cache, was, want in zip(caches, before, expected, strict=True):
        assert torch.equal(cache, want)
        assert torch.equal(cache[:4], was[:4])  # blocks 0-3 untouched


def test_kernel_blocks_are_the_blocks_vllm_split():
    """vLLM may hold its blocks of 32 tokens as kernel blocks of 16: block b is kernel
    blocks 2b and 2b + 1, in token order."""
    assert tensor_block_ids([3, 0], 32, 16) == [6, 7, 0, 1]
    assert tensor_block_ids([3, 0], 16, 16) == [3, 0]
    case = Case("per_token_kv", "LBNHC")
    caches = caches_of(case, block=16, blocks=8)
    kv = detect_layout(caches[0], HEADS, HEAD_DIM, 32, "per_token_kv")
    views = layer_views(caches, kv, HEAD_DIM)
    copier = KVCopier("cpu", (LAYERS, 2, HEADS, 8, HEAD_DIM), torch.float32, block_size=32)
    pages = copier.gather(views, [3, 1])  # kernel blocks 6, 7, 2, 3
    assert torch.equal(pages, reference_pages(case.layout, caches, [6, 7, 2, 3], 8))
    into = caches_of(case, block=16, blocks=8, seed=1)
    copier.scatter(pages[:4], layer_views(into, LAYOUTS[case.layout], HEAD_DIM), [0])
    expected = reference_blocks(case.layout, pages[:4], into, [0, 1])
    assert all(torch.equal(a, b) for a, b in zip(into, expected, strict=True))


def test_the_copier_stages_through_one_host_buffer_kept_across_calls():
    case = Case("cpu_attn", "BHNC")
    caches = caches_of(case, block=16, blocks=6)
    views = layer_views(caches, LAYOUTS[case.layout], HEAD_DIM)
    copier = KVCopier("cpu", (LAYERS, 2, HEADS, 4, HEAD_DIM), torch.float32, block_size=16)
    first = copier.gather(views, [5, 2])
    assert first.shape == (8, LAYERS, 2, HEADS, 4, HEAD_DIM) and not first.is_pinned()
    assert torch.equal(first, reference_pages(case.layout, caches, [5, 2], 4))
    again = copier.host_pages(4)  # smaller: the same buffer
    assert again.data_ptr() == first.data_ptr()
    copier.loads_done()  # nothing queued on the CPU


# ---- detection --------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.layout}-{c.physical}")
def test_the_backends_name_picks_the_layout(case):
    caches = caches_of(case)
    assert detect_layout(caches[0], HEADS, HEAD_DIM, 16, case.layout).name == case.layout


def test_a_five_dim_cache_is_told_by_its_shape_alone():
    caches = caches_of(Case("flash_attn", "SBHND"))
    assert detect_layout(caches[0], HEADS, HEAD_DIM, 16).name == "flash_attn"
    caches = caches_of(Case("blocks_first", "BSNHD"))
    assert detect_layout(caches[0], HEADS, HEAD_DIM, 16).name == "blocks_first"


def test_shapes_more_than_one_layout_fits_are_refused_without_the_backend():
    cache = caches_of(Case("per_token_kv", "BNHC"))[0]
    with pytest.raises(KVLayoutError) as info:
        detect_layout(cache, HEADS, HEAD_DIM, 16)
    message = str(info.value)
    assert "['per_token_kv', 'cpu_attn']" in message
    assert "shape (5, 3, 16, 16)" in message and f"strides {cache.stride()}" in message
    two_blocks = caches_of(Case("flash_attn", "SBNHD"), blocks=2)[0]  # (2, 2, ...)
    with pytest.raises(KVLayoutError, match="flash_attn', 'blocks_first'"):
        detect_layout(two_blocks, HEADS, HEAD_DIM, 16)
    assert detect_layout(two_blocks, HEADS, HEAD_DIM, 16, "flash_attn").name == "flash_attn"


def test_unknown_shapes_and_names_are_refused_with_what_was_seen():
    cache = torch.zeros(5, 16, HEADS * HEAD_DIM * 2)  # a flat layout kvmesh does not read
    with pytest.raises(KVLayoutError, match=r"no known KV layout has shape \(5, 16, 48\)"):
        detect_layout(cache, HEADS, HEAD_DIM, 16)
    with pytest.raises(KVLayoutError, match="unknown KV layout 'nhd'; known: "):
        layout_named("nhd")
    fa = caches_of(Case("flash_attn", "SBNHD"))[0]
    with pytest.raises(KVLayoutError, match=r"says blocks_first \(BSNHD\).*\(2, 5, 16, 3, 8\)"):
        detect_layout(fa, HEADS, HEAD_DIM, 16, "blocks_first")
    with pytest.raises(KVLayoutError, match="not that for 4 KV heads"):
        detect_layout(fa, 4, HEAD_DIM, 16, "flash_attn")
    with pytest.raises(KVLayoutError, match="blocks of 24 tokens"):
        detect_layout(fa, HEADS, HEAD_DIM, 24, "flash_attn")  # 16 does not divide 24


def test_a_cpu_cache_whose_blocks_are_not_dense_is_refused():
    cache = caches_of(Case("per_token_kv", "BNHC"))[0]  # (N, C) of a head not one run
    with pytest.raises(KVLayoutError, match=r"cpu_attn KV cache of shape .* one dense run"):
        detect_layout(cache, HEADS, HEAD_DIM, 16, "cpu_attn")


def test_layers_that_differ_are_refused():
    case = Case("flash_attn", "SBNHD")
    caches = caches_of(case)
    with pytest.raises(KVLayoutError, match="KV caches differ"):
        layer_views([caches[0], caches[1].to(torch.bfloat16)], LAYOUTS["flash_attn"], HEAD_DIM)


def test_a_backends_shape_function_names_its_layout():
    """vLLM before its per-layer views: the backend's `get_kv_cache_shape`."""

    def flash(num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def flashinfer(num_blocks, block_size, num_kv_heads, head_size):
        return (num_blocks, 2, block_size, num_kv_heads, head_size)

    def flat(num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size * num_kv_heads * head_size)

    assert layout_of_shape_fn(flash, HEADS, HEAD_DIM, 16) == "flash_attn"
    assert layout_of_shape_fn(flash, 16, HEAD_DIM, 16) == "flash_attn"  # heads == block
    assert layout_of_shape_fn(flashinfer, HEADS, HEAD_DIM, 16) == "blocks_first"
    assert layout_of_shape_fn(flat, HEADS, HEAD_DIM, 16) is None


def test_layouts_are_checked_when_declared():
    with pytest.raises(ValueError, match="bad dims"):
        KVLayout("x", "BBNC")
    with pytest.raises(ValueError, match="block_kt needs dims ending in NC"):
        KVLayout("x", "BNHC", "block_kt")


def test_the_store_layout_follows_the_views():
    case = Case("flash_attn", "SBHND")
    views = layer_views(caches_of(case), LAYOUTS[case.layout], HEAD_DIM)
    layout = engine_layout(views, 32, 8, num_blocks=10)
    assert layout.page_shape == (LAYERS, 2, HEADS, 8, HEAD_DIM) and layout.num_pages == 40
    with pytest.raises(ValueError, match="block of 32 tokens .* pages of 32"):
        engine_layout(views, 32, 32, num_blocks=10)  # kernel blocks of 16 < a page


# ---- the GPU check, on the CPU ------------------------------------------------------------


def test_the_gpu_check_section_runs_on_the_cpu():
    """Its imports (no vLLM, ZeroMQ or Ray) are checked in tests/workers/test_layers.py."""
    result = gpu_check.run("cpu", quick=True)
    assert result["layouts"] == sorted(LAYOUTS) and result["cases_checked"] == len(CASES) + 2
    for figures in result["rates"].values():
        assert figures["gather_bytes_per_s"] > 0 and figures["scatter_from_host_bytes_per_s"] > 0
