"""Tests for workers/store/disk_tier.py across restarts and bad disks: adoption of every
verified record at open, damaged, truncated, foreign and other-layout records dropped with
their reason, a writer killed with SIGKILL at random points, a filesystem that fills up."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests.workers.store.disk_helpers import (
    KEY,
    OTHER_KEY,
    make_chain,
    reads_true,
    tiny_layout,
    write_chain,
)
from tests.workers.store.store_helpers import start_python
from workers.store.disk_file import DATA_NAME
from workers.store.disk_records import slot_geometry
from workers.store.disk_tier import DiskTier

L = tiny_layout()
GEOMETRY = slot_geometry(L)


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def singles(n: int) -> list:
    """`n` unrelated first pages, none the first page of a `make_chain` of a small seed."""
    return [make_chain(L, seed, 1)[0] for seed in range(100, 100 + n)]


def reopen(open_tier, tier: DiskTier, **kwargs) -> DiskTier:
    tier.check_integrity()
    tier.close()
    return open_tier(directory=tier.directory, **kwargs)


# -- adoption ------------------------------------------------------------------------------


def test_reopen_adopts_every_record_parents_first(open_tier):
    tier = open_tier()
    a = make_chain(L, 1, 3)
    branch = make_chain(L, 2, 2, below=a[0])  # a second child of a1
    b = make_chain(L, 3, 2)
    records = write_chain(tier, a + branch + b)
    tier = reopen(open_tier, tier)
    assert tier.dropped == Counter()
    assert sorted(tier.adopted) == sorted(records)
    position = {record.digest: i for i, record in enumerate(tier.adopted)}
    for record in tier.adopted:
        if record.depth > 1:
            assert position[record.parent] < position[record.digest]
    assert all(tier.lookup(r.digest) == r and reads_true(tier, r) for r in records)
    assert tier.stats()["adopted"] == 7 and tier.stats()["free"] == 1
    [c] = write_chain(tier, make_chain(L, 4, 1))
    assert c.slot == 7  # the one free slot, never an adopted one


@pytest.mark.parametrize(
    "where, reason",
    [("body", "corrupt"), ("header", "corrupt"), ("end of file", "truncated")],
)
def test_damage_is_dropped_with_its_reason(open_tier, where, reason):
    tier = open_tier(capacity=3)
    good0, good1, bad = write_chain(tier, singles(3))
    tier.check_integrity()
    tier.close()
    path = tier.directory / DATA_NAME
    if where == "body":
        flip_byte(path, GEOMETRY.body_offset(bad.slot) + 100)
    elif where == "header":
        flip_byte(path, GEOMETRY.slot_offset(bad.slot) + 12)  # in the generation
    else:
        os.truncate(path, GEOMETRY.body_offset(bad.slot) + 100)
    tier = open_tier(directory=tier.directory, capacity=3)
    assert tier.dropped == Counter({reason: 1})
    assert tier.adopted == [good0, good1]
    assert tier.lookup(bad.digest) is None
    assert not tier.read(bad, memoryview(bytearray(L.page_bytes)))
    assert all(reads_true(tier, record) for record in (good0, good1))
    # The dropped slot was freed on disk: the next open neither counts nor trusts it.
    tier = reopen(open_tier, tier, capacity=3)
    assert tier.dropped == Counter() and tier.adopted == [good0, good1]


def test_a_damaged_parent_orphans_what_hangs_below_it(open_tier):
    tier = open_tier()
    a1, a2, a3 = write_chain(tier, make_chain(L, 1, 3))
    [b1] = write_chain(tier, make_chain(L, 2, 1))
    tier.check_integrity()
    tier.close()
    flip_byte(tier.directory / DATA_NAME, GEOMETRY.body_offset(a1.slot))
    tier = open_tier(directory=tier.directory)
    assert tier.dropped == Counter({"corrupt": 1, "orphan": 2})
    assert tier.adopted == [b1]


def test_records_under_another_key_are_foreign(open_tier):
    stranger = open_tier(key=OTHER_KEY)
    write_chain(stranger, make_chain(L, 1, 3))
    tier = reopen(open_tier, stranger)  # with KEY
    assert tier.dropped == Counter({"foreign": 3}) and tier.adopted == []
    records = write_chain(tier, make_chain(L, 1, 3))
    tier = reopen(open_tier, tier)
    assert tier.adopted == records and tier.dropped == Counter()


def test_a_file_of_another_layout_is_dropped_whole(open_tier):
    other = tiny_layout(head_dim=16)
    tier = open_tier(layout=other)
    write_chain(tier, make_chain(other, 1, 2) + make_chain(other, 2, 1))
    tier = reopen(open_tier, tier)  # with L
    assert tier.dropped == Counter({"format": 3}) and tier.adopted == []
    assert os.path.getsize(tier.directory / DATA_NAME) == GEOMETRY.file_bytes(8)
    records = write_chain(tier, make_chain(L, 1, 2))
    assert all(reads_true(tier, record) for record in records)


def test_a_smaller_capacity_drops_the_slots_beyond_it(open_tier):
    tier = open_tier(capacity=6)
    a1, a2, a3 = write_chain(tier, make_chain(L, 1, 3))
    b1, b2, b3 = write_chain(tier, singles(3))  # slots 3, 4, 5
    tier = reopen(open_tier, tier, capacity=4)
    assert tier.dropped == Counter({"capacity": 2})
    assert tier.adopted == [a1, b1, a2, a3]  # parents first: by depth
    assert os.path.getsize(tier.directory / DATA_NAME) == GEOMETRY.file_bytes(4)
    tier = reopen(open_tier, tier, capacity=6)  # growing drops nothing
    assert tier.dropped == Counter() and len(tier.adopted) == 4


def test_a_damaged_file_header_costs_only_itself(open_tier):
    tier = open_tier()
    records = write_chain(tier, make_chain(L, 1, 3))
    tier.check_integrity()
    tier.close()
    flip_byte(tier.directory / DATA_NAME, 20)
    tier = open_tier(directory=tier.directory)
    assert tier.dropped == Counter({"corrupt": 1}) and tier.adopted == records


def test_damage_found_by_a_read_removes_the_record_and_its_descendants(open_tier):
    tier = open_tier()
    a1, a2 = write_chain(tier, make_chain(L, 1, 2))
    b1, c1 = write_chain(tier, singles(2))
    path = tier.directory / DATA_NAME
    flip_byte(path, GEOMETRY.body_offset(a1.slot) + 7)
    flip_byte(path, GEOMETRY.slot_offset(b1.slot) + 40)
    out = memoryview(bytearray(L.page_bytes))
    assert not tier.read(a1, out) and not tier.read(b1, out)
    assert tier.take_removed() == [(a2, "corrupt"), (a1, "corrupt"), (b1, "corrupt")]
    assert tier.lookup(a1.digest) is tier.lookup(a2.digest) is tier.lookup(b1.digest) is None
    os.truncate(path, GEOMETRY.body_offset(c1.slot) + 10)  # the file cut under the tier
    assert not tier.read(c1, out)
    assert tier.take_removed() == [(c1, "corrupt")]
    stats = tier.stats()
    assert (stats["read_failures"], stats["reads"], stats["pages"]) == (3, 0, 0)
    assert stats["evictions"] == {"corrupt": 4}


# -- a writer killed at random points ------------------------------------------------------

BIG = tiny_layout(num_kv_heads=4, head_dim=2048)  # 512 KiB pages: writes take a while
WRITER = """
import sys
from tests.workers.store.disk_helpers import KEY, make_chain, tiny_layout, write_chain
from workers.store.disk_tier import DiskTier

