"""Tests for workers/store/page_store.py: allocation, page access, page digests and
generations, and what an attached reader may and may not do."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.workers.store.store_helpers import DIGESTS, OWN_PREFIX, make_kv, make_layout
from workers.store.digests import EMPTY_DIGEST
from workers.store.page_pool import PagePool
from workers.store.page_store import (
    SHM_DIR,
    NotOwnerError,
    PageStoreError,
    SharedPageStore,
)

# -- allocation ----------------------------------------------------------------------------


def test_fresh_store_hands_out_ascending_ids(store):
    assert store.is_owner and store.name.startswith(OWN_PREFIX) and store.name.endswith("-unit")
    assert (store.num_pages, store.num_free) == (8, 8)
    assert store.allocate(3) == [0, 1, 2]
    assert store.allocate(2) == [3, 4]
    assert store.num_free == 3
    assert store.can_allocate(3) and not store.can_allocate(4)
    assert store.allocate(4) is None  # running out is a return value, and takes nothing
    assert store.num_free == 3
    store.check_integrity()


def test_free_bumps_generation_in_shared_memory(store):
    pages = store.allocate(3)
    assert store.generations(pages) == [0, 0, 0]
    store.free([pages[1]])
    assert store.generations(pages) == [0, 1, 0]
    assert store.generation(1) == 1
    # LIFO: the page just freed is the next one handed out.
    assert store.allocate(1) == [1]
    store.check_integrity()


def test_double_free_raises_and_changes_nothing(store):
    pages = store.allocate(3)
    store.free([pages[0]])
    with pytest.raises(ValueError, match="page 0 freed twice"):
        store.free([pages[2], pages[0]])
    assert store.num_free == 6
    assert store.generations(pages) == [1, 0, 0]
    with pytest.raises(ValueError, match=r"page 8 out of range \[0, 8\)"):
        store.free([8])
    with pytest.raises(ValueError, match="page 1 freed twice"):
        store.free([pages[2], pages[1], pages[1]])  # twice in one call
    assert store.num_free == 6
    store.check_integrity()


def test_create_rejects_bad_tag_and_other_devices():
    with pytest.raises(ValueError, match="tag must match"):
        SharedPageStore.create(make_layout(), tag="Bad-Tag")
    with pytest.raises(ValueError, match="page store on meta: the device must be cpu or cuda"):
        SharedPageStore.create(make_layout(), device="meta")
    if not torch.cuda.is_available():  # no CUDA here: a clear error, and no segment left
        with pytest.raises(PageStoreError, match="page store on cuda: no CUDA device"):
            SharedPageStore.create(make_layout(), tag="nocuda", device="cuda")
        assert not any(name.endswith("-nocuda") for name in os.listdir(SHM_DIR))
    with SharedPageStore.create(make_layout(), tag="twice") as store:
        with pytest.raises(PageStoreError, match="already exists"):
            SharedPageStore.create(make_layout(), tag="twice")
        store.check_integrity()


# -- page access ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_write_and_read_pages(dtype):
    layout = make_layout(dtype=dtype)
    with SharedPageStore.create(layout) as store:
        pages = store.allocate(3)
        kvs = [make_kv(layout, seed) for seed in range(3)]
        for page, kv in zip(pages, kvs, strict=True):
            store.write_page(page, kv)
        assert store.generations(pages) == [1, 1, 1]  # a write is a rewrite
        assert torch.equal(store.page(1), kvs[1])
        gathered = store.read_pages([2, 0])
        assert torch.equal(gathered, torch.stack([kvs[2], kvs[0]]))
        out = torch.empty((2, *layout.page_shape), dtype=layout.torch_dtype)
        assert store.read_pages([1, 2], out=out) is out
        assert torch.equal(out, torch.stack([kvs[1], kvs[2]]))
        store.check_integrity()


def test_write_page_rejects_bad_input_and_free_pages(store):
    layout = store.layout
    (page,) = store.allocate(1)
    with pytest.raises(ValueError, match="write_page needs"):
        store.write_page(page, torch.zeros(layout.page_shape, dtype=torch.float16))
    with pytest.raises(ValueError, match="write_page needs"):
        store.write_page(page, torch.zeros((1, *layout.page_shape)))
    with pytest.raises(ValueError, match="page 5 is free"):
        store.write_page(5, make_kv(layout, 0))
    with pytest.raises(ValueError, match="out of range"):
        store.read_pages([0, 8])
    with pytest.raises(ValueError, match="out must be"):
        store.read_pages([0], out=torch.empty(layout.page_shape))
    assert store.generation(page) == 0  # nothing written
    store.check_integrity()


def test_copy_page_copies_only_the_first_tokens(store):
    layout = store.layout
    src, dst = store.allocate(2)
    src_kv, dst_kv = make_kv(layout, 1), make_kv(layout, 2)
    store.write_page(src, src_kv)
    store.write_page(dst, dst_kv)
    generation = store.generation(dst)
    store.copy_page(src, dst, num_tokens=3)
    # page: (num_layers, 2, num_kv_heads, page_tokens, head_dim); tokens are dim 3.
    expected = dst_kv.clone()
    expected[:, :, :, :3] = src_kv[:, :, :, :3]
    assert torch.equal(store.page(dst), expected)
    assert torch.equal(store.page(src), src_kv)
    assert store.generation(dst) == generation + 1
    with pytest.raises(ValueError, match="num_tokens 5 outside"):
        store.copy_page(src, dst, num_tokens=5)
    with pytest.raises(ValueError, match="onto itself"):
        store.copy_page(src, src, num_tokens=1)
    with pytest.raises(ValueError, match="page 7 is free"):
        store.copy_page(src, 7, num_tokens=1)
    store.check_integrity()


# -- digests -------------------------------------------------------------------------------


def test_digests_are_recorded_until_free_or_rewrite(store):
    pages = store.allocate(4)
    assert store.kv_format == store.layout.kv_format
    assert store.digests(pages) == [EMPTY_DIGEST] * 4  # a fresh segment is all zeros
    store.set_digests(pages[::-1], DIGESTS[:4])  # not a run of pages: one by one
    assert store.digests(pages) == DIGESTS[:4][::-1]
    store.set_digests(pages, DIGESTS[:4])  # a run: one copy
    store.set_digest(pages[0], DIGESTS[5])  # recorded again: the last one counts
    assert store.digests(pages[::-1]) == [DIGESTS[3], DIGESTS[2], DIGESTS[1], DIGESTS[5]]
    gens = store.generations(pages)
    store.free([pages[0]])
    store.write_page(pages[1], make_kv(store.layout, 1))
    store.copy_page(pages[3], pages[2], num_tokens=1)  # into page 2: a rewrite of it
    assert store.digests(pages) == [EMPTY_DIGEST] * 3 + [DIGESTS[3]]
    assert store.generations(pages) == [g + 1 for g in gens[:3]] + gens[3:]
    (again,) = store.allocate(1)
    assert again == pages[0] and store.digests([again]) == [EMPTY_DIGEST]
    store.check_integrity()


def test_set_digest_checks_its_input_and_changes_nothing_on_error(store):
    pages = store.allocate(2)
    store.set_digest(pages[0], DIGESTS[0])
    with pytest.raises(ValueError, match="digest must be 16 bytes, got 15"):
        store.set_digest(pages[1], bytes(range(1, 16)))
    with pytest.raises(ValueError, match="empty digest"):
        store.set_digest(pages[1], EMPTY_DIGEST)
    with pytest.raises(ValueError, match="page 5 is free"):
        store.set_digest(5, DIGESTS[5])
    with pytest.raises(ValueError, match=r"page 8 out of range \[0, 8\)"):
        store.set_digest(8, DIGESTS[0])
    with pytest.raises(ValueError, match=r"page -1 out of range"):
        store.set_digests([pages[1], -1], DIGESTS[:2])
    with pytest.raises(ValueError, match="page 5 is free"):
        store.set_digests([pages[1], 5], DIGESTS[:2])  # all or nothing: page 1 untouched
    with pytest.raises(ValueError, match="page 2 is free"):
        store.set_digests([1, 2], DIGESTS[:2])  # a run, partly free
    with pytest.raises(ValueError, match=r"page 8 out of range"):
        store.set_digests([7, 8], DIGESTS[:2])
    with pytest.raises(ValueError, match="digest must be 16 bytes, got 15"):
        store.set_digests(pages, [bytes(15), bytes(17)])  # 32 bytes in all, still refused
    with pytest.raises(ValueError, match="1 digests for 2 pages"):
        store.set_digests(pages, DIGESTS[:1])
    with pytest.raises(ValueError, match=r"pages \[9\] out of range"):
        store.digests([0, 9])
    assert store.digests(pages) == [DIGESTS[0], EMPTY_DIGEST]
    store.check_integrity()


def test_a_reader_reads_digests_but_may_not_record_them(store):
    pages = store.allocate(2)
    store.set_digest(pages[1], DIGESTS[1])
    with SharedPageStore.attach(store.name) as reader:
        assert reader.kv_format == store.kv_format
        assert reader.digests(pages) == [EMPTY_DIGEST, DIGESTS[1]]
        for misuse in (
            lambda: reader.set_digest(pages[0], DIGESTS[0]),
            lambda: reader.set_digests(pages, DIGESTS[:2]),
        ):
            with pytest.raises(NotOwnerError, match=store.name):
                misuse()
        store.free(pages[1:])
        assert reader.digests(pages) == [EMPTY_DIGEST] * 2  # the same memory
        reader.check_integrity()
    store.check_integrity()


def test_check_integrity_catches_a_free_page_with_a_digest(store):
    store._digests[3] = 7  # a bug's work: the owner's own view of the digest region
    with pytest.raises(AssertionError, match=r"free pages \[3\] still record a digest"):
        store.check_integrity()
    store._digests[3] = 0
    store.check_integrity()


def test_a_bare_pool_keeps_digests_the_same_way():
    pool = PagePool(4)
    assert pool.kv_format == "" and PagePool(4, kv_format="kv1:x").kv_format == "kv1:x"
    pages = pool.allocate(3)
    pool.set_digests(pages, DIGESTS[:3])
    pool.bump_generation(pages[2])  # rewritten in place
    assert pool.digests(pages) == [DIGESTS[0], DIGESTS[1], EMPTY_DIGEST]
    pool.free(pages[:1])
    assert pool.digests([pages[0], pages[1]]) == [EMPTY_DIGEST, DIGESTS[1]]
    assert pool.generation(pages[0]) == 1
    with pytest.raises(ValueError, match="page 0 is free"):
        pool.set_digest(pages[0], DIGESTS[0])
    with pytest.raises(ValueError, match=r"digests must be \(4, 16\) uint8"):
        PagePool(4, digests=np.zeros((4, 8), dtype=np.uint8))
    pool.check_integrity()


# -- attached readers ----------------------------------------------------------------------


def test_attached_store_is_read_only(store):
    (page,) = store.allocate(1)
    store.write_page(page, make_kv(store.layout, 3))
    with SharedPageStore.attach(store.name) as reader:
        assert not reader.is_owner and reader.layout == store.layout
        assert torch.equal(reader.page(page), store.page(page))
        assert reader.generation(page) == 1
        for misuse in (
            lambda: reader.allocate(1),
            lambda: reader.free([page]),
            lambda: reader.can_allocate(1),
            lambda: reader.num_free,
            lambda: reader.write_page(page, make_kv(store.layout, 4)),
            lambda: reader.copy_page(page, 1, 1),
            reader.unlink,
        ):
            with pytest.raises(NotOwnerError, match=store.name):
                misuse()
        reader.check_integrity()
    assert reader.closed
    assert os.path.exists(os.path.join(SHM_DIR, store.name))  # a reader's close keeps it
    with pytest.raises(PageStoreError, match="closed"):
        reader.page(0)
    store.check_integrity()


# -- the module's names ----------------------------------------------------------------------


def test_the_store_parts_names_are_importable_from_the_page_store():
    import workers
    from workers.store import layout, page_store, segment, segment_names, validated_copy

    for module in (layout, segment, segment_names, validated_copy):
        for name in set(page_store.__all__) & set(vars(module)):
            assert getattr(page_store, name) is getattr(module, name), name
    assert page_store.FORMAT_VERSION == segment.FORMAT_VERSION == 4
    assert page_store.reclaim_dead_segments is segment_names.reclaim_dead_segments
    assert page_store.ValidatedCopy is validated_copy.ValidatedCopy
    assert (workers.SharedPageStore, workers.StoreLayout) == (SharedPageStore, layout.StoreLayout)
