"""Tests for workers/store/disk_tier.py while a tier is open: writing, finding and reading
records, eviction (LRU leaves, never up), removal, validated reads under concurrent
rewrites, the read throttle and estimate, the directory lock. Adoption at open and
damaged or failing disks are in test_disk_tier_recovery.py."""

from __future__ import annotations

import stat
import threading
import time

import pytest

from cache_service.events import Namespace
from tests.workers.store.disk_helpers import (
    NS,
    make_chain,
    page_for,
    read_back,
    reads_true,
    tiny_layout,
    write_chain,
    write_page,
)
from workers.store.disk_file import DATA_NAME, LOCK_NAME
from workers.store.disk_rate import ReadRate
from workers.store.disk_records import NAME_LIMIT
from workers.store.disk_tier import DiskTier, DiskTierError

L = tiny_layout()
PAGE = L.page_bytes

# -- writing, finding, reading -------------------------------------------------------------


def test_write_lookup_chain_read_round_trip(open_tier):
    tier = open_tier()
    a = make_chain(L, seed=1, length=3)
    b = make_chain(L, seed=2, length=2, namespace=Namespace("tiny-model", salt="tenant-b"))
    records = write_chain(tier, a + b)
    assert [r.slot for r in records] == [0, 1, 2, 3, 4]  # lowest free slot first
    assert [r.generation for r in records] == [1] * 5
    assert [r.depth for r in records] == [1, 2, 3, 1, 2]
    assert all(tier.lookup(spec.digest) == r for spec, r in zip(a + b, records, strict=True))
    assert tier.chain([spec.digest for spec in a], 0) == records[:3]
    assert tier.chain([spec.digest for spec in a], 1) == records[1:3]
    # A chain stops at the first page not held, even if a later one is.
    assert tier.chain([a[0].digest, bytes(16), a[2].digest], 0) == records[:1]
    assert tier.lookup(bytes(16)) is None
    for record in records:
        assert read_back(tier, record) == page_for(record.digest, PAGE)
    stats = tier.stats()
    assert (stats["pages"], stats["free"], stats["writes"], stats["reads"]) == (5, 3, 5, 5)
    assert (stats["bytes_written"], stats["bytes_read"]) == (5 * PAGE, 5 * PAGE)
    assert stats["accepting"] and stats["read_failures"] == stats["write_failures"] == 0
    assert tier.take_removed() == []


def test_writing_a_held_digest_returns_the_record_without_rewriting(open_tier):
    tier = open_tier()
    [spec] = make_chain(L, seed=1, length=1)
    first = write_page(tier, spec)
    again = tier.write(memoryview(bytes(PAGE)), spec.digest, spec.parent, NS, 1, spec.tokens)
    assert again == first
    assert tier.stats()["writes"] == 1
    assert reads_true(tier, first)  # the zeros offered the second time were not written


def test_files_get_only_the_owners_permissions(open_tier, tmp_path):
    tier = open_tier(directory=tmp_path / "a" / "b")
    write_chain(tier, make_chain(L, seed=1, length=1))
    assert stat.S_IMODE(tier.directory.stat().st_mode) == 0o700
    for name in (DATA_NAME, LOCK_NAME):
        assert stat.S_IMODE((tier.directory / name).stat().st_mode) == 0o600


def test_bad_writes_raise_and_unstorable_ones_return_none(open_tier):
    tier = open_tier()
    [first, second] = make_chain(L, seed=1, length=2)
    page = memoryview(page_for(first.digest, PAGE))
    with pytest.raises(ValueError, match=f"page is {PAGE - 1} bytes"):
        tier.write(page[1:], first.digest, first.parent, NS, 1, first.tokens)
    with pytest.raises(ValueError, match="does not follow from parent"):
        tier.write(page, second.digest, first.parent, NS, 1, first.tokens)
    with pytest.raises(ValueError, match="tokens are 12 bytes"):
        tier.write(page, first.digest, first.parent, NS, 1, first.tokens[4:])
    # Not errors: a child whose parent is not on disk (it would be an orphan), a namespace
    # too long for a header.
    assert write_page(tier, second) is None
    [long] = make_chain(L, seed=1, length=1, namespace=Namespace("m" * (NAME_LIMIT + 1)))
    assert write_page(tier, long) is None
    assert tier.stats()["pages"] == 0 and tier.stats()["writes_refused"] == 1


