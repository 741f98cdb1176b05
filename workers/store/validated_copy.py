"""Validated copies: reading pages that their owner may rewrite at any moment.

A reader copies pages out of another process's store without a lock, and nothing stops
the owner from freeing, reusing or rewriting a page during the copy. So each page's
generation is read before and after the copy; the copy is valid only if both equal the
generation the caller expected (the one advertised with the page). The owner bumps a
generation before it touches a page's bytes (`SharedPageStore.write_page`), so any change
that could have torn the copy shows up in the second read. (Plain loads suffice on x86,
where loads are not reordered with other loads; weakly ordered CPUs would need a fence
between the reads and the copy.)

With expected digests, a page is valid only if it also records the digest the caller
expects, read twice:

    generations | digests | copy | digests | generations
       before     before            after     after

- after the copy, before the second generation read: the owner clears a digest only
  after it bumps the generation, so an old digest seen here belongs to bytes that the
  second generation read proves unchanged;
- before the copy too: the owner records a digest only once the bytes are final, and the
  model writes a page's KV without bumping its generation (a fresh page is bumped when it
  was last freed). A page an index advertised before its owner published it may be
  mid-write; seen empty before the copy, it is refused, where a digest set during the
  copy would otherwise vouch for torn bytes.

The copy itself (`copy_rows`) is a memcpy per run of consecutive pages when pages and
`out` are both on the CPU; when either is on a CUDA device it is one gather on a stream of
its own (`workers.store.cuda_ipc.gather`), and the stream is synchronised before the
second reads, so they come after the last byte has landed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from workers.store.digests import DIGEST_BYTES


class ValidatedCopy(NamedTuple):
    """Result of `copy_pages_validated`: `valid[i]` says whether row i of `out` holds
    the page as it was at its expected generation (and with its expected digest)."""

    valid: list[bool]

    @property
    def all_valid(self) -> bool:
        return all(self.valid)


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """(length, first) of each run of consecutive values in `rows`."""
    if len(rows) == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(rows)]))
    return [(int(e - s), int(rows[s])) for s, e in zip(starts, ends, strict=True)]


def expected_digests(digests: Sequence[bytes], n: int) -> np.ndarray:
    """The caller's expected digests as `(n, DIGEST_BYTES)` uint8.

    Raises:
        ValueError: not `n` digests, or one that is not `DIGEST_BYTES` long.
    """
    if len(digests) != n:
        raise ValueError(f"{len(digests)} expected digests for {n} pages")
    for i, digest in enumerate(digests):
        if len(digest) != DIGEST_BYTES:
            raise ValueError(f"digest must be {DIGEST_BYTES} bytes, got {len(digest)} (page {i})")
    return np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(n, DIGEST_BYTES)


def copy_validated(
    pages: torch.Tensor,
    generations: np.ndarray,
    recorded: np.ndarray,
    rows: np.ndarray,
    expected: np.ndarray,
    out: torch.Tensor,
    wanted: np.ndarray | None,
) -> ValidatedCopy:
    """Copy `pages[rows]` into `out`, reading generations (and digests) around the copy in
    the order the module docstring explains. Arguments are checked by the caller.

    Args:
        pages: a store's pages, `(num_pages, *page_shape)`, in shared memory or on a
            device.
        generations: its generation counters, `(num_pages,)` int64, in shared memory.
        recorded: its recorded digests, `(num_pages, DIGEST_BYTES)` uint8, in shared memory.
        rows: the page ids to copy, `(n,)` int64, each in range.
        expected: one expected generation per page, `(n,)` int64.
        out: `(n, *page_shape)` of the pages' dtype, on the pages' device or (from a
            CUDA device) on the CPU, pinned for speed.
        wanted: None, or one expected digest per page, `(n, DIGEST_BYTES)` uint8.

    Returns:
        `ValidatedCopy(valid)`, one bool per page.
    """
    before = generations[rows]  # fancy indexing: a copy, not a view
    if wanted is not None:
        digests_before = recorded[rows]
    copy_rows(pages, rows, out)
    valid = before == expected
    if wanted is not None:
        digests_after = recorded[rows]
        valid &= (digests_before == wanted).all(axis=1)
        valid &= (digests_after == wanted).all(axis=1)
        valid &= wanted.any(axis=1)  # expecting EMPTY_DIGEST vouches for nothing
    after = generations[rows]
    valid &= after == expected
    return ValidatedCopy(valid.tolist())


def copy_rows(pages: torch.Tensor, rows: np.ndarray, out: torch.Tensor) -> None:
    """Copy `pages[rows]` into `out` and return once every byte has landed.

    Args:
        pages: `(num_pages, *page_shape)`.
        rows: `(n,)` int64 page ids, each in range.
        out: `(n, *page_shape)` of the pages' dtype.
    """
    if pages.device.type == "cpu" and out.device.type == "cpu":
        # Runs of consecutive pages copy as plain slices (a memcpy each); index_select
        # gathers row by row and is markedly slower on large pages.
        offset = 0
        for length, first in _runs(rows):
            out[offset : offset + length].copy_(pages[first : first + length])
            offset += length
        return
    from workers.store import cuda_ipc  # only a device store gets here

    cuda_ipc.gather(pages, rows, out)


def paste_rows(pages: torch.Tensor, rows: np.ndarray, kv: torch.Tensor) -> None:
    """`pages[rows[i]] = kv[i]`, the owner's bulk write, returning once it has landed.

    Args:
        pages: `(num_pages, *page_shape)`.
        rows: `(n,)` int64 distinct page ids, each in range.
        kv: `(n, *page_shape)` of the pages' dtype.
    """
    if pages.device.type == "cpu" and kv.device.type == "cpu":
        offset = 0
        for length, first in _runs(rows):
            pages[first : first + length].copy_(kv[offset : offset + length])
            offset += length
        return
    from workers.store import cuda_ipc  # only a device store gets here

    cuda_ipc.scatter(pages, rows, kv)
