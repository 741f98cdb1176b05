"""The tier below the prefix cache: where its published pages go when they leave host memory.

The prefix cache keeps the pages of host shared memory (the worker's page store). A worker
with a tier below it (local disk: `workers.disk_link`) hands the cache a `LowerTier`,
and the cache tells it about its published pages as they come and go:

    published   pages became shareable     write-through: written down now; either way a
                                           page the tier holds is marked "up" (in host too)
    keep_above  pages above evicted ones    a tier that keeps whole prefixes (the disk) has
                                           a page's parent whenever it has the page: those
                                           it lacks are written now, and stay up
    demote      pages were evicted          written down if not held yet (write-back); the
                                           cache announces PagesDemoted for those it took,
                                           PagesRemoved("evicted") for the rest
    dropped     pages were dropped          (quarantine) the tier drops its copies too
    held_elsewhere                          pages of the tier that another worker has
                                           stored since: they go first when it makes room
    cleared     the cache was cleared       the tier is cleared too

Each page goes down as a `Spilled`: its page id in host memory (its KV is intact during the
call) and what its record needs to verify it later (digest, the digest before it, namespace,
depth, tokens). The tier emits its own events (records it evicted or found corrupt) through
the `emit` the cache attaches, inside the cache's lock, so the event stream stays ordered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import NamedTuple, Protocol

from cache_service.events import KvEvent, Namespace, PagesStored
from workers.cache.evictor import Evictor
from workers.cache.runs import Run


class Spilled(NamedTuple):
    """One published host page, as a lower tier records it."""

    page: int  # its id in the host store
    digest: bytes  # its chain digest (`workers.store.digests`)
    parent: bytes  # the digest before it: the page before, or the namespace's root digest
    namespace: Namespace
    depth: int  # pages from the namespace root, 1 = first page
    tokens: bytes  # its token ids, packed


class Place(NamedTuple):
    """Where a demoted page is held from now on: its id and generation in `tier` (a tier
    below may pass a page further down, or find it held lower already)."""

    page: int
    generation: int
    tier: str


class LowerTier(Protocol):
    """A tier under host memory, as the prefix cache drives it (see the module docstring).
    Every method runs inside the cache's lock and never raises for I/O trouble (a tier that
    cannot write just takes nothing)."""

    name: str

    def attach(self, emit: Callable[[KvEvent], None]) -> None: ...

    def published(self, pages: Sequence[Spilled]) -> None: ...

    def keep_above(self, pages: Iterator[Spilled]) -> None:
        """Pages about to be demoted hang under these (nearest first), which stay in host
        memory: a tier that keeps whole prefixes writes those it lacks now."""
        ...

    def demote(self, pages: Sequence[Spilled]) -> list[Place | None]:
        """Per page (leaf first): where it is held now, or None when no tier took it."""
        ...

    def held_elsewhere(self, pages: Sequence[int], generations: Sequence[int]) -> int:
        """Pages of this tier (by their ids in it, at these generations) that another worker
        has stored since: they go first when the tier makes room. Returns how many were
        newly marked; ids or generations that do not match are skipped."""
        ...

    def dropped(self, digests: Sequence[bytes], reason: str) -> None: ...

    def cleared(self) -> None: ...

    def snapshot(self, host: Mapping[bytes, int]) -> list[PagesStored]:
        """Its pages that are not in host memory too, as PagesStored chains in its tier,
        parents first (a resync); `host` maps the digests of host pages to their ids (a
        chain's first page may hang under one)."""
        ...


def evict_down(
    evictor: Evictor, lower: LowerTier, n: int, step: int
) -> tuple[list[int], list[tuple[int, Place]], list[int]]:
    """Evict up to `n` pages by policy, each offered to `lower` before it is freed (its KV
    intact), the pages above it kept there first.

    Returns:
        (every page taken off the trie, leaf first; (page, its place below) of those the
        tier took; those it did not take). The caller frees the first list.
    """
    going: list[Spilled] = []

    def take(run: Run, cut: int) -> None:
        # While the run is whole: what stays above the pages going is written first.
        lower.keep_above(above(run, cut, step))
        going.extend(reversed(spilled(run, cut, len(run.pages), step)))

    removed = evictor.evict(n, take)
    if not removed:
        return removed, [], []
    assert [s.page for s in going] == removed, "the evictor took pages it did not show"
    places = lower.demote(going)
    moved = [(s.page, place) for s, place in zip(going, places, strict=True) if place]
    gone = [s.page for s, place in zip(going, places, strict=True) if not place]
    return removed, moved, gone


def above(run: Run, cut: int, step: int) -> Iterator[Spilled]:
    """The published pages above page `cut` of `run`, nearest first, up to the namespace
    root (lazily: a tier stops at the first it holds)."""
    while run.parent is not None:
        if cut:
            yield from reversed(spilled(run, 0, cut, step))
        run = run.parent
        cut = len(run.pages)


def spilled(run: Run, lo: int, hi: int, step: int) -> list[Spilled]:
    """Pages lo .. hi-1 of published `run` as Spilled, in chain order."""
    root = run
    while root.parent is not None:
        root = root.parent
    namespace = root.key
    parent = run.parent
    assert parent is not None and parent.digests and run.digests is not None
    before = parent.digests[-1]
    out = []
    for i in range(lo, hi):
        digest = run.digests[i]
        prior = run.digests[i - 1] if i else before
        tokens = bytes(run.key[i * step : (i + 1) * step])
        out.append(Spilled(run.pages[i], digest, prior, namespace, run.first_depth + i, tokens))
    return out
