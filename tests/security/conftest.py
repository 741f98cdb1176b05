"""A real service over loopback, with authentication on or off, and clients speaking as
the mesh's workers, its front door, or a stranger."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


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
