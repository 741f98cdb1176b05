"""Same-node copies: pages copied straight out of a peer's store attached by name, each run
of destination pages in one validated copy (generation, memcpy, generation, digest)."""

from __future__ import annotations

from collections.abc import Sequence

from workers.store.page_store import SharedPageStore
from workers.transfer.page_wire import check_lengths


def contiguous_runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split a page list into runs of consecutive ids: (offset in list, first page, length)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1:
            runs.append((start, pages[start], i - start))
            start = i
    return runs


def copy_from_peer(
    peer: SharedPageStore,
    page_ids: Sequence[int],
    generations: Sequence[int],
    dst: SharedPageStore,
    dst_pages: Sequence[int],
    digests: Sequence[bytes] | None = None,
) -> list[bool]:
    """Copy pages of a same-node peer's store into our own pages, validated.

    Args:
        digests: optional, one expected digest per page: a page is valid only if its
            holder recorded exactly this digest for it.

    Returns:
        One bool per page: False means the page changed, vanished or holds something
        else, and must be recomputed (its destination holds garbage).
    """
    check_lengths(page_ids, generations, dst_pages, digests)
    valid: list[bool] = []
    for offset, first, length in contiguous_runs(list(dst_pages)):
        out = dst.page_range(first, first + length)
        wanted = None if digests is None else list(digests[offset : offset + length])
        verdict = peer.copy_pages_validated(
            page_ids[offset : offset + length],
            generations[offset : offset + length],
            out,
            digests=wanted,
        )
        valid.extend(verdict.valid)
    return valid
