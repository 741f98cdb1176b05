"""The local prefix cache: exact page ids, COW, batches, events, digests (eviction order:
test_eviction.py)."""

from __future__ import annotations

import random
import threading

import pytest

from cache_service.events import AllCleared, Namespace, PagesRemoved, PagesStored
from tests.workers.cache_helpers import (
    NS,
    PAGE,
    RecordingPool,
    make_cache,
    make_tokens,
    run_request,
)
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.store.digests import EMPTY_DIGEST, page_digests


def test_miss_then_hit_pins_exact_pages():
    cache, pool = make_cache(num_pages=32)
    first = cache.acquire(make_tokens((0, 10)), NS)
    assert first.pages == [0, 1, 2]  # 2 full pages + the partial third
    assert first.cached_tokens == 0
    pool.write(first, 0, 10)
    assert first.publish(10) == 2
    assert cache.take_events() == [
        PagesStored(NS, None, (0, 1), (0, 0), tuple(range(8))),
    ]
    first.release()
    stats = cache.stats()
    assert (stats["free_pages"], stats["cached_pages"], stats["in_use_pages"]) == (30, 2, 0)

    second = cache.acquire(make_tokens((0, 8), (100, 5)), NS)
    # pages 0 and 1 reused; page 2 (the last freed) is handed out again first
    assert second.pages == [0, 1, 2, 3]
    assert second.cached_tokens == 8
    pool.assert_holds(second, 8)
    stats = cache.stats()
    assert stats["hit_tokens"] == 8 and stats["queried_tokens"] == 23
    assert stats["computed_tokens"] == 10 + 5
    second.release()
    cache.check_integrity()


def test_fully_cached_prompt_recomputes_only_last_token_via_cow():
    cache, pool = make_cache()
    run_request(cache, pool, make_tokens((0, 8)))
    again = cache.acquire(make_tokens((0, 8)), NS)
    # page 0 referenced, page 1 copied (3 of 4 slots) into a private page
    assert again.cached_tokens == 7
    assert again.pages[0] == 0 and again.pages[1] not in (0, 1)
    assert pool.copies == [(1, again.pages[1], 3)]
    pool.assert_holds(again, 7)
    assert cache.stats()["cow_tokens"] == 3
    again.release()
    cache.check_integrity()


def test_partial_page_match_copies_matching_slots():
    cache, pool = make_cache()
    run_request(cache, pool, make_tokens((0, 12)))
    # shares 1 full page and the first 2 tokens of the second, then diverges
    prompt = make_tokens((0, 6), (500, 6))
    allocation = cache.acquire(prompt, NS)
    assert allocation.cached_tokens == 6
    assert pool.copies == [(1, allocation.pages[1], 2)]
    pool.assert_holds(allocation, 6)
    pool.write(allocation, 6, 12)
    allocation.publish(12)
    # the COW page became a page of its own, a sibling of the page it was copied from
    stored = cache.take_events()[-1]
    assert stored.parent_page == 0 and stored.page_ids == tuple(allocation.pages[1:3])
    allocation.release()
    cache.check_integrity()


def test_namespaces_never_share_pages():
    cache, pool = make_cache()
    tokens = make_tokens((0, 16))
    run_request(cache, pool, tokens, ns=Namespace("m", salt="tenant-a"))
    other = cache.acquire(tokens, Namespace("m", salt="tenant-b"))
    assert other.cached_tokens == 0
    assert set(other.pages).isdisjoint({0, 1, 2, 3})
    assert cache.match_length(tokens, Namespace("m", salt="tenant-a")) == 16
    assert cache.match_length(tokens, Namespace("m", salt="tenant-b")) == 0
    other.release()
    cache.check_integrity()


