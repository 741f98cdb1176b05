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

    Usually one run start .. start + length - 1 (`nodes` None), read with slices; else
    `nodes` lists them.
    """

    start: int
    length: int
    nodes: np.ndarray | None  # intp

    def of(self, column: np.ndarray) -> np.ndarray:
        """`column` at the path's nodes, in order (a view for a run)."""
        if self.nodes is None:
            return column[self.start : self.start + self.length]
        return column[self.nodes]  # not take(): that copies a strided column whole first

    def node(self, i: int) -> int:
        return self.start + i if self.nodes is None else int(self.nodes[i])


NO_PATH = Path(0, 0, None)


def walk(nodes: Nodes, root: int | None, data: bytes) -> Path:
    """The path of packed prompt `data` below `root` (None: the namespace has no root)."""
    pages = min(len(data) // nodes.page_bytes, nodes.max_depth)
    if root is None or pages == 0:
        return NO_PATH
    runs: list[tuple[int, int]] = []  # (first node, pages)
    parent, done = root, 0
    size, first_child, key = nodes.page_bytes, nodes.first_child, nodes.key
    page_key = nodes.keys.page_key
    while done < pages and first_child[parent] != NONE:
        if len(runs) == MAX_RUNS:
            rest = _lookup(nodes, parent, done, pages, data)
            return Path(0, done + len(rest), np.concatenate([*map(_node_range, runs), rest]))
        page = page_key(key[parent], done, data)
        node = nodes.child(parent, page, data[done * size : (done + 1) * size])
        if node is None:
            break
        length = _run_length(nodes, node, done, pages, data)
        runs.append((node, length))
        done += length
        parent = node + length - 1
    if len(runs) == 1:
        return _new_tuple(Path, (*runs[0], None))
    if not runs:
        return NO_PATH
    return Path(0, done, np.concatenate([*map(_node_range, runs)]))


def _run_length(nodes: Nodes, node: int, depth: int, pages: int, data: bytes) -> int:
    """How many consecutive node ids from `node` (which holds prompt page `depth`)
    continue its chain and hold the prompt's following pages, in order."""
    most = min(pages - depth, nodes.allocated - node)
    broken = nodes.chained[node + 1 : node + most].tobytes().find(0)
    if broken >= 0:
        most = broken + 1
    size = nodes.page_bytes
    stored = nodes.token_bytes[node * size : (node + most) * size].tobytes()
    wanted = data[depth * size : (depth + most) * size]
    if stored == wanted:
        return most
    equal, unequal = 1, most  # the first `equal` pages agree, the first `unequal` do not
    while unequal - equal > 1:
        middle = (equal + unequal) // 2
        if stored[: middle * size] == wanted[: middle * size]:
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
    found_nodes = nodes.table.find_run(keys)
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
