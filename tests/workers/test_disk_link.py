"""The prefix cache over host shared memory with a real disk tier below it: what goes down
when, what the index hears, and what comes back (bytes, digests, chains)."""

from __future__ import annotations

import pytest
import torch

from cache_service.events import PagesDemoted, PagesRemoved, PagesStored
from tests.workers.tier_helpers import NS, P, expected_kv, make_prompt, serve
from workers.cache.disk_settings import mesh_key
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.disk_link import DiskLink
from workers.store.digests import page_digests
from workers.store.disk_tier import DiskTier
from workers.store.page_store import SharedPageStore, StoreLayout

LAYOUT = StoreLayout(num_pages=12, num_layers=2, num_kv_heads=2, page_tokens=P, head_dim=3)
KEY = mesh_key(b"s" * 32)


class Tiers:
    """A host store, its prefix cache and the disk below, built and checked together."""

    def __init__(self, directory, policy: str = "write_back", disk_pages: int = 32):
        self.directory = directory
        self.store = SharedPageStore.create(LAYOUT)
        self.disk = DiskTier.open(directory, LAYOUT, disk_pages, KEY)
        self.link = DiskLink(self.disk, self.store, policy, "w/disk", keep=True)
        self.cache = PrefixCache(self.store, PrefixCacheConfig(page_tokens=P), lower=self.link)

    def serve(self, tokens: list[int]) -> list[int]:
        return serve(self.cache, self.store, tokens)

    def check(self) -> None:
        self.cache.check_integrity()
        self.link.check_integrity()
        self.store.check_integrity()

    def close(self) -> None:
        self.check()
        self.disk.close()
        self.store.close()


@pytest.fixture
def tiers(tmp_path):
    t = Tiers(tmp_path / "disk")
    yield t
    t.close()


def _expected_kv(tokens: list[int], page: int) -> torch.Tensor:
    return expected_kv(tokens, page, LAYOUT.page_shape)


def test_evicted_pages_go_down_and_the_index_hears_demotions(tiers):
    prompt = make_prompt(1, 4)
    tiers.serve(prompt + [9])  # 4 full pages published (the 5th is partial)
    tiers.cache.take_events()
    assert tiers.cache.evict(100) == 4
    events = tiers.cache.take_events()
    assert len(events) == 1 and isinstance(events[0], PagesDemoted), events
    demoted = events[0]
    assert demoted.tier == "disk" and len(demoted.new_page_ids) == 4
    assert all(i >= LAYOUT.num_pages for i in demoted.new_page_ids)  # ids above host's
    assert tiers.link.demotions == 4 and tiers.disk.stats()["pages"] == 4
    # The records continue the prompt from page 0 and read back the very bytes.
    digests = page_digests(NS, LAYOUT.kv_format, prompt, P)
    span = tiers.link.span(digests, 0)
    assert span is not None and len(span.page_ids) == 4 and span.tier == "disk"
    targets = tiers.store.allocate(4)
    valid = tiers.link.source().fetch(
        span.page_ids, span.generations, digests, targets, tiers.store
    )
    assert valid == [True] * 4
    for i, target in enumerate(targets):
        assert torch.equal(tiers.store.page(target), _expected_kv(prompt, i))
    tiers.store.free(targets)


def test_a_leaf_going_down_takes_its_prefix_along_up(tiers):
    """Host memory evicts the leaf first; the disk keeps whole prefixes, so the pages above
    it are written too (marked up: still in host memory, not the index's business)."""
    prompt = make_prompt(2, 3)
    tiers.serve(prompt + [1])
    tiers.cache.take_events()
    assert tiers.cache.evict(1) == 1
    (event,) = tiers.cache.take_events()
    assert isinstance(event, PagesDemoted) and len(event.page_ids) == 1
    assert tiers.disk.stats()["pages"] == 3
    digests = page_digests(NS, LAYOUT.kv_format, prompt, P)
    assert [r.depth for r in tiers.disk.chain(digests, 0)] == [1, 2, 3]
    # The rest going down later writes nothing new.
    written = tiers.disk.stats()["bytes_written"]
    assert tiers.cache.evict(100) == 2
    assert tiers.disk.stats()["bytes_written"] == written
    (event,) = tiers.cache.take_events()
    assert isinstance(event, PagesDemoted) and len(event.page_ids) == 2


