"""KV pages in one torch tensor in named POSIX shared memory.

A worker owns one `SharedPageStore`: it allocates and frees pages through the `PagePool`
wrapped inside, and writes their KV. Another process on the same node attaches by name
and reads pages straight out of the same memory, with no serialisation. Each page has a
generation counter, also in shared memory, that changes whenever the owner frees or
rewrites the page; a reader checks it before and after a copy, so a page reused under its
feet is reported stale instead of being served as wrong KV. Each page also has a digest
(`workers.store.digests`) of the namespace, KV format and token chain it was computed from,
recorded when it is published and cleared when it is freed or rewritten; a reader that
passes the digests it expects gets only pages that hold what it asked for.

Segment format (one file in /dev/shm per store, little-endian), version 2:

    offset 0                 header: magic, format version, layout, region offsets
    offset 4096              num_pages int64 generation counters (padded to 4096)
    offset digests_offset    num_pages x 16-byte digests, all zeros where none is
                             recorded (padded to 4096)
    offset data_offset       pages: (num_pages, num_layers, 2 [k,v], num_kv_heads,
                                     page_tokens, head_dim) in the layout's dtype

Version 1 had no digest region; a reader refuses any version but its own.

Segments are named `kvmesh-{pid}-{start_time}-{tag}` after their owner, so the segments
of a killed worker can be found and reclaimed (`reclaim_dead_segments`). The start time
(field 22 of /proc/{pid}/stat) tells a dead owner from a new process that reuses its pid.

`multiprocessing.shared_memory` is deliberately not used: on Python 3.11 its resource
tracker unlinks a segment when any process that attached to it exits.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import re
import secrets
import struct
import warnings
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from workers.store.digests import DIGEST_BYTES
from workers.store.page_pool import PagePool, digest_rows, generation_rows

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "kvmesh-"
MAGIC = b"KVMESH01"
FORMAT_VERSION = 2  # 2: a digest region after the generations

# Regions start on a page boundary so both views are aligned for any dtype and the data
# region can later be registered (pinned) for DMA as a whole.
_ALIGN = 4096
HEADER_BYTES = 4096

# magic, version, num_pages, num_layers, num_kv_heads, page_tokens, head_dim, dtype_code,
# generations_offset, digests_offset, data_offset, total_bytes
_HEADER = struct.Struct("<8s11q")

# Codes are part of the segment format: never renumber, only append.
_DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only; elsewhere fault lazily
_TAG_RE = re.compile(r"[a-z0-9_]{1,32}")
_NAME_RE = re.compile(r"kvmesh-(\d+)-(\d+)-([a-z0-9_]{1,32})")


class PageStoreError(RuntimeError):
    """A page store or its segment cannot be used as asked."""


class SegmentNotFoundError(PageStoreError, FileNotFoundError):
    """No segment of that name exists (never created, or already unlinked)."""


class SegmentFormatError(PageStoreError):
    """The segment exists but its header is not one this version can read."""


class NotOwnerError(PageStoreError):
    """An attached (reader) store was asked to change pages; only the owner may."""


@dataclass(frozen=True)
class StoreLayout:
    """Shape of a page store.

    The tensor is `# (num_pages, num_layers, 2 [k,v], num_kv_heads, page_tokens, head_dim)`:
    one page holds the K and V of `page_tokens` consecutive tokens for every layer and KV
    head, so copying a prefix between stores is one contiguous copy per page.
    """

    num_pages: int
    num_layers: int
    num_kv_heads: int
    page_tokens: int
    head_dim: int
    dtype: str = "float32"  # the model's KV dtype; float32 is what the CPU runner produces

    def __post_init__(self) -> None:
        for field in ("num_pages", "num_layers", "num_kv_heads", "page_tokens", "head_dim"):
            value = getattr(self, field)
            # bool is an int subclass; True pages is a caller bug, not one page.
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"StoreLayout.{field} must be a positive int, got {value!r}")
        if self.dtype not in _DTYPE_CODES:
            raise ValueError(
                f"StoreLayout.dtype must be one of {sorted(_DTYPE_CODES)}, got {self.dtype!r}"
            )

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """`(num_layers, 2 [k,v], num_kv_heads, page_tokens, head_dim)`."""
        return (self.num_layers, 2, self.num_kv_heads, self.page_tokens, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]

    @property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape) * self.torch_dtype.itemsize

    @property
    def kv_format(self) -> str:
        """What a page's bytes mean, as a stable string; it enters every page digest, so
        pages of another shape or dtype never match. The page count is left out: it
        changes the store, not what a page holds."""
        return (
            f"kv1:layers={self.num_layers}:kv_heads={self.num_kv_heads}:"
            f"head_dim={self.head_dim}:page_tokens={self.page_tokens}:dtype={self.dtype}"
        )


class ValidatedCopy(NamedTuple):
    """Result of `copy_pages_validated`: `valid[i]` says whether row i of `out` holds
    the page as it was at its expected generation (and with its expected digest)."""

    valid: list[bool]

    @property
    def all_valid(self) -> bool:
        return all(self.valid)


class _Regions(NamedTuple):
    generations_offset: int
    digests_offset: int
    data_offset: int
    total_bytes: int


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """(length, first) of each run of consecutive values in `rows`."""
    if len(rows) == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(rows)]))
    return [(int(e - s), int(rows[s])) for s, e in zip(starts, ends, strict=True)]


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _regions(layout: StoreLayout) -> _Regions:
    digests_offset = HEADER_BYTES + _align(layout.num_pages * 8)
    data_offset = digests_offset + _align(layout.num_pages * DIGEST_BYTES)
    total_bytes = data_offset + layout.num_pages * layout.page_bytes
    return _Regions(HEADER_BYTES, digests_offset, data_offset, total_bytes)


def _pack_header(layout: StoreLayout) -> bytes:
    regions = _regions(layout)
    return _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        layout.num_pages,
        layout.num_layers,
        layout.num_kv_heads,
        layout.page_tokens,
        layout.head_dim,
        _DTYPE_CODES[layout.dtype],
        *regions,
    )


def _unpack_header(name: str, raw: bytes) -> StoreLayout:
    values = _HEADER.unpack(raw)
    magic, version, *fields, dtype_code = values[:8]  # fields: the layout's five sizes
    offsets = _Regions(*values[8:])
    if magic != MAGIC:
        raise SegmentFormatError(
            f"segment {name!r}: bad magic {magic!r}, expected {MAGIC!r} "
            "(not a kvmesh page store, or its owner has not finished creating it)"
        )
    if version != FORMAT_VERSION:
        raise SegmentFormatError(
            f"segment {name!r}: format version {version}, this build reads {FORMAT_VERSION}"
        )
    dtypes = {code: dtype for dtype, code in _DTYPE_CODES.items()}
    if dtype_code not in dtypes:
        raise SegmentFormatError(f"segment {name!r}: unknown dtype code {dtype_code}")
    try:
        layout = StoreLayout(*fields, dtype=dtypes[dtype_code])
    except ValueError as e:
        raise SegmentFormatError(f"segment {name!r}: bad layout in header: {e}") from None
    if offsets != _regions(layout):
        raise SegmentFormatError(
            f"segment {name!r}: region offsets {tuple(offsets)} "
            f"do not match its layout {tuple(_regions(layout))}"
        )
    return layout


def process_start_time(pid: int) -> int | None:
    """Start time of a running process (clock ticks since boot), or None if none runs.

    Args:
        pid: the process id.

    Returns:
        Field 22 of /proc/{pid}/stat, or None when no process has that pid or it is a
        zombie (its segments are then as good as an exited owner's).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2 (the command name) may itself contain spaces and parentheses; fields after
    # the last ')' are plain, starting with field 3, the state.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] == b"Z":  # killed, not yet reaped by its parent: it runs no more
        return None
    return int(fields[22 - 3])


def worker_tag(worker_id: str) -> str:
    """A segment tag naming a worker: its id in [a-z0-9_], at most 32 characters."""
    return re.sub(r"[^a-z0-9_]", "_", worker_id.lower())[:32] or "worker"


def _segment_name(tag: str | None) -> str:
    if tag is None:
        tag = secrets.token_hex(4)
    elif not isinstance(tag, str) or not _TAG_RE.fullmatch(tag):
        raise ValueError(f"tag must match [a-z0-9_]{{1,32}}, got {tag!r}")
    pid = os.getpid()
    return f"{SEGMENT_PREFIX}{pid}-{process_start_time(pid)}-{tag}"


def _check_name(name: str) -> str:
    # Names become paths under /dev/shm: only ever accept exactly our own format.
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"not a kvmesh segment name: {name!r}")
    return os.path.join(SHM_DIR, name)


