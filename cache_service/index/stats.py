"""The index's statistics: its sizes and counts as one plain dict (msgpack-friendly).

    {"page_tokens", "pages", "holdings", "workers_live", "tiers": names in use,
     "cluster": counters, "tenants": {name: counters},
     "workers": {worker id: counters + "pages" held + "live" (+ "node" if live)},
     "events": {"batches", "duplicates", "resyncs_requested", "resyncs"},
     "removed_workers": {reason: count}}

where counters are queries, queried_tokens, hit_tokens, local_hit_tokens,
remote_hit_tokens, miss_tokens, alignment_lost_tokens (see `tallies`). Every value is
a copy: the dict can leave the owner thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cache_service.index.nodes import Nodes
from cache_service.index.registry import Registry
from cache_service.index.tallies import Tallies


def index_stats(
    page_tokens: int,
    nodes: Nodes,
    registry: Registry,
    tallies: Tallies,
    events: Mapping[str, int],
) -> dict[str, Any]:
    """The statistics of the index made of these parts, laid out as drawn above.

    Args:
        page_tokens: tokens per page.
        nodes: the trie's nodes.
        registry: the live workers and the removal counts.
        tallies: the hit statistics.
        events: the event batches' outcome counts (`BatchOrder.counts`).
    """
    live = registry.workers
    sections = tallies.report({worker_id: w.pages.size for worker_id, w in live.items()})
    for worker_id, worker in live.items():
        sections["workers"][worker_id]["node"] = worker.node_id
    return {
        "page_tokens": page_tokens,
        "pages": nodes.num_pages,
        "holdings": registry.holdings(),
        "workers_live": len(live),
        "tiers": registry.tiers_in_use(),
        **sections,
        "events": dict(events),
        "removed_workers": dict(registry.removed),
    }
