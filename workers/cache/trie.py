"""The prefix trie: runs under one root per namespace, and the walk that matches a prompt.

The roots are namespaces (model, adapter, tenant salt), so pages are only ever shared
inside one namespace. The trie makes, splits, trims and removes runs and numbers their
pages; who references a run and when it is evicted is the cache's and the evictor's
business (`prefix_cache.py`, `evictor.py`).
"""

from __future__ import annotations

from typing import NamedTuple

from cache_service.events import Namespace
from cache_service.tokens import TOKEN_BYTES
from workers.cache._walk import walk
from workers.cache.runs import Run
from workers.store.digests import root_digest

_NO_OWNERS: dict = {}  # a walk that takes published pages only (never written to)


class Match(NamedTuple):
    """What a walk of the trie found for one prompt (see `Trie.match`)."""

    path: list[Run]  # runs to reference, root's child first; their pages come first
    cow_source: Run | None  # a one-page run whose first slots are copied, or None
    reuse: int  # tokens whose KV the request gets: the path's pages, then copied slots
    aligned_away: int  # cached tokens past the last chunk boundary (computed instead)


class Trie:
    """The runs of every namespace, the ids of their pages and how many pages they hold.

    Not thread-safe: the cache's lock guards it.
    """

    def __init__(self, page_tokens: int, chunk_tokens: int, kv_format: str, num_pages: int = 0):
        self.page_tokens = page_tokens
        self.chunk_tokens = chunk_tokens  # a match is rounded down to a multiple (0: off)
        self.step = page_tokens * TOKEN_BYTES  # bytes of one packed page
        self.kv_format = kv_format  # the allocator's KV format: part of every root digest
        self.roots: dict[Namespace, Run] = {}
        self.next_id = 0  # the id of the next page to enter the trie
        self.num_pages = 0  # pages in the trie
        # Where each page id was last seen (`run_of`), by page id: a run and the page's node
        # id. Brought up to date only when asked: the runs made since (new or split off)
        # wait in `_unplaced`, so that making a run costs one append; past `_unplaced_max`
        # the list is dropped and the next lookup walks the whole trie instead. A later
        # split moves a run's first pages into a new run above it, and a trim or a
        # removal takes pages off, so an entry is a hint that `run_of` follows up the
        # parents and checks.
        self._entered: list[Run | None] = []  # grown to the highest page id placed
        self._node_ids: list[int] = []
        self._unplaced: list[Run] = []
        self._unplaced_max = max(1024, num_pages)
        self._rewalk = False

    def root(self, namespace: Namespace) -> Run:
        """The root of `namespace`, made on first use."""
        root = self.roots.get(namespace)
        if root is None:
            # first_depth 1: the depth its first child's first page takes (see new_run)
            root = self.roots[namespace] = Run(namespace, None, [], None, -1, 1)
            root.digests = [root_digest(namespace, self.kv_format)]
        return root

    def new_run(self, key: bytes, head: bytes, pages: list[int], parent: Run) -> Run:
        """A pending run of `pages` (keyed `key`, first page `head`) under `parent`."""
        depth = parent.first_depth + len(parent.pages)
        run = Run(key, head, pages, parent, self.next_id, depth)
        self._unplace(run)
        self.next_id += len(pages)
        parent.add_child(run)
        self.num_pages += len(pages)
        return run

    def split(self, run: Run, k: int, owners: dict[Run, int] | None) -> Run:
        """Cut `run` after its first `k` pages; returns the new run of those pages.

        `run` keeps its last pages (and with them its heap entry, its rank and every
        allocation that ends in it); the new run takes its place under its parent, and
        in `owners` (a batch's pending runs) the owner of `run`.
        """
        assert 0 < k < len(run.pages), f"cannot split a run of {len(run.pages)} at {k}"
        step = self.step
        low = Run(
            run.key[: k * step], run.head, run.pages[:k], run.parent, run.first_id, run.first_depth
        )
        low.ready, low.ref_count = run.ready, run.ref_count
        low.last_access, low.hits = run.last_access, run.hits
        if run.digests is not None:
            low.digests = run.digests[:k]
            del run.digests[:k]
        run.parent.replace_child(run, low)
        run.key = run.key[k * step :]
        run.head = run.key[:step]
        del run.pages[:k]
        run.first_id += k
        run.first_depth += k
        run.parent = low
        low.children = {run.head: run}
        if owners is not None and run in owners:
            owners[low] = owners[run]
        self._unplace(low)
        return low

    def trim(self, run: Run, keep: int) -> None:
        """Drop the pages of published `run` after its first `keep` (evicted, tail first)."""
        self.num_pages -= len(run.pages) - keep
        del run.pages[keep:]
        del run.digests[keep:]
        run.key = run.key[: keep * self.step]

    def remove_run(self, run: Run) -> None:
        """Take `run` (a leaf) out of the trie, and its root once that has no children."""
        parent = run.parent
        parent.remove_child(run)
        run.alive = False
        self.num_pages -= len(run.pages)
        if parent.parent is None and not parent.children:
            del self.roots[parent.key]  # a root's key is its namespace

    def _unplace(self, run: Run) -> None:
        unplaced = self._unplaced
        unplaced.append(run)
        if len(unplaced) > self._unplaced_max:
            unplaced.clear()
            self._rewalk = True

    def _place(self, runs) -> None:
        """Record where the pages of `runs` are (later runs win: a page id reused)."""
        entered, node_ids = self._entered, self._node_ids
        for run in runs:
            if not run.alive or not run.pages:
                continue
            top = max(run.pages)
            if top >= len(entered):
                entered.extend([None] * (top + 1 - len(entered)))
                node_ids.extend([0] * (top + 1 - len(node_ids)))
            for node_id, page in enumerate(run.pages, run.first_id):
                entered[page] = run
                node_ids[page] = node_id

    def run_of(self, page: int) -> Run | None:
        """The run of the trie that holds page id `page`, or None when none does."""
        if self._rewalk:
            self._rewalk = False
            self._unplaced.clear()
            self._place(self._all_runs())
        elif self._unplaced:
            self._place(self._unplaced)
            self._unplaced.clear()
        if not 0 <= page < len(self._entered):
            return None
        run, node_id = self._entered[page], self._node_ids[page]
        # A page's node id never changes; a split leaves the first pages' ids to the new
        # run above, so an id below a run's first is further up.
        while run is not None and run.parent is not None and node_id < run.first_id:
            run = run.parent
        if run is None or run.parent is None or not run.alive:
            return None
        i = node_id - run.first_id
        return run if i < len(run.pages) and run.pages[i] == page else None

    def _all_runs(self):
        """Every run of the trie, published or pending, in no particular order."""
        for root in self.roots.values():
            stack = list(root.iter_children())
            while stack:
                run = stack.pop()
                yield run
                stack.extend(run.iter_children())

    def published_runs(self):
        """Every published run, in no particular order."""
        for root in self.roots.values():
            stack = list(root.iter_children())
            while stack:
                run = stack.pop()
                if run.ready:
                    yield run
                stack.extend(run.iter_children())

    def match_length(self, packed: bytes, namespace: Namespace) -> int:
        """Tokens of `packed` in full published pages."""
        return walk(self.roots.get(namespace), packed, self.step, _NO_OWNERS)[1] // TOKEN_BYTES

    def match(self, packed: bytes, namespace: Namespace, owners: dict[Run, int]) -> Match:
        """Walk the trie: the runs to reference, the page to copy from, tokens reused.

        Full pages match by exact token bytes; pending pages match only if a request of
        the same batch computes them (`owners`). Past the last full page, a published
        page sharing a first part of the next page is a copy-on-write candidate. Runs are
        split so that the path ends at a run's end and the copy source is a run of one
        page: those pages' state is about to change, and a run's pages share theirs.
        """
        p = self.page_tokens
        n = len(packed) // TOKEN_BYTES
        # The compiled walk (workers/cache/csrc/walk.cpp): the runs whose pages match
        # (`walked`; the last may match only its first pages), the bytes they cover, and
        # past them the published page sharing most of the next page's first tokens: the
        # next page of the run the prompt leaves partway, else the best child.
        root = self.roots.get(namespace)
        walked, end, partial, partial_len = walk(root, packed, self.step, owners)
        matched = end // self.step

        # Leave at least the last prompt token to compute: the model needs its logits.
        reuse = min(matched * p + partial_len, n - 1)
        aligned_away = reuse % self.chunk_tokens if self.chunk_tokens else 0
        reuse -= aligned_away
        full = reuse // p
        # The path: the walked runs up to page `full`, the last one split there if needed.
        # `after` is the walked run that then begins at page `full`, if any.
        path: list[Run] = []
        depth, after = 0, None
        for run in walked:
            if depth == full:
                after = run
                break
            if depth + len(run.pages) > full:
                path.append(self.split(run, full - depth, owners))
                after = run  # what is left of it begins at `full`
                break
            path.append(run)
            depth += len(run.pages)
        cow_source = None
        if reuse % p:
            # A copy of the first slots of the page at `full`: a matched page (the reuse
            # was cut short of it), or the partial match.
            cow_source = after if full < matched else partial
            if not cow_source.ready:  # a batch sibling's page holds no KV yet: no copy
                reuse -= reuse % p
                cow_source = None
            elif len(cow_source.pages) > 1:
                cow_source = self.split(cow_source, 1, owners)
        return Match(path, cow_source, reuse, aligned_away)
