"""Moving pages between vLLM's blocks, on whatever device holds them, and the host buffers
an engine's page store reads and writes (`KVCopier`).

On the CPU the blocks are gathered into, and scattered from, a host staging buffer
directly. On CUDA the copies run on the device (block indexes built there) and cross to
the host through a pinned staging buffer:

    save  (after the forward)   gather on the forward's stream -> pinned host, waited on
    load  (before the forward)  pinned host -> device pages -> scatter, on a load stream

Loads are waited on whole, before the forward, not per layer: a page holds every layer,
so no layer's blocks are complete before the one host-to-device copy of all the pages is,
and per-layer waits would buy nothing. `loads_done` makes the forward's stream wait for
the load stream on the GPU (the host does not block); vLLM's `wait_for_layer_load` then
has nothing left to wait for. Everything CUDA-only is `_CudaSide`, behind the one check
in `KVCopier.__init__`, so the CPU path is the one every test runs.

This module imports only torch: the GPU checks run it on machines without vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engines.blocks import blocks_to_pages, pages_to_blocks, tensor_block_ids
from workers.engines.kv_layouts import LayerKV


class KVCopier:
    """Pages in and out of vLLM's blocks for one engine.

    Args:
        device: where vLLM's caches live.
        page_shape: a page's `(num_layers, 2, kv_heads, page_tokens, head_dim)`.
        dtype: the caches' dtype.
        block_size: vLLM's tokens per block (its caches may hold kernel blocks of fewer).
    """

    def __init__(
        self,
        device: torch.device | str,
        page_shape: Sequence[int],
        dtype: torch.dtype,
        block_size: int,
    ):
        self.device = torch.device(device)
        self.page_shape, self.dtype = tuple(page_shape), dtype
        self.block_size = block_size
        self.pages_per_block = block_size // self.page_shape[3]
        self._staging: torch.Tensor | None = None  # see `host_pages`
        # The one check: CUDA-only code lives in _CudaSide.
        self._cuda = _CudaSide(self.device) if self.device.type == "cuda" else None

    def host_pages(self, pages: int) -> torch.Tensor:
        """A host buffer of `pages` pages for the store to read into (pinned when the
        caches are on CUDA). Kept across calls (grown in whole blocks): a fresh tensor of
        a load's size (23 MB for 1,024 SmolLM2 tokens) costs more in first-touch page
        faults than the copies themselves, and a load is on the request's time to first
        token. A load still copying out of it is waited for first."""
        if self._cuda is not None:
            self._cuda.host_free()
        if self._staging is None or self._staging.shape[0] < pages:
            k = self.pages_per_block
            size = -(-pages // k) * k
            self._staging = None
            pin = self._cuda is not None
            shape = (size, *self.page_shape)
            self._staging = torch.zeros(shape, dtype=self.dtype, pin_memory=pin)
        return self._staging[:pages]

    def gather(self, layers: Sequence[LayerKV], block_ids: Sequence[int]) -> torch.Tensor:
        """vLLM's blocks `block_ids` as pages in a host buffer (`host_pages`'s), in token
        order; complete when this returns."""
        ids, page_tokens = self._tensor_ids(layers, block_ids), self.page_shape[3]
        pages = len(block_ids) * self.pages_per_block
        if self._cuda is None:
            return blocks_to_pages(layers, ids, page_tokens, self.host_pages(pages))
        on_device = blocks_to_pages(layers, ids, page_tokens)
        return self._cuda.to_host(on_device, self.host_pages(pages))

    def scatter(
        self, pages: torch.Tensor, layers: Sequence[LayerKV], block_ids: Sequence[int]
    ) -> None:
        """Copy host pages (in token order) into vLLM's blocks `block_ids`. On CUDA the
        copy is queued on the load stream: `loads_done` before the forward."""
        ids = self._tensor_ids(layers, block_ids)
        if self._cuda is None:
            pages_to_blocks(pages, layers, ids)
        else:
            self._cuda.scatter(pages, layers, ids)

    def loads_done(self) -> None:
        """Make the forward wait for every queued load (on CUDA, on the GPU: the host does
        not block); nothing to do on the CPU, where loads complete in `scatter`."""
        if self._cuda is not None:
            self._cuda.loads_done()

    def _tensor_ids(self, layers: Sequence[LayerKV], block_ids: Sequence[int]) -> list[int]:
        return tensor_block_ids(block_ids, self.block_size, layers[0].k.shape[2])


class _CudaSide:
    """The CUDA-only part of a `KVCopier`: its load stream and the event that says when
    the pinned staging buffer may be written again."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._reading_host: torch.cuda.Event | None = None  # the last load's host copy

    def host_free(self) -> None:
        """Wait until no queued load still reads the pinned staging buffer."""
        if self._reading_host is not None:
            self._reading_host.synchronize()
            self._reading_host = None

    def to_host(self, on_device: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Copy gathered pages to the pinned host buffer, on the forward's stream (after
        the forward that wrote the blocks), and wait for it."""
        host.copy_(on_device, non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return host

    def scatter(self, host: torch.Tensor, layers: Sequence[LayerKV], ids: list[int]) -> None:
        """Queue pinned host pages -> device -> blocks on the load stream. It first waits
        for the forward's stream: vLLM may hand a block freed by a request whose last
        forward is still reading it."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            on_device = host.to(self.device, non_blocking=True)
            pages_to_blocks(on_device, layers, ids)
            self._reading_host = torch.cuda.Event()
            self._reading_host.record(self.stream)
        # `on_device` was allocated on the load stream and used only there: the caching
        # allocator reuses it only after that stream's queued work.

    def loads_done(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
