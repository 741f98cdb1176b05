"""The write side of the index: storing workers' chains of pages, moving holdings between
tiers, and dropping them.

A `PagesStored` chain hangs below the worker's parent page (or the namespace root): each
page becomes (or is found as) a node, and the worker becomes one of its holders. Dropping
a holding prunes every node left with no holder and no child, leaf-up, so a node with no
holders never survives and nothing is ever held below a node nobody holds.

A worker holds a node once, whatever its tiers: the holding is the copy it named last.
A demotion moves a holding in place to its new page id, generation and tier, and a
stored page on a node the worker holds already (loaded back from disk, say) moves it the
same way, so a prefix never loses its holder between tiers:

    stored  host  page 7  gen 3      node N: (w, 7, 3, host)
    demoted 7 -> 1007 gen 4, disk    node N: (w, 1007, 4, disk)   page 7 forgotten
    stored  host  page 9  gen 5      node N: (w, 9, 5, host)      page 1007 forgotten

A worker that newly holds a node others hold already has the newest copy of that page (it
copied it in, or computed it again): the others' copies of it are what a cluster can best
spare. A store from the worker's events (not a resync, and not a holding that only moved to
another id or tier) leaves each of them a notice in the compiled trie, at most
`notice_limit` waiting a worker (the oldest go first), which `GlobalIndex.held_elsewhere`
hands out with their heartbeats.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_service.events import (
    REMOVAL_REASONS,
    TIERS,
    AllCleared,
    KvEvent,
    Namespace,
    PagesDemoted,
    PagesRemoved,
    PagesStored,
)
from cache_service.index._compiled import first_outside
from cache_service.index.nodes import Nodes
from cache_service.index.registry import Worker
from cache_service.tokens import INT32_MAX, pack_tokens

_INT64_MAX = 2**63 - 1
TIER_INDEX = {name: index for index, name in enumerate(TIERS)}


class Chains:
    """Stores, moves and drops holdings (in the compiled trie, over the node and holder
    columns), and counts what the events did: pages removed by (tier index, reason),
    pages demoted into each tier, and page ids named for removal or demotion that the
    worker did not hold."""

    def __init__(self, nodes: Nodes):
        self._nodes = nodes
        self._trie = nodes.trie
        self.removed: dict[tuple[int, str], int] = {}
        self.demoted = [0] * len(TIERS)
        self.unknown_pages = 0

    def apply(
        self,
        worker: Worker,
        events: Sequence[KvEvent],
        packed: Sequence[bytes | None],
        clock: int,
        notify: bool = False,
    ) -> str | None:
        """Apply checked events (`packed`: what `check_event` returned for each) in order;
        `notify`: stored chains leave notices (see `store`).

        Returns:
            None, or why a stored chain cannot be placed (see `store`); the events before
            it stay applied (each is idempotent, and the worker resyncs next).
        """
        for event, data in zip(events, packed, strict=True):
            if isinstance(event, PagesStored):
                failure = self.store(worker, event, data, clock, notify)
                if failure is not None:
                    return failure
            elif isinstance(event, PagesRemoved):
                self._settle(
                    worker,
                    self._trie.drop_pages(worker.pages, worker.slot, event.page_ids),
                    event.reason,
                )
            elif isinstance(event, PagesDemoted):
                failure = self.demote(worker, event)
                if failure is not None:
                    return failure
            else:
                self.drop_all(worker, "cleared")
        return None

    def store(
        self,
        worker: Worker,
        event: PagesStored,
        data: bytes,
        clock: int,
        notify: bool = False,
    ) -> str | None:
        """Hang a checked chain (packed tokens `data`) below the worker's parent page.

        A page on a node the worker holds already (in another tier, or under another
        id) moves that holding to the chain's page id, generation and tier. With
        `notify`, every other holder of a node the worker did not hold before gets a
        notice (named by its id in whichever tier it holds the page).

        Returns:
            None, or why it cannot be placed: "unknown_parent" (the worker holds no such
            parent page), "page_conflict" (a page id of the chain is on its own path),
            "over_capacity" (its new pages would take the worker past its capacity: the
            chain changes nothing).
        """
        if not event.page_ids:
            return None
        if not worker.room_for(event.page_ids):
            return "over_capacity"
        nodes = self._nodes
        if event.parent_page is None:
            parent = nodes.root(event.namespace)
        else:
            parent = worker.pages.get(event.parent_page)
            if parent is None:
                return "unknown_parent"
        nodes.reserve(len(event.page_ids))
        written = self._trie.store(
            worker.pages,
            worker.slot,
            parent,
            data,
            event.page_ids,
            event.generations,
            TIER_INDEX[event.tier],
            clock,
            notify,
        )
        self._settle(worker, written)
        return None if written[0] else "page_conflict"

    def demote(self, worker: Worker, event: PagesDemoted) -> str | None:
        """Move each named holding of the worker in place to its new page id, generation
        and tier; ids the worker does not hold are skipped (and counted).

        Returns:
            None, or "page_conflict": a new page id is the worker's id of an ancestor of
            the page it is to name (the moves before it stay made).
        """
        tier = TIER_INDEX[event.tier]
        written = self._trie.demote(
            worker.pages,
            worker.slot,
            event.page_ids,
            event.new_page_ids,
            event.generations,
            tier,
        )
        self.demoted[tier] += written[3]
        self._settle(worker, written)
        return None if written[0] else "page_conflict"

    def drop_all(self, worker: Worker, reason: str | None = None) -> int:
        """Drop every holding of the worker, pruning nodes left empty."""
        written = self._trie.drop_all(worker.pages, worker.slot, reason is not None)
        self._settle(worker, written, reason)
        assert worker.pages.size == 0 and not any(worker.tier_pages), "a holding outlived all"
        return written[0]

    def _settle(self, worker: Worker, written: tuple, reason: str | None = None) -> None:
        """Take in what a compiled write did: the worker's pages per tier, the removals
        counted under `reason`, the ids it did not hold; free the roots it emptied."""
        _, tier_delta, removed, _, unknown = written
        held = zip(worker.tier_pages, tier_delta, strict=True)
        worker.tier_pages = [pages + delta for pages, delta in held]
        self.unknown_pages += unknown
        if reason is not None:
            for tier, pages in enumerate(removed):
                if pages:
                    key = (tier, reason)
                    self.removed[key] = self.removed.get(key, 0) + pages
        self._nodes.release_emptied_roots()


def check_event(event: KvEvent, page_tokens: int) -> bytes | None:
    """Raise ValueError for a malformed event; the packed tokens of a PagesStored."""
    if isinstance(event, PagesStored):
        if not isinstance(event.namespace, Namespace):
            raise ValueError(f"PagesStored namespace is a {type(event.namespace).__name__}")
        count = len(event.page_ids)
        check_pages(event.page_ids, "a page id repeats within one chain")
        if event.parent_page is not None:
            check_pages((event.parent_page,))
        check_generations(event.generations, count)
        if len(event.tokens) != count * page_tokens:
            raise ValueError(f"{len(event.tokens)} tokens for {count} pages of {page_tokens}")
        check_tier(event.tier)
        return pack_tokens(event.tokens)
    if isinstance(event, PagesRemoved):
        if event.reason not in REMOVAL_REASONS:
            raise ValueError(f"removal reason {event.reason!r} not in {REMOVAL_REASONS}")
        check_pages(event.page_ids)
        check_tier(event.tier)
        return None
    if isinstance(event, PagesDemoted):
        count = len(event.page_ids)
        if len(event.new_page_ids) != count:
            raise ValueError(f"{len(event.new_page_ids)} new page ids for {count} pages")
        check_pages(event.page_ids, "a page id repeats within one demotion")
        check_pages(event.new_page_ids, "a new page id repeats within one demotion")
        check_generations(event.generations, count)
        check_tier(event.tier)
        return None
    if isinstance(event, AllCleared):
        return None
    raise ValueError(f"unknown event type {type(event).__name__}")


def check_snapshot(chains: Sequence[PagesStored], page_tokens: int) -> list[bytes]:
    """Raise ValueError unless `chains` is a whole snapshot: stored chains only, each
    parent stored by an earlier chain, no page id twice; their packed tokens."""
    packed = []
    seen: set[int] = set()
    for i, chain in enumerate(chains):
        if not isinstance(chain, PagesStored):
            raise ValueError(f"resync chain {i} is a {type(chain).__name__}, not PagesStored")
        packed.append(check_event(chain, page_tokens))
        if chain.parent_page is not None and chain.parent_page not in seen:
            raise ValueError(
                f"resync chain {i}: parent page {chain.parent_page} is not stored earlier"
            )
        repeated = seen.intersection(chain.page_ids)
        if repeated:
            raise ValueError(f"resync chain {i}: pages {sorted(repeated)} listed twice")
        seen.update(chain.page_ids)
    return packed


def check_generations(generations: Sequence[int], count: int) -> None:
    """One generation per page, each an int64 >= 0."""
    if len(generations) != count:
        raise ValueError(f"{len(generations)} generations for {count} pages")
    bad = first_outside(generations, 0, _INT64_MAX, False)
    if bad >= 0:
        raise ValueError(f"generations must be ints in [0, 2**63), got {generations[bad]!r}")


def check_tier(tier: str) -> None:
    if not isinstance(tier, str) or tier not in TIER_INDEX:
        raise ValueError(f"tier {tier!r} not in {TIERS}")


def check_pages(page_ids: Sequence[int], repeated: str | None = None) -> None:
    """Page ids travel as int32 in match replies; page stores number pages from 0.
    `repeated`: the error when one repeats (None: repeats are allowed)."""
    bad = first_outside(page_ids, 0, INT32_MAX, repeated is not None)
    if bad < 0:
        return
    page = page_ids[bad]
    if isinstance(page, int) and 0 <= page <= INT32_MAX:
        raise ValueError(f"{repeated}: {page_ids}")
    raise ValueError(f"page ids must be ints in [0, 2**31), got {page!r}")
