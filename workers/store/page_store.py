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

On a device (a GPU worker's top tier) the pages live in one device tensor and the segment
holds only the generations and digests; `placement` puts the pages there and opens them for
a peer (through CUDA IPC), and `staging` moves pages between a device store and the host
store below it.

This module holds what makes a store: creating and attaching it, the owner's writes and
its lifetime. What owner and readers alike may read is `store_reader`, the base of
`SharedPageStore`. The segment itself (`segment`, `segment_names`), the store's layout
(`layout`) and validated copies (`validated_copy`) are modules of their own; the names they
export for the store's users are importable from here as well.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.store import placement
from workers.store.layout import (
    CudaIpcError,
    NotOwnerError,
    PageStoreError,
    SegmentFormatError,
    SegmentNotFoundError,
    StoreLayout,
)
from workers.store.page_pool import PagePool
from workers.store.segment import FORMAT_VERSION, Segment
from workers.store.segment_names import (
    SEGMENT_PREFIX,
    SHM_DIR,
    owner_alive,
    process_start_time,
    reclaim_dead_segments,
    worker_tag,
)
from workers.store.store_reader import StoreReader
from workers.store.validated_copy import ValidatedCopy, expected_digests, paste_rows

if TYPE_CHECKING:
    from workers.store.cuda_ipc import CudaIpcHandle

__all__ = [
    "FORMAT_VERSION",
    "SEGMENT_PREFIX",
    "SHM_DIR",
    "CudaIpcError",
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


class SharedPageStore(StoreReader):
    """KV pages in shared memory, owned by one process and readable by its peers.

    Implements the `PageAllocator` protocol of `workers.store.page_pool` for the owner. An
    attached store is a reader: it may read pages, generations and digests, and anything that
    would change pages raises `NotOwnerError` (its mapping is read-only as well, so a
    write through a page view faults instead of corrupting the owner's KV).

    Build one with `SharedPageStore.create` (owner) or `SharedPageStore.attach` (reader).
    The reads both may make are inherited from `StoreReader` (`workers.store.store_reader`).
    """

    def __init__(
        self,
        segment: Segment,
        pages: torch.Tensor | None = None,
        handle: CudaIpcHandle | None = None,
    ):
        """Private: use `create`, `attach` or `open_peer`."""
        super().__init__(segment, pages)
        self._ipc_handle = handle  # CUDA pages: exported once, at creation (or on first ask)
        # Only the owner keeps a free list; a reader's would claim every page is free.
        self._pool: PagePool | None = (
            PagePool(
                self._layout.num_pages,
                generations=self._generations,
                digests=self._digests,
                kv_format=self._layout.kv_format,
            )
            if self._is_owner
            else None
        )

    # -- construction ------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        layout: StoreLayout,
        tag: str | None = None,
        device: str | torch.device = "cpu",
        *,
        pages_in_segment: bool | None = None,
    ) -> SharedPageStore:
        """Create a new segment and own it; reclaims dead owners' segments first.

        Args:
            layout: the store's shape and dtype.
            tag: a name suffix matching [a-z0-9_]{1,32}; a random one when None.
            device: where the pages live: "cpu", "cuda" or "cuda:N".
            pages_in_segment: whether the pages live in the shared-memory segment (peers
                map them by name). None: on the CPU, yes (the shared-memory store); on a
                device, no. False on the CPU keeps them in private memory behind a
                metadata-only segment, as a device store does.

        Returns:
            The owning store; its `name` is what peers pass to `attach`.

        Raises:
            ValueError: a bad tag, a device that is neither CPU nor CUDA, or pages in the
                segment asked for on a device.
            PageStoreError: the segment exists already, /dev/shm has no room for it, or
                the device has no CUDA or no room for the pages.
        """
        return cls(*placement.place(layout, tag, device, pages_in_segment))

    @classmethod
    def attach(
        cls, name: str, pages: torch.Tensor | CudaIpcHandle | None = None
    ) -> SharedPageStore:
        """Map another process's store for reading.

        Args:
            name: the owner's `name`.
            pages: only for a store whose pages are not in its segment (a device store):
                the owner's `export_pages()` handle, opened here once; or the pages tensor
                itself, `(num_pages, *page_shape)` of the layout's dtype. None: such a
                store is read for its generations and digests only.

        Returns:
            A reader store over the same memory.

        Raises:
            ValueError: `name` is not a kvmesh segment name; `pages` given for a store
                that holds its pages in its segment, or a tensor of the wrong shape or
                dtype.
            SegmentNotFoundError: no such segment.
            SegmentFormatError: the header is not a kvmesh header of this format version,
                or the segment is shorter than its header says.
            CudaIpcError: the handle cannot be opened here.
        """
        return cls(*placement.open_placed(name, pages))

    @classmethod
    def open_peer(cls, name: str) -> SharedPageStore:
        """Attach a same-node peer's store with its pages readable: mapped with its
        segment, or, for a device store, opened (once) through the CUDA IPC handle its
        owner left in the segment.

        Raises:
            ValueError: `name` is not a kvmesh segment name.
            SegmentNotFoundError: no such segment.
            SegmentFormatError: not a kvmesh header of this format version.
            CudaIpcError: a device store whose pages cannot be opened here: it left no
                handle (pages not on CUDA, export refused), or CUDA refuses to open it
                (no CUDA here, another container): read it through its page server.
        """
        return cls(*placement.open_peer(name))

    def export_pages(self) -> CudaIpcHandle:
        """The handle through which same-node peers open this store's device pages
        (`attach(name, pages=handle)`); exported on the first call, then the same.

        Returns:
            A `CudaIpcHandle`; `to_fields()` gives plain fields for a message.

        Raises:
            NotOwnerError: called on an attached store.
            CudaIpcError: the pages are not on a CUDA device (peers read them through the
                host tier), or CUDA refuses to export them.
        """
        pages = self._live_pages()
        if not self._is_owner:
            raise NotOwnerError(f"export_pages on attached segment {self.name!r}")
        if self._ipc_handle is None:
            self._ipc_handle = placement.export_handle(self.name, pages)
        return self._ipc_handle

    # -- PageAllocator (owner only; num_pages and generation are StoreReader's) ---------

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
        placement.settle(self._pages)

    # -- writes (owner only) -----------------------------------------------------------

    def write_page(self, page: int, kv: torch.Tensor) -> None:
        """Overwrite one allocated page with `kv`, bumping its generation and clearing its
        digest (the page holds something else now; whoever publishes it records anew).

        Args:
            page: an allocated page id.
            kv: `(num_layers, 2 [k,v], num_kv_heads, page_tokens, head_dim)` in the
                store's dtype, on any device. On a device store the write has landed when
                this returns.

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
        placement.settle(self._pages)

    def write_pages(
        self, page_ids: Sequence[int], kv: torch.Tensor, digests: Sequence[bytes] | None = None
    ) -> None:
        """`write_page` for several pages in one bulk copy, then (with `digests`) record what
        each holds, as `set_digests` does.

        Args:
            page_ids: distinct allocated page ids.
            kv: `(len(page_ids), *page_shape)` in the store's dtype, on the store's device
                or the CPU (pinned, for a device store).
            digests: None, or one digest per page, none of them `EMPTY_DIGEST`.

        Raises:
            ValueError: a page out of range, free or repeated, `kv` of the wrong shape,
                dtype or device, or bad digests; then nothing is written.
            NotOwnerError: called on an attached store.
        """
        pool = self._owner_pool("write_pages")
        rows = self.check_writable(page_ids)
        self._check_out(kv, len(rows), "kv")
        if digests is not None and not expected_digests(digests, len(rows)).any(axis=1).all():
            raise ValueError("write_pages: an empty digest records nothing; pass None instead")
        for page in rows.tolist():  # every generation moves before any byte: see write_page
            pool.bump_generation(page)
        paste_rows(self._live_pages(), rows, kv)
        if digests is not None and len(rows):
            pool.set_digests(rows.tolist(), digests)

    def check_writable(self, page_ids: Sequence[int]) -> np.ndarray:
        """Check that `page_ids` are distinct allocated pages this owner may write.

        Returns:
            The page ids, `(n,)` int64.

        Raises:
            ValueError: a page out of range, free or repeated.
            NotOwnerError: called on an attached store.
        """
        pool = self._owner_pool("check_writable")
        rows = self._index(page_ids).numpy()
        if len(np.unique(rows)) != len(rows):
            raise ValueError(f"pages {rows.tolist()}: a page appears twice")
        for page in rows.tolist():
            self._check_allocated(pool, page)
        return rows

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
        self.set_digests((page,), (digest,))

    def set_digests(self, pages: Sequence[int], digests: Sequence[bytes]) -> None:
        """`set_digest` for several pages at once, `digests[i]` for `pages[i]`.

        Raises:
            ValueError: what `set_digest` raises, or lengths that differ; then nothing is
                recorded.
            NotOwnerError: called on an attached store.
        """
        pool = self._owner_pool("set_digests")
        placement.settle(self._pages)  # the model's kernels may still be writing the pages
        pool.set_digests(pages, digests)

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
        if self._pages is not None:
            placement.check_pages_tensor(self._layout, self._pages)

    # -- helpers -----------------------------------------------------------------------

    def _owner_pool(self, what: str) -> PagePool:
        self._require_open()
        if self._pool is None:
            raise NotOwnerError(
                f"{what} on attached segment {self.name!r}: only its owner (pid "
                f"{self.name.split('-')[1]}) may allocate, free or write pages"
            )
        return self._pool

    def _check_allocated(self, pool: PagePool, page: int) -> None:
        self._check_page(page)
        if pool.is_free(page):
            raise ValueError(f"page {page} is free: allocate it before using it")
