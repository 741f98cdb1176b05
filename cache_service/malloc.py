"""The service process's allocator policy: large blocks stay mapped, so what the index frees
goes back to the system.

The index's columns are numpy arrays, resized as they grow (realloc: glibc moves a mapped
block with mremap, without copying it) or, when something holds a view of one, replaced by
a larger copy. glibc serves blocks of 128 KiB and more with mmap and unmaps them when they
are freed; but after the first such free it raises that threshold (up to 32 MiB on 64-bit
systems), and smaller blocks then come from the heap, which copies a block to grow it and
keeps the freed one for reuse instead of returning it: about 90 bytes a page at a million
pages (`kvmesh bench lookup`: 292 bytes a page of RSS, 200 with the threshold held).
Holding the threshold at glibc's own starting value keeps the behaviour its defaults begin
with. (Everything else this process allocates at 128 KiB or more is an mmap and an munmap
too: the protocol's encoder keeps one msgpack packer a thread for that reason.)
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's initial value


def keep_large_blocks_mapped() -> bool:
    """Hold this process's mmap threshold at 128 KiB (glibc only).

    Returns:
        True when set; False where the C library has no `mallopt` (not glibc).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
