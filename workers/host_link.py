"""Device memory over host shared memory: the prefix cache's `LowerTier` on a GPU worker.

A GPU worker's prefix cache keeps its pages in a device store, the top tier. Pages the
device evicts go down to the host store below it (write-back: `workers.store.host_tier`
copies each with validation and records it by digest), stay findable (PagesDemoted to
tier "host", at ids after the device's: `id_base + host page`), and come back on a hit:
`span` names the records that continue a prompt past what the device matched, `source`
loads them into device pages in bulk, each validated, and the copy decision weighs `link`,
the measured load-back rate, against recomputing. What is written down when, up records,
whole prefixes and the events are `workers.tier_link`'s, as for the disk.

With a disk below host memory (`disk`), the chain is device -> host -> disk. A host record
the host tier evicts for room goes down to the disk first (the records above it written
up there if the disk lacks them, so the disk keeps whole prefixes): PagesDemoted from its
host id to its disk id, tier "disk". A page the device evicts that host memory cannot take
but the disk holds already is demoted straight to the disk. Drops, clears, held-elsewhere
marks and resync snapshots reach the disk through this link; the disk's own evictions are
announced by the disk link. A prompt's pages load back from whichever tier holds them
(`chain`: the member plans both, each with its own measured rate).

On a machine without a GPU, a CPU store whose pages are not in shared memory
(`SharedPageStore.create(..., pages_in_segment=False)`) stands in for the device: the same
code runs, with plain memory for staging.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cache_service.events import KvEvent, PagesDemoted, PagesStored
from workers.cache.tiers import Place, Spilled
from workers.disk_link import DiskLink
from workers.store.disk_records import DiskRecord
from workers.store.host_tier import HostTier
from workers.store.page_store import SharedPageStore
from workers.tier_link import TierLink

TIER = "host"


class HostLink(TierLink):
    """The host store below one worker's device store (see the module docstring).

    Args:
        tier: the host tier over the worker's host store, under `device`.
        holder: the key its loads go under in copy plans (never a worker id).
        disk: the disk tier below host memory (write-back, its ids after the host
            store's), or None.
    """

    name = TIER

    def __init__(self, tier: HostTier, holder: str, disk: DiskLink | None = None):
        super().__init__(tier, tier.device, "write_back", holder)
        self.tier = tier
        self.disk = disk
        if disk is not None:
            if disk.policy != "write_back" or disk.above is not tier.host:
                raise ValueError("a disk under host memory under a device: write_back, over it")
            if disk.id_base != self.id_base + self.capacity:
                raise ValueError(
                    f"disk ids from {disk.id_base}: after the host tier's, "
                    f"{self.id_base + self.capacity}"
                )
            tier.spill = self._spill

    def chain(self) -> list[TierLink]:
        return [self] if self.disk is None else [self, self.disk]

    # -- the prefix cache's side, passed on to the disk ---------------------------------

    def attach(self, emit: Callable[[KvEvent], None]) -> None:
        super().attach(emit)
        if self.disk is not None:
            self.disk.attach(emit)

    def published(self, pages: Sequence[Spilled]) -> None:
        super().published(pages)
        if self.disk is not None:  # a disk record of a page in a tier above is up
            self.disk.published(pages)

    def demote(self, pages: Sequence[Spilled]) -> list[Place | None]:
        places = super().demote(pages)
        disk = self.disk
        if disk is None:
            return places
        for i, (page, place) in enumerate(zip(pages, places, strict=True)):
            record = None if place is not None else disk.records.lookup(page.digest)
            if record is None:
                continue
            # Host memory had no room for it, or sent it on within this call: the disk
            # holds it (a demotion counted once, when it went down there).
            if disk.records.is_up(page.digest):
                disk.records.set_up(page.digest, False)
                disk.demotions += 1
                disk.counters.demoted(1)
            places[i] = Place(disk.id_base + record.slot, record.generation, disk.name)
        return places

    def held_elsewhere(self, pages: Sequence[int], generations: Sequence[int]) -> int:
        marked = super().held_elsewhere(pages, generations)
        if self.disk is not None:
            marked += self.disk.held_elsewhere(pages, generations)
        return marked

    def dropped(self, digests: Sequence[bytes], reason: str) -> None:
        super().dropped(digests, reason)
        if self.disk is not None:
            self.disk.dropped(digests, reason)

    def cleared(self) -> None:
        super().cleared()
        if self.disk is not None:
            self.disk.cleared()

    def snapshot(self, host: Mapping[bytes, int]) -> list[PagesStored]:
        chains = super().snapshot(host)
        if self.disk is None:
            return chains
        # Disk chains hang under device pages or host records: by digest, the id the
        # index knows each by (a record also on the device is known by its device id).
        above = dict(host)
        for record in self.tier.records():
            above.setdefault(record.digest, self.id_base + record.slot)
        return chains + self.disk.snapshot(above)

    def _spill(self, victim: DiskRecord, parents: list[DiskRecord]) -> Place | None:
        """The host tier evicts `victim` for room (its parents, nearest first, stay): the
        disk takes it if it can, the parents it lacks written first, up."""
        assert self.disk is not None
        self.disk.keep_above(_spilled(record) for record in parents)
        (place,) = self.disk.demote([_spilled(victim)])
        return place

    def _announce_removed(self) -> None:
        super()._announce_removed()
        moved = self.tier.take_moved()
        if moved:
            self.counters.removed("demoted", len(moved))
        if moved and self._emit is not None:
            self._emit(
                PagesDemoted(
                    tuple(self.id_base + record.slot for record, _ in moved),
                    tuple(place.page for _, place in moved),
                    tuple(place.generation for _, place in moved),
                    moved[0][1].tier,
                )
            )

    def read_page(self, page: int, generation: int, out: bytearray) -> bytes | None:
        """A peer's read of host page `page` (an id of this tier) through the page server:
        into `out`, if the record of `generation` is still there and copies validated; the
        record's digest then (the peer checks it is the one it expects), else None. Ids
        past the host tier's are the disk's, read there."""
        if self.disk is not None and page >= self.disk.id_base:
            return self.disk.read_page(page, generation, out)
        record = self.tier.record_at(page - self.id_base)
        if record is None or record.generation != generation:
            return None
        if not self.tier.read(record, out):
            return None
        self.counters.read(len(out))
        return record.digest

    def source(self) -> HostSource:
        return HostSource(self)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "disk": None if self.disk is None else self.disk.stats()}

    def check_integrity(self) -> None:
        super().check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()

    def close(self) -> None:
        """Close the disk below, if any (the host store is the worker's, closed with it)."""
        if self.disk is not None:
            self.disk.close()

    def _write(self, page: Spilled) -> DiskRecord | None:
        return self._write_all([page])[0]

    def _write_all(self, pages: Sequence[Spilled]) -> list[DiskRecord | None]:
        records = self.tier.write_many(pages)
        written = sum(record is not None for record in records)
        if written:
            self.counters.wrote(written * self.tier.layout.page_bytes)
        return records


def _spilled(record: DiskRecord) -> Spilled:
    """A host record as a page going down to the disk (its host page is its slot)."""
    return Spilled(
        record.slot, record.digest, record.parent, record.namespace, record.depth, record.tokens
    )


class HostSource:
    """Loads a worker's own host records into its device pages: the `PageSource` of its
    host tier in a copy plan. A page is valid only if its record is still the one planned
    (host page and generation), holds the digest this prompt expects, and copies up
    validated; the usable prefix ends at the first that is not."""

    remote = False

    def __init__(self, link: HostLink):
        self.link = link
        self.worker_id = link.holder
        self.node_id = ""

    def fetch(
        self,
        pages: Sequence[int],
        gens: Sequence[int],
        digests: Sequence[bytes],
        targets: Sequence[int],
        store: SharedPageStore,
    ) -> list[bool]:
        tier, base = self.link.tier, self.link.id_base
        records: list[DiskRecord] = []
        for page, gen, digest in zip(pages, gens, digests, strict=True):
            record = tier.lookup(digest)
            if record is None or base + record.slot != page or record.generation != gen:
                break
            records.append(record)
        valid = tier.load(records, store, targets[: len(records)])
        return valid + [False] * (len(pages) - len(valid))

    def close(self) -> None:
        pass
