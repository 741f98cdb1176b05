"""A page store's named POSIX shared-memory segment: its name, header and mapping.

The owner creates the segment and maps it writable; a peer on the same node attaches by
name and maps it read-only. `Segment` does only that, and cuts the mapping into the
generation, digest and page views (`Segment.views`) that `SharedPageStore` works on.

Segment format (one file in /dev/shm per store, little-endian), version 4:

    offset 0                 header: magic, format version, layout, page placement,
                             region offsets
    offset 1024              the peer handle slot: length (u32), crc32 (u32), then that
                             many bytes (at most 3064): how a same-node peer opens pages
                             kept outside the segment (a msgpack map of a CUDA IPC
                             handle's plain fields, `workers.store.cuda_ipc`); length 0:
                             none
    offset 4096              num_pages int64 generation counters (padded to 4096)
    offset digests_offset    num_pages x 16-byte digests, all zeros where none is
                             recorded (padded to 4096)
    offset data_offset       pages: (num_pages, num_layers, 2 [k,v], num_kv_heads,
                                     page_tokens, head_dim) in the layout's dtype;
                             empty (data_offset == total_bytes) when the placement is
                             PLACEMENT_DEVICE

A store whose pages live in device memory keeps only its metadata here, so peers read
generations and digests without touching the device; its pages reach them another way
(`workers.store.cuda_ipc`), through the handle its owner leaves in the header: it never
leaves the node. Version 1 had no digest region, version 2 no placement, version 3 no
peer handle slot; a reader refuses any version but its own. Names, and
reclaiming the segments of dead owners, are `workers.store.segment_names`.

`multiprocessing.shared_memory` is deliberately not used: on Python 3.11 its resource
tracker unlinks a segment when any process that attached to it exits.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct
import warnings
import weakref
import zlib
from typing import NamedTuple

import numpy as np
import torch

from workers.store.digests import DIGEST_BYTES
from workers.store.layout import (
    DTYPE_CODES,
    NotOwnerError,
    PageStoreError,
    SegmentFormatError,
    SegmentNotFoundError,
    StoreLayout,
)
from workers.store.segment_names import SHM_DIR, reclaim_dead_segments, segment_name, segment_path

MAGIC = b"KVMESH01"
FORMAT_VERSION = 4  # 2: digests after the generations; 3: page placement; 4: peer handle

# Where the pages are. Codes are part of the format: never renumber, only append.
PLACEMENT_SEGMENT = 0  # in the data region, after the digests
PLACEMENT_DEVICE = 1  # elsewhere (device memory): the segment holds metadata only
_PLACEMENTS = (PLACEMENT_SEGMENT, PLACEMENT_DEVICE)

# Regions start on a page boundary so both views are aligned for any dtype and the data
# region can later be registered (pinned) for DMA as a whole.
_ALIGN = 4096
HEADER_BYTES = 4096

# magic, version, num_pages, num_layers, num_kv_heads, page_tokens, head_dim, dtype_code,
# placement, generations_offset, digests_offset, data_offset, total_bytes
_HEADER = struct.Struct("<8s12q")

# The peer handle slot: length and crc32, then the bytes, inside the header's page.
_HANDLE_OFFSET = 1024
_HANDLE_PREFIX = struct.Struct("<II")
MAX_HANDLE_BYTES = HEADER_BYTES - _HANDLE_OFFSET - _HANDLE_PREFIX.size

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only; elsewhere fault lazily


class Regions(NamedTuple):
    """Where each region of a segment starts, and the segment's size, in bytes."""

    generations_offset: int
    digests_offset: int
    data_offset: int
    total_bytes: int


class SegmentViews(NamedTuple):
    """The regions of a mapped segment as arrays over its memory (no copies): writable
    for the owner, read-only for a reader."""

    generations: np.ndarray  # (num_pages,) int64
    digests: np.ndarray  # (num_pages, DIGEST_BYTES) uint8; zeros (EMPTY_DIGEST) when fresh
    # (num_pages, num_layers, 2 [k,v], num_kv_heads, page_tokens, head_dim); None when the
    # pages are not in the segment (PLACEMENT_DEVICE)
    pages: torch.Tensor | None


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def regions(layout: StoreLayout, placement: int = PLACEMENT_SEGMENT) -> Regions:
    """The region offsets and total size of a segment holding `layout`'s metadata, and its
    pages too when `placement` is PLACEMENT_SEGMENT."""
    digests_offset = HEADER_BYTES + _align(layout.num_pages * 8)
    data_offset = digests_offset + _align(layout.num_pages * DIGEST_BYTES)
    data_bytes = layout.num_pages * layout.page_bytes if placement == PLACEMENT_SEGMENT else 0
    return Regions(HEADER_BYTES, digests_offset, data_offset, data_offset + data_bytes)


