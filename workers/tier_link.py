"""A tier of page records under the prefix cache: the `LowerTier` both lower tiers share.

The prefix cache keeps its pages in its own store (host shared memory on a CPU worker,
device memory on a GPU worker). The tier below it keeps records of whole pages under
their chain digests (`workers.store.record_tables`): the disk under host memory
(`workers.disk_link`), host memory under a device (`workers.host_link`). This module
decides, for either, what goes into it and what the rest of the mesh hears:

    write_back      a page is written when the tier above evicts it (the default)
    write_through   a page is written as soon as it is published (the disk only: a
                    restarted worker then finds everything it had published)

A record also held in the tier above is "up": the index knows the page by its id there,
and the tier below never evicts it. Records keep whole prefixes (a record's parent is a
record too): a page demoted under pages still above has those written first, up, so a
later hit finds whole prompts. A page evicted above that the tier takes is demoted
(PagesDemoted: the worker still holds it, at its id here); one it cannot take is evicted.
A page's id here is its slot after the pages above (`id_base + slot`), so a worker's page
ids stay unique across its tiers.

Loading back is a copy like any other (`workers.member`): `span` names the records that
continue a prompt past what the tier above matched, the tier's `source` reads them into
pages above with each record verified, and the copy decision weighs `link`, the tier's
measured read rate, against recomputing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from cache_service.events import KvEvent, PagesRemoved, PagesStored
from cache_service.messages import HolderSpan, TierFigures
from cache_service.tokens import PackedTokens
from workers.cache.disk_settings import POLICIES  # when pages are written down
from workers.cache.tiers import Place, Spilled
from workers.service.figures import TierCounters
from workers.store.disk_records import DiskRecord
from workers.store.page_store import SharedPageStore
from workers.transfer.costs import Link


class Records(Protocol):
    """A tier's records, as the link drives them (`DiskTier`, `HostTier`)."""

    capacity: int

    def lookup(self, digest: bytes) -> DiskRecord | None: ...
    def chain(self, digests: Sequence[bytes], start: int) -> list[DiskRecord]: ...
    def records(self) -> list[DiskRecord]: ...
    def record_at(self, slot: int) -> DiskRecord | None: ...
    def is_up(self, digest: bytes) -> bool: ...
    def set_up(self, digest: bytes, up: bool) -> None: ...
    def mark(self, slot: int, generation: int) -> bool: ...
    def take_removed(self) -> list[tuple[DiskRecord, str]]: ...
    def remove(self, digests: Sequence[bytes], reason: str) -> list[DiskRecord]: ...
    def clear(self) -> int: ...
    def read_seconds(self, nbytes: int) -> float: ...
    def stats(self) -> dict: ...
    def check_integrity(self) -> None: ...


