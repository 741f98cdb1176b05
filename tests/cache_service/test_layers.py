"""The service's layers: typed messages and tokens below both the codec and the index; the
codec knows nothing of the index; the index is plain Python and numpy."""

from __future__ import annotations

import pytest

from tests.layers import loaded_modules, violations

FORBIDDEN = {
    "cache_service.messages": ["cache_service.protocol", "cache_service.index", "numpy"],
    "cache_service.tokens": ["cache_service.protocol", "cache_service.index"],
    "cache_service.protocol": ["cache_service.index", "ray", "zmq", "torch"],
    "cache_service.index": ["cache_service.protocol", "ray", "zmq", "torch", "msgpack"],
    # The handlers answer one request each, below the loop that owns the socket.
    "cache_service.handlers": ["cache_service.server", "ray", "torch"],
}


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str]]:
    return loaded_modules(FORBIDDEN)


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(loaded, module):
    found = violations(loaded[module], FORBIDDEN[module])
    assert not found, f"importing {module} loads {found}"
