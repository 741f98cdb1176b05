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

import struct
import sys

import numpy as np

from cache_service.events import TIERS
from cache_service.index._compiled import Trie
from cache_service.index.nodes import NONE, grown
from cache_service.index.walk import Path
from cache_service.messages import HolderSpan, PackedSpan

# Inline holder columns per node. Four covers a page shared by a handful of workers
# without touching the side dict; each column costs 15 bytes a node.
INLINE_HOLDERS = 4
EXTRA = INLINE_HOLDERS  # the "column" of a holding kept in the side dict
_LITTLE_ENDIAN = sys.byteorder == "little"
_DISK_CODE = bytes((TIERS.index("disk"),))  # a page's code in a span's tiers
_new_tuple = tuple.__new__


class Holders:
    """The holder columns of every node, grown with the node columns (`grow`), and
    the reads of holdings. The writes run in the compiled trie (`trie`, set by the `Nodes`
    these columns grow with), which also keeps the holders beyond the inline columns."""

    def __init__(self) -> None:
        self.trie: Trie | None = None
        self.count_arr = np.zeros(0, np.int16)  # inline + side-dict holders of each node
        # (nodes, columns), so the spans of one path share cache lines.
        self.slot_arr = np.zeros((0, INLINE_HOLDERS), np.int16)  # NONE: empty
        self.page_arr = np.zeros((0, INLINE_HOLDERS), np.int32)
        self.generation_arr = np.zeros((0, INLINE_HOLDERS), np.int64)
        self.tier_arr = np.zeros((0, INLINE_HOLDERS), np.uint8)  # an index into TIERS

    def grow(self, capacity: int) -> None:
        """Extend the columns to `capacity` nodes and rebind the views."""
        self.count_arr = grown(self.count_arr, capacity, 0)
        self.slot_arr = grown(self.slot_arr, capacity, NONE)
        self.page_arr = grown(self.page_arr, capacity, 0)
        self.generation_arr = grown(self.generation_arr, capacity, 0)
        self.tier_arr = grown(self.tier_arr, capacity, 0)
        self.count = memoryview(self.count_arr)
        # One strided view (and memoryview) per holder column.
        self.slot_cols = list(self.slot_arr.T)
        self.page_cols = list(self.page_arr.T)
        self.generation_cols = list(self.generation_arr.T)
        self.tier_cols = list(self.tier_arr.T)
        self.slot = [memoryview(column) for column in self.slot_cols]
        self.page = [memoryview(column) for column in self.page_cols]
        self.generation = [memoryview(column) for column in self.generation_cols]
        self.tier = [memoryview(column) for column in self.tier_cols]

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

    def holdings(self, path: Path) -> list[tuple[int, int, int]]:
        """(slot, pages held, column) of every holder of the first node of a path.

        Each holder holds a leading run of the path (prefix closure) in one column
        (column consistency), so column c along the path is its holder's run, then empty:
        a holder of the last node holds the whole path, and any other's run ends where a
        binary search over scalar reads finds it.
        """
        length, runs, nodes = path
        first, last = path.first(), path.last()
        holdings = []
        for column, slots in enumerate(self.slot):
            slot = slots[first]
            if slot == NONE:
                continue
            if slots[last] == slot:
                held = length
            elif nodes is None:
                held = _leading_run(slots, runs, slot)
            else:
                held = int(np.count_nonzero(self.slot_cols[column][nodes] == slot))
            holdings.append((slot, held, column))
        for slot, _, _, _ in self.extra(first):
            held = 1
            while held < length and self.column_of(path.node(held), slot) == EXTRA:
                held += 1
            holdings.append((slot, held, EXTRA))
        return holdings

    def span(
        self,
        path: Path,
        holding: tuple[int, int, int],
        worker_id: str,
        tier: int | None,
        packed: bool,
    ) -> HolderSpan | PackedSpan:
        """The span of one holding of `path`, as ints (HolderSpan) or wire bytes (PackedSpan).

        `tier` is the tier of every page the worker holds, when they are all in one (then
        the span's pages are too, and its tiers stay empty without a look); None when they
        are not: then the span's tiers are read from the tier column.
        """
        if tier is not None:
            name = TIERS[tier]
            tiers = b""
        else:
            name, tiers = self._span_tiers(path, holding)
        slot, held, column = holding
        _, runs, nodes = path
        if column < EXTRA:
            pages, generations = self.page_cols[column], self.generation_cols[column]
            if nodes is None and packed and _LITTLE_ENDIAN:  # the server's case
                page_parts, generation_parts = [], []
                for first, length in runs:
                    stop = first + (length if length < held else held)
                    page_parts.append(pages[first:stop].tobytes())
                    generation_parts.append(generations[first:stop].tobytes())
                    held -= length
                    if held <= 0:
                        break
                if len(page_parts) == 1:
                    page_ids, generations = page_parts[0], generation_parts[0]
                else:
                    page_ids, generations = b"".join(page_parts), b"".join(generation_parts)
                return _new_tuple(PackedSpan, (worker_id, name, page_ids, generations, tiers))
            if nodes is None:  # runs of node ids: a slice of each column per run
                parts = _run_slices(runs, held)
                page_parts = [pages[part] for part in parts]
                generation_parts = [generations[part] for part in parts]
            else:
                nodes = nodes[:held]
                page_parts, generation_parts = [pages[nodes]], [generations[nodes]]
            if packed:
                page_ids = b"".join([_wire_bytes(part, "<i4") for part in page_parts])
                generations = b"".join([_wire_bytes(part, "<i8") for part in generation_parts])
                return _new_tuple(PackedSpan, (worker_id, name, page_ids, generations, tiers))
            page_ids = tuple(page for part in page_parts for page in part.tolist())
            generations = tuple(g for part in generation_parts for g in part.tolist())
        else:
            found = [
                next(holder for holder in self.extra(path.node(i)) if holder[0] == slot)
                for i in range(held)
            ]
            page_ids = tuple(holder[1] for holder in found)
            generations = tuple(holder[2] for holder in found)
            if packed:
                page_ids = struct.pack(f"<{held}i", *page_ids)
                generations = struct.pack(f"<{held}q", *generations)
                return _new_tuple(PackedSpan, (worker_id, name, page_ids, generations, tiers))
        return _new_tuple(HolderSpan, (worker_id, name, page_ids, generations, tiers))

    def host_pages(self, path: Path, holding: tuple[int, int, int], tier: int | None) -> int:
        """The pages of a holding's span before its first page on disk (all of them when
        none is); `tier` as for `span`."""
        held = holding[1]
        if tier is not None:
            return 0 if TIERS[tier] == "disk" else held
        name, tiers = self._span_tiers(path, holding)
        if not tiers:
            return 0 if name == "disk" else held
        at = tiers.find(_DISK_CODE)
        return held if at < 0 else at

    def _span_tiers(self, path: Path, holding: tuple[int, int, int]) -> tuple[str, bytes]:
        """The tier of the first page of a holding's span, and the tiers of all its pages
        (one index into TIERS each; empty when they are all that first one's)."""
        slot, held, column = holding
        _, runs, nodes = path
        if column < EXTRA:
            codes = self.tier_cols[column]
            if nodes is None:
                tiers = b"".join([codes[part].tobytes() for part in _run_slices(runs, held)])
            else:
                tiers = codes[nodes[:held]].tobytes()
        else:
            tiers = bytes(
                next(holder for holder in self.extra(path.node(i)) if holder[0] == slot)[3]
                for i in range(held)
            )
        first = tiers[:1]
        return TIERS[tiers[0]], (b"" if tiers.count(first) == held else tiers)