class TierLink:
    """A tier of records below the store of one worker's prefix cache (see the module
    docstring). Thread-safe as far as its records are; the cache calls it inside its lock.

    Subclasses name the tier (`name`) and write a page down (`_write`); they give the
    source that loads records back (`source`) and close the tier (`close`).

    Args:
        records: the tier's records, open.
        above: the store of the prefix cache above (pages are read from it going down).
        policy: one of POLICIES.
        holder: the key its loads go under in copy plans (never a worker id).
    """

    name = ""

    def __init__(
        self,
        records: Records,
        above: SharedPageStore,
        policy: str,
        holder: str,
        id_base: int | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"{self.name} policy {policy!r}: one of {', '.join(POLICIES)}")
        self.records = records
        self.above = above
        self.policy = policy
        self.holder = holder
        # Its ids follow the store above's (and, under a tier below that, that tier's too).
        self.id_base = above.num_pages if id_base is None else id_base
        self.capacity = records.capacity  # ids here: id_base .. id_base + capacity - 1
        self.counters = TierCounters()  # what went through it: every report carries them
        self.demotions = 0  # pages demoted into it
        self.pages_loaded = 0  # loaded back into the tier above by requests
        self.hit_tokens = 0  # prompt tokens requests reused from here
        self._lock = threading.Lock()
        self._emit: Callable[[KvEvent], None] | None = None

    def _write(self, page: Spilled) -> DiskRecord | None:
        """Write one page of the store above down; its record, or None (not taken)."""
        raise NotImplementedError

    def _write_all(self, pages: Sequence[Spilled]) -> list[DiskRecord | None]:
        """Write pages down, parents before children (a tier that copies in bulk does it
        in one go); one record or None per page."""
        return [self._write(page) for page in pages]

    def source(self) -> Any:
        """The `PageSource` (`workers.transfer.copy_in`) that loads its records into pages
        of the store above, each verified."""
        raise NotImplementedError

    def read_page(self, page: int, generation: int, out: bytearray) -> bytes | None:
        """A peer's read of page `page` (an id of this tier) through the page server
        (`workers.transfer.peer_disk.ServedDisk`)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def chain(self) -> list[TierLink]:
        """This tier and the tiers below it, top down."""
        return [self]

    @property
    def id_end(self) -> int:
        """One past the last page id of this tier and those below it."""
        last = self.chain()[-1]
        return last.id_base + last.capacity

    # -- the prefix cache's side (LowerTier) --------------------------------------------

    def attach(self, emit: Callable[[KvEvent], None]) -> None:
        self._emit = emit

    def published(self, pages: Sequence[Spilled]) -> None:
        for page in pages:
            record = self.records.lookup(page.digest)
            if record is None and self.policy == "write_through":
                record = self._write(page)
            if record is not None:
                self.records.set_up(page.digest, True)
        self._announce_removed()

    def keep_above(self, pages: Iterator[Spilled]) -> None:
        missing = []
        for page in pages:
            if self.records.lookup(page.digest) is not None:
                break  # prefix-closed: everything above this is here too
            missing.append(page)
        missing.reverse()  # parents first; a page whose parent is not taken is not either
        for page, record in zip(missing, self._write_all(missing), strict=True):
            if record is None:
                break
            self.records.set_up(page.digest, True)
        self._announce_removed()

    def demote(self, pages: Sequence[Spilled]) -> list[Place | None]:
        taken: dict[bytes, DiskRecord | None] = {}
        writes = []
        for page in parents_first(pages):
            taken[page.digest] = record = self.records.lookup(page.digest)
            if record is None:
                writes.append(page)
        for page, record in zip(writes, self._write_all(writes), strict=True):
            taken[page.digest] = record
        self._announce_removed()
        places: list[Place | None] = []
        for page in pages:
            record = taken[page.digest]
            # A record written early in this call may have made room for a later one.
            if record is not None and self.records.lookup(page.digest) == record:
                self.records.set_up(page.digest, False)
                places.append(Place(self.id_base + record.slot, record.generation, self.name))
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
                marked += self.records.mark(slot, generation)
        return marked

    def dropped(self, digests: Sequence[bytes], reason: str) -> None:
        removed = self.records.remove(digests, reason)
        self._announce(removed, reason)
        self._announce_removed()

    def cleared(self) -> None:
        self.records.clear()
        self.records.take_removed()  # the cache's AllCleared or removals cover them

    def snapshot(self, host: Mapping[bytes, int]) -> list[PagesStored]:
        chains: list[PagesStored] = []
        records = self.records
        for record in records.records():  # parents before children
            if records.is_up(record.digest):
                continue
            parent = records.lookup(record.parent) if record.depth > 1 else None
            if record.depth == 1:
                parent_page = None
            elif parent is not None and not records.is_up(parent.digest):
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
                    self.name,
                )
            )
        return chains

    # -- loading back -------------------------------------------------------------------

    def span(self, digests: Sequence[bytes], first: int) -> HolderSpan | None:
        """The records continuing prompt page `first` on (`digests`: the prompt's page
        digests), as a span of prompt pages 0 .. reach-1 (pages before `first` are in the
        tier above already and never read from here); None when it has page `first` not."""
        records = self.records.chain(digests, first)
        if not records:
            return None
        ids = (0,) * first + tuple(self.id_base + r.slot for r in records)
        gens = (0,) * first + tuple(r.generation for r in records)
        return HolderSpan(self.holder, self.name, ids, gens)

    def loaded(self, pages: int, seconds: float, failures: int) -> None:
        """A request loaded `pages` from here in `seconds` (`failures`: planned pages that
        did not verify)."""
        with self._lock:
            self.pages_loaded += pages
        self.counters.read(pages * self.above.layout.page_bytes)
        self.counters.load_took(seconds)
        if failures:
            self.counters.failed(failures)

    def hit(self, tokens: int) -> None:
        """A request's prompt reused `tokens` loaded from here (counted at its admission)."""
        with self._lock:
            self.hit_tokens += tokens
        self.counters.hit(tokens)

    def link(self) -> Link:
        """The tier's measured read cost, as copy plans weigh a holder's link."""
        nbytes = self.above.layout.page_bytes
        latency = self.records.read_seconds(0)
        per_page = max(self.records.read_seconds(nbytes) - latency, 1e-9)
        return Link(False, nbytes / per_page, latency)

    # -- figures and checks -------------------------------------------------------------

    def figures(self) -> TierFigures:
        """Its figures for the worker's report."""
        stats = self.records.stats()
        layout = self.above.layout
        per_token = self.records.read_seconds(layout.page_bytes) / layout.page_tokens
        return self.counters.figures(
            self.name,
            stats["pages"],
            self.records.capacity,
            read_ns_per_token=round(per_token * 1e9),
            accepting=bool(stats["accepting"]),
        )

    def stats(self) -> dict[str, Any]:
        return {
            **self.records.stats(),
            "policy": self.policy,
            "demotions": self.demotions,
            "pages_loaded": self.pages_loaded,
            "hit_tokens": self.hit_tokens,
        }

    def check_integrity(self) -> None:
        self.records.check_integrity()
        self.counters.check_integrity()

    # -- inside -------------------------------------------------------------------------

    def _announce_removed(self) -> None:
        by_reason: dict[str, list[DiskRecord]] = {}
        for record, reason in self.records.take_removed():
            by_reason.setdefault(reason, []).append(record)
        for reason, records in by_reason.items():
            self._announce(records, reason)

    def _announce(self, records: Sequence[DiskRecord], reason: str) -> None:
        # An up record's page is known by its id above: a removal of its id here is an
        # unknown id to the index, which ignores it.
        if records:
            self.counters.removed(reason, len(records))
        if records and self._emit is not None:
            ids = tuple(self.id_base + r.slot for r in sorted(records, key=lambda r: -r.depth))
            self._emit(PagesRemoved(ids, reason, self.name))


def parents_first(pages: Sequence[Spilled]) -> list[Spilled]:
    """`pages` with every parent before its children and each subtree together (a
    depth-first walk): a tier that must make room for a batch then evicts another chain's
    leaves, never the parent of a page still to come."""
    by_digest = {page.digest: page for page in pages}
    children: dict[bytes, list[Spilled]] = {}
    roots = []
    for page in pages:
        if page.parent in by_digest and by_digest[page.parent].depth == page.depth - 1:
            children.setdefault(page.parent, []).append(page)
        else:
            roots.append(page)
    order: list[Spilled] = []
    stack = list(reversed(roots))
    while stack:
        page = stack.pop()
        order.append(page)
        stack.extend(reversed(children.get(page.digest, ())))
    return order
