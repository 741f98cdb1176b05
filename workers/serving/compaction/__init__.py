"""KV compaction (token dropping): policies that pick which tokens each (layer, KV head)
keeps, the per-head packed layout compacted sequences use, and the compactor that packs
the survivors and returns the rest of a sequence's pages to the store.

`config` (CompactionConfig, Budget) imports no torch; the rest does, so the names below
load when first used: reading a worker's config does not pull torch in.
"""

from __future__ import annotations

from workers.lazy import lazy_exports

_HOMES = {
    "Budget": ".config",
    "CompactionConfig": ".config",
    "CompactionResult": ".compactor",
    "Compactor": ".compactor",
    "KvState": ".kv_state",
    "COMPACTION_POLICIES": ".policies",
    "Candidates": ".policies",
    "CompactionPolicy": ".policies",
    "make_compaction_policy": ".policies",
    "register_compaction_policy": ".policies",
}

__all__ = sorted(_HOMES)


__getattr__ = lazy_exports(__name__, _HOMES)
