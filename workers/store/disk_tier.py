"""The disk tier: a worker's pages on local disk, the tier below host memory.

Pure worker-side storage: the prefix cache decides what goes down and what comes back;
this store keeps records (one page each, under its chain digest), finds them, reads them
back verified, and makes room. A worker restarted on the same node adopts what its last
life wrote, each record verified first (`disk_adopt`). The bytes are `disk_records`, the
files `disk_file`, the slot and eviction tables `disk_index`, the read-rate estimate
`disk_rate`; this module holds them together under its locks.

What the tier holds is prefix-closed, like a trie: a record's parent page is on disk too
(or it is a first page). So eviction takes leaves only, least recently touched first,
never a record that is `up` (also in the host tier), and `remove` takes a record's
descendants with it, children first:

    root ── a1 ── a2 ── a3        evictable: a3, b2 (leaves; b2 unless up)
        └── b1 ── b2              a write under a3 will not evict a3 to make its own room

Concurrency: one lock guards the tables (`disk_index`); a second lock serialises the slot
I/O of writers and removers (taken first), so a write's disk I/O never blocks readers.
Reads run on copy threads with no lock around their I/O and are validated instead: the
slot's header is read before and after the body and must be the same verified header, and
the body's crc32 must match. Writers change the tables before they touch a slot, so a
read that fails while the tables still hold its record found the disk itself bad: that
record (and what hangs below it) is removed as "corrupt".

A failing disk (ENOSPC, EIO, ...) is not the caller's problem: the write returns None,
one warning is logged, and the tier stops accepting pages until `retry_s` has passed.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Iterable
from pathlib import Path

from cache_service.events import Namespace
from cache_service.tokens import TOKEN_BYTES
from workers.store.digests import DIGEST_BYTES
from workers.store.disk_adopt import Adoption, adopt
from workers.store.disk_file import DATA_NAME, DataFile
from workers.store.disk_index import DiskIndex
from workers.store.disk_rate import ReadRate
from workers.store.disk_records import DiskRecord, DiskTierError, RecordCodec
from workers.store.layout import StoreLayout
from workers.store.record_tables import RecordTables

__all__ = ["DiskRecord", "DiskTier", "DiskTierError"]

log = logging.getLogger(__name__)

RETRY_S = 30.0  # after a failed write: long enough not to hammer a full or dying disk


class DiskTier(RecordTables):
    """A worker's pages on local disk, in one locked directory. Thread-safe.

    Build one with `DiskTier.open`. Attributes: `adopted` (records found valid at open,
    parents before children), `dropped` (slots not adopted, by reason), `directory`,
    `capacity` (pages), `layout`, `retry_s` (seconds before a failed tier accepts again).
    """

    def __init__(
        self, file: DataFile, codec: RecordCodec, capacity: int, adoption: Adoption, rate: ReadRate
    ):
        """Private: use `DiskTier.open`."""
        super().__init__(capacity)
        self.directory = file.directory
        self.layout = codec.layout
        self.adopted = adoption.records
        self.dropped = adoption.dropped
        self.retry_s = RETRY_S
        self._file, self._codec, self._rate = file, codec, rate
        self._write_lock = threading.Lock()  # slot I/O of writers and removers; before _lock
        self._index = DiskIndex(capacity, adoption.generations, adoption.records)
        self._accepting = True
        self._failed_at = 0.0
        self._closed = False

    @classmethod
    def open(
        cls,
        directory: Path | str,
        layout: StoreLayout,
        capacity_pages: int,
        key: bytes,
        read_throttle_bytes_per_s: float | None = None,
    ) -> DiskTier:
        """Open (creating) a disk tier directory, adopt its verified records, measure reads.

        Args:
            directory: the tier's own directory (made with mode 0o700 if missing).
            layout: the page layout; a data file of another layout is dropped whole.
            capacity_pages: slots in the data file; records beyond a smaller capacity drop.
            key: the mesh's secret; records under another key are dropped as "foreign".
            read_throttle_bytes_per_s: pace reads to this rate (tests, benchmarks).

        Raises:
            ValueError: a capacity below 1, an empty key, a throttle not above 0.
            DiskTierError: the directory is locked by another owner, or its files cannot
                be created, read or written.
        """
        if isinstance(capacity_pages, bool) or not isinstance(capacity_pages, int):
            raise ValueError(f"capacity_pages must be an int, got {capacity_pages!r}")
        if capacity_pages < 1:
            raise ValueError(f"capacity_pages must be >= 1, got {capacity_pages}")
        codec = RecordCodec(layout, key)
        rate = ReadRate(read_throttle_bytes_per_s)
        path = Path(directory)
        try:
            file = DataFile.open(path, codec.geometry)
        except OSError as e:
            raise DiskTierError(f"cannot open disk tier directory {path}: {e}") from e
        try:
            tier = cls(file, codec, capacity_pages, adopt(file, codec, capacity_pages), rate)
        except OSError as e:
            file.close()
            raise DiskTierError(f"cannot adopt the disk tier in {path}: {e}") from e
        except BaseException:
            file.close()
            raise
        tier.measure()
        return tier

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the data file --------------------------------------------------------------------

    @property
    def data_path(self) -> Path:
        """The data file (tests and benchmarks damage records in it on purpose)."""
        return self.directory / DATA_NAME

    def body_offset(self, slot: int) -> int:
        """Where the page bytes of `slot` start in the data file."""
        return self._file.geometry.body_offset(slot)

    # -- writing -----------------------------------------------------------------------

    def write(
        self,
        page: memoryview,
        digest: bytes,
        parent: bytes,
        namespace: Namespace,
        depth: int,
        tokens: bytes,
    ) -> DiskRecord | None:
        """Store one page under its digest, making room by evicting if needed.

        Args:
            page: the page's KV bytes (`layout.page_bytes`, contiguous).
            digest: the page's chain digest: `next_digest(parent, tokens)`.
            parent: the previous page's digest; for depth 1 the namespace's root digest.
            namespace: the page's namespace.
            depth: pages from the root, 1 = first page.
            tokens: the page's token ids, packed int32 LE.

        Returns:
            The record (the one already held if the digest is on disk: no rewrite), or
            None with nothing changed: no room (every candidate is up or has children), a
            parent not on disk (depth > 1), a namespace too long to record, the tier not
            accepting after a failed write, or closed. Evicted records go to
            `take_removed()` ("evicted").

        Raises:
            ValueError: wrong sizes, or a digest that does not follow from parent and
                tokens (a caller bug: such a record would be dropped at the next open).
        """
        body = memoryview(page).cast("B")
        tokens = bytes(tokens)
        self._check_page(body, digest, parent, namespace, depth, tokens)
        if not self._codec.fits(namespace):
            return None
        body_crc = zlib.crc32(body)
        with self._write_lock:
            with self._lock:
                held = self._index.get(digest)
                if held is not None or self._closed:
                    if held is not None:
                        self._index.touch(digest)
                    return held
                slot = self._take_slot(parent, namespace, depth)
                if slot is None:
                    self._counts["writes_refused"] += 1
                    return None
                generation = self._index.next_generation(slot)
                record = DiskRecord(slot, generation, digest, parent, namespace, depth, tokens)
            try:
                self._file.write_record(slot, self._codec.encode(record, body_crc), body)
            except OSError as e:
                with self._lock:
                    self._index.release(slot)
                    self._write_failed(e)
                return None
            with self._lock:
                self._index.hold(record)
                self._counts["writes"] += 1
                self._counts["bytes_written"] += len(body)
        return record

    def _check_page(
        self,
        body: memoryview,
        digest: bytes,
        parent: bytes,
        namespace: Namespace,
        depth: int,
        tokens: bytes,
    ) -> None:
        layout = self.layout
        if len(body) != layout.page_bytes:
            raise ValueError(f"page is {len(body)} bytes, this tier's are {layout.page_bytes}")
        if len(digest) != DIGEST_BYTES or len(parent) != DIGEST_BYTES:
            raise ValueError(
                f"digests are {DIGEST_BYTES} bytes, got {len(digest)} and {len(parent)}"
            )
        if len(tokens) != layout.page_tokens * TOKEN_BYTES:
            raise ValueError(
                f"tokens are {len(tokens)} bytes, a page's are {layout.page_tokens * TOKEN_BYTES}"
            )
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if not self._codec.chain_ok(DiskRecord(0, 0, digest, parent, namespace, depth, tokens)):
            raise ValueError(
                f"digest {digest.hex()} does not follow from parent {parent.hex()} and the "
                f"tokens (depth {depth}, namespace {namespace})"
            )

    def _accepting_now(self) -> bool:
        if not self._accepting and time.monotonic() - self._failed_at >= self.retry_s:
            log.info("disk tier %s: trying to accept pages again", self.directory)
            self._accepting = True
        return self._accepting

    def _write_failed(self, error: OSError) -> None:
        self._counts["write_failures"] += 1
        if self._accepting:
            log.warning(
                "disk tier %s: a write failed (%s); not accepting pages for %.0f s",
                self.directory,
                error,
                self.retry_s,
            )
        self._accepting = False
        self._failed_at = time.monotonic()

    # -- reading -----------------------------------------------------------------------

    def read(self, record: DiskRecord, out: memoryview) -> bool:
        """Read a record's page straight into `out`, verified.

        True only if the slot's header, read before and after the body, is the same valid
        header of this record (same generation and digest), and the body's crc32 matches.
        A failed read is counted; one that shows the disk itself bad removes the record
        (and its descendants) as "corrupt" (see `take_removed`). Touches the record.

        Raises:
            ValueError: `out` is read-only or not `layout.page_bytes` long.
        """
        view = memoryview(out).cast("B")
        if view.readonly or len(view) != self.layout.page_bytes:
            raise ValueError(
                f"out must be a writable buffer of {self.layout.page_bytes} bytes, "
                f"got {len(view)} (readonly={view.readonly})"
            )
        if not self._holds(record):
            with self._lock:
                self._counts["read_failures"] += 1
            return False
        started = time.monotonic()
        ok = self._read_verified(record, view, started)
        elapsed = time.monotonic() - started
        if ok:
            self._rate.observe(len(view), elapsed)
        with self._lock:
            if ok:
                if self._index.holds(record):
                    self._index.touch(record.digest)
                self._counts["reads"] += 1
                self._counts["bytes_read"] += len(view)
                return True
            self._counts["read_failures"] += 1
        self._remove_corrupt(record)
        return False

    def _holds(self, record: DiskRecord) -> bool:
        with self._lock:
            return not self._closed and self._index.holds(record)

    def _read_verified(self, record: DiskRecord, out: memoryview, started: float) -> bool:
        def pause() -> None:
            self._rate.throttle(len(out), started)

        return self._file.read_record(self._codec, record.slot, out, pause) == record

    def _remove_corrupt(self, record: DiskRecord) -> None:
        """Remove a record whose read failed if the tables still hold it unchanged: no
        writer touched its slot (they change the tables first), so the disk is bad."""
        with self._write_lock:
            if not self._holds(record):
                return  # rewritten, evicted or removed meanwhile: a stale read, not damage
            log.warning("disk tier %s: record in slot %d is corrupt", self.directory, record.slot)
            removed = self._remove_locked([record.digest], "corrupt")
            with self._lock:
                self._removed.extend((each, "corrupt") for each in removed)

    # -- removing ----------------------------------------------------------------------

    def remove(self, digests: Iterable[bytes], reason: str) -> list[DiskRecord]:
        """Drop the records of `digests` (those held) and every record below them on disk.

        Returns:
            The removed records, children before their parents. They are not repeated
            by `take_removed()`.
        """
        with self._write_lock:
            return self._remove_locked(digests, reason)

    def clear(self) -> int:
        """Remove every record ("cleared"); returns how many there were."""
        with self._write_lock:
            with self._lock:
                everything = self._index.digests()
            return len(self._remove_locked(everything, "cleared"))

    def _remove_locked(self, digests: Iterable[bytes], reason: str) -> list[DiskRecord]:
        """`remove`, with _write_lock held: tables first, then the slots on disk."""
        with self._lock:
            if self._closed:
                return []
            doomed = self._drop_subtrees(digests, reason)
        for record in doomed:  # children first, so a kill midway leaves a closed prefix
            try:
                self._file.invalidate(record.slot)
            except OSError as e:
                with self._lock:
                    self._write_failed(e)
        with self._lock:
            for record in doomed:
                self._index.release(record.slot)
        return doomed

    # -- rates, stats, checks, closing -------------------------------------------------

    def read_seconds(self, nbytes: int) -> float:
        """Estimated seconds to read `nbytes` from this tier: latency + bytes / rate."""
        return self._rate.seconds(nbytes)

    def measure(self) -> None:
        """Measure the read rate of this directory's filesystem (a cold read of a scratch
        file of a few MB); reads then keep the estimate current."""
        self._rate.measure(self.directory)

    def throttle(self, bytes_per_s: float | None) -> None:
        """Pace reads to at most `bytes_per_s` from now on (None: full speed): a slow disk,
        for tests and benchmarks. The estimate follows from the reads' real times.

        Raises:
            ValueError: a rate that is not above 0.
        """
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"read throttle must be > 0 bytes/s, got {bytes_per_s}")
        self._rate.throttle_bytes_per_s = bytes_per_s

    def drop_page_cache(self) -> None:
        """Flush the data file and drop it from the page cache (benchmarks time cold reads).

        Raises:
            OSError: the flush failed.
        """
        with self._write_lock:
            self._file.drop_page_cache()

    def _more_stats(self) -> dict:
        return {
            "adopted": len(self.adopted),
            "accepting": self._accepting,
            "dropped": dict(self.dropped),
        }

    def close(self, remove_files: bool = False) -> None:
        """Release the directory's lock (a later `open` adopts what is left).

        Args:
            remove_files: delete the tier's files (and the directory if that empties it),
                as `kvmesh down` does unless the configuration keeps them.
        """
        with self._write_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            self._file.close(remove_files)
