"""Where a page store's pages are placed, and how a peer opens them.

On the CPU the pages live by default in the store's shared-memory segment, and a peer
maps them with it by name. On a device (a GPU worker's top tier) they live in one device
tensor and the segment holds only the generations and digests, so peers still check them
without the device; a peer on the same node opens the pages through CUDA IPC (`cuda_ipc`,
loaded only for a CUDA store), with the handle the owner exported once at creation and
left in its segment's header as plain fields (msgpack; it never leaves the node). The
same metadata-only layout can be asked for on the CPU (`pages_in_segment=False`), which is
how the device path is tested on machines without a GPU.

`SharedPageStore.create` and `attach` place and open pages here; the store itself only
reads and writes them wherever they are.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

import torch

from workers.store.layout import CudaIpcError, StoreLayout
from workers.store.segment import PLACEMENT_DEVICE, PLACEMENT_SEGMENT, Segment

if TYPE_CHECKING:
    from workers.store.cuda_ipc import CudaIpcHandle

log = logging.getLogger(__name__)


class Placement(NamedTuple):
    """A store's segment and, when they are not in it, its pages."""

    segment: Segment
    # (num_pages, *page_shape); None where the segment's views map the pages, or for a
    # reader of a device store given no pages: it reads metadata only.
    pages: torch.Tensor | None
    handle: CudaIpcHandle | None = None  # the owner's export of CUDA pages, if it worked


def place(
    layout: StoreLayout, tag: str | None, device: str | torch.device, pages_in_segment: bool | None
) -> Placement:
    """Create an owner's segment, and its pages where they do not live in it.

    `SharedPageStore.create` documents the arguments and what is raised.
    """
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"page store on {device}: the device must be cpu or cuda")
    if pages_in_segment is None:
        pages_in_segment = device.type == "cpu"
    if pages_in_segment:
        if device.type != "cpu":
            raise ValueError(f"pages on {device} cannot live in a shared-memory segment")
        return Placement(Segment.create(layout, tag), None)
    # The pages first: a device that cannot hold them leaves no segment behind.
    if device.type == "cuda":
        from workers.store import cuda_ipc

        pages = cuda_ipc.allocate_pages(layout, device)
    else:
        pages = torch.zeros((layout.num_pages, *layout.page_shape), dtype=layout.torch_dtype)
    segment = Segment.create(layout, tag, PLACEMENT_DEVICE)
    handle = leave_handle(segment, pages) if device.type == "cuda" else None
    return Placement(segment, pages, handle)


def leave_handle(segment: Segment, pages: torch.Tensor) -> CudaIpcHandle | None:
    """Export CUDA `pages` once and leave the handle in `segment` for same-node peers; None
    (with one log line: peers then read the pages through the owner's page server) when
    CUDA refuses (expandable segments, no IPC on this platform)."""
    import msgpack

    from workers.store import cuda_ipc

    try:
        handle = cuda_ipc.export_pages(pages)
    except CudaIpcError as e:
        log.warning(
            "store %s: no CUDA IPC handle for same-node peers (%s); they read its pages "
            "through its page server",
            segment.name,
            e,
        )
        return None
    segment.set_peer_handle(msgpack.packb(handle.to_fields()))
    return handle


def open_peer(name: str) -> Placement:
    """Attach a same-node peer's segment with its pages readable: mapped with it, or (a
    device store) opened through the handle its owner left there.

    `SharedPageStore.open_peer` documents what is raised.
    """
    segment = Segment.attach(name)
    if segment.placement == PLACEMENT_SEGMENT:
        return Placement(segment, None)
    try:
        data = segment.peer_handle()
        if data is None:
            raise CudaIpcError(
                f"store {name!r} keeps its pages outside shared memory and left no CUDA IPC "
                "handle (its pages are not on a CUDA device, or CUDA refused to export them)"
            )
        import msgpack

        from workers.store import cuda_ipc

        try:
            fields = msgpack.unpackb(data)
        except (ValueError, msgpack.UnpackException) as e:
            raise CudaIpcError(f"store {name!r}: its IPC handle does not decode: {e}") from None
        if not isinstance(fields, dict):
            raise CudaIpcError(f"store {name!r}: its CUDA IPC handle is not a map")
        pages = cuda_ipc.open_pages(cuda_ipc.CudaIpcHandle.from_fields(fields), segment.layout)
        check_pages_tensor(segment.layout, pages)
    except BaseException:
        segment.close()
        raise
    return Placement(segment, pages)


def open_placed(name: str, pages: torch.Tensor | CudaIpcHandle | None) -> Placement:
    """Attach a peer's segment and open its pages as given; the segment is closed again
    if they cannot be opened.

    `SharedPageStore.attach` documents the arguments and what is raised.
    """
    segment = Segment.attach(name)
    try:
        if pages is not None:
            if segment.placement == PLACEMENT_SEGMENT:
                raise ValueError(f"segment {name!r} holds its own pages: attach it bare")
            if not isinstance(pages, torch.Tensor):
                from workers.store import cuda_ipc

                pages = cuda_ipc.open_pages(pages, segment.layout)
            check_pages_tensor(segment.layout, pages)
    except BaseException:
        segment.close()
        raise
    return Placement(segment, pages)


def export_handle(name: str, pages: torch.Tensor) -> CudaIpcHandle:
    """Export store `name`'s pages for same-node peers (`SharedPageStore.export_pages`).

    Raises:
        CudaIpcError: the pages are not on a CUDA device, or CUDA refuses to export them.
    """
    if pages.device.type != "cuda":
        raise CudaIpcError(
            f"store {name!r} keeps its pages on {pages.device}: only CUDA pages "
            "are shared through CUDA IPC"
        )
    from workers.store import cuda_ipc

    return cuda_ipc.export_pages(pages)


def settle(pages: torch.Tensor | None) -> None:
    """Wait until writes queued to `pages` have landed (nothing to wait for off CUDA)."""
    # An owner's write to device pages is queued, not done, when the call returns; it
    # must have landed before a generation or digest vouches for the bytes.
    if pages is not None and pages.device.type == "cuda":
        from workers.store import cuda_ipc

        cuda_ipc.synchronize(pages.device)


def check_pages_tensor(layout: StoreLayout, pages: torch.Tensor) -> None:
    """Raise ValueError unless `pages` is `(num_pages, *page_shape)` of the layout's dtype,
    contiguous."""
    shape = (layout.num_pages, *layout.page_shape)
    if tuple(pages.shape) != shape or pages.dtype != layout.torch_dtype:
        raise ValueError(
            f"pages must be {shape} {layout.torch_dtype}, got {tuple(pages.shape)} {pages.dtype}"
        )
    if not pages.is_contiguous():
        raise ValueError(f"pages of shape {shape} must be contiguous")
