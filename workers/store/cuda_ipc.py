"""Everything the page store does with CUDA: device pages, IPC handles, copies on streams.

A store on a CUDA device keeps its pages in one device tensor `(num_pages, *page_shape)`;
its generations and digests stay in host shared memory (`workers.store.segment`), so a
peer checks them without the GPU. The owner exports the tensor's allocation once as a
`CudaIpcHandle` of plain fields (bytes, ints, a bool: what msgpack carries, never pickled);
a peer on the same node opens it once and reads the pages with `gather` on a stream of its
own, between the generation reads of `workers.store.validated_copy`.

This module is imported only when a store's pages are on a CUDA device (or a copy touches
one): the CPU path never loads it.

What CUDA IPC cannot do, and then `CudaIpcError` is raised and the caller falls back to
the host tier (one log line):
- allocations from expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments`,
  VMM memory): torch exports them through file descriptors that another process may not
  be allowed to take (no ptrace/pidfd rights, as in many containers);
- processes that do not share /dev/shm: each open increments a reference counter that
  torch keeps in a shared-memory file named by the handle;
- a peer in the same process as the owner (the driver refuses to open one's own handle),
  or on another node.

An exported handle names the whole allocation the caching allocator took from the driver,
which may be larger than the pages: a peer can read it all. Peers are the same user's
workers on the same node, which could read the owner's memory anyway.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from workers.store.layout import CudaIpcError, PageStoreError, StoreLayout

# One copy stream per device and process: a peer's copies do not queue behind its model's
# kernels on the default stream, nor those kernels behind its copies.
_COPY_STREAMS: dict[int, torch.cuda.Stream] = {}


class CudaIpcHandle(NamedTuple):
    """What a peer needs to open a store's device pages, as plain fields.

    The fields are those of torch's `UntypedStorage._share_cuda_()`: the allocation's IPC
    handle, where the pages' storage sits in it, torch's shared reference counter that
    keeps the allocation alive while peers hold it open, and an event the opener waits on
    so that it sees the owner's writes up to the export.
    """

    device_index: int
    handle: bytes  # cudaIpcMemHandle of the allocation holding the pages
    storage_size_bytes: int  # num_pages * page_bytes
    storage_offset_bytes: int  # where the pages start in that allocation
    ref_counter_handle: bytes  # name of torch's shared-memory counter file
    ref_counter_offset: int
    event_handle: bytes  # cudaIpcEventHandle recorded at export
    event_sync_required: bool

    def to_fields(self) -> dict[str, Any]:
        """The handle as a dict of bytes, ints and a bool (what msgpack carries)."""
        return self._asdict()

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> CudaIpcHandle:
        """Rebuild a handle from `to_fields`, checking every field's type.

        Raises:
            CudaIpcError: a missing, unknown or mistyped field.
        """
        if set(fields) != set(cls._fields):
            raise CudaIpcError(
                f"CUDA IPC handle fields {sorted(fields)}, expected {sorted(cls._fields)}"
            )
        for name, kind in zip(cls._fields, _FIELD_TYPES, strict=True):
            value = fields[name]
            ok = isinstance(value, kind)
            if not ok or (kind is int and (isinstance(value, bool) or value < 0)):
                raise CudaIpcError(
                    f"CUDA IPC handle field {name}: {value!r} is not a {kind.__name__}"
                )
        return cls(**fields)


_FIELD_TYPES = (int, bytes, int, int, bytes, int, bytes, bool)  # CudaIpcHandle's, in order


def allocate_pages(layout: StoreLayout, device: torch.device) -> torch.Tensor:
    """A zeroed `(num_pages, *page_shape)` tensor of the layout's dtype on a CUDA device.

    Raises:
        PageStoreError: no CUDA device here, or not enough device memory.
    """
    if not torch.cuda.is_available():
        raise PageStoreError(f"page store on {device}: no CUDA device on this machine")
    try:
        return torch.zeros(
            (layout.num_pages, *layout.page_shape), dtype=layout.torch_dtype, device=device
        )
    except (RuntimeError, AssertionError) as e:  # out of memory, a bad index
        raise PageStoreError(
            f"cannot allocate {layout.num_pages} pages of {layout.page_bytes} bytes on "
            f"{device}: {e}"
        ) from None


def export_pages(pages: torch.Tensor) -> CudaIpcHandle:
    """Export a store's device pages for its peers. Call once per store: each call makes
    torch set up another reference counter.

    Args:
        pages: the store's `(num_pages, *page_shape)` CUDA tensor, a whole allocation.

    Returns:
        The handle, as plain fields.

    Raises:
        CudaIpcError: the driver or torch refuses (expandable segments, no IPC support).
    """
    assert pages.device.type == "cuda" and pages.storage_offset() == 0 and pages.is_contiguous()
    try:
        fields = pages.untyped_storage()._share_cuda_()
    except (RuntimeError, TypeError) as e:
        raise CudaIpcError(f"cannot export {pages.device} pages as a CUDA IPC handle: {e}") from e
    device, handle, size, offset, counter, counter_offset, event, event_sync = fields
    return CudaIpcHandle(
        int(device),
        bytes(handle),
        int(size),
        int(offset),
        bytes(counter),
        int(counter_offset),
        bytes(event or b""),
        bool(event_sync),
    )


def open_pages(handle: CudaIpcHandle, layout: StoreLayout) -> torch.Tensor:
    """Open a peer's exported pages in this process (once per peer store).

    Args:
        handle: the owner's `export_pages`.
        layout: the owner's layout, from its segment's header.

    Returns:
        `(num_pages, *page_shape)` on the owner's device, aliasing its memory. Dropping the
        last reference closes the mapping and releases torch's counter.

    Raises:
        CudaIpcError: no CUDA here, a handle whose size does not match the layout, or the
            driver refuses to open it (same process, another node, no shared /dev/shm).
    """
    need = layout.num_pages * layout.page_bytes
    if handle.storage_size_bytes != need:
        raise CudaIpcError(
            f"CUDA IPC handle of {handle.storage_size_bytes} bytes for a layout of "
            f"{layout.num_pages} pages x {layout.page_bytes} bytes = {need}"
        )
    if not torch.cuda.is_available():
        raise CudaIpcError("cannot open a CUDA IPC handle: no CUDA device on this machine")
    if handle.device_index >= torch.cuda.device_count():
        raise CudaIpcError(
            f"CUDA IPC handle on device {handle.device_index}, this process sees "
            f"{torch.cuda.device_count()} devices"
        )
    torch.cuda._lazy_init()
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            handle.device_index,
            handle.handle,
            handle.storage_size_bytes,
            handle.storage_offset_bytes,
            handle.ref_counter_handle,
            handle.ref_counter_offset,
            handle.event_handle,
            handle.event_sync_required,
        )
    except (RuntimeError, TypeError) as e:
        raise CudaIpcError(f"cannot open CUDA IPC handle on cuda:{handle.device_index}: {e}") from e
    device = torch.device("cuda", handle.device_index)
    empty = torch.empty(0, dtype=layout.torch_dtype, device=device)
    return empty.set_(storage, 0, (layout.num_pages, *layout.page_shape))


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """This process's copy stream on `device`, made on first use."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COPY_STREAMS:
        _COPY_STREAMS[index] = torch.cuda.Stream(device=index)
    return _COPY_STREAMS[index]


