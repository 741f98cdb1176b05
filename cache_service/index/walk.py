"""The match walk: the nodes of the longest cached prefix of full pages of a prompt.

Pages published in one chain get consecutive node ids, so the walk goes by runs: find the
node of the next page through its key (checking its parent and tokens), then take as many
of the following node ids as continue the chain (the `chained` flag) and hold the
prompt's next pages. A 128-page prompt published at once is one run. A path fragmented
into more than MAX_RUNS runs is finished with every remaining page's key at once (one
pass over the tokens, a probe of the key table per key, one check of them all). The walk
runs in compiled code over the node columns (`csrc/walk.hpp`, through `Nodes.trie`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cache_service.index.nodes import Nodes

# A path walked as more runs than this is finished with the vectorised lookup.
MAX_RUNS = 4
_new_tuple = tuple.__new__


class Path(NamedTuple):
    """The nodes of a match, in prompt order.

    Usually a few runs of consecutive node ids (`runs`, `nodes` None), read with slices
    and scalar reads: a run costs its consumers a slice each, where a gather of the nodes
    would cost a numpy call for the index array and one per column read through it. A
    path of more than MAX_RUNS runs lists its nodes instead (`runs` empty).
    """

    length: int
    runs: tuple[tuple[int, int], ...]  # (first node, pages), when nodes is None
    nodes: np.ndarray | None  # intp

    def node(self, i: int) -> int:
        """The node of page i of the path."""
        if self.nodes is not None:
            return int(self.nodes[i])
        for first, pages in self.runs:
            if i < pages:
                return first + i
            i -= pages
        raise IndexError(f"page {i} past a path of {self.length}")

    def first(self) -> int:
        return self.runs[0][0] if self.nodes is None else int(self.nodes[0])

    def last(self) -> int:
        if self.nodes is not None:
            return int(self.nodes[-1])
        first, pages = self.runs[-1]
        return first + pages - 1

    def node_ids(self) -> list[int]:
        """Every node of the path, in order."""
        if self.nodes is not None:
            return self.nodes.tolist()
        return [node for first, pages in self.runs for node in range(first, first + pages)]


NO_PATH = Path(0, (), None)


def walk(nodes: Nodes, root: int | None, data: bytes) -> Path:
    """The path of packed prompt `data` below `root` (None: the namespace has no root)."""
    length, runs, listed = nodes.trie.walk(root, data, MAX_RUNS)
    if not length:
        return NO_PATH
    if listed is not None:
        return _new_tuple(Path, (length, (), listed.astype(np.intp, copy=False)))
    return _new_tuple(Path, (length, runs, None))
