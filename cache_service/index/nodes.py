"""The trie's nodes as numpy columns indexed by node id: structure, keys, tokens, access.

The index holds about a million pages, and a Python object per node costs several
hundred bytes; a struct of columns costs a few dozen. Scalar code reads and writes the
columns through memoryviews (as fast as array.array); the match walk reads them in
compiled code (`view`, a `NodeView` holding the arrays). `grow` replaces all three
together, so callers look the columns up on the `Nodes` object each time rather than
keeping them.

Node 0 .. allocated - 1 are handed out; freed ones wait on a free list. A root per
namespace (depth 0, no page) holds the first pages of its prompts as children; a child
list is a doubly linked list through the sibling columns. Pages published in one chain
get consecutive node ids, and a node whose parent is node id - 1 is flagged `chained`,
so the walk can follow a chain by ids alone.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from cache_service.events import Namespace
from cache_service.index._compiled import KeyTable, NodeView
from cache_service.index.keys import PrefixKeys
from cache_service.tokens import TOKEN_DTYPE

NONE = -1  # "no node" / "no holder" inside the int columns, never outside the index


class Nodes:
    """The node columns, the key table over them, and the namespace roots.

    Args:
        page_tokens: tokens per page.
        keys: the index's prefix keys (for root keys).
        on_grow: called with the new capacity whenever the columns grow, so that other
            per-node columns (the holders) grow with them.
    """

    def __init__(self, page_tokens: int, keys: PrefixKeys, on_grow: Callable[[int], None]):
        self.page_tokens = page_tokens
        self.page_bytes = 4 * page_tokens
        self.keys = keys
        self.table = KeyTable()
        self._on_grow = on_grow
        self.capacity = 0
        self.allocated = 0  # node ids handed out so far; the free ones are in `free`
        self.tokens_arr = np.zeros((0, page_tokens), TOKEN_DTYPE)  # (nodes, page_tokens)
        self.parent_arr = np.zeros(0, np.intp)
        self.first_child_arr = np.zeros(0, np.int32)
        self.next_sibling_arr = np.zeros(0, np.int32)
        self.prev_sibling_arr = np.zeros(0, np.int32)
        self.key_arr = np.zeros(0, np.int64)  # prefix key; a root's is its namespace's
        self.depth_arr = np.zeros(0, np.int32)  # pages from the root: 1 for a first page
        self.last_access_arr = np.zeros(0, np.int64)  # the index's logical clock
        self.chained_arr = np.zeros(0, np.uint8)  # 1: the node's parent is node id - 1
        self.roots: dict[Namespace, int] = {}
        self.root_namespace: dict[int, Namespace] = {}
        self.free: list[int] = []
        self.num_pages = 0
        self.max_depth = 0  # no prompt matches deeper than the deepest node ever made
        self.view = self._view()

    def grow(self, capacity: int) -> None:
        """Extend every column to `capacity` nodes and rebind the memoryviews."""
        self.tokens_arr = tokens = grown(self.tokens_arr, capacity, 0)
        self.token_bytes = memoryview(tokens).cast("B")
        self.parent_arr = grown(self.parent_arr, capacity, NONE)
        self.first_child_arr = grown(self.first_child_arr, capacity, NONE)
        self.next_sibling_arr = grown(self.next_sibling_arr, capacity, NONE)
        self.prev_sibling_arr = grown(self.prev_sibling_arr, capacity, NONE)
        self.key_arr = grown(self.key_arr, capacity, 0)
        self.depth_arr = grown(self.depth_arr, capacity, 0)
        self.last_access_arr = grown(self.last_access_arr, capacity, 0)
        self.chained_arr = grown(self.chained_arr, capacity, 0)
        self.parent = memoryview(self.parent_arr)
        self.first_child = memoryview(self.first_child_arr)
        self.next_sibling = memoryview(self.next_sibling_arr)
        self.prev_sibling = memoryview(self.prev_sibling_arr)
        self.key = memoryview(self.key_arr)
        self.depth = memoryview(self.depth_arr)
        self.last_access = memoryview(self.last_access_arr)
        self.chained = memoryview(self.chained_arr)
        self.capacity = capacity
        self.view = self._view()
        self._on_grow(capacity)

    def _view(self) -> NodeView:
        """The compiled match walk over the columns as they are now (`walk.walk`)."""
        return NodeView(
            self.tokens_arr,
            self.parent_arr,
            self.first_child_arr,
            self.chained_arr,
            self.key_arr,
            self.table,
            self.keys.compiled,
        )

    def compiled_nbytes(self) -> int:
        """Bytes held in compiled structures (the key table, the key coefficients), which
        tracemalloc does not see."""
        return self.table.nbytes + self.keys.nbytes

    def allocate(self) -> int:
        """A node id with empty links and no holders."""
        if self.free:
            return self.free.pop()
        if self.allocated == self.capacity:
            # A quarter more each time: amortised O(1), and at most a fifth of the columns
            # idle (doubling would leave up to half of them idle).
            self.grow(self.capacity + self.capacity // 4 + 64)
        self.allocated += 1
        return self.allocated - 1

    def root(self, namespace: Namespace) -> int:
        """The root of `namespace`, made if it has none."""
        root = self.roots.get(namespace)
        if root is not None:
            return root
        root = self.allocate()
        self.key[root] = self.keys.root_key(namespace)
        self.depth[root] = 0
        self.roots[namespace] = root
        self.root_namespace[root] = namespace
        return root

    def new_node(self, parent: int, key: int, tokens: bytes) -> int:
        """A new child of `parent` holding page `tokens` under `key`."""
        node = self.allocate()
        size = self.page_bytes
        self.token_bytes[node * size : (node + 1) * size] = tokens
        self.key[node] = key
        depth = self.depth[node] = self.depth[parent] + 1
        self.max_depth = max(self.max_depth, depth)
        self.parent[node] = parent
        self.chained[node] = parent == node - 1
        first = self.first_child[parent]
        self.next_sibling[node] = first
        if first != NONE:
            self.prev_sibling[first] = node
        self.first_child[parent] = node
        self.table.insert(key, node)
        self.num_pages += 1
        return node

    def release(self, node: int) -> None:
        """Unlink an empty, childless node from its parent and put it on the free list."""
        parent = self.parent[node]
        if parent != NONE:
            prev, following = self.prev_sibling[node], self.next_sibling[node]
            if prev != NONE:
                self.next_sibling[prev] = following
            else:
                self.first_child[parent] = following
            if following != NONE:
                self.prev_sibling[following] = prev
            self.table.remove(self.key[node], node)
            self.num_pages -= 1
        else:
            del self.roots[self.root_namespace.pop(node)]
        self.parent[node] = self.next_sibling[node] = self.prev_sibling[node] = NONE
        self.key[node] = self.chained[node] = 0
        self.free.append(node)

    def child(self, parent: int, key: int, tokens: bytes) -> int | None:
        """The child of `parent` whose page is exactly `tokens`, found through its key (the
        walk's own lookup, compiled)."""
        return self.view.child(parent, key, tokens)

    def is_ancestor_or_self(self, ancestor: int, node: int) -> bool:
        while node != NONE:
            if node == ancestor:
                return True
            node = self.parent[node]
        return False


def grown(column: np.ndarray, capacity: int, fill: int) -> np.ndarray:
    """`column` extended to `capacity` nodes (its first axis), the new entries `fill`."""
    extended = np.full((capacity, *column.shape[1:]), fill, column.dtype)
    extended[: len(column)] = column
    return extended
