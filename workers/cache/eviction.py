"""Eviction policies for the local prefix cache, behind a tiny registry.

A policy only ranks evictable pages; the cache decides what is evictable (unreferenced,
published leaves). The lowest key is evicted first. Keys are tuples of numbers and end
with the node's unique id, so two candidates never compare equal and the heap never
falls through to comparing nodes (the shortfin trie crashed in `heapq` on exactly that).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol


class EvictionCandidate(Protocol):
    """What a policy may read of a trie page (the last page of a run of the trie)."""

    node_id: int  # unique, increasing in creation order (deeper pages of a run: higher)
    last_access: int  # logical clock of the last acquire that reused or created it
    hits: int  # how many acquires reused it
    depth: int  # pages from the namespace root (1 = first page)


class EvictionPolicy(ABC):
    """Ranks evictable pages: `key(node)` lowest goes first.

    Keys are computed when a page becomes evictable; a page is only re-ranked after it
    has been referenced again, so keys may not depend on anything that changes while a
    page sits unreferenced (the clock, other pages).
    """

    name: str
    # True when the key depends on nothing but (hits, last_access, node_id) and rises with
    # node_id: the pages of a trie run share hits and last access, and deeper ones are
    # younger, so once a run's last page is the lowest key, the page before it is lower
    # still, and the cache evicts as many pages of the run as it needs at once. A policy
    # that leaves it False is asked for the key of every page before the next is taken.
    evicts_runs_tail_first: bool = False

    @abstractmethod
    def key(self, node: EvictionCandidate) -> tuple[int, ...]: ...


class LruPolicy(EvictionPolicy):
    """Least recently used first; ties (same acquire) go to the older node."""

    name = "lru"
    evicts_runs_tail_first = True

    def key(self, node: EvictionCandidate) -> tuple[int, ...]:
        return (node.last_access, node.node_id)


class LfuPolicy(EvictionPolicy):
    """Least frequently reused first, then least recently used.

    Keeps hot system prompts through a burst of one-off documents that LRU would let
    push them out.
    """

    name = "lfu"
    evicts_runs_tail_first = True

    def key(self, node: EvictionCandidate) -> tuple[int, ...]:
        return (node.hits, node.last_access, node.node_id)


class DeepestFirstPolicy(EvictionPolicy):
    """Longest prefixes first, then LRU: sheds conversation tails before shared heads."""

    name = "deepest"

    def key(self, node: EvictionCandidate) -> tuple[int, ...]:
        return (-node.depth, node.last_access, node.node_id)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LruPolicy, LfuPolicy, DeepestFirstPolicy)
}


def make_eviction_policy(name: str) -> EvictionPolicy:
    """Build a registered policy by name.

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        known = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; known: {known}") from None


def register_eviction_policy(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator adding a policy to the registry under `cls.name`."""
    if cls.name in EVICTION_POLICIES:
        raise ValueError(f"eviction policy {cls.name!r} is already registered")
    EVICTION_POLICIES[cls.name] = cls
    return cls