def test_write_through_writes_at_publish(tmp_path):
    t = Tiers(tmp_path / "d", policy="write_through")
    try:
        prompt = make_prompt(3, 2)
        t.serve(prompt + [5])
        assert t.disk.stats()["pages"] == 2 and t.disk.stats()["up"] == 2
        written = t.disk.stats()["bytes_written"]
        t.cache.take_events()
        assert t.cache.evict(100) == 2
        (event,) = t.cache.take_events()
        assert isinstance(event, PagesDemoted)
        assert t.disk.stats()["bytes_written"] == written and t.disk.stats()["up"] == 0
    finally:
        t.close()


def test_a_full_disk_evicts_its_own_leaves_and_says_so(tmp_path):
    t = Tiers(tmp_path / "d", disk_pages=3)
    try:
        for seed in range(4):
            t.serve(make_prompt(10 + seed, 2) + [1])
            t.cache.evict(100)
            t.check()
        events = t.cache.take_events()
        removed = [e for e in events if isinstance(e, PagesRemoved)]
        assert removed and all(e.tier == "disk" and e.reason == "evicted" for e in removed)
        assert t.disk.stats()["pages"] <= 3
    finally:
        t.close()


def test_a_disk_record_held_elsewhere_goes_before_older_ones(tmp_path):
    """The index names a page on disk by its disk id: the disk tier evicts that record
    first when it makes room (a stale generation changes nothing)."""
    t = Tiers(tmp_path / "d", disk_pages=4)
    try:
        places = []
        for seed in range(4):  # one page each, down to disk in turn: disk full
            t.serve(make_prompt(20 + seed, 1) + [1])
            t.cache.take_events()
            t.cache.evict(100)
            [demoted] = t.cache.take_events()
            places.append((demoted.new_page_ids[0], demoted.generations[0]))
        second, generation = places[1]  # not the oldest record: that one, LRU would take
        assert t.cache.held_elsewhere([second], [generation + 1]) == 0  # rewritten since
        assert t.cache.held_elsewhere([second], [generation]) == 1
        t.serve(make_prompt(30, 1) + [1])
        t.cache.evict(100)  # the disk makes room for it
        removed = [e for e in t.cache.take_events() if isinstance(e, PagesRemoved)]
        assert [(e.page_ids, e.tier) for e in removed] == [((second,), "disk")]
        assert t.disk.stats()["marked_evicted"] == 1
        t.check()
    finally:
        t.close()


def test_a_reopened_disk_is_announced_as_disk_chains(tmp_path):
    first = Tiers(tmp_path / "d")
    prompt = make_prompt(4, 3)
    first.serve(prompt + [2])
    first.cache.evict(100)
    first.close()
    again = Tiers(tmp_path / "d")
    try:
        assert len(again.disk.adopted) == 3
        chains = again.cache.snapshot()
        assert all(isinstance(c, PagesStored) and c.tier == "disk" for c in chains)
        by_id = {c.page_ids[0]: c for c in chains}
        roots = [c for c in chains if c.parent_page is None]
        assert len(roots) == 1 and list(roots[0].tokens) == prompt[:P]
        child = next(c for c in chains if c.parent_page == roots[0].page_ids[0])
        assert child.page_ids[0] in by_id and list(child.tokens) == prompt[P : 2 * P]
        # A hit reloads them: the host's own acquire finds nothing, the disk does.
        digests = page_digests(NS, LAYOUT.kv_format, prompt, P)
        assert again.cache.match_length(prompt, NS) == 0
        assert len(again.link.span(digests, 0).page_ids) == 3
    finally:
        again.close()


def test_dropped_and_cleared_pages_leave_the_disk_too(tiers):
    a, b = make_prompt(5, 2), make_prompt(6, 2)
    pages_a = tiers.serve(a + [1])
    tiers.serve(b + [1])
    tiers.cache.evict(1)  # b's leaf (or a's) goes down, with its prefix
    tiers.serve(a + [1])
    assert tiers.disk.stats()["pages"] >= 2
    dropped, held = tiers.cache.drop([pages_a[0]], "quarantined")
    assert held == 0 and dropped >= 1
    digests = page_digests(NS, LAYOUT.kv_format, a, P)
    assert tiers.disk.lookup(digests[0]) is None  # a's records went with its host pages
    tiers.check()
    tiers.cache.clear()
    assert tiers.disk.stats()["pages"] == 0
