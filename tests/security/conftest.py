"""A real service over loopback, with authentication on or off, and clients speaking as
the mesh's workers, its front door, or a stranger; page stores for page servers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

# Pages of 64 KiB: a few hundred queued for a reader that never reads fill any socket buffer.
PAGE_LAYOUT = dict(num_pages=256, num_layers=4, num_kv_heads=2, page_tokens=16, head_dim=64)


def _rig(auth: bool) -> Iterator:
    from tests.security.service_rig import ServiceRig

    service = ServiceRig(auth=auth)
    yield service
    service.close()


@pytest.fixture(params=["auth", "no-auth"])
def rig(request) -> Iterator:
    """The service, once with CurveZMQ and identities, once with authentication off."""
    yield from _rig(request.param == "auth")


@pytest.fixture
def auth_rig() -> Iterator:
    yield from _rig(True)


@pytest.fixture
def holder() -> Iterator:
    """A page store whose every page is allocated and filled, and its page ids."""
    import torch

    from workers.store.page_store import SharedPageStore, StoreLayout

    layout = StoreLayout(**PAGE_LAYOUT)
    store = SharedPageStore.create(layout, tag="holder")
    pages = store.allocate(layout.num_pages)
    for page in pages:
        store.write_page(page, torch.full(layout.page_shape, float(page % 97)))
    yield store, pages
    store.check_integrity()
    store.close()


@pytest.fixture
def requester() -> Iterator:
    """A page store to copy into, and 32 of its pages."""
    from workers.store.page_store import SharedPageStore, StoreLayout

    store = SharedPageStore.create(StoreLayout(**PAGE_LAYOUT), tag="requester")
    yield store, store.allocate(32)
    store.check_integrity()
    store.close()
