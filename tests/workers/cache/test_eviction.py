"""Eviction: which unreferenced page goes first under each policy, and that pinned pages
never go (`eviction.py` ranks, `evictor.py` takes)."""

from __future__ import annotations

import pytest

from cache_service.events import PagesRemoved
from tests.workers.cache_helpers import NS, PAGE, make_cache, make_tokens, run_request
from workers.cache.eviction import EVICTION_POLICIES, make_eviction_policy
from workers.cache.prefix_cache import PrefixCacheConfig


def _one_page_sequences(cache, pool, count, keep):
    """Publish `count` one-page sequences; release all but the first `keep`, in order."""
    allocations = [
        run_request(cache, pool, make_tokens((i * 100, PAGE)), release=False) for i in range(count)
    ]
    for allocation in allocations[keep:]:
        allocation.release()
    return allocations


@pytest.mark.parametrize(
    ("reaccessed", "times", "expected_victim"),
    [((), 1, 3), ((3,), 1, 4), ((3, 4), 2, 5), ((3, 4, 5, 6, 7, 8), 3, 9), ((9, 3), 5, 4)],
)
def test_lru_evicts_least_recently_used_unreferenced(reaccessed, times, expected_victim):
    # 10 sequences of one page each; 0-2 stay referenced, 3-9 are released in order;
    # some are used again; a new allocation then needs exactly one page evicted.
    cache, pool = make_cache(num_pages=14)
    allocations = _one_page_sequences(cache, pool, count=10, keep=3)
    for _ in range(times):
        for i in reaccessed:
            again = cache.acquire(make_tokens((i * 100, PAGE), (9_000, 1)), NS)
            assert again.cached_tokens == PAGE
            again.release()
    cache.take_events()
    newcomer = cache.acquire(make_tokens((50_000, 5 * PAGE)), NS)
    assert newcomer is not None
    [removed] = cache.take_events()
    assert removed == PagesRemoved((expected_victim,), "evicted")
    for i in range(3):  # pinned pages never go
        assert cache.match_length(make_tokens((i * 100, PAGE)), NS) == PAGE
    newcomer.release()
    for allocation in allocations[:3]:
        allocation.release()
    cache.check_integrity()


def test_lfu_evicts_least_reused_first():
    cache, pool = make_cache(num_pages=14, eviction_policy="lfu")
    _one_page_sequences(cache, pool, count=10, keep=0)
    for i in (0, 1, 2, 4, 5, 6, 7, 8, 9):  # everything but 3 is reused once
        again = cache.acquire(make_tokens((i * 100, PAGE), (9_000, 1)), NS)
        again.release()
    cache.take_events()
    newcomer = cache.acquire(make_tokens((50_000, 5 * PAGE)), NS)
    assert cache.take_events() == [PagesRemoved((3,), "evicted")]
    newcomer.release()
    cache.check_integrity()


def test_equal_access_times_evict_leaf_first_in_a_fixed_order():
    cache, pool = make_cache(num_pages=16)
    # one chain of 3 pages and a sibling chain; every node of a release shares its time
    run_request(cache, pool, make_tokens((0, 12), (7, 1)))
    run_request(cache, pool, make_tokens((0, 4), (900, 8), (7, 1)))
    cache.take_events()
    assert cache.evict(5) == 5
    removed = [page for event in cache.take_events() for page in event.page_ids]
    # the older release goes first, each chain leaf-first, the shared page 0 last (the
    # partial page 3 of the first request was freed and reused by the second)
    assert removed == [2, 1, 4, 3, 0]
    assert cache.stats()["evictions"] == {"evicted": 5}
    cache.check_integrity()


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="deepest, lfu, lru"):
        make_eviction_policy("fifo")
    with pytest.raises(ValueError, match="unknown eviction_policy 'fifo'"):
        PrefixCacheConfig(eviction_policy="fifo")
    assert set(EVICTION_POLICIES) >= {"lru", "lfu"}


