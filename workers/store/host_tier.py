"""The host tier under a device store: pages a GPU worker's device evicts, kept in host
shared memory and found again by digest.

A GPU worker's prefix cache keeps its pages in a device store (the top tier). When it
evicts one, `workers.host_link` writes it down here: into a page of the host store (the
shared-memory store a CPU worker uses as its page store), copied with validation
(`workers.store.staging.write_back`: generation before, copy, generation after, digest),
and recorded under its chain digest. A hit loads it back the same way
(`staging.load_back`), several pages in one bulk copy.

The records are kept by the same tables as the disk's (`record_tables`, `disk_index`):
prefix-closed, `up` records (still on the device too) never evicted, leaves least recently
used first, records held elsewhere before the rest. A slot is a host page: the tier owns
every page of the host store from the start, so the store's own pool never hands one out,
and a record's generation is its host page's generation in shared memory, the one a peer
checks when it copies the page. A record dropped leaves its page's bytes and digest as
they were until the slot is written again (which moves the generation first), so a peer
that still copies it gets the very page its digest names, or a stale answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from cache_service.events import Namespace
from workers.store.disk_index import DiskIndex
from workers.store.disk_rate import ReadRate
from workers.store.disk_records import DiskRecord
from workers.store.page_store import SharedPageStore
from workers.store.record_tables import RecordTables
from workers.store.staging import load_back, staging_buffer, write_back

__all__ = ["HostTier", "PageDown"]

# A page going down: (device page, digest, parent digest, namespace, depth, packed tokens).
PageDown = tuple[int, bytes, bytes, Namespace, int, bytes]

STAGING_PAGES = 32  # one staging buffer per tier, reused: pinning memory costs more than a copy


class HostTier(RecordTables):
    """Records of device pages in the host store below (see the module docstring).

    Args:
        device: the device store above (owned here); pages are read from it going down
            and written into it coming back.
        host: a fresh host shared-memory store of the same page format (owned here, no
            page allocated yet): the tier takes all of its pages.

    Raises:
        ValueError: stores of different page formats, a host store whose pages are not in
            shared memory, or one with pages allocated already.
    """

    def __init__(self, device: SharedPageStore, host: SharedPageStore):
        if device.layout.kv_format != host.layout.kv_format:
            raise ValueError(
                f"a host tier of {host.layout.kv_format} under a device store of "
                f"{device.layout.kv_format}"
            )
        if not host.pages_in_segment:
            raise ValueError(f"host tier {host.name!r}: its pages must be in shared memory")
        if host.num_free != host.num_pages:
            raise ValueError(
                f"host tier {host.name!r}: {host.num_pages - host.num_free} of its "
                f"{host.num_pages} pages are in use already"
            )
        super().__init__(host.num_pages)
        self.device = device
        self.host = host
        self.layout = host.layout
        taken = host.allocate(host.num_pages)
        assert taken == list(range(host.num_pages)), "a fresh store hands out 0 .. n-1"
        # The host store keeps the pages' generations; the index's own copies (bumped when
        # it drops a record) are not read.
        self._index = DiskIndex(host.num_pages, [0] * host.num_pages, ())
        self._staging = staging_buffer(device, min(STAGING_PAGES, host.num_pages))
        # A tier below (the disk): offered each record evicted for room, with its parents
        # nearest first (`workers.host_link`); where it took it, or None.
        self.spill: Callable[[DiskRecord, list[DiskRecord]], Any | None] | None = None
        self._rate = ReadRate()
        self._rate.start_from(*_measure(host, self._staging))

    # -- writing -----------------------------------------------------------------------

    def _going_down(self, victim: DiskRecord) -> Any | None:
        if self.spill is None:
            return None
        parents = []
        record = victim
        while record.depth > 1:
            record = self._index.get(record.parent)
            assert record is not None, "a held record's parent is held"
            parents.append(record)
        return self.spill(victim, parents)

    def write(
        self,
        page: int,
        digest: bytes,
        parent: bytes,
        namespace: Namespace,
        depth: int,
        tokens: bytes,
    ) -> DiskRecord | None:
        """Copy device page `page` (published, its digest recorded) down into a host page.

        Args:
            page: the device page, owned and intact during the call.
            digest: its chain digest, as the device store records it.
            parent: the previous page's digest; for depth 1 the namespace's root digest.
            namespace: the page's namespace.
            depth: pages from the root, 1 = first page.
            tokens: the page's token ids, packed.

        Returns:
            The record (the one already held if the digest is here: no rewrite), or None
            with nothing changed: no room (every candidate is up or has children), a
            parent not held (depth > 1), or a device page that does not hold `digest`.
            Evicted records go to `take_removed()` ("evicted").
        """
        return self.write_many([(page, digest, parent, namespace, depth, tokens)])[0]

    def write_many(self, pages: Sequence[PageDown]) -> list[DiskRecord | None]:
        """`write` for several device pages, parents before children, in bulk copies (one
        per staging buffer's worth). A page may hang under one written earlier in the same
        call; one whose parent is not taken is not taken either. When the tier has no room
        left for the next page, what is planned so far is written and held first, so the
        tier can make room among everything it holds, as page-by-page writes would.

        Args:
            pages: each (device page, digest, parent digest, namespace, depth, tokens),
                as `write` takes them (`workers.cache.tiers.Spilled` is one).

        Returns:
            One record or None per page, as `write` returns them.
        """
        out: list[DiskRecord | None] = [None] * len(pages)
        with self._lock:
            planned: dict[bytes, int] = {}  # digest -> its index in `pages`, slot taken
            slots: dict[int, int] = {}  # index in `pages` -> its slot, not written yet
            # Held parents of pages taken: not evicted to make room for the pages after.
            keep: set[bytes] = set()
            for i, (_, digest, parent, namespace, depth, _) in enumerate(pages):
                held = self._index.get(digest)
                if held is not None:
                    self._index.touch(digest)
                    out[i] = held
                    continue
                if digest in planned:
                    continue  # twice in one call: taken once
                under = planned.get(parent)
                after = under is not None and pages[under][4] == depth - 1
                slot = self._take_slot(parent, namespace, depth, after, keep)
                if slot is None and slots:  # no room: hold what is planned, then try again
                    self._write_planned(pages, slots, out)
                    planned.clear()
                    slot = self._take_slot(parent, namespace, depth, False, keep)
                    after = False
                if slot is None:
                    self._counts["writes_refused"] += 1
                    continue
                planned[digest], slots[i] = i, slot
                if not after:
                    keep.add(parent)
            self._write_planned(pages, slots, out)
            # A record written and sent on down within this call was never announced
            # here: its page goes from the tier above straight to the one below.
            fresh = {record.digest for record in out if record is not None}
            self._moved = [(r, place) for r, place in self._moved if r.digest not in fresh]
        return out

    def _write_planned(
        self, pages: Sequence[PageDown], slots: dict[int, int], out: list[DiskRecord | None]
    ) -> None:
        """Copy the planned pages (`slots`: index in `pages` -> slot) down in bulk and hold
        those that landed whole under a held parent; `slots` is emptied. Holds _lock."""
        order = list(slots)
        valid: list[bool] = []
        step = len(self._staging)
        for at in range(0, len(order), step):
            part = order[at : at + step]
            devices = [pages[i][0] for i in part]
            valid += write_back(
                self.device,
                devices,
                self.device.generations(devices),
                self.host,
                [slots[i] for i in part],
                [pages[i][1] for i in part],
                self._staging,
            ).valid
        generations = self.host.generations([slots[i] for i in order])
        for i, ok, generation in zip(order, valid, generations, strict=True):
            _, digest, parent, namespace, depth, tokens = pages[i]
            if not ok or (depth > 1 and self._index.get(parent) is None):
                self._index.release(slots[i])  # unwritten, or its parent was not
                self._counts["write_failures"] += 1
                continue
            record = DiskRecord(slots[i], generation, digest, parent, namespace, depth, tokens)
            self._index.hold(record)
            self._counts["writes"] += 1
            self._counts["bytes_written"] += self.layout.page_bytes
            out[i] = record
        slots.clear()

    # -- reading -----------------------------------------------------------------------

    def load(
        self, records: Sequence[DiskRecord], store: SharedPageStore, targets: Sequence[int]
    ) -> list[bool]:
        """Copy the pages of `records` up into `targets` of `store` (the device store), in
        bulk, each validated (its record still held, its host page at the record's
        generation and digest). The usable prefix ends at the first page that fails: the
        pages after it are reported invalid.

        Raises:
            ValueError: lengths that differ, or targets `store` cannot write.
        """
        if len(records) != len(targets):
            raise ValueError(f"{len(records)} records for {len(targets)} target pages")
        valid: list[bool] = []
        step = len(self._staging)
        for at in range(0, len(records), step):
            part = list(records[at : at + step])
            with self._lock:
                held = [self._index.holds(record) for record in part]
            usable = part[: held.index(False)] if False in held else part
            copied = self._load_part(usable, store, targets[at : at + len(usable)])
            good = copied.index(False) if False in copied else len(copied)
            with self._lock:
                for record in usable[:good]:
                    if self._index.holds(record):
                        self._index.touch(record.digest)
                self._counts["reads"] += good
                self._counts["bytes_read"] += good * self.layout.page_bytes
            valid += [True] * good
            if good < len(part):
                break
        failed = len(records) - len(valid)
        if failed:
            with self._lock:
                self._counts["read_failures"] += failed
        return valid + [False] * failed

    def read(self, record: DiskRecord, out: bytearray) -> bool:
        """Copy a record's host page into `out` (a peer's read through the page server),
        validated: the record still held, its page at the record's generation and digest.

        Raises:
            ValueError: `out` is not `layout.page_bytes` long.
        """
        if len(out) != self.layout.page_bytes:
            raise ValueError(f"out is {len(out)} bytes, a page is {self.layout.page_bytes}")
        with self._lock:
            if not self._index.holds(record):
                self._counts["read_failures"] += 1
                return False
        rows = torch.frombuffer(out, dtype=torch.uint8).view(self.layout.torch_dtype)
        rows = rows.view(1, *self.layout.page_shape)
        copied = self.host.copy_pages_validated(
            [record.slot], [record.generation], rows, [record.digest]
        )
        with self._lock:
            ok = copied.valid[0]
            self._counts["reads" if ok else "read_failures"] += 1
            self._counts["bytes_read"] += len(out) if ok else 0
        return ok

    def _load_part(
        self, records: Sequence[DiskRecord], store: SharedPageStore, targets: Sequence[int]
    ) -> list[bool]:
        if not records:
            return []
        started = time.perf_counter()
        copied = load_back(
            self.host,
            [r.slot for r in records],
            [r.generation for r in records],
            store,
            targets,
            [r.digest for r in records],
            self._staging,
        )
        self._rate.observe(len(records) * self.layout.page_bytes, time.perf_counter() - started)
        return copied.valid

    # -- removing ----------------------------------------------------------------------

    def remove(self, digests: Iterable[bytes], reason: str) -> list[DiskRecord]:
        """Drop the records of `digests` (those held) and every record below them.

        Returns:
            The removed records, children before their parents. They are not repeated
            by `take_removed()`.
        """
        with self._lock:
            doomed = self._drop_subtrees(digests, reason)
            for record in doomed:
                self._index.release(record.slot)
        return doomed

    def clear(self) -> int:
        """Remove every record ("cleared"); returns how many there were."""
        with self._lock:
            everything = self._index.digests()
        return len(self.remove(everything, "cleared"))

    # -- rates, stats ------------------------------------------------------------------

    def read_seconds(self, nbytes: int) -> float:
        """Estimated seconds to load `nbytes` back: latency + bytes / rate."""
        return self._rate.seconds(nbytes)

    def check_integrity(self) -> None:
        """The tables' checks (`RecordTables.check_integrity`), and every record's host
        page still at the record's generation and digest."""
        super().check_integrity()
        for record in self.records():
            assert self.host.generation(record.slot) == record.generation, (
                f"host page {record.slot} moved past its record's generation {record.generation}"
            )
            assert self.host.digests([record.slot])[0] == record.digest, (
                f"host page {record.slot} does not hold its record's digest"
            )


def _measure(host: SharedPageStore, staging: torch.Tensor) -> tuple[float, float]:
    """(latency_s, bytes_per_s) of a plain copy out of host pages, one and several, to
    start the load-back estimate from; loads keep it current."""
    n = len(staging)
    pages = host.page_range(0, n)

    def best(k: int) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            staging[:k].copy_(pages[:k])
            times.append(time.perf_counter() - started)
        return min(times)

    one, many = best(1), best(n)
    page_bytes = host.layout.page_bytes
    if n == 1:
        return 0.0, page_bytes / max(one, 1e-9)
    per_page = max((many - one) / (n - 1), 1e-9)
    return max(one - per_page, 0.0), page_bytes / per_page
