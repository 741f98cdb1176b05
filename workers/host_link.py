"""Device memory over host shared memory: the prefix cache's `LowerTier` on a GPU worker.

A GPU worker's prefix cache keeps its pages in a device store, the top tier. Pages the
device evicts go down to the host store below it (write-back: `workers.store.host_tier`
copies each with validation and records it by digest), stay findable (PagesDemoted to
tier "host", at ids after the device's: `id_base + host page`), and come back on a hit:
`span` names the records that continue a prompt past what the device matched, `source`
loads them into device pages in bulk, each validated, and the copy decision weighs `link`,
the measured load-back rate, against recomputing. What is written down when, up records,
whole prefixes and the events are `workers.tier_link`'s, as for the disk.

On a machine without a GPU, a CPU store whose pages are not in shared memory
(`SharedPageStore.create(..., pages_in_segment=False)`) stands in for the device: the same
code runs, with plain memory for staging.
"""

from __future__ import annotations

from collections.abc import Sequence

from workers.cache.tiers import Spilled
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
    """

    name = TIER

    def __init__(self, tier: HostTier, holder: str):
        super().__init__(tier, tier.device, "write_back", holder)
        self.tier = tier

    def read_page(self, page: int, generation: int, out: bytearray) -> bytes | None:
        """A peer's read of host page `page` (an id of this tier) through the page server:
        into `out`, if the record of `generation` is still there and copies validated; the
        record's digest then (the peer checks it is the one it expects), else None."""
        record = self.tier.record_at(page - self.id_base)
        if record is None or record.generation != generation:
            return None
        if not self.tier.read(record, out):
            return None
        self.counters.read(len(out))
        return record.digest

    def source(self) -> HostSource:
        return HostSource(self)

    def close(self) -> None:
        """Nothing to close: the host store is the worker's, closed with it."""

    def _write(self, page: Spilled) -> DiskRecord | None:
        return self._write_all([page])[0]

    def _write_all(self, pages: Sequence[Spilled]) -> list[DiskRecord | None]:
        records = self.tier.write_many(pages)
        written = sum(record is not None for record in records)
        if written:
            self.counters.wrote(written * self.tier.layout.page_bytes)
        return records


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
