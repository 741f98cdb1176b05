"""The index's invariants, checked in full (vectorised where the columns allow).

- every node in use is a root or reachable from one, exactly once, through consistent
  child and sibling links; the free list and the nodes in use partition what was handed
  out; the `chained` flag says whether a node's parent is node id - 1;
- every page node is in the key table once, under its key, and its key and depth follow
  from its parent's and its own tokens;
- holder counts match the inline columns and the holders beyond them; no node survives without a
  holder; no dead slot holds anything; every holding's tier is one of TIERS; each worker's
  holdings are prefix-closed and column-consistent; the workers' reverse page maps list
  exactly their holdings, and their pages per tier count them;
- no worker has more notices waiting than the limit, and no free slot has any.
"""

from __future__ import annotations

import numpy as np

from cache_service.events import TIERS
from cache_service.index.holders import EXTRA, INLINE_HOLDERS, Holders
from cache_service.index.nodes import NONE, Nodes
from cache_service.index.registry import Registry


def check_integrity(nodes: Nodes, holders: Holders, registry: Registry) -> None:
    """Raise AssertionError unless nodes, links, keys, holders and reverse maps agree."""
    used = np.zeros(nodes.allocated, bool)
    for namespace, root in nodes.roots.items():
        assert nodes.root_namespace.get(root) == namespace, f"root {root} of {namespace}"
        assert nodes.parent[root] == NONE, f"root {root} has parent {nodes.parent[root]}"
        assert nodes.first_child[root] != NONE, f"root {root} of {namespace} is empty"
        assert nodes.depth[root] == 0, f"root {root} at depth {nodes.depth[root]}"
        assert nodes.key[root] == nodes.keys.root_key(namespace), f"root {root} key"
        assert holders.count[root] == 0, f"root {root} has holders"
        used[root] = True
    assert len(nodes.root_namespace) == len(nodes.roots), (
        f"{len(nodes.root_namespace)} root namespaces for {len(nodes.roots)} roots"
    )
    keys, pages = nodes.table.check()
    assert len(pages) == nodes.num_pages, (
        f"{len(pages)} nodes in the key table but {nodes.num_pages} pages counted"
    )
    assert not used[pages].any(), "a root is in the key table"
    used[pages] = True
    assert used.sum() == len(nodes.roots) + nodes.num_pages, "a node is in the key table twice"
    assert (nodes.key_arr[pages] == keys).all(), "a node sits in the key table under a wrong key"
    free = np.array(nodes.free, np.intp)
    assert len(set(nodes.free)) == len(free), "a node is on the free list twice"
    assert not used[free].any(), "a node is both free and in use"
    assert used.sum() + len(free) == nodes.allocated, (
        f"{used.sum()} nodes in use + {len(free)} free != {nodes.allocated} allocated"
    )
    assert (holders.count_arr[free] == 0).all(), "a free node has holders"
    parents = nodes.parent_arr[: nodes.allocated]
    chained = used & (parents != NONE) & (parents == np.arange(nodes.allocated) - 1)
    assert (nodes.chained_arr[: nodes.allocated] == chained).all(), "a wrong chained flag"
    assert (holders.slot_arr[free] == NONE).all(), "a free node has inline holders"
    reached = _check_links(nodes, used)
    assert reached == used.sum(), f"{reached} nodes reachable from roots, {used.sum()} in use"
    pages.sort()
    _check_keys(nodes, pages)
    held = _check_holders(nodes, holders, registry, pages)
    mapped = registry.holdings()
    assert held == mapped, f"{held} holders on nodes, {mapped} in reverse maps"
    _check_reverse_maps(holders, registry)
    limit = nodes.trie.notice_limit
    for slot, worker in enumerate(registry.slots):
        waiting = nodes.trie.notices_waiting(slot)
        assert waiting <= limit, f"slot {slot}: {waiting} notices wait, over {limit}"
        assert worker is not None or not waiting, f"free slot {slot} has {waiting} notices"


def _check_links(nodes: Nodes, used: np.ndarray) -> int:
    """Walk the child lists from every root; the number of nodes reached."""
    reached = 0
    stack = list(nodes.roots.values())
    while stack:
        node = stack.pop()
        reached += 1
        assert reached <= len(used), "the child lists loop"
        child, prev = nodes.first_child[node], NONE
        while child != NONE:
            assert used[child], f"child {child} of node {node} is not in use"
            assert nodes.parent[child] == node, (
                f"node {child} is linked under {node} but its parent is {nodes.parent[child]}"
            )
            assert nodes.prev_sibling[child] == prev, f"node {child}: broken sibling link"
            stack.append(child)
            prev, child = child, nodes.next_sibling[child]
    return reached


