"""The trie's nodes as numpy columns indexed by node id: structure, keys, tokens, access.

The index holds about a million pages, and a Python object per node costs several
hundred bytes; a struct of columns costs a few dozen. The columns are numpy arrays owned
here (so they are read with numpy and memoryviews, and integrity checks see them whole);
the match walk and every write (new nodes, holders, pruning) run in compiled code over
them (`trie`, a `Trie` from csrc/trie.hpp, attached to the columns again each time they
grow). `grow` replaces every column together, so callers look the columns up on the
`Nodes` object each time rather than keeping them.

Node ids are handed out by the trie, which keeps the free list. A root per namespace
(depth 0, no page) holds the first pages of its prompts as children; a child list is a
doubly linked list through the sibling columns. Pages published in one chain get
consecutive node ids, and a node whose parent is node id - 1 is flagged `chained`, so the
walk can follow a chain by ids alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cache_service.events import TIERS, Namespace
from cache_service.index._compiled import KeyTable, Trie
from cache_service.index.keys import PrefixKeys
from cache_service.tokens import TOKEN_DTYPE

if TYPE_CHECKING:
    from cache_service.index.holders import Holders

NONE = -1  # "no node" / "no holder" inside the int columns, never outside the index
# The node columns and what fills their unused entries.
_COLUMNS = (
    ("tokens_arr", 0),
    ("parent_arr", NONE),
    ("first_child_arr", NONE),
    ("next_sibling_arr", NONE),
    ("prev_sibling_arr", NONE),
    ("key_arr", 0),
    ("depth_arr", 0),
    ("last_access_arr", 0),
    ("chained_arr", 0),
)


class Nodes:
    """The node columns, the key table over them, the compiled trie, the namespace roots.

    Args:
        page_tokens: tokens per page.
        keys: the index's prefix keys (for root keys).
        holders: the holder columns, grown with the node columns.
    """

    def __init__(self, page_tokens: int, keys: PrefixKeys, holders: Holders):
        self.page_tokens = page_tokens
        self.page_bytes = 4 * page_tokens
        self.keys = keys
        self.table = KeyTable()
        self.trie = Trie(self.table, keys.compiled, len(TIERS))
        self._holders = holders
        holders.trie = self.trie
        self.capacity = 0
        self.tokens_arr = np.zeros((0, page_tokens), TOKEN_DTYPE)  # (nodes, page_tokens)
        self.parent_arr = np.zeros(0, np.int32)
        self.first_child_arr = np.zeros(0, np.int32)
        self.next_sibling_arr = np.zeros(0, np.int32)
        self.prev_sibling_arr = np.zeros(0, np.int32)
        self.key_arr = np.zeros(0, np.int64)  # prefix key; a root's is its namespace's
        self.depth_arr = np.zeros(0, np.int32)  # pages from the root: 1 for a first page
        self.last_access_arr = np.zeros(0, np.int64)  # the index's logical clock
        self.chained_arr = np.zeros(0, np.uint8)  # 1: the node's parent is node id - 1
        self.roots: dict[Namespace, int] = {}
        self.root_namespace: dict[int, Namespace] = {}

    @property
    def allocated(self) -> int:
        """Node ids handed out so far (the free ones among them are in `free`)."""
        return self.trie.allocated

    @property
    def num_pages(self) -> int:
        return self.trie.num_pages

    @property
    def max_depth(self) -> int:
        """No prompt matches deeper than the deepest node ever made."""
        return self.trie.max_depth

    @property
    def free(self) -> tuple[int, ...]:
        return self.trie.free

    def grow(self, capacity: int) -> None:
        """Extend every column (the holders' too) to `capacity` nodes and attach them."""
        # Nothing may view a column while it is resized in place: the trie and the
        # memoryviews let go of them first (a view held elsewhere makes it a copy).
        self.trie.detach()
        holders = self._holders
        holders.release_views()
        self.parent = self.first_child = self.next_sibling = self.prev_sibling = None
        self.key = self.depth = self.last_access = self.chained = None
        for name, fill in _COLUMNS:
            extend(self, name, capacity, fill)
        self.parent = memoryview(self.parent_arr)
        self.first_child = memoryview(self.first_child_arr)
        self.next_sibling = memoryview(self.next_sibling_arr)
        self.prev_sibling = memoryview(self.prev_sibling_arr)
        self.key = memoryview(self.key_arr)
        self.depth = memoryview(self.depth_arr)
        self.last_access = memoryview(self.last_access_arr)
        self.chained = memoryview(self.chained_arr)
        self.capacity = capacity
        holders.grow(capacity)
        self.trie.attach(
            self.tokens_arr,
            self.parent_arr,
            self.first_child_arr,
            self.next_sibling_arr,
            self.prev_sibling_arr,
            self.key_arr,
            self.depth_arr,
            self.last_access_arr,
            self.chained_arr,
            holders.count_arr,
            holders.slot_arr,
            holders.page_arr,
            holders.generation_arr,
            holders.tier_arr,
        )

    def reserve(self, count: int) -> None:
        """Make room for `count` new nodes without another growth."""
        room = self.trie.room
        if room < count:
            # A quarter more each time: amortised O(1), and at most a fifth of the columns
            # idle (doubling would leave up to half of them idle).
            self.grow(max(self.capacity + self.capacity // 4 + 64, self.capacity + count - room))

    def compiled_nbytes(self) -> int:
        """Bytes held in compiled structures (the key table, the key coefficients, the
        free list and extra holders), which tracemalloc does not see."""
        return self.table.nbytes + self.keys.nbytes + self.trie.nbytes

    def root(self, namespace: Namespace) -> int:
        """The root of `namespace`, made if it has none."""
        root = self.roots.get(namespace)
        if root is not None:
            return root
        self.reserve(1)
        root = self.trie.new_root(self.keys.root_key(namespace))
        self.roots[namespace] = root
        self.root_namespace[root] = namespace
        return root

    def release_emptied_roots(self) -> None:
        """Free the roots the last writes left without children."""
        for root in self.trie.take_emptied_roots():
            if root in self.root_namespace and self.first_child[root] == NONE:
                del self.roots[self.root_namespace.pop(root)]
                self.trie.release_root(root)


def extend(owner: object, name: str, capacity: int, fill: int) -> None:
    """Extend `owner`'s column `name` to `capacity` nodes (its first axis), the new entries
    `fill`: resized in place (realloc, which moves large blocks without copying them)
    when nothing else refers to it, else copied. The columns are C-contiguous, so the old
    rows stay where they were."""
    column = getattr(owner, name)
    setattr(owner, name, None)  # this frame's reference is then the only one
    size = len(column)
    try:
        column.resize((capacity, *column.shape[1:]), refcheck=True)
    except ValueError:  # another reference to it (a view someone holds): copy
        copy = np.empty((capacity, *column.shape[1:]), column.dtype)
        copy[:size] = column
        column = copy
    column[size:] = fill
    setattr(owner, name, column)
