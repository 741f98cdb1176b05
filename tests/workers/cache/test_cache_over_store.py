"""The prefix cache over the real shared-memory page store: bytes and digests, not just ids."""

from __future__ import annotations

import torch

from cache_service.events import Namespace, PagesStored
from tests.workers.cache_helpers import make_tokens
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.store.digests import EMPTY_DIGEST, page_digests
from workers.store.page_store import SharedPageStore, StoreLayout

NS = Namespace("tiny")
LAYOUT = StoreLayout(num_pages=16, num_layers=2, num_kv_heads=2, page_tokens=4, head_dim=3)


def _kv_for(tokens: list[int]) -> torch.Tensor:
    """Deterministic stand-in KV of a run of tokens: (layers, 2, heads, len, head_dim)."""
    t = torch.tensor(tokens, dtype=torch.float32).view(1, 1, 1, -1, 1)
    return t.expand(LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, -1, LAYOUT.head_dim).clone()


def _write(store: SharedPageStore, allocation, start: int, end: int) -> None:
    p = LAYOUT.page_tokens
    for pos in range(start, end):
        page = store.page(allocation.pages[pos // p])
        page[:, :, :, pos % p, :] = _kv_for([allocation.tokens[pos]])[:, :, :, 0, :]


def _held(store: SharedPageStore, allocation, end: int) -> torch.Tensor:
    p = LAYOUT.page_tokens
    pages = store.read_pages(allocation.pages)  # (n_pages, layers, 2, heads, p, dim)
    flat = pages.permute(1, 2, 3, 0, 4, 5).reshape(
        LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, -1, LAYOUT.head_dim
    )
    assert flat.shape[3] == len(allocation.pages) * p
    return flat[:, :, :, :end, :]


def test_reused_and_copied_slots_hold_the_exact_kv():
    with SharedPageStore.create(LAYOUT, tag="cachetest") as store:
        cache = PrefixCache(store, PrefixCacheConfig(page_tokens=4))
        first = cache.acquire(make_tokens((10, 10)), NS)
        _write(store, first, 0, 10)
        first.publish(10)
        [stored] = cache.take_events()
        assert stored == PagesStored(
            NS, None, (0, 1), (store.generation(0), store.generation(1)), tuple(range(10, 18))
        )
        first.release()

        # 1 full page plus 2 tokens of the second are shared: the second page is copied
        second = cache.acquire(make_tokens((10, 6), (99, 3)), NS)
        assert second.cached_tokens == 6 and second.pages[0] == 0 and second.pages[1] != 1
        assert torch.equal(_held(store, second, 6), _kv_for(make_tokens((10, 6))))
        _write(store, second, 6, 9)
        assert torch.equal(_held(store, second, 9), _kv_for(second.tokens))
        # the source page is untouched by the copy and the write that followed
        assert torch.equal(store.read_pages([1])[0], _kv_for(make_tokens((14, 4))))
        second.release()
        cache.check_integrity()


def test_evicted_page_changes_generation_for_peers():
    with SharedPageStore.create(LAYOUT, tag="cachetest") as store:
        cache = PrefixCache(store, PrefixCacheConfig(page_tokens=4))
        allocation = cache.acquire(make_tokens((0, 5)), NS)
        _write(store, allocation, 0, 5)
        allocation.publish(5)
        allocation.release()
        [stored] = cache.take_events()
        out = torch.empty((1, *LAYOUT.page_shape))
        assert store.copy_pages_validated([0], list(stored.generations), out).all_valid
        cache.evict(1)
        # a peer holding the advertised generation now sees the page as stale
        assert not store.copy_pages_validated([0], list(stored.generations), out).all_valid
        cache.check_integrity()


def test_published_pages_carry_digests_a_peer_can_check():
    with SharedPageStore.create(LAYOUT, tag="cachetest") as store:
        cache = PrefixCache(store, PrefixCacheConfig(page_tokens=4))
        tokens = make_tokens((100, 10))  # two full pages and a partial one
        allocation = cache.acquire(tokens, NS)
        _write(store, allocation, 0, 10)
        assert store.digests(allocation.pages) == [EMPTY_DIGEST] * 3  # computed, not shared
        allocation.publish(10)
        [stored] = cache.take_events()
        wanted = page_digests(NS, store.kv_format, tokens, 4)
        assert store.digests(allocation.pages) == wanted + [EMPTY_DIGEST]
        allocation.release()

        # A peer asks for the pages with the digests of its own prompt.
        pages, gens = list(stored.page_ids), list(stored.generations)
        out = torch.empty((2, *LAYOUT.page_shape))
        with SharedPageStore.attach(store.name) as peer:
            assert peer.copy_pages_validated(pages, gens, out, digests=wanted).all_valid
            assert torch.equal(out, store.read_pages(pages))
            other_tenant = page_digests(Namespace("tiny", salt="x"), store.kv_format, tokens, 4)
            verdict = peer.copy_pages_validated(pages, gens, out, digests=other_tenant)
            assert verdict.valid == [False, False]
            other_prompt = page_digests(NS, store.kv_format, make_tokens((100, 4), (7, 4)), 4)
            verdict = peer.copy_pages_validated(pages, gens, out, digests=other_prompt)
            assert verdict.valid == [True, False]  # the same first page, another second
            assert cache.clear() == 2  # evicted: freed, the digests go with the generations
            assert peer.digests(pages) == [EMPTY_DIGEST] * 2
            assert not any(peer.copy_pages_validated(pages, gens, out, digests=wanted).valid)
            peer.check_integrity()
        cache.check_integrity()