def owner_alive(name: str) -> bool:
    """Whether the process that created segment `name` still runs (on this node: pids are
    this node's). A name not in the kvmesh format has no owner we know of: False."""
    match = _NAME_RE.fullmatch(name)
    return match is not None and process_start_time(int(match[1])) == int(match[2])


def reclaim_dead_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Unlink the segments of owners that no longer run.

    A segment is reclaimed when no process has its owner's pid, or the process with that
    pid started at another time (the pid was reused). Segments of live owners and files
    whose names are not in the kvmesh format are never touched.

    Owners are looked up in this process's /proc, so every process sharing /dev/shm must
    share one pid namespace (the norm: a container has its own /dev/shm).

    Args:
        prefix: only names starting with this are considered (e.g. "kvmesh-1234-" for
            the segments of one pid).

    Returns:
        The names unlinked, sorted.
    """
    reclaimed = []
    for name in sorted(os.listdir(SHM_DIR)):
        if not name.startswith(prefix) or not _NAME_RE.fullmatch(name) or owner_alive(name):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except (FileNotFoundError, PermissionError):
            # Another process reclaimed it first, or it is another user's: not ours to take.
            continue
        reclaimed.append(name)
    return reclaimed


def _unlink_segment(path: str, owner_pid: int) -> None:
    # Runs from close(), on garbage collection, or at interpreter exit. A forked child
    # inherits the finaliser and must not unlink its parent's segment on its own exit.
    if os.getpid() != owner_pid:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class SharedPageStore:
    """KV pages in shared memory, owned by one process and readable by its peers.

    Implements the `PageAllocator` protocol of `workers.store.page_pool` for the owner. An
    attached store is a reader: it may read pages, generations and digests, and anything that
    would change pages raises `NotOwnerError` (its mapping is read-only as well, so a
    write through a page view faults instead of corrupting the owner's KV).

    Build one with `SharedPageStore.create` (owner) or `SharedPageStore.attach` (reader).
    """

    def __init__(self, name: str, layout: StoreLayout, mm: mmap.mmap, is_owner: bool):
        """Private: use `create` or `attach`."""
        self._name = name
        self._layout = layout
        self._mm: mmap.mmap | None = mm
        self._is_owner = is_owner
        self._closed = False
        regions = _regions(layout)
        # Writable for the owner; a read-only view for readers (numpy honours it).
        self._generations = np.frombuffer(
            mm, dtype="<i8", count=layout.num_pages, offset=regions.generations_offset
        )
        # (num_pages, DIGEST_BYTES); zeros (EMPTY_DIGEST) on a fresh segment
        self._digests = np.frombuffer(
            mm,
            dtype=np.uint8,
            count=layout.num_pages * DIGEST_BYTES,
            offset=regions.digests_offset,
        ).reshape(layout.num_pages, DIGEST_BYTES)
        with warnings.catch_warnings():
            # A reader's mapping is read-only by design; torch only warns that it cannot
            # mark the tensor so.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(
                mm,
                dtype=layout.torch_dtype,
                count=layout.num_pages * math.prod(layout.page_shape),
                offset=regions.data_offset,
            )
        # (num_pages, num_layers, 2 [k,v], num_kv_heads, page_tokens, head_dim)
        self._pages: torch.Tensor | None = flat.view(layout.num_pages, *layout.page_shape)
        # Only the owner keeps a free list; a reader's would claim every page is free.
        self._pool: PagePool | None = (
            PagePool(
                layout.num_pages,
                generations=self._generations,
                digests=self._digests,
                kv_format=layout.kv_format,
            )
            if is_owner
            else None
        )
        self._unlink_finalizer = (
            weakref.finalize(self, _unlink_segment, os.path.join(SHM_DIR, name), os.getpid())
            if is_owner
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
        name = _segment_name(tag)
        reclaim_dead_segments()
        path = os.path.join(SHM_DIR, name)
        size = _regions(layout).total_bytes
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise PageStoreError(f"segment {name!r} already exists (tag reused?)") from None
        try:
            try:
                # Reserve the memory now: a tmpfs that runs out later would kill us with
                # SIGBUS on first touch of a page instead of raising here.
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                raise PageStoreError(
                    f"cannot reserve {size} bytes in {SHM_DIR} for segment {name!r}: {e}"
                ) from None
            # MAP_POPULATE faults every page in now: otherwise the first write to each
            # 4 KiB (a copy landing from a peer, a prefill) pays a page fault, which
            # costs more than the copy itself.
            mm = mmap.mmap(
                fd,
                size,
                flags=mmap.MAP_SHARED | _MAP_POPULATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)  # the mapping keeps the memory; no descriptor needs to stay open
        header = _pack_header(layout)
        # The magic goes in last: a reader that attaches mid-creation sees a bad magic
        # rather than a half-written layout.
        mm[len(MAGIC) : len(header)] = header[len(MAGIC) :]
        mm[: len(MAGIC)] = MAGIC
        return cls(name, layout, mm, is_owner=True)

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
        path = _check_name(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise SegmentNotFoundError(f"no page store segment {name!r} in {SHM_DIR}") from None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES:
                raise SegmentFormatError(
                    f"segment {name!r} is {size} bytes, shorter than its {HEADER_BYTES}-byte header"
                )
            layout = _unpack_header(name, os.pread(fd, _HEADER.size, 0))
            total = _regions(layout).total_bytes
            if size < total:
                # Mapping past the end of the file would fault (SIGBUS) on first read.
                raise SegmentFormatError(
                    f"segment {name!r} is {size} bytes, its layout needs {total}"
                )
            mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(name, layout, mm, is_owner=False)

    # -- properties --------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

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

        The owner may free, reuse or rewrite a page while we copy it, and nothing stops it:
        the copy takes no lock. So each page's generation is read before and after the
        copy; the copy is valid only if both equal the generation the caller expected
        (the one advertised with the page). The owner bumps a generation before it touches
        a page's bytes, so any change that could have torn the copy shows up in the
        second read. (Plain loads suffice on x86, where loads are not reordered with other
        loads; weakly ordered CPUs would need a fence between the reads and the copy.)

        With `digests`, a page is valid only if it also records the digest the caller
        expects, read twice:

            generations | digests | copy | digests | generations
               before     before            after     after

        - after the copy, before the second generation read: the owner clears a digest
          only after it bumps the generation, so an old digest seen here belongs to bytes
          that the second generation read proves unchanged;
        - before the copy too: the owner records a digest only once the bytes are final,
          and the model writes a page's KV without bumping its generation (a fresh page
          is bumped when it was last freed). A page an index advertised before its owner
          published it may be mid-write; seen empty before the copy, it is refused,
          where a digest set during the copy would otherwise vouch for torn bytes.

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
        wanted = None if digests is None else self._expected_digests(digests, len(index))
        expected = np.asarray(expected_generations, dtype=np.int64)
        generations = self._live_generations()
        recorded = self._live_digests()
        rows = index.numpy()
        before = generations[rows]  # fancy indexing: a copy, not a view
        if wanted is not None:
            digests_before = recorded[rows]
        pages = self._live_pages()
        # Runs of consecutive pages copy as plain slices (a memcpy each); index_select
        # gathers row by row and is markedly slower on large pages.
        offset = 0
        for length, first in _runs(rows):
            out[offset : offset + length].copy_(pages[first : first + length])
            offset += length
        valid = before == expected
        if wanted is not None:
            digests_after = recorded[rows]
            valid &= (digests_before == wanted).all(axis=1)
            valid &= (digests_after == wanted).all(axis=1)
            valid &= wanted.any(axis=1)  # expecting EMPTY_DIGEST vouches for nothing
        after = generations[rows]
        valid &= after == expected
        return ValidatedCopy(valid.tolist())

    # -- lifetime ----------------------------------------------------------------------

    def unlink(self) -> None:
        """Remove the segment's name so no new reader can attach; idempotent.

        Mapped stores (this one, attached readers) keep working until they close.

        Raises:
            NotOwnerError: called on an attached store.
        """
        if not self._is_owner:
            raise NotOwnerError(f"unlink of segment {self._name!r}: only its owner may unlink")
        assert self._unlink_finalizer is not None
        self._unlink_finalizer()  # runs once; later calls do nothing

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
        mm, self._mm = self._mm, None
        # BufferError: a caller still holds a page view (or a tensor made from one).
        # Unmapping now would leave it dangling; the mapping goes when the last view does.
        with contextlib.suppress(BufferError):
            mm.close()
        if self._is_owner:
            self.unlink()

    def __enter__(self) -> SharedPageStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self._is_owner else "reader"
        state = "closed" if self._closed else "open"
        return f"SharedPageStore({self._name!r}, {role}, {state}, {self._layout})"

    def check_integrity(self) -> None:
        """Raise AssertionError unless the store is consistent.

        Checks that the mapping is open, that the header in shared memory still describes
        this store's layout, and (for the owner) the free list's integrity and that every
        free page records the empty digest.
        """
        assert not self._closed and self._mm is not None, f"store {self._name!r} is closed"
        header = self._mm[: _HEADER.size]
        assert header == _pack_header(self._layout), (
            f"segment {self._name!r}: header no longer matches layout {self._layout}"
        )
        if self._pool is not None:
            self._pool.check_integrity()

    # -- helpers -----------------------------------------------------------------------

    def _require_open(self) -> None:
        if self._closed:
            raise PageStoreError(f"page store {self._name!r} is closed")

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

    @staticmethod
    def _expected_digests(digests: Sequence[bytes], n: int) -> np.ndarray:
        """The caller's expected digests as `(n, DIGEST_BYTES)` uint8."""
        if len(digests) != n:
            raise ValueError(f"{len(digests)} expected digests for {n} pages")
        for i, digest in enumerate(digests):
            if len(digest) != DIGEST_BYTES:
                raise ValueError(
                    f"digest must be {DIGEST_BYTES} bytes, got {len(digest)} (page {i})"
                )
        return np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(n, DIGEST_BYTES)

    def _owner_pool(self, what: str) -> PagePool:
        self._require_open()
        if self._pool is None:
            raise NotOwnerError(
                f"{what} on attached segment {self._name!r}: only its owner (pid "
                f"{self._name.split('-')[1]}) may allocate, free or write pages"
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
