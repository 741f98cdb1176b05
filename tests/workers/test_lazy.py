"""Tests for workers/lazy.py: a package's exports, loaded when first asked for."""

from __future__ import annotations

import sys

import pytest

from workers.lazy import lazy_exports


def test_a_name_loads_from_its_home_absolute_or_relative():
    homes = {"TRANSFER_VERSION": ".page_wire", "StoreLayout": "workers.store.layout"}
    get = lazy_exports("workers.transfer", homes)
    from workers.store.layout import StoreLayout
    from workers.transfer.page_wire import TRANSFER_VERSION

    assert get("TRANSFER_VERSION") == TRANSFER_VERSION
    assert get("StoreLayout") is StoreLayout
    assert "workers.transfer.page_wire" in sys.modules


def test_an_unknown_name_is_an_attribute_error_naming_it():
    get = lazy_exports("workers.transfer", {})
    with pytest.raises(AttributeError, match="'workers.transfer' has no attribute 'Nope'"):
        get("Nope")
    # what hasattr and getattr with a default rely on
    import workers.transfer

    assert not hasattr(workers.transfer, "Nope")
    assert getattr(workers.transfer, "Nope", 7) == 7