def test_deepest_evicts_the_longest_prefixes_first():
    cache, pool = make_cache(num_pages=16, eviction_policy="deepest")
    # the chains of the leaf-first test above: page 0, then 1-2 and (released later) 3-4
    run_request(cache, pool, make_tokens((0, 12), (7, 1)))
    run_request(cache, pool, make_tokens((0, 4), (900, 8), (7, 1)))
    cache.take_events()
    assert cache.evict(5) == 5
    removed = [page for event in cache.take_events() for page in event.page_ids]
    # depth 3 first (page 2 released before page 4), then depth 2 likewise, the root's
    # child last: LRU would take all of the older chain first ([2, 1, 4, 3, 0])
    assert removed == [2, 4, 1, 3, 0]
    assert cache.stats()["evictions"] == {"evicted": 5}
    cache.check_integrity()


def test_deepest_breaks_depth_ties_by_last_access():
    cache, pool = make_cache(num_pages=16, eviction_policy="deepest")
    run_request(cache, pool, make_tokens((0, 12), (7, 1)))  # pages 0-2, one run
    run_request(cache, pool, make_tokens((500, 4), (7, 1)))  # page 3, depth 1, newer
    cache.take_events()
    # pages 2 and 1 by depth, then page 0 before page 3: both at depth 1, page 0 older
    assert cache.evict(4) == 4
    assert cache.take_events() == [PagesRemoved((2, 1, 0, 3), "evicted")]
    assert cache.num_cached_pages == 0
    cache.check_integrity()


def _stale_heap(num_pages: int):
    """A cache holding g -> {c -> {a, b}, x} (five evictable pages, uncovered leaf after
    leaf by an eviction) and 1,500 one-page prompts referenced again, each with a private
    page: their 1,500 stale heap entries make the next push compact the heap."""
    cache, pool = make_cache(num_pages=num_pages)
    g, c, x = make_tokens((1, 4)), make_tokens((5, 4)), make_tokens((9, 4))
    for tokens in (g + c + make_tokens((20, 4)), g + c + make_tokens((30, 4)), g + x):
        run_request(cache, pool, tokens + [0])
    hot = [make_tokens((1000 + 4 * i, 4), (0, 1)) for i in range(1500)]
    for tokens in hot:
        run_request(cache, pool, tokens)
    held = [cache.acquire(tokens[:4] + [7], NS) for tokens in hot]
    assert cache.num_cached_pages == 5
    return cache, pool, held


def test_leaves_ranked_while_the_heap_is_compacted_are_still_evicted():
    """An eviction pushes the leaves it uncovers; when one of those pushes compacts the
    heap, the eviction must still see them: evict(n) of n evictable pages takes all n,
    and an acquire that needs every evictable page gets them."""
    cache, pool, held = _stale_heap(5 + 2 * 1500 + 100)
    assert cache.evict(5) == 5 and cache.num_cached_pages == 0
    for allocation in held:
        allocation.release()
    cache.check_integrity()

    cache, pool, held = _stale_heap(5 + 2 * 1500)  # not a page free
    assert pool.num_free == 0
    allocation = cache.acquire(make_tokens((9000, 17)), NS)  # 5 pages: exactly those
    assert allocation is not None and len(allocation.pages) == 5
    allocation.release()
    for allocation in held:
        allocation.release()
    cache.check_integrity()


# ---- cluster-aware: pages held elsewhere go first ----------------------------------------


def _mark(cache, pool, pages) -> int:
    return cache.held_elsewhere(list(pages), [pool.generation(page) for page in pages])


def _evict_for(cache, pages: int) -> list[int]:
    """The pages evicted to make room for a new request of `pages` full pages."""
    cache.take_events()
    newcomer = cache.acquire(make_tokens((10**6, pages * PAGE)), NS)  # shares no page
    assert newcomer is not None
    removed = [page for event in cache.take_events() for page in event.page_ids]
    newcomer.release()
    return removed


