"""The shape of a page store (`StoreLayout`) and the store's exceptions.

A layout is all a peer needs to read another worker's pages: the segment's header records
one (`workers.store.segment`), and the page digests name its `kv_format`, so pages of
another shape or dtype never match.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Codes are part of the segment format: never renumber, only append.
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
# Bytes per element, so a layout's sizes are known without torch (a config is checked, and
# a store planned, by processes that never load a model).
_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class PageStoreError(RuntimeError):
    """A page store or its segment cannot be used as asked."""


class SegmentNotFoundError(PageStoreError, FileNotFoundError):
    """No segment of that name exists (never created, or already unlinked)."""


class SegmentFormatError(PageStoreError):
    """The segment exists but its header is not one this version can read."""


class NotOwnerError(PageStoreError):
    """An attached (reader) store was asked to change pages; only the owner may."""


class CudaIpcError(PageStoreError):
    """A store's device pages cannot be exported to, or opened by, a peer through CUDA
    IPC (`workers.store.cuda_ipc`); the caller reads them through the host tier instead."""


@dataclass(frozen=True)
class StoreLayout:
    """Shape of a page store.

    The tensor is `# (num_pages, num_layers, 2 [k,v], num_kv_heads, page_tokens, head_dim)`:
    one page holds the K and V of `page_tokens` consecutive tokens for every layer and KV
    head, so copying a prefix between stores is one contiguous copy per page.
    """

    num_pages: int
    num_layers: int
    num_kv_heads: int
    page_tokens: int
    head_dim: int
    dtype: str = "float32"  # the model's KV dtype; float32 is what the CPU runner produces

    def __post_init__(self) -> None:
        for field in ("num_pages", "num_layers", "num_kv_heads", "page_tokens", "head_dim"):
            value = getattr(self, field)
            # bool is an int subclass; True pages is a caller bug, not one page.
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"StoreLayout.{field} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_CODES:
            raise ValueError(
                f"StoreLayout.dtype must be one of {sorted(DTYPE_CODES)}, got {self.dtype!r}"
            )

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """`(num_layers, 2 [k,v], num_kv_heads, page_tokens, head_dim)`."""
        return (self.num_layers, 2, self.num_kv_heads, self.page_tokens, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here, not above: see _ITEM_BYTES

        return getattr(torch, self.dtype)

    @property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape) * _ITEM_BYTES[self.dtype]

    @property
    def kv_format(self) -> str:
        """What a page's bytes mean, as a stable string; it enters every page digest, so
        pages of another shape or dtype never match. The page count is left out: it
        changes the store, not what a page holds."""
        return (
            f"kv1:layers={self.num_layers}:kv_heads={self.num_kv_heads}:"
            f"head_dim={self.head_dim}:page_tokens={self.page_tokens}:dtype={self.dtype}"
        )
