"""Tests for workers/store/validated_copy.py: copies out of a store that its owner frees
or rewrites, with and without expected digests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import workers.store.validated_copy as validated_copy
from tests.workers.store.store_helpers import DIGESTS, make_kv
from workers.store.page_store import SharedPageStore
from workers.store.validated_copy import ValidatedCopy


def test_runs_splits_rows_into_consecutive_runs():
    runs = validated_copy._runs
    assert runs(np.array([3, 4, 5, 9, 2, 3], dtype=np.int64)) == [(3, 3), (1, 9), (2, 2)]
    assert runs(np.array([5, 5], dtype=np.int64)) == [(1, 5), (1, 5)]  # a page twice: two runs
    assert runs(np.array([], dtype=np.int64)) == []


def test_copy_validated_reports_freed_and_rewritten_pages(store):
    layout = store.layout
    pages = store.allocate(4)
    kvs = [make_kv(layout, seed) for seed in range(4)]
    for page, kv in zip(pages, kvs, strict=True):
        store.write_page(page, kv)
    expected = store.generations(pages)  # what the owner would advertise with the pages
    with SharedPageStore.attach(store.name) as reader:
        store.free([pages[1]])  # the owner frees one page...
        store.write_page(pages[3], make_kv(layout, 9))  # ...and rewrites another
        out = torch.empty((4, *layout.page_shape))
        result = reader.copy_pages_validated(pages, expected, out)
        assert result == ValidatedCopy([True, False, True, False])
        assert not result.all_valid
        assert torch.equal(out[0], kvs[0]) and torch.equal(out[2], kvs[2])
        reader.check_integrity()
        with pytest.raises(ValueError, match="3 expected generations for 4 pages"):
            reader.copy_pages_validated(pages, expected[:3], out)
    store.check_integrity()


def test_copy_validated_all_unchanged(store):
    pages = store.allocate(2)
    out = torch.empty((2, *store.layout.page_shape))
    assert store.copy_pages_validated(pages, store.generations(pages), out).all_valid
    store.check_integrity()


def test_copy_validated_with_digests_wants_both_generation_and_digest(store):
    layout = store.layout
    pages = store.allocate(5)
    kvs = [make_kv(layout, seed) for seed in range(5)]
    for page, kv in zip(pages, kvs, strict=True):
        store.write_page(page, kv)
    store.set_digests(pages[:4], DIGESTS[:4])  # the last page is never published
    gens = store.generations(pages)
    wanted = [DIGESTS[0], DIGESTS[7], DIGESTS[2], DIGESTS[3], DIGESTS[4]]
    with SharedPageStore.attach(store.name) as reader:
        store.free([pages[3]])  # freed: generation and digest both gone
        out = torch.empty((5, *layout.page_shape))
        result = reader.copy_pages_validated(pages, gens, out, digests=wanted)
        # page 1 holds another chain than asked; page 4 records nothing
        assert result == ValidatedCopy([True, False, True, False, False])
        assert torch.equal(out[0], kvs[0]) and torch.equal(out[2], kvs[2])
        # Without digests only the generations count, as before.
        assert reader.copy_pages_validated(pages, gens, out).valid == [True] * 3 + [False, True]
        with pytest.raises(ValueError, match="4 expected digests for 5 pages"):
            reader.copy_pages_validated(pages, gens, out, digests=wanted[:4])
        with pytest.raises(ValueError, match=r"digest must be 16 bytes, got 3 \(page 1\)"):
            reader.copy_pages_validated(pages, gens, out, digests=[DIGESTS[0], b"abc", *wanted[2:]])
        reader.check_integrity()
    store.check_integrity()


def test_a_digest_recorded_while_a_copy_runs_does_not_vouch_for_it(store, monkeypatch):
    # The model writes KV without bumping generations, then publish records the digest:
    # a copy that started before the digest was there may have torn bytes, so the digest
    # read before the copy must already match.
    pages = store.allocate(2)
    gens = store.generations(pages)
    runs = validated_copy._runs

    def publish_during_copy(rows):
        store.set_digests(pages, DIGESTS[:2])
        return runs(rows)

    monkeypatch.setattr(validated_copy, "_runs", publish_during_copy)
    out = torch.empty((2, *store.layout.page_shape))
    assert store.copy_pages_validated(pages, gens, out, digests=DIGESTS[:2]).valid == [False] * 2
    monkeypatch.setattr(validated_copy, "_runs", runs)
    assert store.copy_pages_validated(pages, gens, out, digests=DIGESTS[:2]).all_valid
    store.check_integrity()