def test_pages_held_elsewhere_go_before_older_pages_only_this_worker_holds():
    cache, pool = make_cache(num_pages=10)
    _one_page_sequences(cache, pool, count=10, keep=0)  # LRU order: pages 0..9
    assert _mark(cache, pool, [7, 5]) == 2
    assert _mark(cache, pool, [5]) == 0  # marked already
    assert cache.stats()["held_elsewhere_marked_pages"] == 2
    assert _evict_for(cache, 3) == [5, 7, 0]  # the marked ones by LRU, then LRU
    stats = cache.stats()
    assert stats["held_elsewhere_evicted_pages"] == 2 and stats["held_elsewhere_marked_pages"] == 0
    cache.check_integrity()


def test_a_mark_lapses_once_the_worker_uses_its_copy_again():
    cache, pool = make_cache(num_pages=10)
    _one_page_sequences(cache, pool, count=10, keep=0)
    _mark(cache, pool, [5])
    again = cache.acquire(make_tokens((500, PAGE), (9_000, 1)), NS)  # evicts page 0
    assert again.cached_tokens == PAGE
    again.release()  # its partial page is free again
    assert _evict_for(cache, 2) == [1]  # marked still, 5 would have gone
    cache.check_integrity()


@pytest.mark.parametrize("case", ["generation", "out of range", "not published", "off"])
def test_a_notice_that_does_not_fit_changes_nothing(case):
    cache, pool = make_cache(num_pages=10, cluster_eviction=case != "off")
    _one_page_sequences(cache, pool, count=9, keep=0)  # pages 0..8; 9 free
    pages, generations = [4], [pool.generation(4)]
    if case == "generation":
        generations = [generations[0] + 1]
    elif case == "out of range":
        pages = [10]
    elif case == "not published":
        pages, generations = [9], [pool.generation(9)]
    assert cache.held_elsewhere(pages, generations) == 0
    assert _evict_for(cache, 2) == [0]  # one free page, then LRU
    cache.check_integrity()


def test_only_the_marked_pages_of_a_run_go_ahead_of_older_pages():
    cache, pool = make_cache(num_pages=6)
    run_request(cache, pool, make_tokens((0, PAGE)))  # page 0: the oldest
    long = run_request(cache, pool, make_tokens((100, 4 * PAGE)))  # pages 1-4, one run
    assert long.pages == [1, 2, 3, 4]
    _mark(cache, pool, [3, 4])
    # Page by page: 4 and 3 (marked), then the oldest unmarked page, 0, not 2.
    assert _evict_for(cache, 4) == [4, 3, 0]
    assert cache.match_length(make_tokens((100, 4 * PAGE)), NS) == 2 * PAGE
    cache.check_integrity()


def test_marks_follow_pages_into_the_runs_a_split_makes():
    cache, pool = make_cache(num_pages=8)
    run_request(cache, pool, make_tokens((5_000, PAGE)))  # page 0: the oldest
    run_request(cache, pool, make_tokens((100, 4 * PAGE)))  # pages 1-4, one run
    assert _mark(cache, pool, [3, 4]) == 2
    # A prompt sharing pages 1-2 splits the run there; 3-4 keep their access, and marks.
    run_request(cache, pool, make_tokens((100, 2 * PAGE), (7_000, PAGE)))  # page 5
    assert _mark(cache, pool, [1]) == 1  # found in the run the split made above
    cache.check_integrity()  # every page found in its run by id
    assert _evict_for(cache, 5) == [4, 3, 0]  # two pages free, then 4, 3 before 0
    cache.check_integrity()


def test_pages_are_found_by_id_after_more_runs_than_the_trie_keeps_track_of():
    # Past `_unplaced_max` runs made since the last lookup (1,024 or the page count), the
    # trie drops its list of them and the next lookup walks the whole trie instead.
    cache, pool = make_cache(num_pages=160)
    cache._trie._unplaced_max = 64
    _one_page_sequences(cache, pool, count=150, keep=0)
    assert cache._trie._rewalk  # the path under test
    assert _mark(cache, pool, [5, 149]) == 2
    assert _evict_for(cache, 13) == [5, 149, 0]  # 10 free pages, the marked, then LRU
    cache.check_integrity()
