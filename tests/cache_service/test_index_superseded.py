"""The index's notices for cluster-aware eviction: a worker that stores a page others hold
already has the newest copy, and the others hear of it (`GlobalIndex.held_elsewhere`)."""

from __future__ import annotations

from cache_service.events import PagesDemoted, PagesRemoved
from cache_service.index import GlobalIndex
from tests.cache_service.test_index import make_index
from tests.cache_service.test_index_tiers import apply_ok, stored


def notices(index: GlobalIndex, worker: str, limit: int = 1024) -> tuple[list, list]:
    return index.held_elsewhere(worker, index.worker_info(worker).epoch, limit)


def test_the_older_holders_hear_of_a_newer_copy_once():
    index = make_index("a", "b", "c")
    apply_ok(index, "a", stored((0, 1, 2), (1, 2, 3), generations=(5, 6, 7)))
    apply_ok(index, "b", stored((10, 11), (1, 2)))  # the first two pages again
    assert notices(index, "a") == ([0, 1], [5, 6])
    assert notices(index, "a") == ([], [])  # taken once
    assert notices(index, "b") == ([], [])  # the newest holder supersedes no one
    apply_ok(index, "c", stored((20,), (1,)))
    assert notices(index, "a") == ([0], [5])
    assert notices(index, "b") == ([10], [0])
    assert index.stats()["superseded"] == {"issued": 4, "overflowed": 0}
    index.check_integrity()


def test_a_notice_goes_stale_when_its_page_left_or_changed():
    index = make_index("a", "b")
    apply_ok(index, "a", stored((0, 1, 2), (1, 2, 3), generations=(5, 6, 7)))
    apply_ok(index, "b", stored((10, 11, 12), (1, 2, 3)))
    apply_ok(index, "a", PagesRemoved((2,), "evicted"))  # page 2 gone
    apply_ok(index, "a", stored((1,), (2,), parent=0, generations=(9,)))  # page 1 rewritten
    assert notices(index, "a") == ([0], [5])
    index.check_integrity()


def test_no_notice_once_the_newer_copy_is_gone():
    index = make_index("a", "b")
    apply_ok(index, "a", stored((0, 1), (1, 2), generations=(5, 6)))
    apply_ok(index, "b", stored((10, 11), (1, 2)))
    apply_ok(index, "b", PagesRemoved((10,), "evicted"))  # b holds neither now
    assert notices(index, "a") == ([], [])
    index.check_integrity()


def test_a_copy_on_disk_is_named_by_its_disk_id():
    index = make_index("a", "b")
    apply_ok(index, "a", stored((0, 1), (1, 2), generations=(5, 6)))
    apply_ok(index, "a", PagesDemoted((1,), (101,), (8,), "disk"))  # page 2 went down
    apply_ok(index, "b", stored((10, 11), (1, 2)))
    assert notices(index, "a") == ([0, 101], [5, 8])
    index.check_integrity()


def test_a_resync_or_a_moved_holding_supersedes_no_one():
    index = make_index("a", "b")
    apply_ok(index, "a", stored((0, 1), (1, 2)))
    info = index.worker_info("b")
    index.resync("b", info.epoch, 1, [stored((10, 11), (1, 2))])
    assert notices(index, "a") == ([], [])
    # b names the same pages under new ids (a load back from disk): not a new copy.
    apply_ok(index, "b", stored((12, 13), (1, 2)))
    assert notices(index, "a") == ([], [])
    index.check_integrity()


def test_notices_wait_in_bounds_and_come_a_limit_at_a_time():
    index = make_index("a", "b", max_notices=30)  # the oldest ten are dropped unread
    pages = tuple(range(1, 41))
    apply_ok(index, "a", stored(tuple(range(40)), pages))
    apply_ok(index, "b", stored(tuple(range(100, 140)), pages))
    first = notices(index, "a", limit=25)
    rest = notices(index, "a")
    assert first[0] == list(range(10, 35)) and rest[0] == list(range(35, 40))
    assert index.stats()["superseded"] == {"issued": 40, "overflowed": 10}
    # Another epoch of the worker gets nothing.
    assert index.held_elsewhere("a", index.worker_info("a").epoch + 1) == ([], [])
    index.check_integrity()


def test_a_worker_that_leaves_takes_its_notices_along():
    index = make_index("a", "b")
    apply_ok(index, "a", stored((0, 1), (1, 2)))
    apply_ok(index, "b", stored((10, 11), (1, 2)))
    index.remove_worker("a", "dead")
    index.register("a", node_id="node0")  # a new incarnation, maybe in the same slot
    apply_ok(index, "a", stored((0, 1), (1, 2)))  # the same page ids again
    assert notices(index, "a") == ([], [])
    assert notices(index, "b") == ([10, 11], [0, 0])
    index.check_integrity()


def test_notices_keep_their_order_across_takes_and_wrap_arounds():
    index = make_index("a", "b", "c", max_notices=4)
    apply_ok(index, "a", stored(tuple(range(7)), tuple(range(1, 8))))
    apply_ok(index, "b", stored((10, 11, 12), (1, 2, 3)))
    assert notices(index, "a", limit=2)[0] == [0, 1]  # 2 waits
    apply_ok(index, "b", stored((13, 14, 15), (4, 5, 6), parent=12))  # 3, 4, 5 after it
    assert notices(index, "a", limit=1)[0] == [2]
    apply_ok(index, "c", stored((20,), (1,)))  # 0 again, for a and for b: a's fourth
    apply_ok(index, "b", stored((16,), (7,), parent=15))  # 6: the oldest waiting (3) goes
    assert notices(index, "a")[0] == [4, 5, 0, 6]
    assert notices(index, "b")[0] == [10]
    assert index.stats()["superseded"] == {"issued": 9, "overflowed": 1}
    index.check_integrity()
