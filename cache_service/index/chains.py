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
from cache_service.index.holders import Holders
from cache_service.index.nodes import NONE, Nodes
from cache_service.index.registry import Worker
from cache_service.tokens import INT32_MAX, pack_tokens

_INT64_MAX = 2**63 - 1
TIER_INDEX = {name: index for index, name in enumerate(TIERS)}


class Chains:
    """Stores, moves and drops holdings over the node and holder columns, and counts what
    the events did: pages removed by (tier index, reason), pages demoted into each tier,
    and page ids named for removal or demotion that the worker did not hold."""

    def __init__(self, nodes: Nodes, holders: Holders):
        self._nodes = nodes
        self._holders = holders
        self.removed: dict[tuple[int, str], int] = {}
        self.demoted = [0] * len(TIERS)
        self.unknown_pages = 0

    def apply(
        self, worker: Worker, events: Sequence[KvEvent], packed: Sequence[bytes | None], clock: int
    ) -> str | None:
        """Apply checked events (`packed`: what `check_event` returned for each) in order.

        Returns:
            None, or why a stored chain cannot be placed (see `store`); the events before
            it stay applied (each is idempotent, and the worker resyncs next).
        """
        for event, data in zip(events, packed, strict=True):
            if isinstance(event, PagesStored):
                failure = self.store(worker, event, data, clock)
                if failure is not None:
                    return failure
            elif isinstance(event, PagesRemoved):
                self.drop_pages(worker, event.page_ids, event.reason)
            elif isinstance(event, PagesDemoted):
                failure = self.demote(worker, event)
                if failure is not None:
                    return failure
            else:
                self.drop_all(worker, "cleared")
        return None

    def store(self, worker: Worker, event: PagesStored, data: bytes, clock: int) -> str | None:
        """Hang a checked chain (packed tokens `data`) below the worker's parent page.

        A page on a node the worker holds already (in another tier, or under another
        id) moves that holding to the chain's page id, generation and tier.

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
        nodes, holders = self._nodes, self._holders
        if event.parent_page is None:
            parent = nodes.root(event.namespace)
        else:
            parent = worker.pages.get(event.parent_page)
            if parent is None:
                return "unknown_parent"
        keys = nodes.keys.chain_keys(nodes.key[parent], nodes.depth[parent], data).tolist()
        # The worker's column on the parent is its column all along the chain.
        column = None if event.parent_page is None else holders.column_of(parent, worker.slot)
        size = nodes.page_bytes
        tier = TIER_INDEX[event.tier]
        for i, (page, generation) in enumerate(zip(event.page_ids, event.generations, strict=True)):
            tokens = data[i * size : (i + 1) * size]
            node = nodes.child(parent, keys[i], tokens)
            old = worker.pages.get(page)
            if old is not None and old != node:
                # The worker reused the page id: what it held there (and beneath) is gone.
                if nodes.is_ancestor_or_self(old, parent):
                    return "page_conflict"
                self.drop_subtree(worker, old)
                if i == 0 and event.parent_page is None:  # the drop may have pruned the root
                    parent = nodes.root(event.namespace)
                node = nodes.child(parent, keys[i], tokens)
            if node is None:
                node = nodes.new_node(parent, keys[i], tokens)
            column = self._hold(worker, node, page, generation, tier, column)
            nodes.last_access[node] = clock
            parent = node
        return None

    def demote(self, worker: Worker, event: PagesDemoted) -> str | None:
        """Move each named holding of the worker in place to its new page id, generation
        and tier; ids the worker does not hold are skipped (and counted).

        Returns:
            None, or "page_conflict": a new page id is the worker's id of an ancestor of
            the page it is to name (the moves before it stay made).
        """
        tier = TIER_INDEX[event.tier]
        pages = worker.pages
        moves = zip(event.page_ids, event.new_page_ids, event.generations, strict=True)
        for old, new, generation in moves:
            node = pages.get(old)
            if node is None:
                self.unknown_pages += 1
                continue
            taken = pages.get(new)
            if taken is not None and taken != node:
                # The worker reused the id: what it held there (and beneath) is gone.
                if self._nodes.is_ancestor_or_self(taken, node):
                    return "page_conflict"
                self.drop_subtree(worker, taken)
            self._hold(worker, node, new, generation, tier, None)
            self.demoted[tier] += 1
        return None

    def _hold(
        self, worker: Worker, node: int, page: int, generation: int, tier: int, column: int | None
    ) -> int:
        """Record the worker's holding of `node` (see `Holders.add`); its column."""
        column, previous = self._holders.add(node, worker.slot, page, generation, tier, column)
        tier_pages = worker.tier_pages
        if previous is not None:
            old_page, old_tier = previous
            tier_pages[old_tier] -= 1
            if old_page != page:
                # The worker holds this prefix under a new page id now; newest wins.
                worker.pages.pop(old_page)
        tier_pages[tier] += 1
        worker.pages.set(page, node)
        # It holds a page in `tier` now: all its pages are in one tier only if in that one.
        worker.only_tier = tier if tier_pages[tier] == worker.pages.size else None
        return column

    def _release(self, worker: Worker, node: int, reason: str | None) -> None:
        """Take the worker's holding off `node`, counting it under `reason` (None: a drop
        no event asked for, e.g. a page id reused or a worker gone)."""
        page, tier = self._holders.remove(node, worker.slot)
        worker.pages.pop(page)
        worker.tier_pages[tier] -= 1
        if worker.only_tier is None:  # one page less may leave the rest in one tier
            worker.only_tier = worker.single_tier()
        if reason is not None:
            key = (tier, reason)
            self.removed[key] = self.removed.get(key, 0) + 1

    def drop_subtree(self, worker: Worker, top: int, reason: str | None = None) -> int:
        """Drop the worker's holdings of `top` and of everything it holds beneath it."""
        nodes, holders = self._nodes, self._holders
        held, stack = [], [top]
        while stack:
            node = stack.pop()
            if holders.column_of(node, worker.slot) is None:
                continue  # prefix-closed: nothing of the worker's below either
            held.append(node)
            child = nodes.first_child[node]
            while child != NONE:
                stack.append(child)
                child = nodes.next_sibling[child]
        for node in reversed(held):  # children before parents, so pruning climbs once
            self._release(worker, node, reason)
            self._prune(node)
        return len(held)

    def drop_all(self, worker: Worker, reason: str | None = None) -> int:
        """Drop every holding of the worker, pruning nodes left empty."""
        held = worker.pages.items()
        # Any order works: a node emptied here has no holders below it (prefix closure),
        # so it is released when the last of its children is, whichever comes last.
        for _, node in held:
            self._release(worker, node, reason)
            self._prune(node)
        assert worker.pages.size == 0 and not any(worker.tier_pages), "a holding outlived all"
        worker.pages.clear()
        return len(held)

    def drop_pages(self, worker: Worker, page_ids: Sequence[int], reason: str) -> None:
        """Drop the named pages of the worker (and what it holds below them); unknown
        pages are skipped (and counted)."""
        for page in page_ids:
            node = worker.pages.get(page)
            if node is None:
                self.unknown_pages += 1
            else:
                self.drop_subtree(worker, node, reason)

    def _prune(self, node: int) -> None:
        """Remove `node` and then its ancestors while they have no holders and no children."""
        nodes, count = self._nodes, self._holders.count
        while count[node] == 0 and nodes.first_child[node] == NONE:
            parent = nodes.parent[node]
            nodes.release(node)
            if parent == NONE:
                return
            node = parent


