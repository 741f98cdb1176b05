"""Fixtures shared by the worker tests: a real service, without Ray."""

from __future__ import annotations

import pytest

from cache_service.server import ServerConfig, make_server

SERVICE_PAGE_TOKENS = 4  # the page size of the workers these tests build


@pytest.fixture
def service():
    """A running ServiceServer on loopback (no authentication), checked after the test."""
    server = make_server(ServerConfig(page_tokens=SERVICE_PAGE_TOKENS))
    server.start()
    yield server
    server.stop()
    server.index.check_integrity()
