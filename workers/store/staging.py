"""Moving pages between a device store and the host store below it.

A GPU worker's pages live in a device store (the top tier) over a host shared-memory
store. Write-back takes pages down (an eviction that keeps them findable), load-back
brings a host hit up:

    write-back   device pages --gather--> device scratch --bulk--> pinned staging
                 --memcpy per run--> host store pages
    load-back    host store pages --memcpy per run--> pinned staging --bulk--> device
                 --scatter--> device store pages

Both are one function, `stage_pages`: a validated copy out of the source store (generation
before, copy, generation after, digests: `workers.store.validated_copy`) into a staging
buffer, then the destination's owner writes the valid rows with `write_pages` (bumping
their generations and recording their digests). A page the source changed during the copy
is reported invalid and its destination page left as it was. On the CPU (a "cpu" device
store standing in for the device) the same code runs with plain memory as staging.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.store.layout import NotOwnerError
from workers.store.page_store import SharedPageStore
from workers.store.validated_copy import ValidatedCopy


def staging_buffer(store: SharedPageStore, num_pages: int) -> torch.Tensor:
    """A host buffer for `num_pages` of `store`'s pages: pinned when any CUDA device is
    in play (a bulk copy from pinned memory runs at the bus's speed), plain otherwise.

    Make one and reuse it: pinning memory costs far more than a copy through it.

    Args:
        store: the store whose layout the buffer holds.
        num_pages: its capacity in pages, at least 1.

    Returns:
        `(num_pages, *page_shape)` of the store's dtype, on the CPU.

    Raises:
        ValueError: `num_pages` below 1.
    """
    if num_pages < 1:
        raise ValueError(f"a staging buffer of {num_pages} pages: need at least 1")
    shape = (num_pages, *store.layout.page_shape)
    if torch.cuda.is_available():
        from workers.store import cuda_ipc

        return cuda_ipc.pinned_empty(shape, store.layout.torch_dtype)
    return torch.empty(shape, dtype=store.layout.torch_dtype)


def reused_rows(rows: torch.Tensor | None, store: SharedPageStore, n: int) -> torch.Tensor:
    """`rows` if it holds at least `n` pages of `store`'s layout, else a new
    `staging_buffer`: a reader keeps its rows and passes them back each time, since
    pinning memory costs more than a copy through it."""
    if (
        rows is None
        or len(rows) < n
        or rows.dtype != store.layout.torch_dtype
        or tuple(rows.shape[1:]) != store.layout.page_shape
    ):
        return staging_buffer(store, n)
    return rows


def row_bytes(rows: torch.Tensor, i: int) -> memoryview:
    """Row `i` of a staging buffer as a flat writable byte view (what a record or a frame
    is read into)."""
    return memoryview(rows[i].view(torch.uint8).numpy()).cast("B")


def stage_pages(
    src: SharedPageStore,
    src_pages: Sequence[int],
    expected_generations: Sequence[int],
    dst: SharedPageStore,
    dst_pages: Sequence[int],
    digests: Sequence[bytes] | None = None,
    staging: torch.Tensor | None = None,
) -> ValidatedCopy:
    """Copy pages from one store into another through a host staging buffer, validated.

    Args:
        src: the store to read (owned here or attached; its pages must be reachable).
        src_pages: its pages to copy.
        expected_generations: one per source page, as advertised with it.
        dst: a store owned here, of the same layout.
        dst_pages: one distinct allocated destination page per source page.
        digests: None, or one expected digest per page: checked on the source as a
            validated copy does, and recorded on the destination pages written.
        staging: a host buffer of at least `len(src_pages)` pages (`staging_buffer`);
            None makes one for this call.

    Returns:
        `ValidatedCopy(valid)`: `valid[i]` says `dst_pages[i]` now holds `src_pages[i]` as
        it was at its expected generation (and digest); an invalid one was not written.

    Raises:
        ValueError: layouts that differ, lengths that differ, a bad page or digest, or a
            staging buffer too small or of another dtype; then nothing changes.
        NotOwnerError: `dst` is an attached store.
    """
    n = len(src_pages)
    if src.layout.kv_format != dst.layout.kv_format:
        raise ValueError(f"pages of {src.layout.kv_format} into a store of {dst.layout.kv_format}")
    if len(dst_pages) != n or len(expected_generations) != n:
        raise ValueError(
            f"{n} source pages, {len(dst_pages)} destination pages, "
            f"{len(expected_generations)} expected generations"
        )
    if not dst.is_owner:
        raise NotOwnerError(f"staging into attached store {dst.name!r}: only its owner writes")
    if staging is None:
        staging = staging_buffer(src, max(n, 1))
    if (
        staging.device.type != "cpu"
        or staging.dtype != src.layout.torch_dtype
        or tuple(staging.shape[1:]) != src.layout.page_shape
        or len(staging) < n
    ):
        raise ValueError(
            f"staging must be a CPU ({n}+, *{src.layout.page_shape}) {src.layout.torch_dtype} "
            f"buffer, got {tuple(staging.shape)} {staging.dtype} on {staging.device}"
        )
    dst.check_writable(dst_pages)  # before anything is read: bad input changes nothing
    if n == 0:
        return ValidatedCopy([])
    result = src.copy_pages_validated(src_pages, expected_generations, staging[:n], digests)
    keep = [i for i, ok in enumerate(result.valid) if ok]
    if keep:
        rows = staging[:n] if len(keep) == n else staging[torch.tensor(keep)]
        dst.write_pages(
            [dst_pages[i] for i in keep],
            rows,
            None if digests is None else [digests[i] for i in keep],
        )
    return result


def write_back(
    device_store: SharedPageStore,
    device_pages: Sequence[int],
    expected_generations: Sequence[int],
    host_store: SharedPageStore,
    host_pages: Sequence[int],
    digests: Sequence[bytes] | None = None,
    staging: torch.Tensor | None = None,
) -> ValidatedCopy:
    """Copy pages down from a device store into its host store (`stage_pages`).

    Raises:
        ValueError: what `stage_pages` raises, or a host store whose pages are not in
            shared memory.
        NotOwnerError: the host store is attached.
    """
    if not host_store.pages_in_segment:
        raise ValueError(f"write_back into {host_store.name!r}: not a shared-memory store")
    return stage_pages(
        device_store, device_pages, expected_generations, host_store, host_pages, digests, staging
    )


def load_back(
    host_store: SharedPageStore,
    host_pages: Sequence[int],
    expected_generations: Sequence[int],
    device_store: SharedPageStore,
    device_pages: Sequence[int],
    digests: Sequence[bytes] | None = None,
    staging: torch.Tensor | None = None,
) -> ValidatedCopy:
    """Copy pages up from a host store into a device store (`stage_pages`).

    Raises:
        ValueError: what `stage_pages` raises, or a host store whose pages are not in
            shared memory.
        NotOwnerError: the device store is attached.
    """
    if not host_store.pages_in_segment:
        raise ValueError(f"load_back from {host_store.name!r}: not a shared-memory store")
    return stage_pages(
        host_store, host_pages, expected_generations, device_store, device_pages, digests, staging
    )
