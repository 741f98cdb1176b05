"""The service's layers: typed messages and tokens below both the codec and the index; the
codec knows nothing of the index; the index is plain Python and numpy."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FORBIDDEN = {
    "cache_service.messages": ["cache_service.protocol", "cache_service.index", "numpy"],
    "cache_service.tokens": ["cache_service.protocol", "cache_service.index"],
    "cache_service.protocol": ["cache_service.index", "ray", "zmq", "torch"],
    "cache_service.index": ["cache_service.protocol", "ray", "zmq", "torch", "msgpack"],
    # The handlers answer one request each, below the loop that owns the socket.
    "cache_service.handlers": ["cache_service.server", "ray", "torch"],
}


def imported_by(module: str) -> set[str]:
    """Every module a fresh interpreter has loaded once it imported `module`."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(module):
    loaded = imported_by(module)
    for forbidden in FORBIDDEN[module]:
        found = sorted(
            name for name in loaded if name == forbidden or name.startswith(forbidden + ".")
        )
        assert not found, f"importing {module} loads {found}"