def test_open_checks_its_arguments(tmp_path):
    with pytest.raises(ValueError, match="capacity_pages must be >= 1, got 0"):
        DiskTier.open(tmp_path, L, 0, b"k")
    with pytest.raises(ValueError, match="non-empty bytes key"):
        DiskTier.open(tmp_path, L, 4, b"")
    with pytest.raises(ValueError, match="read throttle must be > 0"):
        DiskTier.open(tmp_path, L, 4, b"k", read_throttle_bytes_per_s=0)


# -- eviction ------------------------------------------------------------------------------


def test_eviction_takes_the_least_recently_touched_leaf(open_tier):
    tier = open_tier(capacity=4)
    a1, a2, b1, b2 = write_chain(tier, make_chain(L, 1, 2) + make_chain(L, 2, 2))
    # a1 is older than a2, but a2 hangs below it: leaves go first.
    [c1] = write_chain(tier, make_chain(L, 3, 1))
    assert c1.slot == a2.slot == 1 and c1.generation == 3  # bumped when freed, and written
    assert tier.take_removed() == [(a2, "evicted")]
    tier.check_integrity()
    # a1 is a leaf now, and the least recently touched of a1, b2, c1.
    [d1] = write_chain(tier, make_chain(L, 4, 1))
    assert d1.slot == a1.slot == 0
    assert tier.take_removed() == [(a1, "evicted")]
    # A read touches: b2 read last, so c1 is the one to go.
    assert reads_true(tier, b2)
    write_chain(tier, make_chain(L, 5, 1))
    assert tier.take_removed() == [(c1, "evicted")]
    assert [tier.lookup(r.digest) for r in (b1, b2)] == [b1, b2]
    assert tier.stats()["evictions"] == {"evicted": 3}


def test_a_write_never_evicts_its_own_parent(open_tier):
    tier = open_tier(capacity=2)
    x = make_chain(L, 1, 2)
    [y] = make_chain(L, 2, 1)
    x1, y1 = write_page(tier, x[0]), write_page(tier, y)
    x2 = write_page(tier, x[1])  # x1 is the oldest leaf, but x2 needs it
    assert x2.slot == y1.slot and tier.take_removed() == [(y1, "evicted")]
    assert tier.lookup(x1.digest) == x1
    tier.check_integrity()


def test_up_records_are_never_evicted(open_tier):
    tier = open_tier(capacity=3)
    p1, p2, p3 = write_chain(tier, [make_chain(L, seed, 1)[0] for seed in (1, 2, 3)])
    for record in (p1, p2, p3):
        tier.set_up(record.digest, True)
    [p4] = make_chain(L, 4, 1)
    assert write_page(tier, p4) is None  # a full tier of up records: no room
    assert tier.take_removed() == [] and tier.stats()["pages"] == 3
    assert tier.stats()["up"] == 3 and tier.stats()["writes_refused"] == 1
    tier.check_integrity()
    tier.set_up(p2.digest, False)  # p1 is older, but still up
    assert write_page(tier, p4).slot == p2.slot
    assert tier.take_removed() == [(p2, "evicted")]
    tier.set_up(bytes(16), True)  # not held: ignored
    assert tier.stats()["up"] == 2


def test_remove_takes_descendants_children_first_and_clear_takes_all(open_tier):
    tier = open_tier()
    a1, a2, a3 = write_chain(tier, make_chain(L, 1, 3))
    b1, b2 = write_chain(tier, make_chain(L, 2, 2))
    tier.set_up(a2.digest, True)
    assert tier.remove([a2.digest, bytes(16)], "quarantined") == [a3, a2]
    assert tier.lookup(a3.digest) is None and not tier.read(a3, memoryview(bytearray(PAGE)))
    assert tier.stats()["up"] == 0 and tier.take_removed() == []
    tier.check_integrity()
    assert tier.clear() == 3
    assert tier.stats()["pages"] == 0 and tier.stats()["free"] == 8
    assert tier.stats()["evictions"] == {"quarantined": 2, "cleared": 3}
    # A freed slot's next record has a newer generation.
    [again] = write_chain(tier, make_chain(L, 1, 1))
    assert again.digest == a1.digest and again.generation > a1.generation


# -- validated reads -----------------------------------------------------------------------


