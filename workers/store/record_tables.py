"""What a tier of page records does with its tables, whatever holds the bytes.

A tier below the prefix cache (the disk, `disk_tier`; host memory under a device store,
`host_tier`) keeps one page per record under its chain digest, in slots, with the tables
of `disk_index`: prefix-closed, `up` records (still in the tier above) never evicted,
leaves least recently touched first, records held elsewhere before the rest. This base
holds the lookups, marks and the room-making every such tier shares, under the tier's
lock; the tier itself moves the bytes.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from itertools import islice
from typing import Any

from cache_service.events import Namespace
from workers.store.disk_index import DiskIndex
from workers.store.disk_rate import ReadRate
from workers.store.disk_records import DiskRecord

# The counters every tier keeps (`stats`).
COUNTED = (
    "bytes_written",
    "bytes_read",
    "writes",
    "reads",
    "read_failures",
    "write_failures",
    "writes_refused",
    "marked_evicted",
)


class RecordTables:
    """The tables of one tier of page records, behind its lock. Thread-safe.

    Subclasses set `_index` (a `DiskIndex`) and `_rate` (a `ReadRate`) in their
    constructor after calling this one's, and may override `_accepting_now` (a tier that
    stops taking pages for a while) and `_more_stats`.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._lock = threading.Lock()  # the index, counters and removed list
        self._index: DiskIndex
        self._rate: ReadRate
        self._removed: list[tuple[DiskRecord, str]] = []
        self._moved: list[tuple[DiskRecord, Any]] = []  # (record, where it went below)
        self._counts: Counter[str] = Counter()
        self._evictions: Counter[str] = Counter()

    # -- finding records ---------------------------------------------------------------

    def lookup(self, digest: bytes) -> DiskRecord | None:
        """The record held under `digest`, or None. Does not touch it (a lookup is not a use)."""
        with self._lock:
            return self._index.get(digest)

    def chain(self, digests: Sequence[bytes], start: int) -> list[DiskRecord]:
        """The records of `digests[start]`, `digests[start + 1]`, ... up to the first one
        not held (so a run that continues a match found in a tier above)."""
        records = []
        with self._lock:
            for digest in islice(digests, start, None):
                record = self._index.get(digest)
                if record is None:
                    break
                records.append(record)
        return records

    def records(self) -> list[DiskRecord]:
        """Every record held, parents before children (shallower first)."""
        with self._lock:
            held = [self._index.get(d) for d in self._index.digests()]
        return sorted((r for r in held if r is not None), key=lambda r: (r.depth, r.slot))

    def record_at(self, slot: int) -> DiskRecord | None:
        """The record held in `slot` now, or None (free, being written, or no such slot)."""
        with self._lock:
            return self._index.at(slot)

    def is_up(self, digest: bytes) -> bool:
        """Whether the page of `digest` is marked up (in the tier above too)."""
        with self._lock:
            return digest in self._index.up

    # -- marks ---------------------------------------------------------------------------

    def set_up(self, digest: bytes, up: bool) -> None:
        """Mark a held page as also in the tier above (up: never evicted from here) or no
        longer; a digest not held is ignored."""
        with self._lock:
            self._index.set_up(digest, up)

    def mark(self, slot: int, generation: int) -> bool:
        """Mark the record in `slot`, if it is still the one at `generation`: another
        worker has stored its page since, so it goes before unmarked records when the tier
        makes room (until it is read or written again). Returns whether it was marked."""
        with self._lock:
            record = self._index.at(slot)
            if record is None or record.generation != generation:
                return False
            return self._index.mark(record.digest)

    def take_moved(self) -> list[tuple[DiskRecord, Any]]:
        """Records the tier evicted for room that a tier below took since the last call,
        each with where it is held now (`_going_down`'s answer), for the owner's events."""
        with self._lock:
            moved, self._moved = self._moved, []
        return moved

    def take_removed(self) -> list[tuple[DiskRecord, str]]:
        """Records the tier removed on its own since the last call (evicted to make room,
        found corrupt on read), each with its reason, for the owner's events."""
        with self._lock:
            removed, self._removed = self._removed, []
        return removed

    # -- making room -------------------------------------------------------------------

    def _accepting_now(self) -> bool:
        return True

    def _going_down(self, victim: DiskRecord) -> Any | None:
        """Offer a record evicted for room to a tier below, its page still intact; where
        it is held there, or None: it is gone. Holds _lock."""
        return None

    def _take_slot(
        self,
        parent: bytes,
        namespace: Namespace,
        depth: int,
        parent_taken: bool = False,
        keep: Collection[bytes] = (),
    ) -> int | None:
        """A busy slot for a new record (evicting one leaf if none is free); None if no
        room, no parent held (depth > 1; `parent_taken`: its parent has a slot of its own
        and is being written, so it need not be held yet), or not accepting. The parent and
        the records of `keep` are never evicted for it. Holds _lock."""
        if not self._accepting_now():
            return None
        if depth > 1 and not parent_taken:
            above = self._index.get(parent)
            if above is None or above.depth != depth - 1 or above.namespace != namespace:
                return None
        slot = self._index.take_free()
        if slot is not None:
            return slot
        victim = self._index.pop_leaf(exclude={parent, *keep} if keep else parent)
        if victim is None:
            return None
        if self._index.is_marked(victim.digest):
            self._counts["marked_evicted"] += 1
        place = self._going_down(victim)
        self._index.drop(victim)
        if place is None:
            self._evictions["evicted"] += 1
            self._removed.append((victim, "evicted"))
        else:
            self._evictions["demoted"] += 1
            self._moved.append((victim, place))
        return victim.slot

    def _drop_subtrees(self, digests: Iterable[bytes], reason: str) -> list[DiskRecord]:
        """Take the records of `digests` and all below them out of the tables, children
        first; their slots are busy until the caller releases them. Holds _lock."""
        doomed = self._index.subtrees(digests)
        for record in doomed:
            self._index.drop(record)
        if doomed:
            self._evictions[reason] += len(doomed)
        return doomed

    def stats(self) -> dict:
        """Counts and rates for metrics: pages, capacity, free, up, bytes and operations,
        failures, whether the tier accepts pages, removed records by reason, the read-rate
        estimate, and what the tier adds (`_more_stats`)."""
        with self._lock:
            stats = {
                "pages": len(self._index),
                "capacity": self.capacity,
                "free": self._index.num_free,
                "up": len(self._index.up),
                **{name: self._counts[name] for name in COUNTED},
                "evictions": dict(self._evictions),
                **self._more_stats(),
            }
        stats["read_bytes_per_s"] = self._rate.bytes_per_s
        stats["read_latency_s"] = self._rate.latency_s
        return stats

    def _more_stats(self) -> dict:
        """The tier's own figures for `stats` (at least "accepting"). Holds _lock."""
        return {"accepting": True}

    def check_integrity(self) -> None:
        """Raise AssertionError unless the tables agree (`DiskIndex.check_integrity`): free +
        held + in-flight slots make the capacity, digest map and slot table agree, child
        counts are right, every held record's parent is held, the up set is within it."""
        with self._lock:
            self._index.check_integrity()
