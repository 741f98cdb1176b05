"""Host memory over local disk: the prefix cache's `LowerTier` on a worker's `DiskTier`.

The disk tier (`workers.store.disk_tier`) keeps records of whole pages in one file of
slots; this module decides what goes into it and what the rest of the mesh hears:

    write_back      a page is written when host memory evicts it (the default)
    write_through   a page is written as soon as it is published (a restarted worker then
                    finds everything it had published)

A record also held in host memory is "up": the index knows the page by its host id
then, and the disk never evicts it. The disk keeps whole prefixes (a record's parent is a
record too): a page demoted under pages still in host memory has those written first,
up, so a restarted worker finds whole prompts. A page evicted from host memory that the disk takes
is demoted (PagesDemoted: the worker still holds it, at its disk id); one it cannot take
is evicted. A disk page's id is its slot after the host store's pages
(`id_base + slot`), so a worker's page ids stay unique across its tiers.

Loading back is a copy like any other (`workers.member`): `span` names the records that
continue a prompt past what host memory matched, `source` reads them into host pages with
each record verified, and the copy decision weighs `link`, the disk's measured read rate,
against recomputing. Peers read the records too: through the page server (`read_page`,
the `ServedDisk` it serves), or, on the same node, out of the data file itself
(`workers.transfer.peer_disk`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from cache_service.events import KvEvent, PagesRemoved, PagesStored
from cache_service.messages import HolderSpan, TierFigures
from cache_service.tokens import PackedTokens
from workers.cache.disk_settings import POLICIES, DiskSettings, default_directory, mesh_key
from workers.cache.tiers import Spilled
from workers.service.figures import TierCounters
from workers.store.disk_tier import DiskRecord, DiskTier, DiskTierError
from workers.store.layout import StoreLayout
from workers.store.page_store import SharedPageStore
from workers.transfer.costs import Link

log = logging.getLogger(__name__)

TIER = "disk"


def open_disk(
    settings: DiskSettings,
    secret: bytes,
    worker_id: str,
    layout: StoreLayout,
    host: SharedPageStore,
) -> DiskLink | None:
    """The worker's disk tier opened (its records verified and adopted), or None when it
    cannot be opened: the worker then runs on host memory alone, as it says in its log."""
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
    return DiskLink(disk, host, settings.policy, f"{worker_id}/disk", settings.keep)


class DiskLink:
    """The disk below one worker's host store (see the module docstring). Thread-safe as
    far as the disk tier is; the cache calls it inside its lock.

    Args:
        disk: the worker's disk tier, open.
        host: the worker's page store (pages are read from it when written down).
        policy: one of POLICIES.
        holder: the key its loads go under in copy plans (never a worker id).
    """

    name = TIER

    def __init__(
        self, disk: DiskTier, host: SharedPageStore, policy: str, holder: str, keep: bool = False
    ):
        if policy not in POLICIES:
            raise ValueError(f"disk policy {policy!r}: one of {', '.join(POLICIES)}")
        self.disk = disk
        self.host = host
        self.policy = policy
        self.holder = holder
        self.keep = keep
        self.id_base = host.num_pages
        self.capacity = disk.capacity  # disk page ids: id_base .. id_base + capacity - 1
        self.counters = TierCounters()  # what went through it: every report carries them
        self.demotions = 0  # pages demoted into it
        self.pages_loaded = 0  # loaded back into host memory by requests
        self.hit_tokens = 0  # prompt tokens requests reused from here
        self._lock = threading.Lock()
        for reason, records in disk.dropped.items():  # found when it was opened
            self.counters.dropped(reason, records)
        self._emit: Callable[[KvEvent], None] | None = None

    # -- the prefix cache's side (LowerTier) --------------------------------------------

    def attach(self, emit: Callable[[KvEvent], None]) -> None:
        self._emit = emit

    def published(self, pages: Sequence[Spilled]) -> None:
        for page in pages:
            record = self.disk.lookup(page.digest)
            if record is None and self.policy == "write_through":
                record = self._write(page)
            if record is not None:
                self.disk.set_up(page.digest, True)
        self._announce_removed()

    def keep_above(self, pages: Iterator[Spilled]) -> None:
        missing = []
        for page in pages:
            if self.disk.lookup(page.digest) is not None:
                break  # the disk is prefix-closed: everything above this is there too
            missing.append(page)
        for page in reversed(missing):  # parents first
            if self._write(page) is None:
                break
            self.disk.set_up(page.digest, True)
        self._announce_removed()

    def demote(self, pages: Sequence[Spilled]) -> list[tuple[int, int] | None]:
        taken: dict[bytes, DiskRecord | None] = {}
        for page in sorted(pages, key=lambda s: s.depth):  # parents before children
            record = self.disk.lookup(page.digest)
            if record is None:
                record = self._write(page)
            taken[page.digest] = record
        self._announce_removed()
        places: list[tuple[int, int] | None] = []
        for page in pages:
            record = taken[page.digest]
            # A record written early in this call may have made room for a later one.
            if record is not None and self.disk.lookup(page.digest) == record:
                self.disk.set_up(page.digest, False)
                places.append((self.id_base + record.slot, record.generation))
                self.demotions += 1
                self.counters.demoted(1)
            else:
                places.append(None)
        return places

    def held_elsewhere(self, pages: Sequence[int], generations: Sequence[int]) -> int:
        marked = 0
        for page, generation in zip(pages, generations, strict=True):
            slot = page - self.id_base
            if 0 <= slot < self.capacity:
                marked += self.disk.mark(slot, generation)
        return marked

    def dropped(self, digests: Sequence[bytes], reason: str) -> None:
        removed = self.disk.remove(digests, reason)
        self._announce(removed, reason)
        self._announce_removed()

    def cleared(self) -> None:
        self.disk.clear()
        self.disk.take_removed()  # the cache's AllCleared or removals cover them

    def snapshot(self, host: Mapping[bytes, int]) -> list[PagesStored]:
        chains: list[PagesStored] = []
        for record in self.disk.records():  # parents before children
            if self.disk.is_up(record.digest):
                continue
            parent = self.disk.lookup(record.parent) if record.depth > 1 else None
            if record.depth == 1:
                parent_page = None
            elif parent is not None and not self.disk.is_up(parent.digest):
                parent_page = self.id_base + parent.slot
            elif record.parent in host:
                parent_page = host[record.parent]
            else:
                continue  # its parent is nowhere this worker can name: not announced
            chains.append(
                PagesStored(
                    record.namespace,
                    parent_page,
                    (self.id_base + record.slot,),
                    (record.generation,),
                    PackedTokens(record.tokens),
                    TIER,
                )
            )
        return chains

    # -- loading back -------------------------------------------------------------------

    def span(self, digests: Sequence[bytes], first: int) -> HolderSpan | None:
        """The records continuing prompt page `first` on (`digests`: the prompt's page
        digests), as a span of prompt pages 0 .. reach-1 (pages before `first` are in
        host memory already and never read from here); None when it has page `first` not."""
        records = self.disk.chain(digests, first)
        if not records:
            return None
        ids = (0,) * first + tuple(self.id_base + r.slot for r in records)
        gens = (0,) * first + tuple(r.generation for r in records)
        return HolderSpan(self.holder, TIER, ids, gens)

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

    def loaded(self, pages: int, seconds: float, failures: int) -> None:
        """A request loaded `pages` from here in `seconds` (`failures`: planned pages that
        did not verify)."""
        with self._lock:
            self.pages_loaded += pages
        self.counters.read(pages * self.host.layout.page_bytes)
        self.counters.load_took(seconds)
        if failures:
            self.counters.failed(failures)

    def hit(self, tokens: int) -> None:
        """A request's prompt reused `tokens` loaded from here (counted at its admission)."""
        with self._lock:
            self.hit_tokens += tokens
        self.counters.hit(tokens)

    def link(self) -> Link:
        """The disk's measured read cost, as copy plans weigh a holder's link."""
        nbytes = self.host.layout.page_bytes
        latency = self.disk.read_seconds(0)
        per_page = max(self.disk.read_seconds(nbytes) - latency, 1e-9)
        return Link(False, nbytes / per_page, latency)

    def source(self) -> DiskSource:
        return DiskSource(self)

    # -- inside -------------------------------------------------------------------------

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

    def _announce_removed(self) -> None:
        by_reason: dict[str, list[DiskRecord]] = {}
        for record, reason in self.disk.take_removed():
            by_reason.setdefault(reason, []).append(record)
        for reason, records in by_reason.items():
            self._announce(records, reason)

    def figures(self) -> TierFigures:
        """Its figures for the worker's report."""
        stats = self.disk.stats()
        layout = self.host.layout
        per_token = self.disk.read_seconds(layout.page_bytes) / layout.page_tokens
        return self.counters.figures(
            TIER,
            stats["pages"],
            self.disk.capacity,
            read_ns_per_token=round(per_token * 1e9),
            accepting=bool(stats["accepting"]),
        )

    def _announce(self, records: Sequence[DiskRecord], reason: str) -> None:
        # An up record's page is known by its host id: a removal of its disk id is an
        # unknown id to the index, which ignores it.
        if records:
            self.counters.removed(reason, len(records))
        if records and self._emit is not None:
            ids = tuple(self.id_base + r.slot for r in sorted(records, key=lambda r: -r.depth))
            self._emit(PagesRemoved(ids, reason, TIER))

    def stats(self) -> dict[str, Any]:
        return {
            **self.disk.stats(),
            "policy": self.policy,
            "demotions": self.demotions,
            "pages_loaded": self.pages_loaded,
            "hit_tokens": self.hit_tokens,
            "directory": str(self.disk.directory),
        }

    def check_integrity(self) -> None:
        self.disk.check_integrity()
        self.counters.check_integrity()

    def close(self) -> None:
        """Close the tier; its files go unless the settings keep them."""
        self.disk.close(remove_files=not self.keep)


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
        valid = []
        for page, gen, digest, target in zip(pages, gens, digests, targets, strict=True):
            record = disk.lookup(digest)
            ok = (
                record is not None
                and base + record.slot == page
                and record.generation == gen
                and disk.read(record, store.page_buffer(target))
            )
            valid.append(ok)
            if not ok:
                break  # the usable prefix ends at the first failure
        valid += [False] * (len(pages) - len(valid))
        self.link._announce_removed()  # a record found corrupt is gone
        return valid

    def close(self) -> None:
        pass
