"""A member's own tiers, opened together: the store its prefix cache keeps pages in, and
the tier of records below it.

    CPU worker   host shared memory (the page store)  ->  local disk, if configured
    GPU worker   device memory (the page store)        ->  host shared memory
                                                        ->  local disk, if configured

On a GPU worker the host store is the tier below (`workers.host_link`): its pages are in
shared memory as a CPU worker's are, and the device store keeps its generations and
digests in a shared-memory segment of its own. Peers read a device store's pages through
its page server, on its node too (it names no shared-memory segment of pages to them).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from cache_service.messages import HolderSpan, TierFigures
from workers.cache.device_settings import DeviceSettings
from workers.cache.disk_settings import DiskSettings
from workers.disk_link import open_disk
from workers.host_link import HostLink
from workers.service.figures import TierCounters
from workers.store.host_tier import HostTier
from workers.store.layout import StoreLayout
from workers.store.page_store import SharedPageStore
from workers.store.segment_names import worker_tag
from workers.tier_link import TierLink

log = logging.getLogger(__name__)


class OwnTiers(NamedTuple):
    """A member's tiers, top down."""

    store: SharedPageStore  # the prefix cache's pages: device memory, or host shared memory
    host: SharedPageStore | None  # host shared memory under a device store (None: none)
    below: TierLink | None  # the tier of records under `store` (None: none)
    # What went through a device store (its figures in heartbeats); unused on the CPU.
    device_counters: TierCounters

    @property
    def store_tier(self) -> str:
        """The tier of the store's own pages, in events and reports."""
        return "host" if self.host is None else "device"

    def chain(self) -> list[TierLink]:
        """The tiers of records under the store, top down."""
        return [] if self.below is None else self.below.chain()

    @property
    def capacity(self) -> int:
        """Pages in all of them together: what the member may hold in the index."""
        return self.store.num_pages + sum(tier.capacity for tier in self.chain())

    def continuing(
        self, digests: Sequence[bytes], first: int
    ) -> list[tuple[HolderSpan, TierLink, int]]:
        """The tiers below that continue a prompt from page `first` (`digests`: its page
        digests), each where the one above stops: (its span, the tier, its first page)."""
        found, reach = [], first
        for tier in self.chain():
            span = tier.span(digests, reach)
            if span is not None:
                found.append((span, tier, reach))
                reach = len(span.page_ids)
        return found

    def figures(self, cache_stats: Mapping[str, Any]) -> list[TierFigures]:
        """Each tier's figures for a heartbeat, top down: a device store's own first (the
        prefix cache's page counts, `cache_stats`)."""
        figures = [tier.figures() for tier in self.chain()]
        if self.host is not None:
            held = cache_stats["cached_pages"] + cache_stats["in_use_pages"]
            total = cache_stats["total_pages"]
            figures.insert(0, self.device_counters.figures("device", held, total))
        return figures

    def check_integrity(self) -> None:
        if self.below is not None:
            self.below.check_integrity()
        if self.host is not None:
            self.host.check_integrity()


def device_of(settings: DeviceSettings | None) -> torch.device | None:
    """The device a device tier goes on here, or None for none (the host store is then
    the page store).

    Raises:
        ValueError: a CUDA device asked for where torch sees none.
    """
    if settings is None:
        return None
    if settings.device == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else None
    if settings.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"store.device {settings.device!r}: torch sees no CUDA device here")
    return torch.device(settings.device)


def open_tiers(
    worker_id: str,
    layout: StoreLayout,
    device: DeviceSettings | None,
    disk: DiskSettings | None,
    secret: bytes,
) -> OwnTiers:
    """Create a member's stores and the tier below its page store.

    Args:
        worker_id: whose tiers (names its segments and its disk directory).
        layout: the host store's layout (its `num_pages`: the host tier's size).
        device: its device tier (None, or "auto" without a GPU: none).
        disk: its disk tier under host memory (None: none); write-back only under a
            device tier.
        secret: the mesh secret (the disk's records are made under it).

    Returns:
        The tiers; the caller closes them (`close_tiers`).

    Raises:
        ValueError: a write-through disk under a device tier, or a CUDA device where
            there is none; nothing is left open then.
        Whatever creating a store raises; nothing is left open then.
    """
    where = device_of(device)
    tag = worker_tag(worker_id)
    if where is None:
        store = SharedPageStore.create(layout, tag=tag)
        try:
            below = None if disk is None else open_disk(disk, secret, worker_id, layout, store)
        except BaseException:
            store.close()
            raise
        return OwnTiers(store, None, below, TierCounters())
    if disk is not None and disk.policy != "write_back":
        raise ValueError(
            f"a {disk.policy} disk under a device tier: pages reach the disk from host "
            "memory when it evicts them (write_back)"
        )
    assert device is not None
    host = SharedPageStore.create(layout, tag=tag)
    try:
        top = replace(layout, num_pages=device.pages)
        store = SharedPageStore.create(
            top, tag=f"{tag[:30]}_d", device=where, pages_in_segment=False
        )
    except BaseException:
        host.close()
        raise
    lowest = None
    try:
        if disk is not None:  # its ids after the device's and host memory's
            lowest = open_disk(disk, secret, worker_id, layout, host, device.pages + host.num_pages)
        below = HostLink(HostTier(store, host), f"{worker_id}/host", lowest)
    except BaseException:
        if lowest is not None:
            lowest.close()
        store.close()
        host.close()
        raise
    log.info(
        "%s keeps %d pages on %s above %d pages of host memory%s",
        worker_id,
        device.pages,
        where,
        layout.num_pages,
        "" if lowest is None else f" and {lowest.capacity} on disk",
    )
    return OwnTiers(store, host, below, TierCounters())


def close_tiers(tiers: OwnTiers) -> None:
    """Close a member's tiers, top down."""
    tiers.store.close()
    if tiers.below is not None:
        tiers.below.close()
    if tiers.host is not None:
        tiers.host.close()
