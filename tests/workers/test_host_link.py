"""The prefix cache over a device store with host shared memory below it: what goes down
when, what the index hears, and what comes back (bytes, digests, chains).

A CPU store whose pages are not in shared memory (`pages_in_segment=False`) stands in for
the device: the same code as on a GPU, with plain memory for staging."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cache_service.events import PagesDemoted, PagesRemoved, PagesStored
from cache_service.index.global_index import GlobalIndex
from cache_service.tokens import pack_tokens
from tests.workers.tier_helpers import NS, P, expected_kv, make_prompt, serve
from workers.cache.disk_settings import mesh_key
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.disk_link import DiskLink
from workers.host_link import HostLink
from workers.store.digests import page_digests, root_digest
from workers.store.disk_tier import DiskTier
from workers.store.host_tier import HostTier
from workers.store.page_store import SharedPageStore, StoreLayout

KEY = mesh_key(b"s" * 32)
DEVICE = StoreLayout(num_pages=8, num_layers=2, num_kv_heads=2, page_tokens=P, head_dim=3)


class Tiers:
    """A device store, its prefix cache and the host store below, built and checked
    together."""

    def __init__(self, host_pages: int = 16, disk_directory: Path | None = None):
        self.device = SharedPageStore.create(DEVICE, device="cpu", pages_in_segment=False)
        self.host = SharedPageStore.create(replace(DEVICE, num_pages=host_pages))
        self.tier = HostTier(self.device, self.host)
        self.disk = None
        if disk_directory is not None:  # the disk below host memory: ids after its pages
            records = DiskTier.open(disk_directory, self.host.layout, 32, KEY)
            base = DEVICE.num_pages + host_pages
            self.disk = DiskLink(records, self.host, "write_back", "w/disk", id_base=base)
        self.link = HostLink(self.tier, "w/host", self.disk)
        config = PrefixCacheConfig(page_tokens=P)
        self.cache = PrefixCache(self.device, config, lower=self.link, tier="device")

    def serve(self, tokens: list[int]) -> list[int]:
        return serve(self.cache, self.device, tokens)

    def load_back(self, prompt: list[int]) -> tuple[list[int], list[bool]]:
        """Load the host records of `prompt` into fresh device pages: (targets, valid)."""
        digests = page_digests(NS, DEVICE.kv_format, prompt, P)
        span = self.link.span(digests, 0)
        assert span is not None and span.tier == "host"
        targets = self.device.allocate(len(span.page_ids))
        assert targets is not None
        valid = self.link.source().fetch(
            span.page_ids, span.generations, digests, targets, self.device
        )
        return targets, valid

    def check(self) -> None:
        self.cache.check_integrity()
        self.link.check_integrity()
        self.device.check_integrity()
        self.host.check_integrity()

    def close(self) -> None:
        self.check()
        self.link.close()
        self.device.close()
        self.host.close()


@pytest.fixture
def tiers():
    t = Tiers()
    yield t
    t.close()


def _expected_kv(tokens: list[int], page: int) -> torch.Tensor:
    return expected_kv(tokens, page, DEVICE.page_shape)


def test_a_bad_host_store_is_refused_and_changes_nothing():
    device = SharedPageStore.create(DEVICE, device="cpu", pages_in_segment=False)
    stores = [device]
    try:
        other = SharedPageStore.create(replace(DEVICE, head_dim=4))
        stores.append(other)
        private = SharedPageStore.create(DEVICE, device="cpu", pages_in_segment=False)
        stores.append(private)
        used = SharedPageStore.create(DEVICE)
        stores.append(used)
        with pytest.raises(ValueError, match="a host tier of"):
            HostTier(device, other)
        with pytest.raises(ValueError, match="must be in shared memory"):
            HostTier(device, private)
        used.allocate(1)
        with pytest.raises(ValueError, match="1 of its 8 pages are in use"):
            HostTier(device, used)
        assert other.num_free == other.num_pages and used.num_free == used.num_pages - 1
    finally:
        for store in stores:
            store.close()
    with pytest.raises(ValueError, match="unknown tier 'gpu'"):
        PrefixCache(device, PrefixCacheConfig(page_tokens=P), tier="gpu")


def test_device_pages_go_down_to_host_memory_and_come_back(tiers):
    prompt = make_prompt(1, 4)
    tiers.serve(prompt + [9])  # 4 full pages published (the 5th is partial)
    (stored,) = tiers.cache.take_events()
    assert isinstance(stored, PagesStored) and stored.tier == "device"
    assert tiers.cache.evict(100) == 4
    (demoted,) = tiers.cache.take_events()
    assert isinstance(demoted, PagesDemoted) and demoted.tier == "host"
    assert demoted.page_ids == tuple(stored.page_ids[::-1])  # leaf first
    # Host ids come after the device's; each record is its host page at its generation.
    assert all(i >= DEVICE.num_pages for i in demoted.new_page_ids)
    slots = [i - DEVICE.num_pages for i in demoted.new_page_ids]
    assert list(demoted.generations) == tiers.host.generations(slots)
    assert tiers.link.demotions == 4 and tiers.tier.stats()["pages"] == 4
    for depth, slot in enumerate(reversed(slots)):
        assert torch.equal(tiers.host.page(slot), _expected_kv(prompt, depth))
    # Loaded back into fresh device pages: the very bytes, validated.
    targets, valid = tiers.load_back(prompt)
    assert valid == [True] * 4
    for i, target in enumerate(targets):
        assert torch.equal(tiers.device.page(target), _expected_kv(prompt, i))
    assert tiers.tier.stats()["reads"] == 4
    tiers.device.free(targets)


def test_a_host_page_rewritten_after_its_record_is_not_loaded_back(tiers):
    """The host page under the second record changes behind the tier's back: its
    generation moves, so load-back serves the first page only and leaves the rest of the
    targets as they were."""
    prompt = make_prompt(2, 3)
    tiers.serve(prompt + [1])
    tiers.cache.evict(100)
    digests = page_digests(NS, DEVICE.kv_format, prompt, P)
    second = tiers.tier.lookup(digests[1])
    assert second is not None
    tiers.host.write_page(second.slot, torch.zeros(DEVICE.page_shape))
    targets = tiers.device.allocate(3)
    before = [tiers.device.page(t).clone() for t in targets]
    span = tiers.link.span(digests, 0)
    valid = tiers.link.source().fetch(
        span.page_ids, span.generations, digests, targets, tiers.device
    )
    assert valid == [True, False, False]
    assert torch.equal(tiers.device.page(targets[0]), _expected_kv(prompt, 0))
    assert all(
        torch.equal(tiers.device.page(t), b) for t, b in zip(targets[1:], before[1:], strict=True)
    )
    assert tiers.tier.stats()["read_failures"] == 2
    tiers.device.free(targets)
    # The record no longer matches its page: the tier's check says so, until it is dropped.
    with pytest.raises(AssertionError, match="moved past its record's generation"):
        tiers.tier.check_integrity()
    tiers.cache.take_events()
    tiers.link.dropped([second.digest], "quarantined")
    (removed,) = tiers.cache.take_events()
    assert isinstance(removed, PagesRemoved) and removed.tier == "host"
    assert len(removed.page_ids) == 2  # the page and the one after it


def test_a_leaf_going_down_takes_its_prefix_along_up(tiers):
    """The device evicts the leaf first; the host tier keeps whole prefixes, so the pages
    above it are written too (up: still on the device, not the index's business)."""
    prompt = make_prompt(3, 3)
    tiers.serve(prompt + [1])
    tiers.cache.take_events()
    assert tiers.cache.evict(1) == 1
    (event,) = tiers.cache.take_events()
    assert isinstance(event, PagesDemoted) and len(event.page_ids) == 1
    assert tiers.tier.stats()["pages"] == 3 and tiers.tier.stats()["up"] == 2
    written = tiers.tier.stats()["bytes_written"]
    assert tiers.cache.evict(100) == 2  # the rest going down writes nothing new
    assert tiers.tier.stats()["bytes_written"] == written
    assert tiers.tier.stats()["up"] == 0


def test_a_full_host_tier_evicts_its_own_leaves_and_says_so():
    t = Tiers(host_pages=3)
    try:
        for seed in range(4):
            t.serve(make_prompt(10 + seed, 2) + [1])
            t.cache.evict(100)
            t.check()
        events = t.cache.take_events()
        evicted = [e for e in events if isinstance(e, PagesRemoved) and e.reason == "evicted"]
        assert evicted and all(e.tier == "host" for e in evicted)
        assert all(i >= DEVICE.num_pages for e in evicted for i in e.page_ids)
        assert t.tier.stats()["pages"] <= 3 and t.tier.stats()["evictions"]["evicted"] >= 5
        # The newest prompt is still whole below.
        targets, valid = t.load_back(make_prompt(13, 2))
        assert valid == [True, True]
        t.device.free(targets)
    finally:
        t.close()


def test_a_host_record_held_elsewhere_goes_first():
    t = Tiers(host_pages=2)
    try:
        first, second = make_prompt(20, 1), make_prompt(21, 1)
        for prompt in (first, second):
            t.serve(prompt + [1])
            t.cache.evict(100)
        demoted = [e for e in t.cache.take_events() if isinstance(e, PagesDemoted)]
        (first_id,), (second_id,) = (e.new_page_ids for e in demoted)
        (second_gen,) = demoted[1].generations
        assert t.cache.held_elsewhere([second_id], [second_gen + 1]) == 0  # stale: skipped
        assert t.cache.held_elsewhere([second_id], [second_gen]) == 1
        t.serve(make_prompt(22, 1) + [1])
        t.cache.evict(100)  # the host tier makes room: the marked record goes, not the older
        removed = [e for e in t.cache.take_events() if isinstance(e, PagesRemoved)]
        assert [e.page_ids for e in removed] == [(second_id,)]
        assert t.tier.stats()["marked_evicted"] == 1
        assert t.tier.lookup(page_digests(NS, DEVICE.kv_format, first, P)[0]) is not None
    finally:
        t.close()


def test_a_resync_names_host_pages_and_the_index_finds_them_there(tiers):
    prompt = make_prompt(4, 3)
    tiers.serve(prompt + [1])
    tiers.cache.evict(1)  # the last page down, the two above it stay on the device
    index = GlobalIndex(page_tokens=P)
    reg = index.register("w", node_id="n0", capacity=DEVICE.num_pages + tiers.host.num_pages)
    snapshot = tiers.cache.snapshot(drain_events=True)
    assert [(c.tier, len(c.page_ids)) for c in snapshot] == [("device", 2), ("host", 1)]
    assert snapshot[1].parent_page == snapshot[0].page_ids[-1]
    index.resync("w", reg.epoch, 1, snapshot)
    (span,) = index.match(NS, prompt).spans
    assert span.worker_id == "w" and len(span.page_ids) == 3
    assert span.page_ids[2] >= DEVICE.num_pages
    tiers.cache.evict(100)
    result = index.apply_events("w", reg.epoch, 2, tiers.cache.take_events())
    assert result.reason == "applied", result
    (span,) = index.match(NS, prompt).spans
    assert all(i >= DEVICE.num_pages for i in span.page_ids)
    index.check_integrity()


def test_dropped_and_cleared_pages_leave_the_host_tier_too(tiers):
    prompt = make_prompt(5, 2)
    pages = tiers.serve(prompt + [1])
    tiers.cache.evict(1)  # page 2 down, page 1 up below
    assert tiers.tier.stats()["pages"] == 2
    tiers.serve(prompt + [1])  # page 1 still on the device, page 2 recomputed there
    tiers.cache.drop([pages[0]])
    assert tiers.tier.stats()["pages"] == 0
    tiers.serve(make_prompt(6, 2) + [1])
    tiers.cache.evict(100)
    assert tiers.tier.stats()["pages"] == 2
    tiers.cache.clear()
    assert tiers.tier.stats()["pages"] == 0


# -- device -> host -> disk ------------------------------------------------------------------


@pytest.fixture
def chain(tmp_path):
    t = Tiers(host_pages=2, disk_directory=tmp_path / "disk")
    yield t
    t.close()


def _apply(index: GlobalIndex, epoch: int, seq: int, events) -> None:
    result = index.apply_events("w", epoch, seq, events)
    assert result.reason == "applied", result


def _tiers_of(index: GlobalIndex, prompt: list[int]) -> list[str]:
    (span,) = index.match(NS, prompt).spans
    return [span.tier_of(i) for i in range(len(span.page_ids))]


def test_host_memory_evicts_down_to_disk_and_a_prompt_loads_back_from_both(chain):
    """Host memory holds 2 pages: a second prompt pushes the first one's pages down to
    the disk (the parent written there first, so the disk keeps whole prefixes), the
    index follows every move, and the first prompt loads back from the disk, exact."""
    index = GlobalIndex(page_tokens=P)
    host_end = DEVICE.num_pages + 2
    epoch = index.register("w", node_id="n0", capacity=host_end + 32).epoch
    a, b = make_prompt(30, 2), make_prompt(31, 2)
    for seq, prompt in enumerate((a, b), start=1):
        chain.serve(prompt + [1])
        chain.cache.evict(100)
        _apply(index, epoch, seq, chain.cache.take_events())
        chain.check()
    assert _tiers_of(index, b) == ["host", "host"]
    assert _tiers_of(index, a) == ["disk", "disk"]
    assert chain.disk.demotions == 2 and chain.tier.stats()["evictions"] == {"demoted": 2}
    digests = page_digests(NS, DEVICE.kv_format, a, P)
    assert chain.link.span(digests, 0) is None
    span = chain.disk.span(digests, 0)
    assert span is not None and all(i >= host_end for i in span.page_ids)
    targets = chain.device.allocate(2)
    valid = chain.disk.source().fetch(
        span.page_ids, span.generations, digests, targets, chain.device
    )
    assert valid == [True, True]
    for i, target in enumerate(targets):
        assert torch.equal(chain.device.page(target), expected_kv(a, i, DEVICE.page_shape))
    chain.device.free(targets)
    # A resync names every tier's pages where they are.
    fresh = GlobalIndex(page_tokens=P)
    registered = fresh.register("w", node_id="n0", capacity=host_end + 32)
    fresh.resync("w", registered.epoch, 1, chain.cache.snapshot(drain_events=True))
    assert _tiers_of(fresh, a) == ["disk", "disk"] and _tiers_of(fresh, b) == ["host", "host"]
    fresh.check_integrity()
    index.check_integrity()


def test_a_device_page_host_memory_cannot_take_goes_to_the_disk_that_holds_it(chain):
    """Host memory is full of pages still on the device (up: never evicted), so it takes
    no more; a page the device evicts that the disk holds already (here written there
    directly) is demoted straight to the disk, and no longer up there."""
    prompt = make_prompt(32, 3)
    pages = chain.serve(prompt + [1])[:3]
    digests = page_digests(NS, DEVICE.kv_format, prompt, P)
    parents = [root_digest(NS, DEVICE.kv_format), *digests[:2]]
    for depth, page in enumerate(pages, start=1):
        tokens = pack_tokens(prompt[(depth - 1) * P : depth * P])
        body = chain.device.page_buffer(page)
        record = chain.disk.disk.write(
            body, digests[depth - 1], parents[depth - 1], NS, depth, tokens
        )
        assert record is not None
        chain.disk.disk.set_up(record.digest, True)
    chain.cache.take_events()
    assert chain.cache.evict(1) == 1  # the leaf: its two parents go to host memory, up
    (event,) = chain.cache.take_events()
    third = chain.disk.disk.lookup(digests[2])
    assert isinstance(event, PagesDemoted) and event.tier == "disk"
    assert event.page_ids == (pages[2],)
    assert event.new_page_ids == (chain.disk.id_base + third.slot,)
    assert event.generations == (third.generation,)
    assert chain.tier.stats()["pages"] == 2 and chain.tier.stats()["up"] == 2
    assert not chain.disk.disk.is_up(digests[2]) and chain.disk.disk.is_up(digests[1])
    assert chain.disk.demotions == 1


def test_drops_clears_and_marks_reach_the_disk_below_host_memory(chain):
    a, b = make_prompt(33, 2), make_prompt(34, 2)
    for prompt in (a, b):
        chain.serve(prompt + [1])
        chain.cache.evict(100)
    events = chain.cache.take_events()
    (to_disk,) = [e for e in events if isinstance(e, PagesDemoted) and e.tier == "disk"]
    # A notice that another worker stored a disk page since: marked on the disk.
    assert chain.cache.held_elsewhere(to_disk.new_page_ids[:1], to_disk.generations[:1]) == 1
    assert chain.disk.disk.stats()["pages"] == 2
    digests = page_digests(NS, DEVICE.kv_format, a, P)
    chain.link.dropped(digests[:1], "quarantined")  # a's first page and all below it
    (removed,) = chain.cache.take_events()
    assert isinstance(removed, PagesRemoved) and removed.tier == "disk"
    assert set(removed.page_ids) == set(to_disk.new_page_ids)
    assert chain.disk.disk.stats()["pages"] == 0 and chain.tier.stats()["pages"] == 2
    chain.serve(a + [1])
    chain.cache.evict(100)  # b's pages go down to the disk now
    assert chain.disk.disk.stats()["pages"] == 2
    chain.cache.clear()
    assert chain.disk.disk.stats()["pages"] == 0 and chain.tier.stats()["pages"] == 0


def test_one_eviction_larger_than_host_memory_keeps_every_page_below(chain):
    """Two 2-page prompts leave the device in one eviction; host memory holds 2 pages.
    The batch goes down a chain at a time (parents first): host memory holds what it
    wrote so far, then makes room by sending the first chain on to the disk, so every
    page is still held, the index hears each page's move once, and both prompts load
    back whole."""
    a, b = make_prompt(35, 2), make_prompt(36, 2)
    index = GlobalIndex(page_tokens=P)
    epoch = index.register("w", node_id="n0", capacity=DEVICE.num_pages + 2 + 32).epoch
    for prompt in (a, b):
        chain.serve(prompt + [1])
    _apply(index, epoch, 1, chain.cache.take_events())
    assert chain.cache.evict(100) == 4
    events = chain.cache.take_events()
    _apply(index, epoch, 2, events)
    assert _tiers_of(index, a) == ["disk", "disk"] and _tiers_of(index, b) == ["host", "host"]
    assert index.stats()["events"]["unknown_pages"] == 0  # each move heard once, in order
    index.check_integrity()
    assert not [e for e in events if isinstance(e, PagesRemoved)], events
    demoted = [e for e in events if isinstance(e, PagesDemoted)]
    # From the device: b's pages to host memory, a's (there for a moment) to the disk.
    assert sorted((e.tier, len(e.page_ids)) for e in demoted) == [("disk", 2), ("host", 2)]
    assert all(i < DEVICE.num_pages for e in demoted for i in e.page_ids)
    assert chain.disk.demotions == 2
    assert chain.tier.stats()["pages"] == 2 and chain.disk.disk.stats()["pages"] == 2
    for prompt in (a, b):
        digests = page_digests(NS, DEVICE.kv_format, prompt, P)
        reach, targets = 0, chain.device.allocate(2)
        for tier in chain.link.chain():
            span = tier.span(digests, reach)
            if span is None:
                continue
            ids, gens = span.page_ids[reach:], span.generations[reach:]
            end = len(span.page_ids)
            got = tier.source().fetch(
                ids, gens, digests[reach:end], targets[reach:end], chain.device
            )
            assert all(got)
            reach = end
        assert reach == 2
        for i, target in enumerate(targets):
            assert torch.equal(chain.device.page(target), expected_kv(prompt, i, DEVICE.page_shape))
        chain.device.free(targets)
