"""Tests for workers/store/layout.py: a store's shape, dtype and KV format."""

from __future__ import annotations

import pytest
import torch

from tests.workers.store.store_helpers import make_layout


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_pages", 0),
        ("num_layers", -1),
        ("num_kv_heads", 1.5),
        ("page_tokens", True),
        ("head_dim", "64"),
    ],
)
def test_layout_rejects_bad_sizes_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"StoreLayout.{field} .*{value!r}"):
        make_layout(**{field: value})


def test_layout_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="StoreLayout.dtype .*'int8'"):
        make_layout(dtype="int8")


def test_layout_shape_and_bytes():
    layout = make_layout(dtype="bfloat16")
    assert layout.page_shape == (2, 2, 3, 4, 5)
    assert layout.torch_dtype is torch.bfloat16
    assert layout.page_bytes == 2 * 2 * 3 * 4 * 5 * 2
    assert make_layout().page_bytes == 2 * 2 * 3 * 4 * 5 * 4


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_page_bytes_known_without_torch_agree_with_torch(dtype):
    # The layout sizes pages from its own table (a config is checked without torch).
    layout = make_layout(dtype=dtype)
    page = torch.empty(layout.page_shape, dtype=layout.torch_dtype)
    assert layout.torch_dtype is getattr(torch, dtype)
    assert layout.page_bytes == page.numel() * page.element_size()


def test_kv_format_names_what_the_bytes_mean_not_how_many_pages():
    layout = make_layout()
    assert layout.kv_format == "kv1:layers=2:kv_heads=3:head_dim=5:page_tokens=4:dtype=float32"
    assert make_layout(num_pages=100).kv_format == layout.kv_format
    others = [
        make_layout(num_layers=3),
        make_layout(num_kv_heads=1),
        make_layout(page_tokens=8),
        make_layout(head_dim=6),
        make_layout(dtype="bfloat16"),
    ]
    assert len({layout.kv_format, *(other.kv_format for other in others)}) == 6
