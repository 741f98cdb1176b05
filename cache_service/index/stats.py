"""The index's statistics: its sizes and counts as one plain dict (msgpack-friendly).

    {"page_tokens", "pages", "holdings", "workers_live",
     "tiers": {tier: holdings in it, for every name of events.TIERS},
     "removals": {tier: {reason: pages removed}}, "demotions": {tier: pages moved into it},
     "cluster": counters, "tenants": {name: counters},
     "workers": {worker id: counters + "pages" held + "live" (+ "node" if live)},
     "events": {"batches", "duplicates", "resyncs_requested", "resyncs", "over_capacity",
                "unknown_pages"},
     "removed_workers": {reason: count},
     "superseded": {"issued", "overflowed"}}

"removals" counts the holdings that removal events (PagesRemoved, AllCleared as
"cleared") dropped, under the tier each was in; "demotions" the holdings PagesDemoted
moved; "unknown_pages" the page ids those events named that the worker did not hold.
Removals and demotions list only tiers (and reasons) that occurred. "superseded" counts
the notices of pages stored by another worker since (`GlobalIndex.held_elsewhere`), and
those dropped unread.

where counters are queries, queried_tokens, hit_tokens, local_hit_tokens,
remote_hit_tokens, miss_tokens, alignment_lost_tokens (see `tallies`). Every value is
a copy: the dict can leave the owner thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cache_service.events import TIERS
from cache_service.index.chains import Chains
from cache_service.index.nodes import Nodes
from cache_service.index.registry import Registry
from cache_service.index.tallies import Tallies


def index_stats(
    page_tokens: int,
    nodes: Nodes,
    registry: Registry,
    tallies: Tallies,
    events: Mapping[str, int],
    chains: Chains,
) -> dict[str, Any]:
    """The statistics of the index made of these parts, laid out as drawn above.

    Args:
        page_tokens: tokens per page.
        nodes: the trie's nodes.
        registry: the live workers and the removal counts.
        tallies: the hit statistics.
        events: the event batches' outcome counts (`BatchOrder.counts`).
        chains: the write side, with its counts of what the events did.
    """
    live = registry.workers
    sections = tallies.report({worker_id: w.pages.size for worker_id, w in live.items()})
    for worker_id, worker in live.items():
        sections["workers"][worker_id]["node"] = worker.node_id
    removals: dict[str, dict[str, int]] = {}
    for (tier, reason), pages in sorted(chains.removed.items()):
        removals.setdefault(TIERS[tier], {})[reason] = pages
    return {
        "page_tokens": page_tokens,
        "pages": nodes.num_pages,
        "holdings": registry.holdings(),
        "workers_live": len(live),
        "tiers": dict(zip(TIERS, registry.tier_holdings(), strict=True)),
        "removals": removals,
        "demotions": {TIERS[t]: pages for t, pages in enumerate(chains.demoted) if pages},
        **sections,
        "events": {**events, "unknown_pages": chains.unknown_pages},
        "superseded": dict(zip(("issued", "overflowed"), nodes.trie.notices, strict=True)),
        "removed_workers": dict(registry.removed),
    }
