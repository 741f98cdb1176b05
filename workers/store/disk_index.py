"""The disk tier's tables: which slot holds which record, what hangs below what, and what
may be evicted. Plain Python, no I/O and no locks (`disk_tier` holds its lock around every
call), so the rules are tested on their own.

Each slot is in one state at a time:

    free ──take_free──> busy ──hold──> held ──drop──> busy ──release──> free

`busy` is a slot whose disk I/O is in flight (being written, or being freed on disk): it
is neither handed out nor found. Its generation is bumped when it is dropped and again
when it is written, so a reader holding an old record never mistakes the slot's new one
for it.

What is held stays prefix-closed: a record's parent is held (or it is a first page). Only
leaves that are not `up` are evictable, least recently touched first. They sit in a heap
of (rank, stamp, digest) with stale entries skipped as they are popped: touching a record
pushes it again instead of searching the heap. Rank 0 is a *marked* record (another worker
has stored its page since: `mark`), which goes before every unmarked one (rank 1); a mark
holds until the record is touched again.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable

from workers.store.disk_records import DiskRecord


class DiskIndex:
    """Slots, records by digest, children, the up set and the LRU order of one disk tier."""

    def __init__(self, capacity: int, generations: list[int], records: Iterable[DiskRecord]):
        """Args:
        capacity: slots.
        generations: each slot's current generation (`capacity` items, kept and bumped).
        records: records already on disk, parents before children.
        """
        assert len(generations) == capacity, f"{len(generations)} generations for {capacity}"
        self.capacity = capacity
        self._generations = generations
        self._slots: list[DiskRecord | None] = [None] * capacity
        self._records: dict[bytes, DiskRecord] = {}
        self._children: dict[bytes, set[bytes]] = {}
        self.up: set[bytes] = set()
        self._touched: dict[bytes, int] = {}  # digest -> stamp of its last touch
        self._marked: dict[bytes, int] = {}  # digest -> its stamp when marked
        self._clock = 0
        self._leaves: list[tuple[int, int, bytes]] = []
        self._busy: set[int] = set()
        held = set()
        for record in records:
            self._busy.add(record.slot)
            self.hold(record)
            held.add(record.slot)
        # Reversed, so pop() hands out the lowest slot first.
        self._free = [slot for slot in reversed(range(capacity)) if slot not in held]

    def __len__(self) -> int:
        return len(self._records)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def get(self, digest: bytes) -> DiskRecord | None:
        return self._records.get(digest)

    def at(self, slot: int) -> DiskRecord | None:
        """The record held in `slot`, or None (free, in flight, or out of range)."""
        return self._slots[slot] if 0 <= slot < self.capacity else None

    def holds(self, record: DiskRecord) -> bool:
        """Whether `record` is held, unchanged, in its slot."""
        return 0 <= record.slot < self.capacity and self._slots[record.slot] == record

    def digests(self) -> list[bytes]:
        return list(self._records)

    # -- slot states ---------------------------------------------------------------------

    def take_free(self) -> int | None:
        """A free slot, now busy (the lowest first while none was freed), or None."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._busy.add(slot)
        return slot

    def next_generation(self, slot: int) -> int:
        """Bump a busy slot's generation for the record about to be written into it."""
        assert slot in self._busy, f"slot {slot} is not busy"
        self._generations[slot] += 1
        return self._generations[slot]

    def hold(self, record: DiskRecord) -> None:
        """Enter a record whose busy slot is written; its parent must be held."""
        assert record.slot in self._busy, f"slot {record.slot} is not busy"
        assert record.depth == 1 or record.parent in self._records, "parent not held"
        self._busy.discard(record.slot)
        self._records[record.digest] = record
        self._slots[record.slot] = record
        self._children[record.digest] = set()
        if record.depth > 1:
            self._children[record.parent].add(record.digest)
        self.touch(record.digest)

    def drop(self, record: DiskRecord) -> None:
        """Take a childless record out; its slot becomes busy (see `release`)."""
        digest = record.digest
        assert not self._children[digest], f"slot {record.slot} dropped before its children"
        del self._records[digest], self._touched[digest], self._children[digest]
        self._marked.pop(digest, None)
        self._slots[record.slot] = None
        self._busy.add(record.slot)
        self.up.discard(digest)
        self._generations[record.slot] += 1
        siblings = self._children.get(record.parent)
        if siblings is not None:
            siblings.discard(digest)
            self._push_if_evictable(record.parent)

    def release(self, slot: int) -> None:
        """A busy slot whose I/O is over (or failed) becomes free."""
        self._busy.remove(slot)
        self._free.append(slot)

    def subtrees(self, digests: Iterable[bytes]) -> list[DiskRecord]:
        """The held records of `digests` and all below them, each child before its parent
        (the order to drop them in)."""
        order: list[DiskRecord] = []
        seen: set[bytes] = set()
        for top in digests:
            if top not in self._records or top in seen:
                continue
            stack = [(top, False)]
            while stack:
                digest, expanded = stack.pop()
                if expanded:
                    order.append(self._records[digest])
                elif digest not in seen:
                    seen.add(digest)
                    stack.append((digest, True))
                    stack.extend((child, False) for child in self._children[digest])
        return order

    # -- eviction order ------------------------------------------------------------------

    def set_up(self, digest: bytes, up: bool) -> None:
        """Mark a held record up (never evicted) or not; a digest not held is ignored."""
        if digest not in self._records:
            return
        if up:
            self.up.add(digest)
        elif digest in self.up:
            self.up.discard(digest)
            self._push_if_evictable(digest)

    def touch(self, digest: bytes) -> None:
        """Make a held record the most recently used (a mark on it lapses)."""
        self._clock += 1
        self._touched[digest] = self._clock
        self._push_if_evictable(digest)
        if len(self._leaves) > 2 * len(self._records) + 64:  # mostly stale: rebuild
            self._leaves = [self._entry(d) for d in self._records if self._evictable(d)]
            heapq.heapify(self._leaves)

    def mark(self, digest: bytes) -> bool:
        """Mark a held record to go before unmarked ones (its page is held elsewhere, by a
        newer copy); False when it is not held or marked already."""
        if digest not in self._records or self.is_marked(digest):
            return False
        self._marked[digest] = self._touched[digest]
        self._push_if_evictable(digest)
        return True

    def is_marked(self, digest: bytes) -> bool:
        """Whether the record is marked and not touched since."""
        stamp = self._marked.get(digest)
        return stamp is not None and stamp == self._touched.get(digest)

    def pop_leaf(self, exclude: bytes | Collection[bytes]) -> DiskRecord | None:
        """The evictable record not in `exclude` (one digest, or several) to go first
        (marked ones first, then the least recently touched), or None."""
        if isinstance(exclude, bytes):
            exclude = (exclude,)
        kept = []
        found = None
        while self._leaves:
            entry = heapq.heappop(self._leaves)
            digest = entry[2]
            if entry != self._entry(digest) or not self._evictable(digest):
                continue  # stale: touched or marked since, dropped, or no longer a leaf
            if digest in exclude:
                kept.append(entry)
                continue
            found = self._records[digest]
            break
        for entry in kept:
            heapq.heappush(self._leaves, entry)
        return found

    def _evictable(self, digest: bytes) -> bool:
        return not self._children[digest] and digest not in self.up

    def _entry(self, digest: bytes) -> tuple[int, int, bytes]:
        """The record's heap entry as it stands now."""
        return (0 if self.is_marked(digest) else 1, self._touched.get(digest, -1), digest)

    def _push_if_evictable(self, digest: bytes) -> None:
        if self._evictable(digest):
            heapq.heappush(self._leaves, self._entry(digest))

    # -- checks --------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError unless free + held + busy slots make the capacity, the
        digest map and the slot table agree, child sets are right, every held record's
        parent is held one page shallower (or it is a first page), and the up set and LRU
        stamps cover exactly what is held."""
        held = [record for record in self._slots if record is not None]
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is on the free list twice"
        total = len(free) + len(held) + len(self._busy)
        assert total == self.capacity, (
            f"{len(free)} free + {len(held)} held + {len(self._busy)} busy slots "
            f"!= capacity {self.capacity}"
        )
        for slot in free | self._busy:
            assert self._slots[slot] is None, f"slot {slot} is free or busy but held"
        assert len(held) == len(self._records), (
            f"{len(held)} slots held but {len(self._records)} digests mapped"
        )
        children: dict[bytes, set[bytes]] = {digest: set() for digest in self._records}
        for slot, record in enumerate(self._slots):
            if record is None:
                continue
            assert record.slot == slot, f"record of slot {record.slot} in slot {slot}"
            assert self._records.get(record.digest) == record, f"slot {slot} not mapped"
            if record.depth > 1:
                parent = self._records.get(record.parent)
                assert parent is not None, f"slot {slot}'s parent is not held"
                assert parent.depth == record.depth - 1, f"slot {slot}: depth off"
                children[record.parent].add(record.digest)
        assert children == self._children, "child sets disagree with the records"
        assert self.up <= self._records.keys(), "an up digest is not held"
        assert self._touched.keys() == self._records.keys(), "LRU stamps disagree"
        assert self._marked.keys() <= self._records.keys(), "a marked digest is not held"
