"""KV pages in one torch tensor in named POSIX shared memory.

A worker owns one `SharedPageStore`: it allocates and frees pages through the `PagePool`
wrapped inside, and writes their KV. Another process on the same node attaches by name
and reads pages straight out of the same memory, with no serialisation. Each page has a
generation counter, also in shared memory, that changes whenever the owner frees or
rewrites the page; a reader checks it before and after a copy, so a page reused under its
feet is reported stale instead of being served as wrong KV (`workers.store.validated_copy`).
Each page also has a digest (`workers.store.digests`) of the namespace, KV format and token
chain it was computed from, recorded when it is published and cleared when it is freed or
rewritten; a reader that passes the digests it expects gets only pages that hold what it
asked for.

The segment itself (`segment`, `segment_names`), the store's layout (`layout`) and validated
copies (`validated_copy`) are modules of their own; the names they export for the store's
users are importable from here as well.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from workers.store.layout import (
    NotOwnerError,
    PageStoreError,
    SegmentFormatError,
    SegmentNotFoundError,
    StoreLayout,
)
from workers.store.page_pool import PagePool, digest_rows, generation_rows
from workers.store.segment import FORMAT_VERSION, Segment
from workers.store.segment_names import (
    SEGMENT_PREFIX,
    SHM_DIR,
    owner_alive,
    process_start_time,
    reclaim_dead_segments,
    worker_tag,
)
from workers.store.validated_copy import ValidatedCopy, copy_validated, expected_digests

__all__ = [
    "FORMAT_VERSION",
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "NotOwnerError",
    "PageStoreError",
    "SegmentFormatError",
    "SegmentNotFoundError",
    "SharedPageStore",
    "StoreLayout",
    "ValidatedCopy",
    "owner_alive",
    "process_start_time",
    "reclaim_dead_segments",
    "worker_tag",
]


class SharedPageStore:
    """KV pages in shared memory, owned by one process and readable by its peers.

    Implements the `PageAllocator` protocol of `workers.store.page_pool` for the owner. An
    attached store is a reader: it may read pages, generations and digests, and anything that
    would change pages raises `NotOwnerError` (its mapping is read-only as well, so a
    write through a page view faults instead of corrupting the owner's KV).

    Build one with `SharedPageStore.create` (owner) or `SharedPageStore.attach` (reader).
    """

    def __init__(self, segment: Segment):
        """Private: use `create` or `attach`."""
        self._segment = segment
        self._layout = segment.layout
        self._is_owner = segment.is_owner
        self._closed = False
        views = segment.views()
        self._generations: np.ndarray | None = views.generations
        self._digests: np.ndarray | None = views.digests
        self._pages: torch.Tensor | None = views.pages
        # Only the owner keeps a free list; a reader's would claim every page is free.
        self._pool: PagePool | None = (
            PagePool(
                self._layout.num_pages,
                generations=views.generations,
                digests=views.digests,
                kv_format=self._layout.kv_format,
            )
            if self._is_owner
            else None
        )

    # -- construction ------------------------------------------------------------------

    @classmethod
    def create(
        cls, layout: StoreLayout, tag: str | None = None, device: str | torch.device = "cpu"
    ) -> SharedPageStore:
        """Create a new segment and own it; reclaims dead owners' segments first.

        Args:
            layout: the store's shape and dtype.
            tag: a name suffix matching [a-z0-9_]{1,32}; a random one when None.
            device: where the pages live. Only "cpu" (the shared-memory store itself).

        Returns:
            The owning store; its `name` is what peers pass to `attach`.

        Raises:
            ValueError: a bad tag.
            NotImplementedError: a device other than the CPU.
            PageStoreError: the segment exists already, or /dev/shm has no room for it.
        """
        if torch.device(device).type != "cpu":
            # The GPU tier keeps pages in device memory and shares them by CUDA IPC; the
            # shared-memory store then serves as its CPU tier.
            raise NotImplementedError(f"page store on device {device!r}: only 'cpu' so far")
        return cls(Segment.create(layout, tag))

    @classmethod
    def attach(cls, name: str) -> SharedPageStore:
        """Map another process's store for reading.

        Args:
            name: the owner's `name`.

        Returns:
            A reader store over the same memory.

        Raises:
            ValueError: `name` is not a kvmesh segment name.
            SegmentNotFoundError: no such segment.
            SegmentFormatError: the header is not a kvmesh header of this format version,
                or the segment is shorter than its header says.
        """
        return cls(Segment.attach(name))

    # -- properties --------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def layout(self) -> StoreLayout:
        return self._layout

    @property
    def is_owner(self) -> bool:
        return self._is_owner

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def kv_format(self) -> str:
        """Its layout's `kv_format`: what the page bytes mean, a root of every digest."""
        return self._layout.kv_format

    # -- PageAllocator (owner only, except num_pages and generation) --------------------

    @property
    def num_pages(self) -> int:
        return self._layout.num_pages

    @property
    def num_free(self) -> int:
        return self._owner_pool("num_free").num_free

    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(n)` would succeed now."""
        return self._owner_pool("can_allocate").can_allocate(n)

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` free pages.

        Args:
            n: how many pages.

        Returns:
            The page ids (ascending on a fresh store), or None (nothing taken) when fewer
            than `n` are free: running out is an ordinary outcome, not an error.

        Raises:
            ValueError: `n` is negative.
            NotOwnerError: called on an attached store.
        """
        return self._owner_pool("allocate").allocate(n)

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the free list, bumping each page's generation in shared memory
        and then clearing its digest.

        Args:
            pages: allocated page ids.

        Raises:
            ValueError: a page is out of range or already free; then nothing is freed.
            NotOwnerError: called on an attached store.
        """
        self._owner_pool("free").free(pages)

    def generation(self, page: int) -> int:
        """The page's generation; it changes whenever the owner frees or rewrites the page.

        Raises:
            ValueError: `page` is out of range.
        """
        self._check_page(page)
        return int(self._live_generations()[page])

    def copy_page(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first `num_tokens` token slots of every layer, K/V and head of `src`
        into `dst`, bump `dst`'s generation and clear its digest. Slots past `num_tokens`
        are untouched.

        Args:
            src: an allocated page to copy from.
            dst: another allocated page to copy into.
            num_tokens: token slots to copy, 0..page_tokens.

        Raises:
            ValueError: a page out of range or free, `src == dst`, or a bad `num_tokens`.
            NotOwnerError: called on an attached store.
        """
        pool = self._owner_pool("copy_page")
        self._check_allocated(pool, src)
        self._check_allocated(pool, dst)
        if src == dst:
            raise ValueError(f"copy_page from page {src} onto itself")
        if not 0 <= num_tokens <= self._layout.page_tokens:
            raise ValueError(f"num_tokens {num_tokens} outside [0, {self._layout.page_tokens}]")
        pages = self._live_pages()
        pool.bump_generation(dst)  # and clears the digest, before the write: see write_page
        # page: (num_layers, 2, num_kv_heads, page_tokens, head_dim)
        pages[dst, ..., :num_tokens, :].copy_(pages[src, ..., :num_tokens, :])

    # -- page access -------------------------------------------------------------------

    def page(self, page: int) -> torch.Tensor:
        """A view of one page, `(num_layers, 2 [k,v], num_kv_heads, page_tokens, head_dim)`.

        The view aliases shared memory: the owner may free and reuse the page at any time,
        so a reader copies with `copy_pages_validated` rather than trusting a view. On an
        attached store the memory is read-only and a write through the view faults.

        Raises:
            ValueError: `page` is out of range.
        """
        self._check_page(page)
        return self._live_pages()[page]

    def page_buffer(self, page: int) -> memoryview:
        """One page's bytes in shared memory, as a flat byte view (whatever the store's
        dtype: numpy, which page transfers go through, has no bfloat16). Aliases shared
        memory as `page` does.

        Raises:
            ValueError: `page` is out of range.
        """
        return memoryview(self.page(page).view(torch.uint8).numpy()).cast("B")

    def page_range(self, start: int, stop: int) -> torch.Tensor:
        """A view of pages [start, stop), `(stop - start, *page_shape)`, contiguous.

        Lets a copy land straight in a run of consecutive pages (one memcpy, no staging).

        Raises:
            ValueError: the range is empty or out of bounds.
        """
        if not 0 <= start < stop <= self.num_pages:
            raise ValueError(f"page range [{start}, {stop}) not in [0, {self.num_pages})")
        return self._live_pages()[start:stop]

    def write_page(self, page: int, kv: torch.Tensor) -> None:
        """Overwrite one allocated page with `kv`, bumping its generation and clearing its
        digest (the page holds something else now; whoever publishes it records anew).

        Args:
            page: an allocated page id.
            kv: `(num_layers, 2 [k,v], num_kv_heads, page_tokens, head_dim)` in the
                store's dtype, on any device.

        Raises:
            ValueError: the page is out of range or free, or `kv` has the wrong shape
                or dtype.
            NotOwnerError: called on an attached store.
        """
        pool = self._owner_pool("write_page")
        self._check_allocated(pool, page)
        if tuple(kv.shape) != self._layout.page_shape or kv.dtype != self._layout.torch_dtype:
            raise ValueError(
                f"write_page needs a {self._layout.page_shape} {self._layout.torch_dtype} "
                f"tensor, got {tuple(kv.shape)} {kv.dtype}"
            )
        # The generation moves *before* the bytes do. A reader copying this page at the
        # same time reads the generation again after its copy, so it sees the bump of
        # any write that could have torn its copy. (Expected generations must be taken
        # once a write has returned, as the owner does when it publishes a page.)
        # The digest is cleared after the bump and before the bytes move: a reader that
        # still sees the old digest after its copy either also sees the bump in its
        # second generation read, or copied the old bytes, which the old digest names.
        pool.bump_generation(page)
        self._live_pages()[page].copy_(kv)

    def read_pages(self, page_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather a copy of some pages, without any validation (see `copy_pages_validated`).

        Args:
            page_ids: page ids, in the order wanted.
            out: optional CPU tensor `(len(page_ids), *page_shape)` of the store's dtype
                to copy into.

        Returns:
            `(len(page_ids), num_layers, 2, num_kv_heads, page_tokens, head_dim)`: `out`
            when given, else a new tensor.

        Raises:
            ValueError: a page out of range, or `out` of the wrong shape, dtype or device.
        """
        index = self._index(page_ids)
        if out is None:
            return self._live_pages().index_select(0, index)
        self._check_out(out, len(index))
        return torch.index_select(self._live_pages(), 0, index, out=out)

    def generations(self, page_ids: Sequence[int]) -> list[int]:
        """The generations of some pages, in order.

        Raises:
            ValueError: a page is out of range.
        """
        return generation_rows(self._live_generations(), page_ids, self.num_pages)

    def set_digest(self, page: int, digest: bytes) -> None:
        """Record what an allocated page holds (`workers.store.digests`), visible to readers.

        Call it once the page's KV bytes are final, as the prefix cache does at publish: a
        reader trusts bytes it copied after seeing the digest. Any later free or rewrite
        of the page clears it again.

        Args:
            page: an allocated page id.
            digest: `DIGEST_BYTES` bytes, not `EMPTY_DIGEST`.

        Raises:
            ValueError: the page is out of range or free, or the digest is not 16 bytes
                or is the empty digest.
            NotOwnerError: called on an attached store.
        """
        self._owner_pool("set_digest").set_digest(page, digest)

    def set_digests(self, pages: Sequence[int], digests: Sequence[bytes]) -> None:
        """`set_digest` for several pages at once, `digests[i]` for `pages[i]`.

        Raises:
            ValueError: what `set_digest` raises, or lengths that differ; then nothing is
                recorded.
            NotOwnerError: called on an attached store.
        """
        self._owner_pool("set_digests").set_digests(pages, digests)

    def digests(self, page_ids: Sequence[int]) -> list[bytes]:
        """The recorded digests of some pages, in order; `EMPTY_DIGEST` where none is.

        Raises:
            ValueError: a page is out of range.
        """
        return digest_rows(self._live_digests(), page_ids, self.num_pages)

    def copy_pages_validated(
        self,
        page_ids: Sequence[int],
        expected_generations: Sequence[int],
        out: torch.Tensor,
        digests: Sequence[bytes] | None = None,
    ) -> ValidatedCopy:
        """Copy pages into `out` and report which copies can be trusted.

        The copy takes no lock: each page's generation is read before and after it, and
        with `digests` each page's digest too; a page is valid only if they are what the
        caller expects. `workers.store.validated_copy` explains the order of the reads.

        Args:
            page_ids: pages to copy.
            expected_generations: one expected generation per page.
            out: CPU tensor `(len(page_ids), *page_shape)` of the store's dtype; rows whose
                page is invalid hold garbage and must be recomputed.
            digests: None, or one expected `DIGEST_BYTES` digest per page (the requester's
                own, from `workers.store.digests.page_digests` over its prompt).

        Returns:
            `ValidatedCopy(valid)`, one bool per page.

        Raises:
            ValueError: mismatched lengths, a digest not 16 bytes, a page out of range, or
                a bad `out`.
        """
        index = self._index(page_ids)
        if len(expected_generations) != len(index):
            raise ValueError(
                f"{len(expected_generations)} expected generations for {len(index)} pages"
            )
        self._check_out(out, len(index))
        wanted = None if digests is None else expected_digests(digests, len(index))
        return copy_validated(
            self._live_pages(),
            self._live_generations(),
            self._live_digests(),
            index.numpy(),
            np.asarray(expected_generations, dtype=np.int64),
            out,
            wanted,
        )

    # -- lifetime ----------------------------------------------------------------------

    def unlink(self) -> None:
        """Remove the segment's name so no new reader can attach; idempotent.

        Mapped stores (this one, attached readers) keep working until they close.

        Raises:
            NotOwnerError: called on an attached store.
        """
        self._segment.unlink()

    def close(self) -> None:
        """Unmap the store, and for the owner also unlink the segment; idempotent.

        Page views handed out earlier keep the mapping alive until they are dropped.
        """
        if self._closed:
            return
        self._closed = True
        self._pool = None
        self._pages = None
        self._generations = None
        self._digests = None
        self._segment.close()

    def __enter__(self) -> SharedPageStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self._is_owner else "reader"
        state = "closed" if self._closed else "open"
        return f"SharedPageStore({self.name!r}, {role}, {state}, {self._layout})"

    def check_integrity(self) -> None:
        """Raise AssertionError unless the store is consistent.

        Checks that the mapping is open, that the header in shared memory still describes
        this store's layout, and (for the owner) the free list's integrity and that every
        free page records the empty digest.
        """
        assert not self._closed, f"store {self.name!r} is closed"
        self._segment.check_integrity()
        if self._pool is not None:
            self._pool.check_integrity()

    # -- helpers -----------------------------------------------------------------------

    def _require_open(self) -> None:
        if self._closed:
            raise PageStoreError(f"page store {self.name!r} is closed")

    def _live_pages(self) -> torch.Tensor:
        self._require_open()
        assert self._pages is not None
        return self._pages

    def _live_generations(self) -> np.ndarray:
        self._require_open()
        assert self._generations is not None
        return self._generations

    def _live_digests(self) -> np.ndarray:
        self._require_open()
        assert self._digests is not None
        return self._digests

    def _owner_pool(self, what: str) -> PagePool:
        self._require_open()
        if self._pool is None:
            raise NotOwnerError(
                f"{what} on attached segment {self.name!r}: only its owner (pid "
                f"{self.name.split('-')[1]}) may allocate, free or write pages"
            )
        return self._pool

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self._layout.num_pages:
            raise ValueError(f"page {page} out of range [0, {self._layout.num_pages})")

    def _check_allocated(self, pool: PagePool, page: int) -> None:
        self._check_page(page)
        if pool.is_free(page):
            raise ValueError(f"page {page} is free: allocate it before using it")

    def _index(self, page_ids: Sequence[int]) -> torch.Tensor:
        index = torch.as_tensor(page_ids, dtype=torch.int64).reshape(-1)
        if len(index) and not (int(index.min()) >= 0 and int(index.max()) < self.num_pages):
            bad = [p for p in index.tolist() if not 0 <= p < self.num_pages]
            raise ValueError(f"pages {bad} out of range [0, {self.num_pages})")
        return index

    def _check_out(self, out: torch.Tensor, n: int) -> None:
        shape = (n, *self._layout.page_shape)
        if tuple(out.shape) != shape or out.dtype != self._layout.torch_dtype:
            raise ValueError(
                f"out must be {shape} {self._layout.torch_dtype}, "
                f"got {tuple(out.shape)} {out.dtype}"
            )
        if out.device.type != "cpu":
            raise ValueError(f"out must be on the CPU, got {out.device}")