def test_exact_token_comparison_distinguishes_every_token():
    cache, pool = make_cache()
    run_request(cache, pool, make_tokens((0, 9)))
    for changed in range(8):
        tokens = make_tokens((0, 9))
        tokens[changed] = 10_000
        assert cache.match_length(tokens, NS) == (changed // PAGE) * PAGE
    cache.check_integrity()


def test_out_of_pages_is_none_and_changes_nothing():
    cache, pool = make_cache(num_pages=6)
    held = run_request(cache, pool, make_tokens((0, 16)), release=False)  # 4 pages pinned
    run_request(cache, pool, make_tokens((500, 4), (1, 1)))  # 1 page cached, 1 freed
    before = cache.stats()
    cache.take_events()
    assert cache.acquire(make_tokens((1000, 13)), NS) is None  # needs 4, can get 2
    after = cache.stats()
    assert after["failed_acquires"] == before["failed_acquires"] + 1
    for key in ("free_pages", "cached_pages", "in_use_pages", "evictions"):
        assert after[key] == before[key]
    assert cache.take_events() == []
    held.release()
    cache.check_integrity()


def test_bad_calls_raise_and_change_nothing():
    cache, pool = make_cache()
    with pytest.raises(ValueError, match="no tokens"):
        cache.acquire([], NS)
    with pytest.raises(ValueError, match="extra_token_slots"):
        cache.acquire([1, 2], NS, extra_token_slots=-1)
    allocation = cache.acquire(make_tokens((0, 6)), NS)
    with pytest.raises(ValueError, match="cannot publish 7 tokens of an allocation holding 6"):
        allocation.publish(7)
    allocation.release()
    with pytest.raises(RuntimeError, match="already released"):
        allocation.release()
    with pytest.raises(RuntimeError, match="already released"):
        allocation.publish(1)
    assert cache.stats()["cached_pages"] == 0
    cache.check_integrity()


def test_unpublished_pages_are_dropped_on_release_silently():
    cache, pool = make_cache()
    allocation = cache.acquire(make_tokens((0, 9)), NS)
    allocation.release()
    assert cache.take_events() == []
    stats = cache.stats()
    assert (stats["free_pages"], stats["cached_pages"], stats["aborted_pages"]) == (32, 0, 2)
    assert cache.match_length(make_tokens((0, 9)), NS) == 0
    cache.check_integrity()


def test_pending_pages_are_not_matched_outside_their_batch():
    cache, pool = make_cache()
    first = cache.acquire(make_tokens((0, 9)), NS)
    second = cache.acquire(make_tokens((0, 9)), NS)
    assert second.cached_tokens == 0  # the first has not computed its pages yet
    pool.write(first, 0, 9)
    first.publish(9)
    pool.write(second, 0, 9)
    assert second.publish(9) == 0  # a duplicate: the first's pages are the shared ones
    second.release()
    first.release()
    assert cache.match_length(make_tokens((0, 9)), NS) == 8
    cache.check_integrity()


def test_batch_computes_a_common_prefix_once():
    cache, pool = make_cache(num_pages=64)
    prefix = make_tokens((0, 12))
    prompts = [prefix + make_tokens((1000 * (i + 1), 6)) for i in range(3)]
    plan = cache.acquire_batch(prompts, NS)
    assert [entry.compute_from for entry in plan] == [0, 12, 12]
    assert [entry.depends_on for entry in plan] == [(), (0,), (0,)]
    shared = plan[0].allocation.pages[:3]
    assert all(entry.allocation.pages[:3] == shared for entry in plan)
    assert cache.stats()["batch_shared_tokens"] == 24
    assert cache.stats()["hit_tokens"] == 0
    for entry in plan:  # run in plan order, as a worker would
        allocation = entry.allocation
        pool.assert_holds(allocation, entry.compute_from)
        pool.write(allocation, entry.compute_from, allocation.num_tokens)
        allocation.publish(allocation.num_tokens)
    for entry in plan:
        entry.allocation.release()
    assert cache.match_length(prompts[2], NS) == 16
    cache.check_integrity()


def test_batch_that_does_not_fit_holds_nothing():
    cache, pool = make_cache(num_pages=8)
    prompts = [make_tokens((0, 12), (1000 * (i + 1), 8)) for i in range(4)]
    assert cache.acquire_batch(prompts, NS) is None
    stats = cache.stats()
    assert (stats["free_pages"], stats["live_allocations"]) == (8, 0)
    cache.check_integrity()


def test_chunk_aligned_match_rounds_down():
    cache, pool = make_cache(chunk_tokens=8)
    run_request(cache, pool, make_tokens((0, 16)))
    allocation = cache.acquire(make_tokens((0, 14), (700, 4)), NS)
    assert allocation.cached_tokens == 8  # 12 matched full pages -> 8 on a chunk boundary
    assert cache.stats()["hit_tokens"] == 8
    pool.assert_holds(allocation, 8)
    allocation.release()
    cache.check_integrity()


@pytest.mark.parametrize("publish_decode", [True, False])
def test_decode_pages_published_only_when_switched_on(publish_decode):
    cache, pool = make_cache(publish_decode_pages=publish_decode)
    allocation = cache.acquire(make_tokens((0, 6)), NS, extra_token_slots=2)
    assert len(allocation.pages) == 2
    pool.write(allocation, 0, 6)
    for token in (60, 61, 62, 63, 64):  # decode: each token is appended, then computed
        assert allocation.extend([token])
        pool.write(allocation, allocation.num_tokens - 1, allocation.num_tokens)
    assert len(allocation.pages) == 3
    published = allocation.publish(allocation.num_tokens)
    assert published == (2 if publish_decode else 1)
    allocation.release()
    tokens = make_tokens((0, 6)) + [60, 61, 62, 63, 64]
    assert cache.match_length(tokens, NS) == (8 if publish_decode else 4)
    cache.check_integrity()


def test_extend_without_pages_returns_false_and_keeps_tokens():
    cache, pool = make_cache(num_pages=2)
    allocation = cache.acquire(make_tokens((0, 8)), NS)
    assert not allocation.extend([1, 2])
    assert allocation.num_tokens == 8 and len(allocation.pages) == 2
    allocation.release()
    cache.check_integrity()


def test_clear_and_snapshot():
    cache, pool = make_cache()
    run_request(cache, pool, make_tokens((0, 12), (1, 1)))
    run_request(cache, pool, make_tokens((0, 4), (300, 8), (1, 1)))
    cache.take_events()
    chains = cache.snapshot()
    assert sorted([(c.parent_page, c.page_ids) for c in chains], key=str) == sorted(
        [(None, (0,)), (0, (1, 2)), (0, (3, 4))], key=str
    )
    held = cache.acquire(make_tokens((0, 12), (2, 1)), NS)
    assert cache.clear() == 2  # 0-1-2 are held; the sibling branch 3-4 goes
    assert cache.take_events() == [PagesRemoved((4, 3), "cleared")]
    held.release()
    assert cache.clear() == 3
    assert cache.take_events() == [AllCleared()]
    assert cache.stats()["free_pages"] == 32
    cache.check_integrity()


def test_many_threads_acquire_publish_release():
    cache, pool = make_cache(num_pages=96, page_tokens=4)
    prefixes = [make_tokens((i * 1000, 12)) for i in range(4)]
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                tail = [rng.randrange(50) for _ in range(rng.randint(1, 9))]
                tokens = rng.choice(prefixes) + tail
                allocation = cache.acquire(tokens, NS, extra_token_slots=rng.randint(0, 4))
                if allocation is None:
                    continue
                with cache._lock:  # the "model" writes while the pages are held
                    pool.assert_holds(allocation, allocation.cached_tokens)
                    pool.write(allocation, allocation.cached_tokens, allocation.num_tokens)
                allocation.publish(allocation.num_tokens)
                allocation.release()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    stats = cache.stats()
    assert stats["queries"] == 8 * 150
    assert stats["hit_tokens"] > 0 and stats["live_allocations"] == 0
    cache.check_integrity()


# ---- digests: recorded at publish, for exactly the pages that become shareable -------------


def chain(tokens, ns=NS, kv_format=""):
    """What a requester expects each full page of `tokens` to record."""
    return page_digests(ns, kv_format, tokens, PAGE)


def test_publish_records_digests_of_exactly_the_published_pages():
    cache, pool = make_cache()
    tokens = make_tokens((0, 10))
    allocation = cache.acquire(tokens, NS)
    assert allocation.pages == [0, 1, 2]
    assert pool.digests([0, 1, 2]) == [EMPTY_DIGEST] * 3  # pending and private: none yet
    pool.write(allocation, 0, 10)
    allocation.publish(10)
    assert pool.digests([0, 1, 2]) == chain(tokens) + [EMPTY_DIGEST]  # the partial page: none
    allocation.release()
    assert pool.digests([0, 1, 2]) == chain(tokens) + [EMPTY_DIGEST]  # cached, still shareable
    cache.check_integrity()


def test_a_chain_published_in_two_publishes_records_the_same_digests():
    cache, pool = make_cache()
    tokens = make_tokens((0, 12))
    allocation = cache.acquire(tokens, NS)
    pool.write(allocation, 0, 12)
    assert allocation.publish(5) == 1
    assert pool.digests(allocation.pages) == chain(tokens)[:1] + [EMPTY_DIGEST] * 2
    cache.check_integrity()
    assert allocation.publish(12) == 2
    assert pool.digests(allocation.pages) == chain(tokens)
    allocation.release()
    # a later request extends the cached chain from its node's digest
    longer = tokens + make_tokens((50, 5))
    run_request(cache, pool, longer)
    assert pool.digests([0, 1, 2, 3]) == chain(longer)
    cache.check_integrity()


def test_same_batch_sharing_records_one_digest_per_shared_page():
    cache, pool = make_cache(num_pages=64)
    prefix = make_tokens((0, 8))
    prompts = [prefix + make_tokens((1000 * (i + 1), 5)) for i in range(3)]
    plan = cache.acquire_batch(prompts, NS)
    shared = plan[0].allocation.pages[:2]
    assert all(entry.allocation.pages[:2] == shared for entry in plan)
    for entry in plan:  # one forward pass computes them all
        pool.write(entry.allocation, entry.compute_from, entry.allocation.num_tokens)
    plan[1].allocation.publish(len(prompts[1]))  # a sibling first: the shared pages go with it
    assert pool.digests(shared) == chain(prompts[1])[:2] == chain(prefix)
    assert pool.digests(plan[0].allocation.pages[2:]) == [EMPTY_DIGEST] * 2
    for entry, prompt in zip(plan, prompts, strict=True):
        entry.allocation.publish(len(prompt))
        own = entry.allocation.pages[2]
        assert pool.digests([own, entry.allocation.pages[3]]) == chain(prompt)[2:] + [EMPTY_DIGEST]
    cache.check_integrity()
    for entry in plan:
        entry.allocation.release()
    cache.check_integrity()


def test_cow_and_unpublished_decode_pages_record_nothing():
    cache, pool = make_cache(publish_decode_pages=False)
    run_request(cache, pool, make_tokens((0, 8)))
    again = cache.acquire(make_tokens((0, 8)), NS, extra_token_slots=4)
    cow, decode = again.pages[1], again.pages[2]
    assert pool.copies == [(1, cow, 3)]
    pool.write(again, 7, 8)
    assert again.extend([60, 61, 62, 63])
    pool.write(again, 8, 12)
    assert again.publish(12) == 0  # the copy duplicates page 1; decode pages stay private
    assert pool.digests([0, 1, cow, decode]) == chain(make_tokens((0, 8))) + [EMPTY_DIGEST] * 2
    cache.check_integrity()
    again.release()
    cache.check_integrity()


def test_eviction_clears_digests_and_namespaces_and_formats_differ():
    pool = RecordingPool(16)
    pool.kv_format = "kv1:test"
    cache = PrefixCache(pool, PrefixCacheConfig(page_tokens=PAGE))
    tokens = make_tokens((0, 8), (9, 1))
    tenant = Namespace("test-model", salt="b")
    assert run_request(cache, pool, tokens, ns=NS).pages == [0, 1, 2]
    assert run_request(cache, pool, tokens, ns=tenant).pages == [2, 3, 4]  # 2: freed, reused
    assert pool.digests([0, 1]) == chain(tokens, kv_format="kv1:test")
    assert pool.digests([2, 3]) == chain(tokens, tenant, kv_format="kv1:test")
    assert pool.digests([0]) != chain(tokens)[:1]  # another format: another root
    assert cache.clear() == 4
    assert pool.digests([0, 1, 2, 3]) == [EMPTY_DIGEST] * 4
    cache.check_integrity()


def test_check_integrity_catches_a_wrong_or_stray_digest():
    cache, pool = make_cache()
    run_request(cache, pool, make_tokens((0, 8)))
    pool.set_digest(1, chain(make_tokens((0, 4), (99, 4)))[1])  # not what page 1 holds
    with pytest.raises(AssertionError, match="page 1 records digest"):
        cache.check_integrity()
    pool.set_digest(1, chain(make_tokens((0, 8)))[1])
    held = cache.acquire(make_tokens((20, 6)), NS)
    pool.set_digest(held.pages[1], chain(make_tokens((0, 8)))[1])  # a private page
    with pytest.raises(AssertionError, match=f"page {held.pages[1]} records digest"):
        cache.check_integrity()
    pool.bump_generation(held.pages[1])  # rewritten: cleared
    held.release()
    cache.check_integrity()


def test_drop_takes_a_page_and_every_page_after_it_once_no_request_holds_them():
    cache, pool = make_cache(num_pages=32)
    run_request(cache, pool, make_tokens((0, 16)))  # pages 0-3, one run
    run_request(cache, pool, make_tokens((0, 8), (200, 8)))  # a branch after page 1: 4, 5
    run_request(cache, pool, make_tokens((500, 8)))  # another chain: 6, 7
    cache.take_events()
    held = cache.acquire(make_tokens((0, 8), (200, 9)), NS)  # holds pages 0, 1, 4, 5
    assert cache.drop([1]) == (0, 1)  # a request holds page 1: nothing goes yet
    assert cache.take_events() == []
    assert cache.drop([2]) == (2, 0)  # page 2 and page 3 after it
    assert cache.take_events() == [PagesRemoved((3, 2), "quarantined")]
    held.release()
    assert cache.drop([1]) == (3, 0)  # page 1 and what hangs under it: the branch 4, 5
    assert cache.take_events() == [PagesRemoved((5, 4, 1), "quarantined")]
    assert cache.match_length(make_tokens((0, 16)), NS) == 4  # page 0 is still there
    assert cache.match_length(make_tokens((500, 8)), NS) == 8
    stats = cache.stats()
    assert stats["evictions"]["quarantined"] == 5
    assert (stats["cached_pages"], stats["in_use_pages"]) == (3, 0)
    assert cache.evict(32) == 3  # what is left is evictable as ever
    cache.check_integrity()
