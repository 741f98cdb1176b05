"""How fast the disk tier reads: measured on its own filesystem, then kept up to date.

A hit in the disk tier is worth loading only when reading it beats recomputing it, so the
tier estimates a read as `latency + bytes / rate`:

- `measure` times a cold read of a scratch file written in the tier's directory (written,
  fdatasync'ed and dropped from the page cache first), so the estimate starts from this
  filesystem, not from a constant;
- every successful page read then moves `rate` (an EWMA of whole reads) so a disk that
  turns slow, or the test throttle, is seen as slow.

The average is taken over seconds per byte, not bytes per second: what is estimated is a
time, and a mean of rates would let one fast cached read hide a slow one. A sample is a
read's effective rate, latency included; for large pages (the real case: megabytes) that
latency is a rounding error, for tiny test pages the estimate comes out high, which errs
toward recomputing.

`throttle` slows reads down to a byte rate (for tests and benchmarks of a slow disk); it
paces all threads' reads together.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from workers.store.disk_file import SCRATCH_NAME, open_private, read_into, write_all

log = logging.getLogger(__name__)

MEASURE_BYTES = 4 << 20  # a few MB: long enough to see the rate, short enough for open()
_CHUNK = 1 << 20
_PROBE = 4096  # the first, latency-bound read
# Until measured (or when the scratch file cannot be written): a plain SSD's numbers.
DEFAULT_BYTES_PER_S = 500e6
DEFAULT_LATENCY_S = 1e-4
EWMA_WEIGHT = 0.2  # of each new read: about the last ten reads count


class ReadRate:
    """The read-rate estimate of one disk tier, and its optional throttle. Thread-safe."""

    def __init__(self, throttle_bytes_per_s: float | None = None):
        """Args:
        throttle_bytes_per_s: pace reads to at most this rate; None reads at full speed.

        Raises:
            ValueError: a throttle that is not a positive number.
        """
        if throttle_bytes_per_s is not None and not throttle_bytes_per_s > 0:
            raise ValueError(f"read throttle must be > 0 bytes/s, got {throttle_bytes_per_s}")
        self.throttle_bytes_per_s = throttle_bytes_per_s
        self.latency_s = DEFAULT_LATENCY_S
        self._seconds_per_byte = 1 / DEFAULT_BYTES_PER_S
        self._lock = threading.Lock()
        self._next_free = 0.0  # when the throttle lets the next read finish (monotonic)

    @property
    def bytes_per_s(self) -> float:
        return 1 / self._seconds_per_byte

    def seconds(self, nbytes: int) -> float:
        """Estimated seconds to read `nbytes` in one read."""
        with self._lock:
            return self.latency_s + nbytes * self._seconds_per_byte

    def start_from(self, latency_s: float, bytes_per_s: float) -> None:
        """Start from a rate measured elsewhere (a tier that is not a directory's files)."""
        with self._lock:
            self.latency_s, self._seconds_per_byte = latency_s, 1 / max(bytes_per_s, 1.0)

    def observe(self, nbytes: int, seconds: float) -> None:
        """Fold one whole read of `nbytes` that took `seconds` into the rate."""
        if nbytes <= 0:
            return
        sample = max(seconds, 1e-9) / nbytes
        with self._lock:
            self._seconds_per_byte += EWMA_WEIGHT * (sample - self._seconds_per_byte)

    def throttle(self, nbytes: int, started: float) -> None:
        """Sleep until a read of `nbytes` begun at `started` (time.monotonic) fits the
        throttle; reads of all threads share it. Returns at once without a throttle."""
        if self.throttle_bytes_per_s is None:
            return
        with self._lock:
            begin = max(started, self._next_free)
            self._next_free = begin + nbytes / self.throttle_bytes_per_s
            wake = self._next_free
        delay = wake - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def measure(self, directory: Path) -> None:
        """Time a cold read of MEASURE_BYTES in `directory` and start from that rate.

        A filesystem that cannot take the scratch file (full, read-only) keeps the current
        estimate, with one warning; nothing is raised.
        """
        path = directory / SCRATCH_NAME
        try:
            fd = open_private(path)
            try:
                latency, seconds_per_byte = _time_cold_read(fd)
            finally:
                os.close(fd)
                path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("disk tier %s: could not measure the read rate (%s)", directory, e)
            return
        with self._lock:
            self.latency_s, self._seconds_per_byte = latency, seconds_per_byte


def _time_cold_read(fd: int) -> tuple[float, float]:
    """(latency_s, seconds_per_byte) of a file written here and dropped from the page cache."""
    block = os.urandom(_CHUNK)  # incompressible, so a compressing filesystem cannot cheat
    os.ftruncate(fd, 0)
    for offset in range(0, MEASURE_BYTES, _CHUNK):
        write_all(fd, block, offset)
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    buffer = memoryview(bytearray(_CHUNK))
    start = time.perf_counter()
    read_into(fd, buffer[:_PROBE], 0)
    probed = time.perf_counter()
    offset = _PROBE
    while offset < MEASURE_BYTES:
        got = read_into(fd, buffer[: min(_CHUNK, MEASURE_BYTES - offset)], offset)
        if got == 0:
            break
        offset += got
    done = time.perf_counter()
    if offset < MEASURE_BYTES:
        raise OSError(f"scratch file read back short: {offset} of {MEASURE_BYTES} bytes")
    return probed - start, max(done - probed, 1e-9) / (offset - _PROBE)