def span_order(span: HolderSpan | PackedSpan) -> tuple[int, str]:
    """The order of a match's spans: the longest first, then by worker id."""
    return (-len(span.page_ids), span.worker_id)


def _leading_run(slots: memoryview, runs: tuple[tuple[int, int], ...], slot: int) -> int:
    """How many leading pages of the path of `runs` column `slots` gives to `slot`, which
    holds the first page but not the last (its holding is a leading run: see holdings)."""
    held = 0
    for first, pages in runs:
        if slots[first + pages - 1] == slot:
            held += pages
            continue
        low, high = 0, pages - 1  # pages [0, low) of the run are held, page high is not
        while low < high:
            middle = (low + high) // 2
            if slots[first + middle] == slot:
                low = middle + 1
            else:
                high = middle
        return held + low
    return held


def _run_slices(runs: tuple[tuple[int, int], ...], pages: int) -> list[slice]:
    """The node slices of the first `pages` pages of a path of `runs`."""
    parts = []
    for first, length in runs:
        if pages <= length:
            parts.append(slice(first, first + pages))
            return parts
        parts.append(slice(first, first + length))
        pages -= length
    return parts


def _wire_bytes(values: np.ndarray, dtype: str) -> bytes:
    """`values` as the wire's little-endian bytes (a copy of the column's bytes where the
    machine is little-endian itself)."""
    return values.tobytes() if _LITTLE_ENDIAN else values.astype(dtype).tobytes()
