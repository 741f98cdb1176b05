"""Page-id allocation: a free list plus one generation counter and one digest per page.

The pool knows nothing of KV bytes. The shared-memory page store wraps a pool around its
tensor (its generation counters and digests then live in shared memory, where peers read
them); the prefix cache only ever talks to the `PageAllocator` protocol below.

A page's digest (`workers.store.digests`) names what its KV was computed from; it is recorded
when the page is published and cleared back to `EMPTY_DIGEST` whenever the page is freed
or rewritten, always after the generation bump (see `PagePool.free`).
"""

from __future__ import annotations

from collections.abc import Iterable, MutableSequence, Sequence
from typing import Protocol

import numpy as np

from cache_service import _native
from workers.store.digests import DIGEST_BYTES, EMPTY_DIGEST


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

    def generations(self, page_ids: Sequence[int]) -> list[int]:
        """`generation` of several pages, in order (an event announces a run of them)."""

    def copy_page(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the KV of the first `num_tokens` token slots of page `src` into `dst`."""

    @property
    def kv_format(self) -> str:
        """What the KV bytes mean; it enters the root of every page digest."""

    def set_digest(self, page: int, digest: bytes) -> None:
        """Record what an allocated page holds, once its KV is final (at publish)."""

    def set_digests(self, pages: Sequence[int], digests: Sequence[bytes]) -> None:
        """`set_digest` for several pages at once (a publish records a run of pages)."""

    def digests(self, page_ids: Sequence[int]) -> list[bytes]:
        """The recorded digests of some pages; `EMPTY_DIGEST` where none is."""


class PagePool:
    """A LIFO free list of page ids with generation counters and digests.

    LIFO because a just-freed page is the one most likely still in the CPU cache (or the
    GPU's L2); the generation bump on free is what keeps a fast reuse safe for readers
    that copied the page before. Pages are handed out in ascending order on a fresh pool,
    which keeps page ids predictable in tests.
    """

    def __init__(
        self,
        num_pages: int,
        generations: MutableSequence[int] | None = None,
        digests: np.ndarray | None = None,
        kv_format: str = "",
    ):
        """
        Args:
            num_pages: pages to manage, ids 0..num_pages-1.
            generations: where the counters live (the page store passes its shared
                memory); a new list of zeros when None.
            digests: where the digests live, `(num_pages, DIGEST_BYTES)` uint8, all
                zeros (the page store passes its shared memory); new when None.
            kv_format: what the KV bytes mean; a bare pool holds none, hence "".

        Raises:
            ValueError: num_pages not positive, or counters or digests of another size.
        """
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        if generations is None:
            generations = [0] * num_pages
        if len(generations) != num_pages:
            raise ValueError(f"{len(generations)} generation counters for {num_pages} pages")
        if digests is None:
            digests = np.zeros((num_pages, DIGEST_BYTES), dtype=np.uint8)
        if digests.shape != (num_pages, DIGEST_BYTES) or digests.dtype != np.uint8:
            raise ValueError(
                f"digests must be ({num_pages}, {DIGEST_BYTES}) uint8, "
                f"got {digests.shape} {digests.dtype}"
            )
        self._num_pages = num_pages
        self._generations = generations
        self._digests = digests
        # One flat byte view: recording a digest is then a 16-byte slice assignment, the
        # cheapest write there is (publish does one per page).
        self._digest_bytes = memoryview(digests.reshape(-1))
        self.kv_format = kv_format
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages  # 1: free (read compiled too)

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
        low = min(pages, default=0)
        if n and max(pages) - low == n - 1:
            # n distinct pages spanning n ids: all of [low, low + n), one slice (the common
            # case: a fresh pool, or pages freed together and taken again).
            self._is_free[low : low + n] = bytes(n)
        else:
            for page in pages:
                self._is_free[page] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        is_free = self._is_free
        for page in pages:
            if not 0 <= page < self._num_pages:
                raise ValueError(f"page {page} out of range [0, {self._num_pages})")
            if is_free[page]:
                raise ValueError(f"page {page} freed twice")
        for i, page in enumerate(pages):
            if is_free[page]:  # listed twice in this call: undo, so nothing is freed
                for done in pages[:i]:
                    is_free[done] = False
                raise ValueError(f"page {page} freed twice")
            is_free[page] = True
        self._free.extend(pages)
        # Many pages (an eviction) go in one numpy op each; a few, element by element,
        # below numpy's fixed cost per call.
        index = np.array(pages, dtype=np.intp) if len(pages) >= _NUMPY_FROM else None
        generations = self._generations
        if index is not None and isinstance(generations, np.ndarray):
            generations[index] += 1
        else:
            for page in pages:
                generations[page] += 1
        # Digests are cleared after the generations move: a reader reads a page's digest
        # before its second generation read, so whatever digest it saw, the bump of a
        # free that could have touched what it copied shows up there.
        if index is not None:
            self._digests[index] = 0
        else:
            for page in pages:
                start = page * DIGEST_BYTES
                self._digest_bytes[start : start + DIGEST_BYTES] = EMPTY_DIGEST

    def bump_generation(self, page: int) -> None:
        """Mark a page rewritten in place, so copies taken before are detected as stale.

        Its digest is cleared too (after the bump, as in `free`): it named the old content.
        """
        self._generations[page] += 1
        self._digest_bytes[page * DIGEST_BYTES : (page + 1) * DIGEST_BYTES] = EMPTY_DIGEST

    def generation(self, page: int) -> int:
        return int(self._generations[page])

    def generations(self, page_ids: Sequence[int]) -> list[int]:
        """The generations of some pages, in order.

        Raises:
            ValueError: a page is out of range.
        """
        return generation_rows(self._generations, page_ids, self._num_pages)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def copy_page(self, src: int, dst: int, num_tokens: int) -> None:
        """No KV bytes live in a bare pool: there is nothing to copy."""

    def set_digest(self, page: int, digest: bytes) -> None:
        """Record what an allocated page holds; call once its KV is final (at publish).

        Args:
            page: an allocated page id.
            digest: `DIGEST_BYTES` bytes from `workers.store.digests`, not `EMPTY_DIGEST`.

        Raises:
            ValueError: the page is out of range or free, or the digest is not 16 bytes
                or is the empty digest.
        """
        self.set_digests((page,), (digest,))

    def set_digests(self, pages: Sequence[int], digests: Sequence[bytes]) -> None:
        """Record what several allocated pages hold, `digests[i]` for `pages[i]`.

        Publish records every page of a run in one call, on the request path: the checks
        and the writes are one compiled pass (`_native.record_digests`).

        Raises:
            ValueError: what `set_digest` raises, or lengths that differ; then nothing is
                recorded.
        """
        if type(pages) is not list:
            pages = np.asarray(pages, dtype=np.int64).reshape(-1).tolist()
        digests = digests if type(digests) is list else list(digests)
        fault = _native.record_digests(self._digest_bytes, self._is_free, pages, digests)
        if fault is None:
            return
        kind, at = fault
        if kind == _OUT_OF_RANGE:
            raise ValueError(f"page {pages[at]} out of range [0, {self._num_pages})")
        if kind == _FREE:
            raise ValueError(f"page {pages[at]} is free: allocate it before using it")
        if kind == _NOT_A_DIGEST:
            digest = digests[at]
            got = len(digest) if isinstance(digest, bytes) else type(digest).__name__
            raise ValueError(f"digest must be {DIGEST_BYTES} bytes, got {got}")
        raise ValueError(f"page {pages[at]}: the empty digest is what an unpublished page holds")

    def digests(self, page_ids: Sequence[int]) -> list[bytes]:
        """The recorded digests of some pages, in order; `EMPTY_DIGEST` where none is.

        Raises:
            ValueError: a page is out of range.
        """
        return digest_rows(self._digests, page_ids, self._num_pages)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the free list and the free flags agree, and every
        free page records the empty digest."""
        assert len(set(self._free)) == len(self._free), "a page is on the free list twice"
        flagged = sum(self._is_free)
        assert flagged == len(self._free), (
            f"{flagged} pages flagged free but {len(self._free)} on the free list"
        )
        for page in self._free:
            assert self._is_free[page], f"page {page} on the free list but not flagged free"
        recorded = np.flatnonzero(self._digests[self._free].any(axis=1))
        assert len(recorded) == 0, (
            f"free pages {[self._free[i] for i in recorded]} still record a digest"
        )


# `_native.record_digests`'s faults.
_OUT_OF_RANGE, _FREE, _NOT_A_DIGEST = 1, 2, 3
_NUMPY_FROM = 8  # pages from which one numpy op beats a Python loop (measured: 6 to 8)


def generation_rows(
    generations: MutableSequence[int], page_ids: Sequence[int], num_pages: int
) -> list[int]:
    """Items of a generation array (a list, or shared int64 numpy) as ints, range-checked.

    A publish announces its run of pages with their generations: a slice when the run is
    ascending (pages are handed out so), else one fancy-indexed copy.
    """
    if type(page_ids) is list:
        pages = page_ids
    else:
        pages = np.asarray(page_ids, dtype=np.int64).reshape(-1).tolist()
    if not pages:
        return []
    low = pages[0]
    high = low + len(pages) - 1
    if (
        pages[-1] == high
        and low >= 0
        and high < num_pages
        and isinstance(generations, np.ndarray)
        and pages == list(range(low, high + 1))
    ):
        return generations[low : high + 1].tolist()  # the common case, no min/max scans
    low, high = min(pages), max(pages)
    if low < 0 or high >= num_pages:
        bad = [p for p in pages if not 0 <= p < num_pages]
        raise ValueError(f"pages {bad} out of range [0, {num_pages})")
    if not isinstance(generations, np.ndarray):
        return [int(generations[page]) for page in pages]
    if high - low + 1 == len(pages) and pages == list(range(low, high + 1)):
        return generations[low : high + 1].tolist()
    return generations[pages].tolist()


def digest_rows(digests: np.ndarray, page_ids: Sequence[int], num_pages: int) -> list[bytes]:
    """Rows of a `(num_pages, DIGEST_BYTES)` digest array as bytes, range-checked."""
    rows = np.asarray(page_ids, dtype=np.int64).reshape(-1)
    if len(rows) and not (rows.min() >= 0 and rows.max() < num_pages):
        bad = [int(p) for p in rows if not 0 <= p < num_pages]
        raise ValueError(f"pages {bad} out of range [0, {num_pages})")
    raw = digests[rows].tobytes()  # fancy indexing: one copy of the rows asked for
    return [raw[i : i + DIGEST_BYTES] for i in range(0, len(raw), DIGEST_BYTES)]