def pack_header(layout: StoreLayout, placement: int = PLACEMENT_SEGMENT) -> bytes:
    """The header of a segment holding `layout` with its pages placed as `placement`,
    magic first."""
    assert placement in _PLACEMENTS, placement
    return _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        layout.num_pages,
        layout.num_layers,
        layout.num_kv_heads,
        layout.page_tokens,
        layout.head_dim,
        DTYPE_CODES[layout.dtype],
        placement,
        *regions(layout, placement),
    )


def unpack_header(name: str, raw: bytes) -> tuple[StoreLayout, int]:
    """The layout and page placement a segment's header records.

    Args:
        name: the segment's name, for messages.
        raw: the header's first `_HEADER.size` bytes.

    Returns:
        `(layout, placement)`.

    Raises:
        SegmentFormatError: a bad magic, another format version, an unknown dtype or
            placement, a bad layout, or region offsets that do not follow from them.
    """
    values = _HEADER.unpack(raw)
    magic, version, *fields, dtype_code, placement = values[:9]  # fields: five sizes
    offsets = Regions(*values[9:])
    if magic != MAGIC:
        raise SegmentFormatError(
            f"segment {name!r}: bad magic {magic!r}, expected {MAGIC!r} "
            "(not a kvmesh page store, or its owner has not finished creating it)"
        )
    if version != FORMAT_VERSION:
        raise SegmentFormatError(
            f"segment {name!r}: format version {version}, this build reads {FORMAT_VERSION}"
        )
    dtypes = {code: dtype for dtype, code in DTYPE_CODES.items()}
    if dtype_code not in dtypes:
        raise SegmentFormatError(f"segment {name!r}: unknown dtype code {dtype_code}")
    if placement not in _PLACEMENTS:
        raise SegmentFormatError(
            f"segment {name!r}: unknown page placement {placement}, known {list(_PLACEMENTS)}"
        )
    try:
        layout = StoreLayout(*fields, dtype=dtypes[dtype_code])
    except ValueError as e:
        raise SegmentFormatError(f"segment {name!r}: bad layout in header: {e}") from None
    if offsets != regions(layout, placement):
        raise SegmentFormatError(
            f"segment {name!r}: region offsets {tuple(offsets)} "
            f"do not match its layout {tuple(regions(layout, placement))}"
        )
    return layout, placement


def _unlink_segment(path: str, owner_pid: int) -> None:
    # Runs from close(), on garbage collection, or at interpreter exit. A forked child
    # inherits the finaliser and must not unlink its parent's segment on its own exit.
    if os.getpid() != owner_pid:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# -- the segment -----------------------------------------------------------------------


