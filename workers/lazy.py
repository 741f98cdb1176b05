"""Names a package exports but loads on first use.

A package whose modules need torch (the page store, the page client, the compactor) still
exports its most used names at its top level; loading them lazily keeps `import` of any
one of its light modules (a config, the wire's constants) from pulling torch in.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: each name in `homes` is read from its home
    module (absolute, or relative to `package` when it starts with a dot) when first asked
    for; any other name raises AttributeError, as a missing attribute does."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(home, package), name)

    return __getattr__