def check_event(event: KvEvent, page_tokens: int) -> bytes | None:
    """Raise ValueError for a malformed event; the packed tokens of a PagesStored."""
    if isinstance(event, PagesStored):
        if not isinstance(event.namespace, Namespace):
            raise ValueError(f"PagesStored namespace is a {type(event.namespace).__name__}")
        count = len(event.page_ids)
        check_pages(event.page_ids)
        if event.parent_page is not None:
            check_pages((event.parent_page,))
        check_generations(event.generations, count)
        if len(event.tokens) != count * page_tokens:
            raise ValueError(f"{len(event.tokens)} tokens for {count} pages of {page_tokens}")
        if len(set(event.page_ids)) != count:
            raise ValueError(f"a page id repeats within one chain: {event.page_ids}")
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
        check_pages(event.page_ids)
        check_pages(event.new_page_ids)
        check_generations(event.generations, count)
        for name, ids in (("page id", event.page_ids), ("new page id", event.new_page_ids)):
            if len(set(ids)) != count:
                raise ValueError(f"a {name} repeats within one demotion: {ids}")
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
    for generation in generations:
        if not isinstance(generation, int) or not 0 <= generation <= _INT64_MAX:
            raise ValueError(f"generations must be ints in [0, 2**63), got {generation!r}")


def check_tier(tier: str) -> None:
    if not isinstance(tier, str) or tier not in TIER_INDEX:
        raise ValueError(f"tier {tier!r} not in {TIERS}")


def check_pages(page_ids: Sequence[int]) -> None:
    """Page ids travel as int32 in match replies; page stores number pages from 0."""
    for page in page_ids:
        if not isinstance(page, int) or not 0 <= page <= INT32_MAX:
            raise ValueError(f"page ids must be ints in [0, 2**31), got {page!r}")