class Segment:
    """One mapped segment: writable and unlinked on close (or when dropped) for its owner,
    read-only for a reader. Build one with `Segment.create` or `Segment.attach`."""

    def __init__(
        self, name: str, layout: StoreLayout, mm: mmap.mmap, is_owner: bool, placement: int
    ):
        """Private: use `create` or `attach`."""
        self._name = name
        self._layout = layout
        self._placement = placement
        self._mm: mmap.mmap | None = mm
        self._is_owner = is_owner
        self._unlink_finalizer = (
            weakref.finalize(self, _unlink_segment, os.path.join(SHM_DIR, name), os.getpid())
            if is_owner
            else None
        )

    @classmethod
    def create(
        cls, layout: StoreLayout, tag: str | None = None, placement: int = PLACEMENT_SEGMENT
    ) -> Segment:
        """Create a new segment and own it; reclaims dead owners' segments first.

        Args:
            layout: the shape and dtype of the pages it holds.
            tag: a name suffix matching [a-z0-9_]{1,32}; a random one when None.
            placement: PLACEMENT_SEGMENT (pages in the segment) or PLACEMENT_DEVICE
                (metadata only).

        Returns:
            The owner's segment, mapped writable, its header written.

        Raises:
            ValueError: a bad tag.
            PageStoreError: the segment exists already, or /dev/shm has no room for it.
        """
        name = segment_name(tag)
        reclaim_dead_segments()
        path = os.path.join(SHM_DIR, name)
        if placement not in _PLACEMENTS:
            raise ValueError(f"page placement {placement}, known {list(_PLACEMENTS)}")
        size = regions(layout, placement).total_bytes
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
        header = pack_header(layout, placement)
        # The magic goes in last: a reader that attaches mid-creation sees a bad magic
        # rather than a half-written layout.
        mm[len(MAGIC) : len(header)] = header[len(MAGIC) :]
        mm[: len(MAGIC)] = MAGIC
        return cls(name, layout, mm, is_owner=True, placement=placement)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map another process's segment for reading.

        Args:
            name: the owner's segment name.

        Returns:
            A reader's segment, mapped read-only.

        Raises:
            ValueError: `name` is not a kvmesh segment name.
            SegmentNotFoundError: no such segment.
            SegmentFormatError: the header is not a kvmesh header of this format version,
                or the segment is shorter than its header says.
        """
        path = segment_path(name)
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
            layout, placement = unpack_header(name, os.pread(fd, _HEADER.size, 0))
            total = regions(layout, placement).total_bytes
            if size < total:
                # Mapping past the end of the file would fault (SIGBUS) on first read.
                raise SegmentFormatError(
                    f"segment {name!r} is {size} bytes, its layout needs {total}"
                )
            mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(name, layout, mm, is_owner=False, placement=placement)

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
    def placement(self) -> int:
        """PLACEMENT_SEGMENT (pages in the segment) or PLACEMENT_DEVICE (metadata only)."""
        return self._placement

    @property
    def closed(self) -> bool:
        return self._mm is None

    def set_peer_handle(self, data: bytes) -> None:
        """Leave how a same-node peer opens this store's pages (owner only), once, before
        the store's name is handed out: a reader checks the bytes' crc32 all the same.

        Raises:
            NotOwnerError: called on a reader's segment.
            ValueError: more than MAX_HANDLE_BYTES, or none.
            PageStoreError: the segment is closed.
        """
        if not self._is_owner:
            raise NotOwnerError(f"set_peer_handle on segment {self._name!r}: owner only")
        if not 0 < len(data) <= MAX_HANDLE_BYTES:
            raise ValueError(f"a peer handle of {len(data)} bytes: 1 to {MAX_HANDLE_BYTES}")
        if self._mm is None:
            raise PageStoreError(f"segment {self._name!r} is closed")
        start = _HANDLE_OFFSET + _HANDLE_PREFIX.size
        self._mm[start : start + len(data)] = data
        prefix = _HANDLE_PREFIX.pack(len(data), zlib.crc32(data))
        self._mm[_HANDLE_OFFSET : _HANDLE_OFFSET + _HANDLE_PREFIX.size] = prefix  # last

    def peer_handle(self) -> bytes | None:
        """The bytes `set_peer_handle` left, or None when there are none (or they do not
        match their crc32: not written yet, or not by this format).

        Raises:
            PageStoreError: the segment is closed.
        """
        if self._mm is None:
            raise PageStoreError(f"segment {self._name!r} is closed")
        length, crc = _HANDLE_PREFIX.unpack_from(self._mm, _HANDLE_OFFSET)
        if not 0 < length <= MAX_HANDLE_BYTES:
            return None
        start = _HANDLE_OFFSET + _HANDLE_PREFIX.size
        data = bytes(self._mm[start : start + length])
        return data if zlib.crc32(data) == crc else None

    def views(self) -> SegmentViews:
        """The generation, digest and page regions as arrays over the mapping.

        Each view keeps the mapping alive while it (or a tensor made from it) exists.

        Raises:
            PageStoreError: the segment is closed.
        """
        if self._mm is None:
            raise PageStoreError(f"segment {self._name!r} is closed")
        mm, layout = self._mm, self._layout
        offsets = regions(layout, self._placement)
        # Writable for the owner; a read-only view for readers (numpy honours it).
        generations = np.frombuffer(
            mm, dtype="<i8", count=layout.num_pages, offset=offsets.generations_offset
        )
        digests = np.frombuffer(
            mm,
            dtype=np.uint8,
            count=layout.num_pages * DIGEST_BYTES,
            offset=offsets.digests_offset,
        ).reshape(layout.num_pages, DIGEST_BYTES)
        if self._placement != PLACEMENT_SEGMENT:
            return SegmentViews(generations, digests, None)
        with warnings.catch_warnings():
            # A reader's mapping is read-only by design; torch only warns that it cannot
            # mark the tensor so.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(
                mm,
                dtype=layout.torch_dtype,
                count=layout.num_pages * math.prod(layout.page_shape),
                offset=offsets.data_offset,
            )
        return SegmentViews(generations, digests, flat.view(layout.num_pages, *layout.page_shape))

    def unlink(self) -> None:
        """Remove the segment's name so no new reader can attach; idempotent.

        Raises:
            NotOwnerError: called on a reader's segment.
        """
        if not self._is_owner:
            raise NotOwnerError(f"unlink of segment {self._name!r}: only its owner may unlink")
        assert self._unlink_finalizer is not None
        self._unlink_finalizer()  # runs once; later calls do nothing

    def close(self) -> None:
        """Unmap the segment, and for the owner also unlink it; idempotent.

        Views handed out earlier keep the mapping alive until they are dropped.
        """
        if self._mm is None:
            return
        mm, self._mm = self._mm, None
        # BufferError: a caller still holds a view (or a tensor made from one). Unmapping
        # now would leave it dangling; the mapping goes when the last view does.
        with contextlib.suppress(BufferError):
            mm.close()
        if self._is_owner:
            self.unlink()

    def check_integrity(self) -> None:
        """Raise AssertionError unless the segment is mapped and its header in shared memory
        still describes its layout."""
        assert self._mm is not None, f"store {self._name!r} is closed"
        assert self._mm[: _HEADER.size] == pack_header(self._layout, self._placement), (
            f"segment {self._name!r}: header no longer matches layout {self._layout}"
        )

    def __repr__(self) -> str:
        role = "owner" if self._is_owner else "reader"
        state = "closed" if self._mm is None else "open"
        return f"Segment({self._name!r}, {role}, {state}, {self._layout})"
