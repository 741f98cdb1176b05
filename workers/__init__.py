"""Worker side of kvmesh, a subpackage per role:

    store/      the page store in shared memory, its free lists, page digests
    cache/      the local prefix cache (trie, allocations, eviction, events)
    transfer/   moving pages: page server and client, same-node copies, copy-in, costs
    service/    the worker's link to the service: client, publisher, heartbeat figures
    serving/    sequences, scheduler, batch runner, serving loop, sampling, models
    engines/    inference engines (vLLM) as members of the mesh
    member.py   the mesh member a worker and an engine are both built on
    worker.py   the worker: a member with a model and its serving loop
    api.py      the typed values a front door and a worker exchange
    actor.py    the worker as a Ray actor

The most used names are importable from here; they load on first use, so importing a
subpackage (the trie, say) never pulls in torch through this module.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SharedPageStore": "workers.store.page_store",
    "StoreLayout": "workers.store.page_store",
    "PrefixCache": "workers.cache.prefix_cache",
    "PrefixCacheConfig": "workers.cache.prefix_cache",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'workers' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
