"""Host memory over local disk: the prefix cache's `LowerTier` on a worker's `DiskTier`.

The disk tier (`workers.store.disk_tier`) keeps records of whole pages in one file of
slots; what goes into it and what the rest of the mesh hears is `workers.tier_link`'s,
as for every tier of records: write-back (the default) or write-through (a restarted
worker then finds everything it had published), up records, whole prefixes, demotions.
A disk page's id is its slot after the host store's pages (`id_base + slot`).

Loading back is a copy like any other (`workers.member`): `span` names the records that
continue a prompt past what host memory matched, `source` reads them into host pages with
each record verified, and the copy decision weighs `link`, the disk's measured read rate,
against recomputing. Peers read the records too: through the page server (`read_page`,
the `ServedDisk` it serves), or, on the same node, out of the data file itself
(`workers.transfer.peer_disk`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from workers.cache.disk_settings import DiskSettings, default_directory, mesh_key
from workers.cache.tiers import Spilled
from workers.store.disk_tier import DiskRecord, DiskTier, DiskTierError
from workers.store.layout import StoreLayout
from workers.store.page_store import SharedPageStore
from workers.store.staging import reused_rows, row_bytes
from workers.tier_link import TierLink

log = logging.getLogger(__name__)

TIER = "disk"


def open_disk(
    settings: DiskSettings,
    secret: bytes,
    worker_id: str,
    layout: StoreLayout,
    host: SharedPageStore,
    id_base: int | None = None,
) -> DiskLink | None:
    """The worker's disk tier opened (its records verified and adopted), or None when it
    cannot be opened: the worker then runs on host memory alone, as it says in its log.
    `id_base`: its first page id (`DiskLink`)."""
    directory = Path(settings.directory or default_directory(secret, worker_id))
    try:
        disk = DiskTier.open(directory, layout, settings.pages, mesh_key(secret))
    except (OSError, DiskTierError) as exc:
        log.warning("%s: no disk tier at %s (%s); host memory only", worker_id, directory, exc)
        return None
    if disk.adopted or disk.dropped:
        log.info(
            "%s adopted %d disk records at %s (dropped: %s)",
            worker_id,
            len(disk.adopted),
            directory,
            dict(disk.dropped) or "none",
        )
    holder = f"{worker_id}/disk"
    return DiskLink(disk, host, settings.policy, holder, settings.keep, id_base)


class DiskLink(TierLink):
    """The disk below one worker's host store (see the module docstring and
    `workers.tier_link`). Thread-safe as far as the disk tier is; the cache calls it
    inside its lock.

    Args:
        disk: the worker's disk tier, open.
        host: the worker's page store (pages are read from it when written down).
        policy: one of POLICIES.
        holder: the key its loads go under in copy plans (never a worker id).
        keep: keep the tier's files when it closes.
        id_base: its first page id (None: after the host store's pages; under a device
            tier, after the device's and the host's).
    """

    name = TIER

    def __init__(
        self,
        disk: DiskTier,
        host: SharedPageStore,
        policy: str,
        holder: str,
        keep: bool = False,
        id_base: int | None = None,
    ):
        super().__init__(disk, host, policy, holder, id_base)
        self.disk = disk
        self.host = host
        self.keep = keep
        self.row: torch.Tensor | None = None  # where its loads into a device store land
        for reason, records in disk.dropped.items():  # found when it was opened
            self.counters.dropped(reason, records)

    def read_page(self, page: int, generation: int, out: bytearray) -> bytes | None:
        """A peer's read of disk page `page` (an id of this tier) through the page server:
        into `out`, if its slot still holds the record of `generation` and it reads back
        verified; the record's digest then (the peer checks it is the one it expects),
        else None. A record found corrupt is removed and announced."""
        record = self.disk.record_at(page - self.id_base)
        if record is None or record.generation != generation:
            return None
        if not self.disk.read(record, memoryview(out)):
            self._announce_removed()
            return None
        self.counters.read(len(out))
        return record.digest

    def source(self) -> DiskSource:
        return DiskSource(self)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "directory": str(self.disk.directory)}

    def close(self) -> None:
        """Close the tier; its files go unless the settings keep them."""
        self.disk.close(remove_files=not self.keep)

    def _write(self, page: Spilled) -> DiskRecord | None:
        record = self.disk.write(
            self.host.page_buffer(page.page),
            page.digest,
            page.parent,
            page.namespace,
            page.depth,
            page.tokens,
        )
        if record is not None:
            self.counters.wrote(self.host.layout.page_bytes)
        return record


class DiskSource:
    """Loads a worker's own disk records into its host pages: the `PageSource` of its disk
    in a copy plan. A page is valid only if its record is still the one planned (slot and
    generation), holds the digest this prompt expects, and reads back verified."""

    remote = False

    def __init__(self, link: DiskLink):
        self.link = link
        self.worker_id = link.holder
        self.node_id = ""

    def fetch(self, pages, gens, digests, targets, store) -> list[bool]:
        disk, base = self.link.disk, self.link.id_base
        # Into the page itself, or (a device store's, under host memory) a host row
        # written up once the record verified.
        row = None
        if not store.pages_in_segment:
            row = self.link.row = reused_rows(self.link.row, store, 1)
        valid = []
        for page, gen, digest, target in zip(pages, gens, digests, targets, strict=True):
            record = disk.lookup(digest)
            ok = (
                record is not None
                and base + record.slot == page
                and record.generation == gen
                and disk.read(
                    record, store.page_buffer(target) if row is None else row_bytes(row, 0)
                )
            )
            if ok and row is not None:
                store.write_pages([target], row)
            valid.append(ok)
            if not ok:
                break  # the usable prefix ends at the first failure
        valid += [False] * (len(pages) - len(valid))
        self.link._announce_removed()  # a record found corrupt is gone
        return valid

    def close(self) -> None:
        pass
