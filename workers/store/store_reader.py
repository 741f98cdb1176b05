"""The read side of a page store: what its owner and every attached reader may do.

`StoreReader` is the base of `SharedPageStore` (`workers.store.page_store`), which adds
creating and attaching, the owner's writes and the store's lifetime. Here: the store's
mapping (its segment, its generations and digests, its pages wherever `placement` put
them), the reads of pages, generations and digests, the validated copy out of them
(`validated_copy`), and the checks of page ids and copy buffers that reads and bulk writes
share.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from workers.store.layout import PageStoreError, StoreLayout
from workers.store.page_pool import digest_rows, generation_rows
from workers.store.segment import PLACEMENT_SEGMENT, Segment
from workers.store.validated_copy import ValidatedCopy, copy_validated, expected_digests


class StoreReader:
    """An open mapping of a page store, and the reads owner and readers alike may make.

    Not built on its own: `SharedPageStore.create` and `attach` build the whole store.
    """

    def __init__(self, segment: Segment, pages: torch.Tensor | None = None):
        self._segment = segment
        self._layout = segment.layout
        self._is_owner = segment.is_owner
        self._closed = False
        views = segment.views()
        self._generations: np.ndarray | None = views.generations
        self._digests: np.ndarray | None = views.digests
        # In the segment, or (PLACEMENT_DEVICE) a tensor of their own; None for a reader
        # of a device store that was given no pages: it reads metadata only.
        self._pages: torch.Tensor | None = views.pages if pages is None else pages

    # -- properties --------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def layout(self) -> StoreLayout:
        return self._layout

    @property
    def is_owner(self) -> bool:
        return self._is_owner

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def device(self) -> torch.device | None:
        """Where the pages are; None for a reader of a device store given no pages."""
        return None if self._pages is None else self._pages.device

    @property
    def pages_in_segment(self) -> bool:
        """Whether peers map the pages with the segment (else they live on `device`)."""
        return self._segment.placement == PLACEMENT_SEGMENT

    @property
    def kv_format(self) -> str:
        """Its layout's `kv_format`: what the page bytes mean, a root of every digest."""
        return self._layout.kv_format

    @property
    def num_pages(self) -> int:
        return self._layout.num_pages

    # -- generations and digests -------------------------------------------------------

    def generation(self, page: int) -> int:
        """The page's generation; it changes whenever the owner frees or rewrites the page.

        Raises:
            ValueError: `page` is out of range.
        """
        self._check_page(page)
        return int(self._live_generations()[page])

    def generations(self, page_ids: Sequence[int]) -> list[int]:
        """The generations of some pages, in order.

        Raises:
            ValueError: a page is out of range.
        """
        return generation_rows(self._live_generations(), page_ids, self.num_pages)

    def digests(self, page_ids: Sequence[int]) -> list[bytes]:
        """The recorded digests of some pages, in order; `EMPTY_DIGEST` where none is.

        Raises:
            ValueError: a page is out of range.
        """
        return digest_rows(self._live_digests(), page_ids, self.num_pages)

    # -- page access -------------------------------------------------------------------

    def page(self, page: int) -> torch.Tensor:
        """A view of one page, `(num_layers, 2 [k,v], num_kv_heads, page_tokens, head_dim)`.

        The view aliases shared memory: the owner may free and reuse the page at any time,
        so a reader copies with `copy_pages_validated` rather than trusting a view. On an
        attached store the memory is read-only and a write through the view faults.

        Raises:
            ValueError: `page` is out of range.
        """
        self._check_page(page)
        return self._live_pages()[page]

    def page_buffer(self, page: int) -> memoryview:
        """One page's bytes in shared memory, as a flat byte view (whatever the store's
        dtype: numpy, which page transfers go through, has no bfloat16). Aliases shared
        memory as `page` does.

        Raises:
            ValueError: `page` is out of range.
            PageStoreError: the pages are on a device (stage them to the host tier first).
        """
        if self.device is not None and self.device.type != "cpu":
            raise PageStoreError(f"page_buffer of {self.name!r}: its pages are on {self.device}")
        return memoryview(self.page(page).view(torch.uint8).numpy()).cast("B")

    def page_range(self, start: int, stop: int) -> torch.Tensor:
        """A view of pages [start, stop), `(stop - start, *page_shape)`, contiguous.

        Lets a copy land straight in a run of consecutive pages (one memcpy, no staging).

        Raises:
            ValueError: the range is empty or out of bounds.
        """
        if not 0 <= start < stop <= self.num_pages:
            raise ValueError(f"page range [{start}, {stop}) not in [0, {self.num_pages})")
        return self._live_pages()[start:stop]

    def read_pages(self, page_ids: Sequence[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """Gather a copy of some pages, without any validation (see `copy_pages_validated`).

        Args:
            page_ids: page ids, in the order wanted.
            out: optional tensor `(len(page_ids), *page_shape)` of the store's dtype, on
                its device, to copy into.

        Returns:
            `(len(page_ids), num_layers, 2, num_kv_heads, page_tokens, head_dim)`: `out`
            when given, else a new tensor.

        Raises:
            ValueError: a page out of range, or `out` of the wrong shape, dtype or device.
        """
        pages = self._live_pages()
        index = self._index(page_ids).to(pages.device)
        if out is None:
            return pages.index_select(0, index)
        self._check_out(out, len(index), "out", (pages.device,))
        return torch.index_select(pages, 0, index, out=out)

    def copy_pages_validated(
        self,
        page_ids: Sequence[int],
        expected_generations: Sequence[int],
        out: torch.Tensor,
        digests: Sequence[bytes] | None = None,
    ) -> ValidatedCopy:
        """Copy pages into `out` and report which copies can be trusted.

        The copy takes no lock: each page's generation is read before and after it, and
        with `digests` each page's digest too; a page is valid only if they are what the
        caller expects. `workers.store.validated_copy` explains the order of the reads.

        Args:
            page_ids: pages to copy.
            expected_generations: one expected generation per page.
            out: `(len(page_ids), *page_shape)` of the store's dtype, on the store's device
                or (from a CUDA store) the CPU, pinned; rows whose page is invalid hold
                garbage and must be recomputed.
            digests: None, or one expected `DIGEST_BYTES` digest per page (the requester's
                own, from `workers.store.digests.page_digests` over its prompt).

        Returns:
            `ValidatedCopy(valid)`, one bool per page.

        Raises:
            ValueError: mismatched lengths, a digest not 16 bytes, a page out of range, or
                a bad `out`.
        """
        index = self._index(page_ids)
        if len(expected_generations) != len(index):
            raise ValueError(
                f"{len(expected_generations)} expected generations for {len(index)} pages"
            )
        pages = self._live_pages()
        self._check_out(out, len(index))
        wanted = None if digests is None else expected_digests(digests, len(index))
        return copy_validated(
            pages,
            self._live_generations(),
            self._live_digests(),
            index.numpy(),
            np.asarray(expected_generations, dtype=np.int64),
            out,
            wanted,
        )

    # -- helpers -----------------------------------------------------------------------

    def _require_open(self) -> None:
        if self._closed:
            raise PageStoreError(f"page store {self.name!r} is closed")

    def _live_pages(self) -> torch.Tensor:
        self._require_open()
        if self._pages is None:
            raise PageStoreError(
                f"reader of store {self.name!r} has no pages: its owner keeps them on a "
                "device; attach with the owner's export_pages() handle to read them"
            )
        return self._pages

    def _live_generations(self) -> np.ndarray:
        self._require_open()
        assert self._generations is not None
        return self._generations

    def _live_digests(self) -> np.ndarray:
        self._require_open()
        assert self._digests is not None
        return self._digests

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self._layout.num_pages:
            raise ValueError(f"page {page} out of range [0, {self._layout.num_pages})")

    def _index(self, page_ids: Sequence[int]) -> torch.Tensor:
        index = torch.as_tensor(page_ids, dtype=torch.int64).reshape(-1)
        if len(index) and not (int(index.min()) >= 0 and int(index.max()) < self.num_pages):
            bad = [p for p in index.tolist() if not 0 <= p < self.num_pages]
            raise ValueError(f"pages {bad} out of range [0, {self.num_pages})")
        return index

    def _check_out(
        self,
        out: torch.Tensor,
        n: int,
        what: str = "out",
        devices: tuple[torch.device, ...] | None = None,
    ) -> None:
        # By default the store's device or the CPU: a bulk copy across the bus.
        shape = (n, *self._layout.page_shape)
        if tuple(out.shape) != shape or out.dtype != self._layout.torch_dtype:
            raise ValueError(
                f"{what} must be {shape} {self._layout.torch_dtype}, "
                f"got {tuple(out.shape)} {out.dtype}"
            )
        devices = devices or tuple({self._live_pages().device, torch.device("cpu")})
        if out.device not in devices:
            places = " or ".join(sorted(map(str, devices)))
            raise ValueError(f"{what} must be on {places}, got {out.device}")