@pytest.mark.parametrize("same_page", [False, True], ids=["another page", "same page again"])
def test_a_slot_rewritten_between_the_header_reads_fails_the_read(
    open_tier, monkeypatch, same_page
):
    tier = open_tier(capacity=1)
    [old_spec] = make_chain(L, 1, 1)
    old = write_page(tier, old_spec)
    new_spec = old_spec if same_page else make_chain(L, 2, 1)[0]
    rewritten = []

    def rewrite_the_slot(rate, nbytes, started):
        # The read has checked the first header and the body; the owner now frees the
        # slot and writes into it before the read checks the header again.
        tier.remove([old.digest], "evicted")
        rewritten.append(write_page(tier, new_spec))

    monkeypatch.setattr(ReadRate, "throttle", rewrite_the_slot)
    out = bytearray(PAGE)
    assert not tier.read(old, memoryview(out))
    monkeypatch.undo()
    [new] = rewritten
    assert new.slot == old.slot and new.generation == old.generation + 2
    # Stale, not damaged: nothing is removed, and the new record reads.
    assert tier.take_removed() == [] and tier.lookup(new.digest) == new
    assert tier.stats()["read_failures"] == 1
    assert reads_true(tier, new)
    assert not tier.read(old, memoryview(out))  # and the old one never again


def test_reads_on_threads_while_the_owner_writes_and_evicts(open_tier):
    tier = open_tier(capacity=6)
    chains = [make_chain(L, seed, 3) for seed in range(6)]
    stop = threading.Event()
    wrong, good = [], []

    def copy_thread():
        out = bytearray(PAGE)
        while not stop.is_set():
            for spec in (spec for chain in chains for spec in chain):
                record = tier.lookup(spec.digest)
                if record is not None and tier.read(record, memoryview(out)):
                    good.append(record)
                    if bytes(out) != page_for(record.digest, PAGE):
                        wrong.append(record)

    threads = [threading.Thread(target=copy_thread, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(4):
            for chain in chains:
                write_chain(tier, chain)
                tier.check_integrity()
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=10)
    assert good and not wrong
    assert {reason for _, reason in tier.take_removed()} == {"evicted"}


def test_reads_check_the_buffer(open_tier):
    tier = open_tier()
    [record] = write_chain(tier, make_chain(L, 1, 1))
    with pytest.raises(ValueError, match=f"writable buffer of {PAGE} bytes"):
        tier.read(record, memoryview(bytes(PAGE)))
    with pytest.raises(ValueError, match=f"got {PAGE - 4}"):
        tier.read(record, memoryview(bytearray(PAGE - 4)))


# -- rates ---------------------------------------------------------------------------------


def test_throttled_reads_are_slow_and_the_estimate_follows(open_tier):
    rate = 51200.0  # 10 ms per 512-byte page
    tier = open_tier(read_throttle_bytes_per_s=rate)
    records = write_chain(tier, make_chain(L, 1, 4))
    before = tier.read_seconds(PAGE)
    # open() measured the filesystem, not the throttle (the latency it saw is noisy on a
    # busy machine, so only the rate is compared).
    assert tier.stats()["read_bytes_per_s"] > 10 * rate
    started = time.monotonic()
    assert all(reads_true(tier, record) for record in records)
    assert time.monotonic() - started >= 0.9 * len(records) * PAGE / rate
    # Four reads move the estimate most of the way: 1 - 0.8**4 of it.
    assert tier.read_seconds(PAGE) - before > 0.5 * PAGE / rate
    assert tier.stats()["read_bytes_per_s"] < 2 * rate


# -- the directory lock --------------------------------------------------------------------


def test_a_locked_directory_is_refused_until_closed(open_tier, tmp_path):
    first = open_tier(directory=tmp_path / "shared")
    [record] = write_chain(first, make_chain(L, 1, 1))
    with pytest.raises(DiskTierError, match=r"is in use: .*lock is locked by another owner"):
        DiskTier.open(tmp_path / "shared", L, 8, b"k")
    first.check_integrity()
    first.close()
    second = open_tier(directory=tmp_path / "shared")
    assert second.adopted == [record]


def test_close_can_remove_the_files(open_tier, tmp_path):
    tier = open_tier(directory=tmp_path / "gone")
    write_chain(tier, make_chain(L, 1, 2))
    tier.check_integrity()
    tier.close(remove_files=True)
    assert not (tmp_path / "gone").exists()
    tier.close()  # twice is harmless
    assert write_chain(tier, make_chain(L, 2, 1)) == [None]
