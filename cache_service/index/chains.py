"""The write side of the index: storing workers' chains of pages and dropping holdings.

A `PagesStored` chain hangs below the worker's parent page (or the namespace root): each
page becomes (or is found as) a node, and the worker becomes one of its holders. Dropping
a holding prunes every node left with no holder and no child, leaf-up, so a node with no
holders never survives and nothing is ever held below a node nobody holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_service.events import (
    REMOVAL_REASONS,
    AllCleared,
    KvEvent,
    Namespace,
    PagesRemoved,
    PagesStored,
)
from cache_service.index.holders import Holders
from cache_service.index.nodes import NONE, Nodes
from cache_service.index.registry import Worker
from cache_service.tokens import INT32_MAX, pack_tokens

_INT64_MAX = 2**63 - 1


class Chains:
    """Stores and drops holdings over the node and holder columns."""

    def __init__(self, nodes: Nodes, holders: Holders):
        self._nodes = nodes
        self._holders = holders

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
                self.drop_pages(worker, event.page_ids)
            else:
                self.drop_all(worker)
        return None

    def store(self, worker: Worker, event: PagesStored, data: bytes, clock: int) -> str | None:
        """Hang a checked chain (packed tokens `data`) below the worker's parent page.

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
            column, replaced = holders.add(node, worker.slot, page, generation, column)
            if replaced is not None:
                # The worker holds this prefix under a new page id now; newest wins.
                worker.pages.pop(replaced)
            worker.pages.set(page, node)
            nodes.last_access[node] = clock
            parent = node
        return None

    def drop_subtree(self, worker: Worker, top: int) -> int:
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
            worker.pages.pop(holders.remove(node, worker.slot))
            self._prune(node)
        return len(held)

    def drop_all(self, worker: Worker) -> int:
        """Drop every holding of the worker, pruning nodes left empty."""
        held = worker.pages.items()
        worker.pages.clear()
        # Any order works: a node emptied here has no holders below it (prefix closure),
        # so it is released when the last of its children is, whichever comes last.
        for _, node in held:
            self._holders.remove(node, worker.slot)
            self._prune(node)
        return len(held)

    def drop_pages(self, worker: Worker, page_ids: Sequence[int]) -> None:
        """Drop the named pages of the worker (and what it holds below them); unknown
        pages are ignored."""
        for page in page_ids:
            node = worker.pages.get(page)
            if node is not None:
                self.drop_subtree(worker, node)

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
        if len(event.generations) != count:
            raise ValueError(f"{len(event.generations)} generations for {count} pages")
        for generation in event.generations:
            if not isinstance(generation, int) or not 0 <= generation <= _INT64_MAX:
                raise ValueError(f"generations must be ints in [0, 2**63), got {generation!r}")
        if len(event.tokens) != count * page_tokens:
            raise ValueError(f"{len(event.tokens)} tokens for {count} pages of {page_tokens}")
        if len(set(event.page_ids)) != count:
            raise ValueError(f"a page id repeats within one chain: {event.page_ids}")
        return pack_tokens(event.tokens)
    if isinstance(event, PagesRemoved):
        if event.reason not in REMOVAL_REASONS:
            raise ValueError(f"removal reason {event.reason!r} not in {REMOVAL_REASONS}")
        check_pages(event.page_ids)
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


def check_pages(page_ids: Sequence[int]) -> None:
    """Page ids travel as int32 in match replies; page stores number pages from 0."""
    for page in page_ids:
        if not isinstance(page, int) or not 0 <= page <= INT32_MAX:
            raise ValueError(f"page ids must be ints in [0, 2**31), got {page!r}")
