"""Fixtures shared by the page store and disk tier tests."""

from __future__ import annotations

import pytest

from tests.workers.store.disk_helpers import KEY, tiny_layout
from tests.workers.store.store_helpers import make_layout
from workers.store.disk_tier import DiskTier
from workers.store.page_store import SharedPageStore


@pytest.fixture
def store():
    """An owned 8-page store (`make_layout()`), tagged "unit"."""
    with SharedPageStore.create(make_layout(), tag="unit") as s:
        yield s


@pytest.fixture
def open_tier(tmp_path):
    """Opens disk tiers (by default in tmp_path/"disk", `tiny_layout()`, 8 pages, `KEY`);
    each is checked with check_integrity() and closed when the test ends."""
    tiers: list[DiskTier] = []

    def opener(directory=None, layout=None, capacity=8, key=KEY, **kwargs) -> DiskTier:
        directory = tmp_path / "disk" if directory is None else directory
        tier = DiskTier.open(directory, layout or tiny_layout(), capacity, key, **kwargs)
        tiers.append(tier)
        return tier

    yield opener
    for tier in tiers:
        tier.check_integrity()
        tier.close()
