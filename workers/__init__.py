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
    lazy.py     names a package exports but loads on first use

The most used names are importable from here; they load on first use, so importing a
subpackage (the trie, say) never pulls in torch through this module.
"""

from __future__ import annotations

from workers.lazy import lazy_exports

_HOMES = {
    "SharedPageStore": "workers.store.page_store",
    "StoreLayout": "workers.store.page_store",
    "PrefixCache": "workers.cache.prefix_cache",
    "PrefixCacheConfig": "workers.cache.prefix_cache",
}

__all__ = sorted(_HOMES)


__getattr__ = lazy_exports(__name__, _HOMES)
