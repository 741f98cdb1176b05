"""The disk tier's files: its directory, the lock that makes one process its owner, and
positioned reads and writes of the data file's slots.

    DIRECTORY/           mode 0o700 when created here
        lock             flock(LOCK_EX) held while a tier is open; records the owner's pid
        pages.kv         the slots (`workers.store.disk_records` has the format), mode 0o600

File names are fixed here, never taken from a caller or the network. Every read and write
names its offset (pread/pwrite), so reads on copy threads need no lock around the file.
What the bytes mean is `disk_records`; this module moves them, and reads a slot back
verified (`SlotReader.read_record`) for the owner and for same-node peers alike: a peer
opens the data file read-only (`SlotReader.open_peer`) and never takes the lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import zlib
from collections.abc import Callable
from pathlib import Path

from workers.store.disk_records import (
    FILE_HEADER_BYTES,
    FREE_MAGIC,
    DiskRecord,
    DiskTierError,
    RecordCodec,
    RecordHeader,
    SlotGeometry,
    check_file_header,
)

DATA_NAME = "pages.kv"
LOCK_NAME = "lock"
SCRATCH_NAME = "read-rate.tmp"  # `disk_rate` measures the filesystem with it
_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def open_private(path: Path) -> int:
    """Open (creating) a file only this user may read or write; returns the descriptor."""
    fd = os.open(path, _FLAGS, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a file left by an earlier run may carry wider bits
    except OSError:
        os.close(fd)
        raise
    return fd


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """pwrite all of `data` at `offset`; a write that makes no progress is ENOSPC."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[written:], offset + written


def read_into(fd: int, out: memoryview, offset: int) -> int:
    """preadv into `out` until it is full or the file ends; returns the bytes read."""
    done = 0
    while done < len(out):
        got = os.preadv(fd, [out[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done


class SlotReader:
    """Positioned reads of a data file's slots, and a slot's record read back verified."""

    def __init__(self, geometry: SlotGeometry, data_fd: int):
        self.geometry = geometry
        self._fd = data_fd

    @classmethod
    def open_peer(cls, path: Path, codec: RecordCodec) -> SlotReader:
        """Open another worker's data file read-only (its owner keeps the lock; a reader
        never takes it): a regular file of this user, made for `codec`'s layout.

        Raises:
            DiskTierError: not such a file, or a data file of another layout.
            OSError: it cannot be opened (absent, a symlink, no permission).
        """
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise DiskTierError(f"{path} is not a data file of this user")
            check = check_file_header(os.pread(fd, FILE_HEADER_BYTES, 0), codec.layout)
            if check.status != "ok":
                raise DiskTierError(f"{path}: data file header {check.status}")
        except BaseException:
            os.close(fd)
            raise
        return cls(codec.geometry, fd)

    def read_head(self, slot: int) -> bytes:
        """The slot's whole record header area."""
        return os.pread(self._fd, self.geometry.header_bytes, self.geometry.slot_offset(slot))

    def read_body(self, slot: int, out: memoryview) -> int:
        """Read the slot's body straight into `out`; returns the bytes read."""
        return read_into(self._fd, out, self.geometry.body_offset(slot))

    def read_record(
        self,
        codec: RecordCodec,
        slot: int,
        out: memoryview,
        pause: Callable[[], None] | None = None,
    ) -> DiskRecord | None:
        """The record in `slot` with its page read into `out`, or None unless the header,
        read before and after the body, is the same verified header (checksum, MAC under
        the codec's key, format) and the body's crc32 matches it. `pause` runs between
        the body and the second header read (a throttle): a rewrite meanwhile is caught
        like one during the body read. A failed read (OSError) is None too."""
        try:
            head = self.read_head(slot)
            decoded = codec.decode(head, slot)
            if not isinstance(decoded, RecordHeader):
                return None
            if self.read_body(slot, out) != len(out) or zlib.crc32(out) != decoded.body_crc:
                return None
            if pause is not None:
                pause()
            return decoded.record if self.read_head(slot) == head else None
        except OSError:
            return None

    def close(self) -> None:
        os.close(self._fd)


class DataFile(SlotReader):
    """A locked disk tier directory and its open data file."""

    def __init__(self, directory: Path, geometry: SlotGeometry, lock_fd: int, data_fd: int):
        """Private: use `DataFile.open`."""
        super().__init__(geometry, data_fd)
        self.directory = directory
        self._lock_fd = lock_fd
        self._closed = False

    @classmethod
    def open(cls, directory: Path, geometry: SlotGeometry) -> DataFile:
        """Create the directory if needed, take its lock, and open the data file.

        Raises:
            DiskTierError: another process (or another tier in this one) holds the lock.
            OSError: the directory or files cannot be created or opened.
        """
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock_path = directory / LOCK_NAME
        lock_fd = open_private(lock_path)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(lock_fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(lock_fd)
            raise DiskTierError(
                f"disk tier directory {directory} is in use: {lock_path} is locked by "
                f"another owner (pid {owner}); two workers must not share a disk tier"
            ) from None
        try:
            os.ftruncate(lock_fd, 0)
            write_all(lock_fd, f"{os.getpid()}\n".encode(), 0)
            data_fd = open_private(directory / DATA_NAME)
        except BaseException:
            os.close(lock_fd)
            raise
        return cls(directory, geometry, lock_fd, data_fd)

    @property
    def fd(self) -> int:
        return self._fd

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def read_at(self, nbytes: int, offset: int) -> bytes:
        """Up to `nbytes` at `offset` (fewer at the end of the file)."""
        return os.pread(self._fd, nbytes, offset)

    def write_record(self, slot: int, header: bytes, body: memoryview) -> None:
        """Write one record so that no kill point leaves a header over the wrong body:
        free the slot's header first, then the body, then the header that describes it."""
        base = self.geometry.slot_offset(slot)
        write_all(self._fd, FREE_MAGIC, base)
        write_all(self._fd, body, base + self.geometry.header_bytes)
        write_all(self._fd, header, base)

    def invalidate(self, slot: int) -> None:
        """Mark the slot free on disk (its record never verifies again)."""
        write_all(self._fd, FREE_MAGIC, self.geometry.slot_offset(slot))

    def write_file_header(self, header: bytes) -> None:
        write_all(self._fd, header.ljust(FILE_HEADER_BYTES, b"\0"), 0)

    def resize(self, nbytes: int) -> None:
        """Cut or extend the file; an extension is sparse (space is taken on first write)."""
        os.ftruncate(self._fd, nbytes)

    def drop_page_cache(self) -> None:
        """Flush the data file and drop it from the page cache, so the next reads are cold."""
        os.fdatasync(self._fd)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self, remove_files: bool = False) -> None:
        """Close the files and release the lock; `remove_files` deletes this tier's files
        (by their fixed names only) and the directory if that leaves it empty."""
        if self._closed:
            return
        self._closed = True
        if remove_files:
            for name in (DATA_NAME, SCRATCH_NAME, LOCK_NAME):  # the lock last: still held
                with contextlib.suppress(FileNotFoundError):
                    (self.directory / name).unlink()
            with contextlib.suppress(OSError):
                self.directory.rmdir()
        os.close(self._fd)
        os.close(self._lock_fd)  # releases the flock
