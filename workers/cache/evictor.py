"""Eviction mechanics of the local prefix cache: references, the count of evictable
pages, and the heap of evictable leaves that a policy (`eviction.py`) ranks.

A published page no allocation references is evictable; only a leaf goes (its run's
last page, with no children), so an unreferenced chain leaves tail first. Each evictable
leaf has an entry in a heap keyed by the policy. Entries are deleted lazily: a run that
is referenced again, trimmed or removed keeps its old entry, which is skipped when popped
because its version is no longer the run's latest.

Eviction knows the cluster: a page that another worker has stored since this one did (the
index says so, `PrefixCache.held_elsewhere`) is *marked*, and marked leaves go before
every unmarked one, by the policy among themselves: the mesh keeps the page if this
worker lets it go, and keeps more distinct prefixes. A mark lasts until the page's run is
accessed again (this worker uses its copy: it is not the one to spare) or the page
leaves. Marked leaves wait in a heap of their own, so a cache without marks ranks and
evicts exactly as before.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import NamedTuple

from workers.cache.eviction import EvictionPolicy
from workers.cache.runs import Run
from workers.cache.trie import Trie

# Marks of pages gone from the trie (dropped, cleared) are let go once they pass twice the
# trie's pages plus this many.
MARKS_SLACK = 1024


class _PageView(NamedTuple):
    """One page of a run as an eviction policy sees it (`EvictionCandidate`)."""

    node_id: int
    last_access: int
    hits: int
    depth: int


class Evictor:
    """Counts and ranks the trie's evictable pages and takes them off the trie.

    Not thread-safe: the cache's lock guards it.
    """

    def __init__(self, trie: Trie, policy: EvictionPolicy):
        self.trie = trie
        self.policy = policy
        # Whether a run's pages, which share their access history, rank deepest first and
        # ahead of every other page (see `EvictionPolicy.evicts_runs_tail_first`): then an
        # eviction takes the pages it needs from a run at once.
        self.whole_runs = policy.evicts_runs_tail_first
        self.heap: list[tuple[tuple[int, ...], int, Run]] = []
        # The marked leaves (their last page marked), by the policy's key too: they go
        # before every leaf of `heap`. A run has one valid entry, in one of the two.
        self.marked_heap: list[tuple[tuple[int, ...], int, Run]] = []
        self.num_evictable = 0  # ready pages with no references (all evictable, leaf first)
        self._versions = itertools.count(1)
        # Marked pages: page id -> its run's last access when marked (the mark holds while
        # the run's last access is still that).
        self.marks: dict[int, int] = {}
        self.marked_evicted = 0  # marked pages evicted

    def key(self, run: Run) -> tuple[int, ...]:
        """The heap key of `run` (its last page), in whichever heap it is."""
        return self.policy.key(run)

    def is_marked(self, run: Run, page: int) -> bool:
        """Whether `page` of `run` is marked, and the mark still holds."""
        marks = self.marks
        return bool(marks) and marks.get(page, -1) == run.last_access

    def mark(self, run: Run, page: int) -> bool:
        """Mark `page` of published `run` (held elsewhere, see the module docstring);
        re-ranks the run if it is an evictable leaf ending in it. Returns whether the
        mark is new."""
        if self.is_marked(run, page):
            return False
        if len(self.marks) >= MARKS_SLACK + 2 * self.trie.num_pages:
            self.marks = {p: at for p, at in self.marks.items() if self.trie.run_of(p) is not None}
        self.marks[page] = run.last_access
        if run.pages[-1] == page and run.is_evictable_leaf():
            self.push(run)
        return True

    def push(self, run: Run) -> None:
        """Rank evictable leaf `run` by its current key (again, if its key changed)."""
        # Lazy deletion: an entry is valid only while its version is the run's latest.
        # (key, version) is unique per entry, so the heap never compares two runs.
        run.heap_version = next(self._versions)
        marked = self.marks and self.is_marked(run, run.pages[-1])
        heap = self.marked_heap if marked else self.heap
        heapq.heappush(heap, (self.policy.key(run), run.heap_version, run))
        if len(heap) > 2 * self.num_evictable + 1024:
            # In place: an eviction in progress holds this very list and must see what is
            # pushed while it runs (a new list would hide those leaves from it).
            heap[:] = [e for e in heap if e[2].is_evictable_leaf() and e[2].heap_version == e[1]]
            heapq.heapify(heap)

    def incref(self, run: Run) -> None:
        """One more allocation holds `run`: its pages are no longer evictable."""
        if run.ref_count == 0 and run.ready:
            self.num_evictable -= len(run.pages)
        run.ref_count += 1

    def decref(self, run: Run) -> None:
        """An allocation let go of `run`: unreferenced and published, its pages are
        evictable again (and ranked, if it is a leaf)."""
        assert run.ref_count > 0, f"page {run.pages[-1]} released more often than acquired"
        run.ref_count -= 1
        if run.ref_count == 0 and run.ready:
            self.num_evictable += len(run.pages)
            if not run.children:
                self.push(run)

    def evict(self, n: int, on_take: Callable[[Run, int], None] | None = None) -> list[int]:
        """Take up to `n` evictable pages off the trie: marked leaves first, each heap
        lowest key first.

        Args:
            n: pages wanted.
            on_take: called with a run and `cut` just before its pages from `cut` on leave
                (the run is still whole then): a tier below writes them down.

        Returns:
            The pages taken, in eviction order; the caller frees them.
        """
        removed: list[int] = []
        trie, marks, marked_heap = self.trie, self.marks, self.marked_heap
        while len(removed) < n:
            while marked_heap and not _valid(marked_heap[0]):
                heapq.heappop(marked_heap)
            marked = bool(marked_heap)
            heap = marked_heap if marked else self.heap
            if not heap:
                break
            _, version, run = heapq.heappop(heap)
            if run.heap_version != version or not run.is_evictable_leaf():
                continue
            # Leaf first, one page at a time, as long as the run's next page would be the
            # policy's next choice anyway.
            take = 1
            if self.whole_runs:
                take = min(n - len(removed), len(run.pages))
            else:
                while (
                    take < len(run.pages)
                    and len(removed) + take < n
                    and (not heap or self._key_after(run, take) < heap[0][0])
                ):
                    take += 1
            if marks:  # only pages ranked alike: marked (or not) as the last one is
                same = 1
                while same < take and self.is_marked(run, run.pages[-1 - same]) == marked:
                    same += 1
                take = same
            cut = len(run.pages) - take
            if on_take is not None:
                on_take(run, cut)
            removed.extend(reversed(run.pages[cut:]))
            if marks:
                for page in run.pages[cut:]:
                    if marks.pop(page, -1) == run.last_access:
                        self.marked_evicted += 1
            self.num_evictable -= take
            if cut:
                trie.trim(run, cut)
                self.push(run)  # its new last page: a leaf, ranked as one
                continue
            parent = run.parent
            trie.remove_run(run)
            if parent.parent is not None and parent.ref_count == 0 and not parent.children:
                self.push(parent)
        return removed

    def _key_after(self, run: Run, take: int) -> tuple[int, ...]:
        """The policy's key of the page that ends `run` once its last `take` pages went."""
        i = len(run.pages) - take - 1
        view = _PageView(run.first_id + i, run.last_access, run.hits, run.first_depth + i)
        return self.policy.key(view)


def _valid(entry: tuple[tuple[int, ...], int, Run]) -> bool:
    """Whether a heap entry is its run's latest and the run an evictable leaf."""
    run = entry[2]
    return run.heap_version == entry[1] and run.is_evictable_leaf()
