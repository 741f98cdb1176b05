"""Who holds each node: four inline holder columns per node, and more beside them.

A holding is (worker slot, the worker's page id, the page's generation, the page's tier:
its index into `events.TIERS`). A worker holds a node once, in whichever tier it named
last (see `chains`); the holders past the inline columns are kept by the compiled trie
(csrc/trie.hpp), which makes every write. A worker keeps one column along its whole path:
the column of a page's holding is the column of its parent's holding, and only a first
page picks a free column. Two workers never compete for a column (the one already there
would hold the parent in that column too), so along a prompt column c belongs to one
worker, and a span is a slice (or gather) of column c over the matched nodes. Each
worker's holdings are prefix-closed (it holds a page only with its parent), so along one
prompt every holder holds a leading run of the matched pages.
"""

from __future__ import annotations

from array import array

import numpy as np

from cache_service.events import TIERS
from cache_service.index._compiled import Trie
from cache_service.index.nodes import NONE, extend
from cache_service.messages import HolderSpan, PackedSpan

# Inline holder columns per node (kInline in csrc/trie.hpp). Four covers a page shared by
# a handful of workers without a holder beyond them; each column costs 15 bytes a node.
INLINE_HOLDERS = 4
EXTRA = INLINE_HOLDERS  # the "column" of a holding kept beyond the inline ones
_DISK = TIERS.index("disk")
_DISK_CODE = bytes((_DISK,))  # a page's code in a span's tiers
_new_tuple = tuple.__new__


class Holders:
    """The holder columns of every node, grown with the node columns (`grow`), and a
    worker's holding of a node. The writes, and the spans of a match, run in the compiled
    trie (`trie`, set by the `Nodes` these columns grow with), which also keeps the
    holders beyond the inline columns."""

    def __init__(self) -> None:
        self.trie: Trie | None = None
        self.count_arr = np.zeros(0, np.int16)  # holders of each node, inline and beyond
        # (nodes, columns), so the spans of one path share cache lines.
        self.slot_arr = np.zeros((0, INLINE_HOLDERS), np.int16)  # NONE: empty
        self.page_arr = np.zeros((0, INLINE_HOLDERS), np.int32)
        self.generation_arr = np.zeros((0, INLINE_HOLDERS), np.int64)
        self.tier_arr = np.zeros((0, INLINE_HOLDERS), np.uint8)  # an index into TIERS

    def release_views(self) -> None:
        """Drop the memoryviews of the columns (before they are resized)."""
        self.count = None
        self.page = self.generation = self.tier = []

    def grow(self, capacity: int) -> None:
        """Extend the columns to `capacity` nodes and rebind the views (after
        `release_views`)."""
        for name, fill in (
            ("count_arr", 0),
            ("slot_arr", NONE),
            ("page_arr", 0),
            ("generation_arr", 0),
            ("tier_arr", 0),
        ):
            extend(self, name, capacity, fill)
        self.count = memoryview(self.count_arr)
        # One memoryview per holder column, for scalar reads.
        self.page = [memoryview(column) for column in self.page_arr.T]
        self.generation = [memoryview(column) for column in self.generation_arr.T]
        self.tier = [memoryview(column) for column in self.tier_arr.T]

    def column_of(self, node: int, slot: int) -> int | None:
        """The column of the worker's holding on `node` (EXTRA: beside the columns); None:
        it holds none."""
        return self.trie.column_of(node, slot)

    def extra(self, node: int) -> tuple[tuple[int, int, int, int], ...]:
        """The holders of `node` beyond its inline columns: (slot, page, generation, tier)."""
        return self.trie.extra(node)

    def holding(self, node: int, slot: int) -> tuple[int, int, int] | None:
        """The worker's (page id, generation, tier) for `node`; None when it does not hold it."""
        column = self.column_of(node, slot)
        if column is None:
            return None
        if column < EXTRA:
            return self.page[column][node], self.generation[column][node], self.tier[column][node]
        return next(holder[1:] for holder in self.extra(node) if holder[0] == slot)


def match_spans(
    found: tuple, slots: list, requester_slot: int, packed: bool
) -> tuple[tuple[HolderSpan | PackedSpan, ...], int]:
    """A match's spans, the longest first (then by worker id), from the compiled match's
    holdings `found` ((slot, pages, tier, page ids, generations, tiers) each), and the
    pages the requester holds itself. `packed`: PackedSpans (the wire's bytes as they
    are), else HolderSpans of ints."""
    span_type = PackedSpan if packed else HolderSpan
    built, local = [], 0
    for slot, held, tier, page_ids, generations, tiers in found:
        if slot == requester_slot:
            local = held
        worker = slots[slot]
        assert worker is not None, f"a holding of dead slot {slot}"
        if not packed:
            page_ids = tuple(array("i", page_ids))  # little-endian: the module checks
            generations = tuple(array("q", generations))
        fields = (worker.worker_id, TIERS[tier], page_ids, generations, tiers)
        built.append(_new_tuple(span_type, fields))
    if len(built) > 1:
        built.sort(key=span_order)  # packed lengths are 4x, in the same order
    return tuple(built), local


def span_order(span: HolderSpan | PackedSpan) -> tuple[int, str]:
    """The order of a match's spans: the longest first, then by worker id."""
    return (-len(span.page_ids), span.worker_id)


def host_pages(held: int, tier: int, tiers: bytes) -> int:
    """The pages of a span before its first on disk (`tiers` empty: all in `tier`)."""
    if not tiers:
        return 0 if tier == _DISK else held
    at = tiers.find(_DISK_CODE)
    return held if at < 0 else at