layout = tiny_layout(num_kv_heads=4, head_dim=2048)
tier = DiskTier.open(sys.argv[1], layout, 16, KEY)
print("ready", flush=True)
seed = int(sys.argv[2])
while True:
    chain = make_chain(layout, seed, 1 + seed % 4)
    write_chain(tier, chain)
    if seed % 5 == 0:
        tier.remove([chain[0].digest], "evicted")
    seed += 1
"""


def test_records_survive_sigkill_at_random_points(tmp_path):
    assert BIG.page_bytes == 512 << 10
    rng = random.Random(7)
    directory = tmp_path / "killed"
    adopted = 0
    for round_ in range(4):
        writer = start_python(WRITER, str(directory), str(round_ * 1000))
        try:
            assert writer.stdout.readline() == b"ready\n", writer.stderr.read().decode()
            with contextlib.suppress(subprocess.TimeoutExpired):  # it never exits by itself
                writer.wait(timeout=rng.uniform(0.05, 0.4))
            assert writer.returncode is None, writer.stderr.read().decode()
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.communicate()
        tier = DiskTier.open(directory, BIG, 16, KEY)
        try:
            # Whatever verified reads back as written; nothing was dropped but for a reason
            # that verification gives.
            assert set(tier.dropped) <= {"corrupt"}, tier.dropped
            assert all(reads_true(tier, record) for record in tier.adopted)
            adopted += len(tier.adopted)
            tier.check_integrity()
        finally:
            tier.close()
    assert adopted > 0


# -- a filesystem that fills up ------------------------------------------------------------


def test_a_full_disk_stops_accepting_without_raising(small_tmpfs, caplog):
    tier = DiskTier.open(small_tmpfs / "disk", L, 64, KEY)
    try:
        caplog.set_level(logging.WARNING, logger="workers.store.disk_tier")
        specs = singles(40)
        records = write_chain(tier, specs)
        held = [record for record in records if record is not None]
        assert 5 < len(held) < 40 and records[len(held) :] == [None] * (40 - len(held))
        stats = tier.stats()
        assert not stats["accepting"] and stats["write_failures"] == 1
        assert stats["writes"] == len(held) and stats["writes_refused"] == 40 - len(held) - 1
        warnings = [r for r in caplog.records if r.name == "workers.store.disk_tier"]
        assert len(warnings) == 1 and "not accepting pages for 30 s" in warnings[0].message
        assert all(reads_true(tier, record) for record in held)
        tier.check_integrity()
        # After retry_s, the next write tries again: into a slot whose space is held.
        tier.remove([held[0].digest], "evicted")
        tier.retry_s = 0.0
        again = write_chain(tier, specs[len(held) : len(held) + 1])[0]
        assert again is not None and again.slot == held[0].slot
        assert tier.stats()["accepting"] and reads_true(tier, again)
        tier.check_integrity()
    finally:
        tier.close()
