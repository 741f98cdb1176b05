"""KV compaction (token dropping): policies that pick which tokens each (layer, KV head)
keeps, the per-head packed layout compacted sequences use, and the compactor that packs
the survivors and returns the rest of a sequence's pages to the store."""

from workers.serving.compaction.compactor import CompactionConfig, CompactionResult, Compactor
from workers.serving.compaction.kv_state import KvState
from workers.serving.compaction.policies import (
    COMPACTION_POLICIES,
    Budget,
    Candidates,
    CompactionPolicy,
    make_compaction_policy,
    register_compaction_policy,
)

__all__ = [
    "COMPACTION_POLICIES",
    "Budget",
    "Candidates",
    "CompactionConfig",
    "CompactionPolicy",
    "CompactionResult",
    "Compactor",
    "KvState",
    "make_compaction_policy",
    "register_compaction_policy",
]
