"""Routing over the index: the inputs a policy of `cache_service.routing` weighs, built
from what the index holds.

For a prompt, the candidates are the live workers among the caller's loads (their
reported loads and costs beside them); a policy that reads holdings also gets, from one
walk of the trie, what each holder holds of the prompt, on which node, and how much of
that is in host memory before its first page on disk. A policy is made on first use and
kept (round-robin keeps its place between calls).
"""

from __future__ import annotations

from collections.abc import Mapping

from cache_service.events import Namespace
from cache_service.index.holders import host_pages
from cache_service.index.nodes import Nodes
from cache_service.index.registry import Registry
from cache_service.messages import RouteDecision
from cache_service.routing import (
    RouteInputs,
    RoutingPolicy,
    WorkerLoad,
    candidates_of,
    make_policy,
)

# A path of more than this many runs of consecutive node ids is finished by looking up
# the rest of the prompt's keys at once (csrc/walk.hpp).
MAX_RUNS = 4


class Router:
    """Runs the routing policies over one index's nodes and registry.

    Args:
        nodes: the index's trie nodes (their compiled trie walks the prompt).
        registry: its workers.
        page_tokens: tokens per page.
        load_weight: the weight of the queue term (kvmesh's estimate).
    """

    def __init__(self, nodes: Nodes, registry: Registry, page_tokens: int, load_weight: float):
        self._nodes = nodes
        self._registry = registry
        self.page_tokens = page_tokens
        self.load_weight = load_weight
        self._policies: dict[str, RoutingPolicy] = {}  # by name, made on first use

    def route(
        self,
        namespace: Namespace,
        data: bytes,
        loads: Mapping[str, float],
        pending: Mapping[str, float] | None,
        reported: Mapping[str, WorkerLoad] | None,
        policy: str,
    ) -> RouteDecision:
        """The policy's choice for a prompt (`data`: its checked int32 bytes); see
        `GlobalIndex.route`.

        Raises:
            ValueError: a load negative or not finite, or an unknown policy.
        """
        chooser = self._policies.get(policy)
        if chooser is None:
            chooser = self._policies[policy] = make_policy(policy)  # raises if unknown
        workers = self._registry.workers
        nodes = {w: workers[w].node_id for w in loads if w in workers}
        candidates = candidates_of(loads, nodes, reported)
        if not candidates:
            return RouteDecision(None, 0, 0.0, "no_live_worker")
        holdings = []  # a policy that reads no holdings spares the walk
        if chooser.uses_holdings:
            trie = self._nodes.trie
            _, found = trie.match(self._nodes.roots.get(namespace), data, MAX_RUNS, None)
            holdings = [
                (slot, held, host_pages(held, tier, tiers))
                for slot, held, tier, _, _, tiers in found
            ]
        held, at, host = self._registry.by_worker(holdings, self.page_tokens)
        pending = {w: int(n) for w, n in (pending or {}).items() if n >= 0}
        inputs = RouteInputs(candidates, len(data) // 4, held, at, pending, self.load_weight, host)
        return chooser.choose(inputs)