def _check_keys(nodes: Nodes, pages: np.ndarray) -> None:
    """Every page's depth and key follow from its parent's and its own tokens."""
    size = nodes.page_tokens
    deepest = nodes.depth_arr[pages].max() if len(pages) else 0
    assert nodes.max_depth >= deepest, f"a node at depth {deepest} > {nodes.max_depth}"
    positions = np.arange(size)
    coefficients_of = nodes.keys.coefficients(int(deepest) * size)
    for start in range(0, len(pages), 1 << 16):  # in chunks: bounded temporaries
        chunk = pages[start : start + (1 << 16)]
        parents = nodes.parent_arr[chunk]
        depth = nodes.depth_arr[chunk]
        assert (depth == nodes.depth_arr[parents] + 1).all(), "a node at the wrong depth"
        coefficients = coefficients_of[(depth[:, None] - 1) * size + positions]
        sums = (nodes.tokens_arr[chunk] * coefficients).sum(1) + nodes.key_arr[parents]
        assert (sums == nodes.key_arr[chunk]).all(), "a node's key does not match its page"


def _check_holders(nodes: Nodes, holders: Holders, registry: Registry, pages: np.ndarray) -> int:
    """Counts, columns and prefix closure of every page's holders; the holder count."""
    slots = holders.slot_arr[pages].T  # (columns, pages)
    inline = (slots != NONE).sum(0)
    extra = np.zeros(len(pages), np.int64)
    extras = {node: holders.extra(node) for node in holders.trie.extra_nodes()}
    for node, held in extras.items():
        assert held, f"node {node} has an empty extra-holder list"
        where = np.searchsorted(pages, node)
        assert where < len(pages) and pages[where] == node, f"free node {node} has holders"
        extra[where] = len(held)
    counts = holders.count_arr[pages]
    assert (counts == inline + extra).all(), "a holder count is off"
    assert (counts > 0).all(), f"nodes survive with no holder: {pages[counts == 0][:5]}"
    for a in range(INLINE_HOLDERS):
        assert all(
            ((slots[a] == NONE) | (slots[a] != slots[b])).all()
            for b in range(a + 1, INLINE_HOLDERS)
        ), "a worker holds a node in two columns"
    live = np.array([worker is not None for worker in registry.slots] + [False], bool)
    assert live[slots[slots != NONE]].all(), "a node is held by a dead slot"
    tiers = holders.tier_arr[pages].T
    assert (tiers[slots != NONE] < len(TIERS)).all(), "a holding in no tier of TIERS"
    # Prefix closure and column consistency: a holder of a page below a first page holds
    # the parent in the same column.
    parents = nodes.parent_arr[pages]
    below = nodes.depth_arr[pages] > 1
    parent_slots = holders.slot_arr[parents].T
    closed = (slots == NONE) | (slots == parent_slots) | ~below
    assert closed.all(), "a worker holds a page but not its parent in the same column"
    for node, held in extras.items():
        held_by = [holder[0] for holder in held]
        assert len(set(held_by)) == len(held_by), f"node {node}: a worker holds it twice"
        assert all(0 <= holder[3] < len(TIERS) for holder in held), f"node {node}: a bad tier"
        for slot in held_by:
            assert registry.slots[slot] is not None, f"node {node} held by dead slot {slot}"
            assert slot not in slots[:, np.searchsorted(pages, node)], (
                f"node {node}: slot {slot} both inline and extra"
            )
            parent = nodes.parent[node]
            assert nodes.depth[node] == 1 or holders.column_of(parent, slot) == EXTRA, (
                f"slot {slot} holds node {node} beside the columns but not its parent"
            )
    return int(counts.sum())


def _check_reverse_maps(holders: Holders, registry: Registry) -> None:
    """Every page of a worker's page map is a holding of that worker, under that page; its
    pages per tier count its holdings in each tier."""
    for worker in registry.workers.values():
        tier_pages = [0] * len(TIERS)
        for page, node in worker.pages.items():
            holding = holders.holding(node, worker.slot)
            assert holding is not None and holding[0] == page, (
                f"{worker.worker_id} page {page}: reverse map says node {node}, which "
                f"holds {holding}"
            )
            tier_pages[holding[2]] += 1
        assert tier_pages == worker.tier_pages, (
            f"{worker.worker_id} holds {tier_pages} pages per tier, counted {worker.tier_pages}"
        )
