"""Page-id allocation: a free list plus one generation counter per page.

The pool knows nothing of KV bytes. The shared-memory page store wraps a pool around its
tensor (its generation counters then live in shared memory, where peers read them); the
prefix cache only ever talks to the `PageAllocator` protocol below.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableSequence
from typing import Protocol


class PageAllocator(Protocol):
    """What the local prefix cache needs from a page store."""

    @property
    def num_pages(self) -> int: ...

    @property
    def num_free(self) -> int: ...

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` free pages; None (nothing taken) when fewer than `n` are free."""

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the free list, bumping each page's generation."""

    def generation(self, page: int) -> int:
        """The page's generation: it changes whenever the page is freed or rewritten."""

    def copy_page(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the KV of the first `num_tokens` token slots of page `src` into `dst`."""


class PagePool:
    """A LIFO free list of page ids with generation counters.

    LIFO because a just-freed page is the one most likely still in the CPU cache (or the
    GPU's L2); the generation bump on free is what keeps a fast reuse safe for readers
    that copied the page before. Pages are handed out in ascending order on a fresh pool,
    which keeps page ids predictable in tests.
    """

    def __init__(self, num_pages: int, generations: MutableSequence[int] | None = None):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        if generations is None:
            generations = [0] * num_pages
        if len(generations) != num_pages:
            raise ValueError(f"{len(generations)} generation counters for {num_pages} pages")
        self._num_pages = num_pages
        self._generations = generations
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        for page in pages:
            self._is_free[page] = False
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        for page in pages:
            if not 0 <= page < self._num_pages:
                raise ValueError(f"page {page} out of range [0, {self._num_pages})")
            if self._is_free[page]:
                raise ValueError(f"page {page} freed twice")
        for page in pages:
            self._is_free[page] = True
            self._generations[page] += 1
            self._free.append(page)

    def bump_generation(self, page: int) -> None:
        """Mark a page rewritten in place, so copies taken before are detected as stale."""
        self._generations[page] += 1

    def generation(self, page: int) -> int:
        return int(self._generations[page])

    def is_free(self, page: int) -> bool:
        return self._is_free[page]

    def copy_page(self, src: int, dst: int, num_tokens: int) -> None:
        """No KV bytes live in a bare pool: there is nothing to copy."""

    def check_integrity(self) -> None:
        """Raise AssertionError unless the free list and the free flags agree."""
        assert len(set(self._free)) == len(self._free), "a page is on the free list twice"
        flagged = sum(self._is_free)
        assert flagged == len(self._free), (
            f"{flagged} pages flagged free but {len(self._free)} on the free list"
        )
        for page in self._free:
            assert self._is_free[page], f"page {page} on the free list but not flagged free"
