"""Fixtures shared by the page store tests."""

from __future__ import annotations

import pytest

from tests.workers.store.store_helpers import make_layout
from workers.store.page_store import SharedPageStore


@pytest.fixture
def store():
    """An owned 8-page store (`make_layout()`), tagged "unit"."""
    with SharedPageStore.create(make_layout(), tag="unit") as s:
        yield s
