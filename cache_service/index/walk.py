"""The match walk: the nodes of the longest cached prefix of full pages of a prompt.

Pages published in one chain get consecutive node ids, so the walk goes by runs: find the
node of the next page through its key (checking its parent and tokens), then take as many
of the following node ids as continue the chain (the `chained` flag) and hold the
prompt's next pages (one bytes comparison). A 128-page prompt published at once is one
run, a dozen operations. A path fragmented into many runs is finished with every
remaining page's key at once (`_lookup`: one numpy multiply and cumulative sum, a
vectorised probe of the key table, one vectorised check).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cache_service.index.nodes import NONE, Nodes

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
    pages = min(len(data) // nodes.page_bytes, nodes.max_depth)
    if root is None or pages == 0:
        return NO_PATH
    runs: list[tuple[int, int]] = []  # (first node, pages)
    parent, done = root, 0
    first_child, branch = nodes.first_child, nodes.branch
    while done < pages and first_child[parent] != NONE:
        if len(runs) == MAX_RUNS:
            rest = _lookup(nodes, parent, done, pages, data)
            return Path(done + len(rest), (), np.concatenate([*map(_node_range, runs), rest]))
        node = branch(parent, done, data)
        if node is None:
            break
        length = _run_length(nodes, node, done, pages, data)
        runs.append((node, length))
        done += length
        parent = node + length - 1
    if not runs:
        return NO_PATH
    return _new_tuple(Path, (done, tuple(runs), None))


def _run_length(nodes: Nodes, node: int, depth: int, pages: int, data: bytes) -> int:
    """How many consecutive node ids from `node` (which holds prompt page `depth`)
    continue its chain and hold the prompt's following pages, in order."""
    most = min(pages - depth, nodes.allocated - node)
    broken = nodes.chained[node + 1 : node + most].tobytes().find(0)
    if broken >= 0:
        most = broken + 1
    size = nodes.page_bytes
    # bytes.startswith compares the index's memory in place (no copy of the run first).
    stored = nodes.token_bytes[node * size : (node + most) * size]
    offset = depth * size
    if data.startswith(stored, offset):
        return most
    equal, unequal = 1, most  # the first `equal` pages agree, the first `unequal` do not
    while unequal - equal > 1:
        middle = (equal + unequal) // 2
        if data.startswith(stored[: middle * size], offset):
            equal = middle
        else:
            unequal = middle
    return equal


def _lookup(nodes: Nodes, parent: int, depth: int, pages: int, data: bytes) -> np.ndarray:
    """The nodes of prompt pages depth .. pages - 1 below `parent`, all keys at once.

    Every page's key in one multiply and cumulative sum, the key table's first candidate
    for each, then one exact check of all of them (stored tokens equal the prompt's pages,
    each node's parent the node before). A collision fails that check and takes the exact
    walk instead, which tries every candidate.
    """
    size = nodes.page_bytes
    data = data[depth * size : pages * size]
    keys = nodes.keys.chain_keys(nodes.key[parent], depth, data)
    found_nodes = nodes.table.find_run(keys).astype(np.intp, copy=False)
    if len(found_nodes) == 0:
        return found_nodes
    parents = nodes.parent_arr.take(found_nodes)
    if (
        parents[0] == parent
        and parents[1:].tobytes() == found_nodes[:-1].tobytes()
        and nodes.page_records.take(found_nodes).tobytes() == data[: len(found_nodes) * size]
    ):
        return found_nodes
    found = []
    for i, key in enumerate(keys.tolist()):
        parent = nodes.child(parent, key, data[i * size : (i + 1) * size])
        if parent is None:
            break
        found.append(parent)
    return np.array(found, dtype=np.intp)


def _node_range(run: tuple[int, int]) -> np.ndarray:
    first, length = run
    return np.arange(first, first + length, dtype=np.intp)
