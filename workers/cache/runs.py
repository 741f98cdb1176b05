"""The prefix trie's node, the run (the walk that compares packed token keys along runs is
compiled: `workers/cache/csrc/walk.cpp`).

The trie's unit is the page (`page_tokens` token ids): pages are matched, referenced,
published and evicted one by one. Its nodes are *runs*: a run is a chain of full pages
that nothing tells apart (no branch between them, and the same references, readiness and
access history), stored as one node, as SGLang's radix tree stores multi-token edges. A
1,536-token system prompt shared by every request is then one node: matching it is one
dict lookup and one comparison of its token bytes, and referencing it one increment,
instead of 96 of each. A run is split where a prompt leaves it or where its pages stop
sharing their state (a match or a publish ending inside it); its tail page is trimmed
when that page is evicted. Which page is evicted, and every event, counter and page id,
is what a trie of one node per page would give: the tests pin them.

Keys are the pages' token ids packed as int32 bytes (`cache_service.tokens`): a dict
lookup on a run's first page finds it among its siblings, and a byte comparison of the
whole run confirms it, so a hash collision can never serve another prompt's KV. Bytes
rather than tuples of ints because a bytes object caches its hash and compares with
memcmp.
"""

from __future__ import annotations

from cache_service.tokens import TOKEN_BYTES

_SCAN_LIMIT = 16  # children scanned one by one for a partial match before indexing them


class Run:
    """A node of the trie: a chain of full pages sharing one state (or a namespace root,
    with no pages).

    Every page of a run has the same references, readiness, last access and hits, and
    only its last page may have children: whatever would tell two of its pages apart
    splits the run first. `node_id` and `depth` are those of the last page, the only one
    that can be an evictable leaf, so an eviction policy ranks a run as that page.
    """

    __slots__ = (
        "key",
        "head",
        "pages",
        "parent",
        "children",
        "by_first",
        "first_id",
        "first_depth",
        "ready",
        "ref_count",
        "last_access",
        "hits",
        "heap_version",
        "alive",
        "digests",
    )

    def __init__(
        self,
        key,
        head,
        pages: list[int],
        parent: Run | None,
        first_id: int,
        first_depth: int,
    ):
        self.key = key  # the pages' token ids, packed back to back; a root's is its Namespace
        self.head = head  # the first page's packed tokens: the run's key in its parent
        self.pages = pages
        self.parent = parent
        # Created on the first child: most runs are leaves, and every container object
        # a request allocates is one more for Python's cyclic GC to walk.
        self.children: dict[bytes, Run] | None = None
        # first token -> children starting with it, kept only for wide fan-outs (a root
        # under many distinct prompts), where a partial match would otherwise scan all.
        self.by_first: dict[bytes, list[Run]] | None = None
        # Page i of the run has id first_id + i (ids rise in creation order) and depth
        # first_depth + i (pages from the namespace root, 1 = first page).
        self.first_id = first_id
        self.first_depth = first_depth
        self.ready = parent is None
        self.ref_count = 0
        self.last_access = 0
        self.hits = 0
        self.heap_version = 0
        self.alive = True
        # The chain digest of each page once published (a root's: [its root digest]), so
        # a child's first digest is one hash of digests[-1] and its key, never a walk.
        self.digests: list[bytes] | None = None

    @property
    def node_id(self) -> int:
        return self.first_id + len(self.pages) - 1

    @property
    def depth(self) -> int:
        return self.first_depth + len(self.pages) - 1

    def is_evictable_leaf(self) -> bool:
        """In the trie, published, unreferenced and childless: its last page may go."""
        return self.alive and self.ready and self.ref_count == 0 and not self.children

    def child(self, head: bytes) -> Run | None:
        return None if self.children is None else self.children.get(head)

    def add_child(self, run: Run) -> None:
        if self.children is None:
            self.children = {}
        self.children[run.head] = run
        if self.by_first is not None:
            self.by_first.setdefault(run.head[:TOKEN_BYTES], []).append(run)
        elif len(self.children) > _SCAN_LIMIT:
            self.by_first = {}
            for child in self.children.values():
                self.by_first.setdefault(child.head[:TOKEN_BYTES], []).append(child)

    def replace_child(self, old: Run, new: Run) -> None:
        """Put `new` where `old` was (same head): the order of children is kept."""
        self.children[new.head] = new
        if self.by_first is not None:
            siblings = self.by_first[new.head[:TOKEN_BYTES]]
            siblings[siblings.index(old)] = new

    def remove_child(self, run: Run) -> None:
        del self.children[run.head]
        if not self.children:
            self.children = self.by_first = None
        elif self.by_first is not None:
            first = run.head[:TOKEN_BYTES]
            siblings = self.by_first[first]
            siblings.remove(run)
            if not siblings:
                del self.by_first[first]

    def starting_with(self, first: bytes):
        """Children whose first token is `first` (packed)."""
        if self.children is None:
            return ()
        if self.by_first is not None:
            return self.by_first.get(first, ())
        return [child for child in self.children.values() if child.head.startswith(first)]

    def iter_children(self):
        return () if self.children is None else self.children.values()


def pages_for(n_tokens: int, page_tokens: int) -> int:
    """Pages that hold `n_tokens` tokens."""
    return -(-n_tokens // page_tokens)