def gather(pages: torch.Tensor, rows: np.ndarray, out: torch.Tensor) -> None:
    """`out[i] = pages[rows[i]]` on the copy stream, returning once every byte has landed.

    Scattered pages are gathered by one kernel (a copy per page would cost a launch each,
    far more than moving a page); into a CPU `out` (pinned, for the copy to be
    asynchronous and fast) they are gathered on the device first and cross the bus in one
    bulk copy.

    Args:
        pages: `(num_pages, *page_shape)` on a CUDA device (the caller's or a peer's).
        rows: `(n,)` int64 page ids, each in range.
        out: `(n, *page_shape)` of the pages' dtype, on the pages' device or the CPU.
    """
    assert pages.device.type == "cuda" and out.device in (pages.device, torch.device("cpu"))
    stream = copy_stream(pages.device)
    # Work queued on `out` (or on pages this process wrote) by the current stream first.
    stream.wait_stream(torch.cuda.current_stream(pages.device))
    with torch.cuda.stream(stream):
        index = torch.from_numpy(rows).to(pages.device)
        if out.device == pages.device:
            torch.index_select(_words(pages), 0, index, out=_words(out))
        else:
            # Made and freed on this stream: the allocator reuses it only after the copy.
            out.copy_(pages.index_select(0, index), non_blocking=True)
    stream.synchronize()


def scatter(pages: torch.Tensor, rows: np.ndarray, kv: torch.Tensor) -> None:
    """`pages[rows[i]] = kv[i]` on the current stream, returning once it has landed (an
    owner's write is final when it returns: only then may a generation be advertised).

    Args:
        pages: `(num_pages, *page_shape)` on a CUDA device.
        rows: `(n,)` int64 distinct page ids, each in range.
        kv: `(n, *page_shape)` of the pages' dtype, on that device or the CPU (pinned).
    """
    assert pages.device.type == "cuda"
    with torch.cuda.device(pages.device):
        index = torch.from_numpy(rows).to(pages.device)
        _words(pages).index_copy_(0, index, _words(kv.to(pages.device, non_blocking=True)))
        torch.cuda.current_stream().synchronize()


def _words(pages: torch.Tensor) -> torch.Tensor:
    """`(n, *page_shape)` as `(n, page_bytes / 8)` int64 where the page's size allows: the
    index kernels move elements, and wider ones move the same bytes several times faster."""
    flat = pages.view(len(pages), -1)
    if flat.shape[1] * flat.element_size() % 8:
        return flat
    return flat.view(torch.int64)


def synchronize(device: torch.device) -> None:
    """Wait for every stream's work on `device` (the model's writes before a publish)."""
    torch.cuda.synchronize(device)


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host tensor, for bulk copies to and from a device."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)
