"""Tests for workers/store/disk_index.py, the disk tier's tables without I/O: slot states,
generations, eviction order against a brute-force model, subtrees children first."""

from __future__ import annotations

import random

import pytest

from tests.workers.store.disk_helpers import NS
from workers.store.disk_index import DiskIndex
from workers.store.disk_records import DiskRecord

ROOT = b"r" * 16  # no test digest is this


def entered(index: DiskIndex, digest: bytes, parent: bytes = ROOT, depth: int = 1) -> DiskRecord:
    """Take a free slot and hold a record in it, as a write does."""
    slot = index.take_free()
    assert slot is not None
    record = DiskRecord(slot, index.next_generation(slot), digest, parent, NS, depth, b"")
    index.hold(record)
    return record


def test_slots_go_free_busy_held_busy_free_and_generations_count_both_ways():
    index = DiskIndex(3, [0, 0, 0], [])
    a = entered(index, b"a" * 16)
    b = entered(index, b"b" * 16, parent=a.digest, depth=2)
    assert (a.slot, a.generation, b.slot, b.generation) == (0, 1, 1, 1)
    assert len(index) == 2 and index.num_free == 1 and index.holds(a)
    with pytest.raises(AssertionError, match="dropped before its children"):
        index.drop(a)
    index.drop(b)  # busy now: neither free nor held
    assert not index.holds(b) and index.num_free == 1
    index.check_integrity()
    index.release(b.slot)
    again = entered(index, b.digest, parent=a.digest, depth=2)
    assert again.slot == b.slot and again.generation == 3  # freed, then written
    index.check_integrity()


def test_adopted_records_are_held_and_the_rest_free_lowest_first():
    a = DiskRecord(2, 5, b"a" * 16, ROOT, NS, 1, b"")
    b = DiskRecord(0, 9, b"b" * 16, a.digest, NS, 2, b"")
    index = DiskIndex(4, [9, 0, 5, 0], [a, b])
    assert index.get(b.digest) == b and index.num_free == 2
    assert index.take_free() == 1
    assert index.pop_leaf(exclude=b"") == b  # a has a child
    index.check_integrity()


def test_marked_leaves_go_first_until_touched_again():
    index = DiskIndex(4, [0] * 4, [])
    a, b, c = (entered(index, bytes([n]) * 16) for n in b"abc")  # LRU: a, b, c
    assert index.mark(c.digest) and not index.mark(c.digest)  # marked already
    assert not index.mark(b"x" * 16)  # not held
    assert index.pop_leaf(exclude=b"") == c  # before the older a and b
    index.drop(c)
    index.mark(b.digest)
    index.touch(b.digest)  # read again: the mark lapses
    assert not index.is_marked(b.digest)
    assert index.pop_leaf(exclude=b"") == a
    index.drop(a)
    index.mark(b.digest)
    index.drop(b)  # a dropped record takes its mark along
    assert not index.is_marked(b.digest)
    index.check_integrity()


def test_subtrees_lists_children_before_parents_once():
    index = DiskIndex(6, [0] * 6, [])
    a = entered(index, b"a" * 16)
    b = entered(index, b"b" * 16, a.digest, 2)
    c = entered(index, b"c" * 16, b.digest, 3)
    d = entered(index, b"d" * 16, a.digest, 2)
    order = index.subtrees([b.digest, a.digest, b"x" * 16, c.digest])
    assert sorted(order) == sorted([a, b, c, d]) and len(order) == 4
    for record in order:
        assert order.index(record) > max(
            (order.index(r) for r in order if r.parent == record.digest), default=-1
        )
    index.check_integrity()


@pytest.mark.parametrize("seed", range(5))
def test_eviction_order_matches_a_brute_force_model(seed):
    rng = random.Random(seed)
    index = DiskIndex(12, [0] * 12, [])
    parents: dict[bytes, bytes] = {}  # the model: digest -> parent, for what is held
    last_touch: dict[bytes, int] = {}
    up: set[bytes] = set()
    clock = 0

    def evictable(digest: bytes) -> bool:
        return digest not in up and digest not in parents.values()

    for step in range(600):
        op = rng.random()
        held = sorted(parents)
        if op < 0.35 and index.num_free:
            parent = rng.choice([ROOT, *held])
            digest = step.to_bytes(16, "big")
            depth = 1 if parent == ROOT else index.get(parent).depth + 1
            entered(index, digest, parent, depth)
            parents[digest], clock = parent, clock + 1
            last_touch[digest] = clock
        elif op < 0.55 and held:
            digest = rng.choice(held)
            index.touch(digest)
            clock += 1
            last_touch[digest] = clock
        elif op < 0.7 and held:
            digest = rng.choice(held)
            flag = rng.random() < 0.5
            index.set_up(digest, flag)
            (up.add if flag else up.discard)(digest)
        elif op < 0.9:
            exclude = rng.choice([b"", *held])
            candidates = [d for d in held if evictable(d) and d != exclude]
            expected = min(candidates, key=last_touch.__getitem__, default=None)
            victim = index.pop_leaf(exclude)
            assert (victim.digest if victim else None) == expected
            if victim is not None:
                index.drop(victim)
                index.release(victim.slot)
                del parents[victim.digest]
        elif held:
            for record in index.subtrees([rng.choice(held)]):
                index.drop(record)
                index.release(record.slot)
                del parents[record.digest]
                up.discard(record.digest)
        index.check_integrity()
        assert index.up == up & parents.keys()
