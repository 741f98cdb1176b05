"""Dropping published chains from the trie: the copies of a holder found serving pages
that do not hold what they claim (`PrefixCache.drop`).

A dropped page takes every page after it in its chains along (their KV was computed over
it). A chain that a live request holds (the page or one after it) stays, for the caller to
ask again once the request released it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from workers.cache.evictor import Evictor
from workers.cache.runs import Run
from workers.cache.trie import Trie


class Dropped(NamedTuple):
    pages: list[int]  # off the trie, leaf first: the caller frees them
    digests: list[bytes]  # theirs, for a tier below
    held: int  # pages asked for that live requests still hold


def drop_chains(trie: Trie, evictor: Evictor, pages: Iterable[int]) -> Dropped:
    """Take published `pages` and everything after them off the trie (see the module
    docstring); the evictor's count follows."""
    wanted = set(pages)
    starts: dict[Run, int] = {}
    for run in trie.published_runs():
        for i, page in enumerate(run.pages):
            if page in wanted:
                starts[run] = min(i, starts.get(run, i))
                break
    removed: list[int] = []
    digests: list[bytes] = []
    held = 0
    for run, i in starts.items():
        if not run.alive or i >= len(run.pages):
            continue  # already dropped with a run before it
        below = _runs_below(run)
        if run.ref_count or any(r.ref_count or not r.ready for r in below):
            held += 1
            continue
        for part, lo in [*((r, 0) for r in below), (run, i)]:
            digests += part.digests[lo:] if part.digests else []
        removed += _drop_from(trie, evictor, run, i, below)
    return Dropped(removed, digests, held)


def _drop_from(trie: Trie, evictor: Evictor, run: Run, i: int, below: list[Run]) -> list[int]:
    """Unreferenced `run` from its page i on, and the runs `below` it (deepest first):
    off the trie and out of the evictable count; returns their pages, leaf first."""
    removed: list[int] = []
    for child in below:
        removed.extend(reversed(child.pages))
        evictor.num_evictable -= len(child.pages)
        trie.remove_run(child)
    removed.extend(reversed(run.pages[i:]))
    evictor.num_evictable -= len(run.pages) - i
    if i:
        trie.trim(run, i)
        evictor.push(run)  # its new last page: a leaf, ranked as one
        return removed
    parent = run.parent
    trie.remove_run(run)
    if parent.parent is not None and parent.ref_count == 0 and not parent.children:
        evictor.push(parent)
    return removed


def _runs_below(run: Run) -> list[Run]:
    """Every run under `run`, children after their descendants (deepest first)."""
    order: list[Run] = []
    stack = list(run.iter_children())
    while stack:
        child = stack.pop()
        order.append(child)
        stack.extend(child.iter_children())
    return order[::-1]
