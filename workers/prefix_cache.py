"""The worker's local prefix cache: a page-granular trie over token ids.

Each trie node is one full page of `page_tokens` token ids, stored under the node of the
page before it; the roots are namespaces (model, adapter, tenant salt), so pages are only
ever shared inside one namespace. A match walks the trie comparing the token ids of every
page exactly (dict lookups keyed by the page's token ids packed as int32 bytes: a hash
finds the candidate, byte equality confirms it), so a hash collision can never serve
another prompt's KV. Bytes rather than tuples of ints because a bytes object caches its
hash and compares with memcmp: the walk costs a slice and a lookup per page.

One acquire lays out a request's pages like this:

    tokens  |<-------- reused -------->|<------------- computed ------------->|
            |  full pages    | part of |                                      |
    pages   [ n0 ][ n1 ][ n2 ][  c3   ][ p4 ][ p5 ][ p6 ][ p7 ][ q8 ]   [ d9 ]
             `-- trie nodes, ref'd --'  `-- new trie nodes, pending --' priv.  decode
                                 c3: copy-on-write of a cached page of which only
                                     the first tokens match; the rest is computed

- n0..n2 are cached pages this request reuses; its reference pins them against eviction.
- c3 is a private copy of a cached page that matched only partly: its matched token
  slots are copied, the rest are computed into it.
- c3..p7 are the request's full prompt pages: they enter the trie at once as *pending*
  nodes (not yet matchable) so that `acquire_batch` can share them inside a batch, and
  become shareable when the request `publish`es them.
- q8 (the partial last page) and d9 (decode slots) stay private until they are full and
  published (decode pages only if `publish_decode_pages`).

Page accounting: every page is free (in the allocator), cached (in the trie, no
references) or in use (referenced by a live allocation, as a trie node or privately);
`check_integrity()` proves free + cached + in-use == total.

Digests: when a page becomes shareable, its chain digest (`workers.digests`: namespace,
the allocator's KV format, every token up to the end of the page) is computed from its
parent node's, kept on its node and recorded with the allocator, so a peer copying the page
can check it holds what the peer asked for. Pending, private, copy-on-write and unpublished
decode pages record none (`EMPTY_DIGEST`).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from cache_service.events import AllCleared, KvEvent, Namespace, PagesRemoved, PagesStored
from cache_service.tokens import TOKEN_BYTES as _TOKEN_BYTES
from cache_service.tokens import pack_tokens, token_tuple
from workers.digests import EMPTY_DIGEST, extend_chain, next_digest, root_digest
from workers.eviction import EVICTION_POLICIES, make_eviction_policy
from workers.page_pool import PageAllocator


@dataclass(frozen=True)
class PrefixCacheConfig:
    """How the local prefix cache matches and keeps pages."""

    # 16 tokens per page: the granularity of vLLM/SGLang paged attention; smaller pages
    # match more of a prompt but cost more trie nodes per token.
    page_tokens: int = 16
    eviction_policy: str = "lru"
    # Chunked prefill computes in chunks of this many tokens; a match is rounded down to
    # a multiple of it so the first computed chunk starts on a chunk boundary. 0: off.
    chunk_tokens: int = 0
    # Pages filled during decode become shareable (a follow-up turn reuses the answer).
    publish_decode_pages: bool = True

    def __post_init__(self) -> None:
        if self.page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {self.page_tokens}")
        if self.chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0, got {self.chunk_tokens}")
        if self.eviction_policy not in EVICTION_POLICIES:
            known = ", ".join(sorted(EVICTION_POLICIES))
            raise ValueError(f"unknown eviction_policy {self.eviction_policy!r}; known: {known}")


@dataclass
class CacheStats:
    """Counters of one prefix cache. Hit tokens count only KV that was reused, never
    tokens that were recomputed (the last prompt token, chunk alignment, batch siblings).
    """

    queries: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0  # reused from cached pages, including copy-on-write tokens
    cow_tokens: int = 0  # of hit_tokens, reused by copying part of a cached page
    batch_shared_tokens: int = 0  # computed once by another request of the same batch
    computed_tokens: int = 0
    failed_acquires: int = 0  # not enough pages even after eviction
    allocated_pages: int = 0  # taken from the allocator (new KV, copies, decode slots)
    published_pages: int = 0
    aborted_pages: int = 0  # pending pages dropped because their request never published
    evictions: dict[str, int] = field(default_factory=dict)  # reason -> pages

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = dict(self.__dict__)
        out["evictions"] = dict(self.evictions)
        return out


class _Node:
    """One full page in the trie (or a namespace root, with `page` None)."""

    __slots__ = (
        "key",
        "page",
        "parent",
        "children",
        "by_first",
        "depth",
        "node_id",
        "ready",
        "ref_count",
        "last_access",
        "hits",
        "heap_version",
        "alive",
        "digest",
    )

    def __init__(self, key, page: int | None, parent: _Node | None, node_id: int):
        self.key = key  # the page's token ids, packed; a root's key is its Namespace
        self.page = page
        self.parent = parent
        # Created on the first child: most nodes are leaves, and every container object
        # a request allocates is one more for Python's cyclic GC to walk.
        self.children: dict[bytes, _Node] | None = None
        # first token -> children starting with it, kept only for wide fan-outs (a root
        # under many distinct prompts), where a partial match would otherwise scan all.
        self.by_first: dict[bytes, list[_Node]] | None = None
        self.depth = 0 if parent is None else parent.depth + 1
        self.node_id = node_id
        self.ready = parent is None
        self.ref_count = 0
        self.last_access = 0
        self.hits = 0
        self.heap_version = 0
        self.alive = True
        # The chain digest of the page, set when it is published (a root's at creation):
        # a child's digest is one hash of this and its key, never a walk from the root.
        self.digest: bytes | None = None

    def child(self, key: bytes) -> _Node | None:
        return None if self.children is None else self.children.get(key)

    def add_child(self, node: _Node) -> None:
        if self.children is None:
            self.children = {}
        self.children[node.key] = node
        if self.by_first is not None:
            self.by_first.setdefault(node.key[:_TOKEN_BYTES], []).append(node)
        elif len(self.children) > _SCAN_LIMIT:
            self.by_first = {}
            for child in self.children.values():
                self.by_first.setdefault(child.key[:_TOKEN_BYTES], []).append(child)

    def remove_child(self, node: _Node) -> None:
        del self.children[node.key]
        if not self.children:
            self.children = self.by_first = None
        elif self.by_first is not None:
            first = node.key[:_TOKEN_BYTES]
            siblings = self.by_first[first]
            siblings.remove(node)
            if not siblings:
                del self.by_first[first]

    def starting_with(self, first: bytes):
        """Children whose first token is `first` (packed)."""
        if self.children is None:
            return ()
        if self.by_first is not None:
            return self.by_first.get(first, ())
        return [child for child in self.children.values() if child.key.startswith(first)]

    def iter_children(self):
        return () if self.children is None else self.children.values()


class BatchEntry(NamedTuple):
    """One request of a batch plan.

    The request computes tokens [compute_from, num_tokens); the pages before
    `compute_from` hold cached KV or KV that the requests in `depends_on` compute, so it
    must run after them (or in the same forward pass, reading their pages).
    """

    allocation: Allocation
    compute_from: int
    depends_on: tuple[int, ...]


class Allocation:
    """A request's pages: cached prefix pages it references plus pages it computes into.

    Attributes:
        namespace: the key root the request was matched under.
        tokens: the request's token ids so far (prompt, then decoded tokens via extend()).
        pages: page ids covering token slots [0, capacity), in order.
        cached_tokens: tokens whose KV was present at acquire; compute from here.
        prompt_tokens: the prompt length at acquire.
    """

    def __init__(
        self,
        cache: PrefixCache,
        namespace: Namespace,
        tokens: list[int],
        packed: bytes,
        pages: list[int],
        nodes: list[_Node],
        cached_tokens: int,
        chain_broken: bool,
    ):
        self._cache = cache
        self.namespace = namespace
        self.tokens = tokens
        self._packed = packed  # tokens as int32 bytes: page keys are slices of it
        self.pages = pages
        self._nodes = nodes  # trie nodes of pages[0:len(nodes)], each holding our reference
        self.cached_tokens = cached_tokens
        self.prompt_tokens = len(tokens)
        # A page of this prompt collided with a page another request holds unpublished:
        # the pages after it stay private (they cannot hang under someone else's pending
        # page, which may be dropped).
        self._chain_broken = chain_broken
        self.released = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def capacity(self) -> int:
        return len(self.pages) * self._cache.page_tokens

    @property
    def private_pages(self) -> list[int]:
        """Pages only this allocation uses (not in the trie)."""
        return self.pages[len(self._nodes) :]

    def publish(self, n_tokens: int) -> int:
        """Declare the KV of tokens [0, n_tokens) written, making its full pages shareable.

        Pages filled during decode (beyond the prompt) are published only if the cache's
        `publish_decode_pages` is set.

        Returns:
            The number of pages that became shareable by this call.
        Raises:
            ValueError: n_tokens is negative or beyond the allocation's tokens.
            RuntimeError: the allocation was released.
        """
        with self._cache._lock:
            self._check_live()
            if not 0 <= n_tokens <= len(self.tokens):
                raise ValueError(
                    f"cannot publish {n_tokens} tokens of an allocation holding {len(self.tokens)}"
                )
            return self._cache._publish(self, n_tokens)

    def extend(self, new_tokens: Sequence[int]) -> bool:
        """Append decoded token ids, growing the allocation by pages as needed.

        Returns:
            False (and nothing changed) when the pages cannot be had even after eviction.
        Raises:
            RuntimeError: the allocation was released.
        """
        with self._cache._lock:
            self._check_live()
            new_tokens = _as_token_list(new_tokens)
            packed = pack_tokens(new_tokens)
            needed = _pages_for(len(self.tokens) + len(new_tokens), self._cache.page_tokens)
            grow = needed - len(self.pages)
            if grow > 0:
                pages = self._cache._allocate(grow, pinned=())
                if pages is None:
                    return False
                self.pages.extend(pages)
            self.tokens.extend(new_tokens)
            self._packed += packed
            return True

    def release(self) -> None:
        """Drop this allocation's references; published pages stay cached until evicted.

        Raises:
            RuntimeError: released twice.
        """
        with self._cache._lock:
            self._check_live()
            self._cache._release(self)

    def _check_live(self) -> None:
        if self.released:
            raise RuntimeError("allocation already released")


class PrefixCache:
    """Page-granular prefix trie over a page allocator; see the module docstring.

    Thread-safe: one re-entrant lock guards the trie, the allocations and the allocator,
    so concurrent request threads of a worker may acquire, publish and release at once.
    """

    def __init__(self, allocator: PageAllocator, config: PrefixCacheConfig | None = None):
        self.config = config or PrefixCacheConfig()
        self.page_tokens = self.config.page_tokens
        self._allocator = allocator
        # An allocator that keeps no digests (none of ours) still gets digests on its
        # nodes; there is just nothing to record them in.
        self._kv_format: str = getattr(allocator, "kv_format", "")
        self._set_digests = getattr(allocator, "set_digests", None)
        self._policy = make_eviction_policy(self.config.eviction_policy)
        self._lock = threading.RLock()
        self._roots: dict[Namespace, _Node] = {}
        self._ids = itertools.count(1)
        self._clock = 0
        self._heap: list[tuple[tuple[int, ...], int, _Node]] = []
        self._num_nodes = 0
        self._num_evictable = 0  # ready nodes with no references (all evictable, leaf first)
        self._live: dict[int, Allocation] = {}
        self._events: list[KvEvent] = []
        self._stats = CacheStats()

    # ------------------------------------------------------------------ public API

    def acquire(
        self, tokens: Sequence[int], namespace: Namespace, extra_token_slots: int = 0
    ) -> Allocation | None:
        """Match the longest cached prefix of `tokens` and allocate pages for the rest.

        At least the last prompt token is always left to compute (the model needs its
        logits), so a fully cached prompt reuses all but that token, through a
        copy-on-write of its last page.

        Args:
            tokens: the prompt's token ids (at least one).
            namespace: the key root (model, adapter, tenant salt).
            extra_token_slots: slots to reserve beyond the prompt for decode.
        Returns:
            The allocation, or None when not enough pages are free even after evicting
            every unreferenced page (nothing is then held).
        Raises:
            ValueError: empty prompt or negative extra_token_slots.
        """
        entries = self.acquire_batch([tokens], namespace, extra_token_slots)
        return None if entries is None else entries[0].allocation

    def acquire_batch(
        self,
        requests: Sequence[Sequence[int]],
        namespace: Namespace,
        extra_token_slots: int = 0,
    ) -> list[BatchEntry] | None:
        """Acquire pages for requests arriving together, computing shared prefixes once.

        Requests are planned in order: a request whose prefix matches full pages that an
        earlier request of the batch will compute references those pages instead of
        computing them again, and its entry lists that request in `depends_on`.

        Returns:
            One BatchEntry per request, or None (nothing held) when the batch does not fit.
        Raises:
            ValueError: an empty prompt or negative extra_token_slots.
        """
        if extra_token_slots < 0:
            raise ValueError(f"extra_token_slots must be >= 0, got {extra_token_slots}")
        prompts = [_as_token_list(tokens) for tokens in requests]
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"request {i} of the batch has no tokens")
        with self._lock:
            owners: dict[int, int] = {}  # pending node id -> index of the request computing it
            entries: list[BatchEntry] = []
            for index, prompt in enumerate(prompts):
                entry = self._acquire_one(prompt, namespace, extra_token_slots, owners, index)
                if entry is None:
                    for done in entries:
                        self._release(done.allocation)
                    return None
                entries.append(entry)
            return entries

    def match_length(self, tokens: Sequence[int], namespace: Namespace) -> int:
        """Tokens of `tokens` in full published pages, without referencing anything."""
        packed = pack_tokens(_as_token_list(tokens))
        step = self.page_tokens * _TOKEN_BYTES
        with self._lock:
            node = self._roots.get(namespace)
            matched = 0
            while node is not None and matched + step <= len(packed):
                node = node.child(packed[matched : matched + step])
                if node is None or not node.ready:
                    break
                matched += step
            return matched // _TOKEN_BYTES

    def evict(self, n_pages: int) -> int:
        """Evict up to `n_pages` unreferenced pages by policy; returns how many went."""
        with self._lock:
            return len(self._evict(n_pages, "evicted"))

    def clear(self) -> int:
        """Drop every unreferenced page; returns how many went.

        Emits AllCleared when nothing shareable is left, else PagesRemoved("cleared").
        """
        with self._lock:
            removed = self._evict(self._num_evictable, "cleared", emit=False)
            if not any(self._published_nodes()):
                self._events.append(AllCleared())
            elif removed:
                self._events.append(PagesRemoved(tuple(removed), "cleared"))
            return len(removed)

    def take_events(self) -> list[KvEvent]:
        """Drain the KV events (stored / removed / cleared) emitted since the last call."""
        with self._lock:
            events, self._events = self._events, []
            return events

    def snapshot(self, drain_events: bool = False) -> list[PagesStored]:
        """Every published page as PagesStored chains, parents before children (resync).

        With `drain_events`, pending events are dropped in the same critical section: the
        snapshot already contains their effect, so a resync can replace them.
        """
        with self._lock:
            if drain_events:
                self._events = []
            chains: list[PagesStored] = []
            for namespace, root in self._roots.items():
                stack = [(child, None) for child in root.iter_children()]
                while stack:
                    node, parent_page = stack.pop()
                    if not node.ready:
                        continue
                    run = [node]
                    while True:
                        kids = [c for c in run[-1].iter_children() if c.ready]
                        if len(kids) != 1:
                            break
                        run.append(kids[0])
                    chains.append(self._stored_event(namespace, parent_page, run))
                    stack.extend((kid, run[-1].page) for kid in run[-1].iter_children())
            return chains

    def stats(self) -> dict[str, object]:
        """Counters plus the page accounting (free / cached / in use / total)."""
        with self._lock:
            out = self._stats.as_dict()
            in_use = self._allocator.num_pages - self._allocator.num_free - self._num_evictable
            out.update(
                free_pages=self._allocator.num_free,
                cached_pages=self._num_evictable,
                in_use_pages=in_use,
                total_pages=self._allocator.num_pages,
                live_allocations=len(self._live),
            )
            return out

    @property
    def num_cached_pages(self) -> int:
        """Pages in the trie that no allocation references (free to evict)."""
        return self._num_evictable

    # ------------------------------------------------------------------ acquire

    def _acquire_one(
        self,
        tokens: list[int],
        namespace: Namespace,
        extra_slots: int,
        owners: dict[int, int],
        index: int,
    ) -> BatchEntry | None:
        p = self.page_tokens
        n = len(tokens)
        packed = pack_tokens(tokens)
        path, cow_source, reuse = self._match(packed, namespace, owners)
        full_ref = len(path)
        new_pages = _pages_for(n + extra_slots, p) - full_ref

        self._stats.queries += 1
        self._stats.queried_tokens += n
        pinned = path + ([cow_source] if cow_source is not None else [])
        pages = self._allocate(new_pages, pinned)
        if pages is None:
            self._stats.failed_acquires += 1
            return None

        self._clock += 1
        shared = [node for node in path if not node.ready]
        for node in path:
            self._incref(node)
            node.last_access = self._clock
            if node.ready:
                node.hits += 1
        cow_tokens = reuse - full_ref * p
        if cow_source is not None:
            # The only KV copy of an acquire: the matched slots of a partly matching page
            # into the request's own page, which the model then completes.
            self._allocator.copy_page(cow_source.page, pages[0], cow_tokens)
            cow_source.last_access = self._clock
            cow_source.hits += 1
            if self._is_evictable_leaf(cow_source):
                self._push_evictable(cow_source)  # re-rank: its key just changed

        nodes = list(path)
        chain_broken = self._insert_pending(namespace, packed, nodes, pages, owners, index)

        self._stats.hit_tokens += reuse - len(shared) * p
        self._stats.cow_tokens += cow_tokens
        self._stats.batch_shared_tokens += len(shared) * p
        self._stats.computed_tokens += n - reuse
        allocation = Allocation(
            self,
            namespace,
            tokens,
            packed,
            [node.page for node in path] + pages,
            nodes,
            reuse,
            chain_broken,
        )
        self._live[id(allocation)] = allocation
        depends_on = tuple(sorted({owners[node.node_id] for node in shared}))
        return BatchEntry(allocation, reuse, depends_on)

    def _match(
        self, packed: bytes, namespace: Namespace, owners: dict[int, int]
    ) -> tuple[list[_Node], _Node | None, int]:
        """Walk the trie: the pages to reference, the page to copy from, tokens reused.

        Full pages match by exact token tuple; nodes still pending match only if a request
        of the same batch computes them (`owners`). Past the last full page, a published
        child sharing a first part of the next page is a copy-on-write candidate.
        """
        p = self.page_tokens
        step = p * _TOKEN_BYTES
        n = len(packed) // _TOKEN_BYTES
        node = self._roots.get(namespace)
        path: list[_Node] = []
        end = step
        while node is not None and end <= len(packed):
            child = node.child(packed[end - step : end])
            if child is None or not (child.ready or child.node_id in owners):
                break
            path.append(child)
            node = child
            end += step

        partial, partial_len = None, 0
        if node is not None and len(path) * p < n and (node.ready or node.node_id in owners):
            rest = packed[end - step : end]
            for child in node.starting_with(rest[:_TOKEN_BYTES]):
                if child.ready:
                    common = _common_tokens(child.key, rest)
                    if common > partial_len:
                        partial, partial_len = child, common

        # Leave at least the last prompt token to compute: the model needs its logits.
        reuse = min(len(path) * p + partial_len, n - 1)
        if self.config.chunk_tokens:
            reuse -= reuse % self.config.chunk_tokens
        full = reuse // p
        cow_source = None
        if reuse % p:
            cow_source = path[full] if full < len(path) else partial
            if not cow_source.ready:  # a batch sibling's page holds no KV yet: no copy
                reuse -= reuse % p
                cow_source = None
        return path[:full], cow_source, reuse

    def _insert_pending(
        self,
        namespace: Namespace,
        packed: bytes,
        nodes: list[_Node],
        pages: list[int],
        owners: dict[int, int],
        index: int,
    ) -> bool:
        """Enter the request's own full prompt pages into the trie as pending nodes.

        Returns True when a page collided with an unusable node (the chain stops there).
        """
        step = self.page_tokens * _TOKEN_BYTES
        first = len(nodes)
        parent = nodes[-1] if nodes else self._root(namespace)
        for i in range(first, len(packed) // step):
            key = packed[i * step : (i + 1) * step]
            if parent.child(key) is not None:
                return True
            node = self._new_node(key, pages[i - first], parent)
            node.ref_count = 1
            node.last_access = self._clock
            owners[node.node_id] = index
            nodes.append(node)
            parent = node
        return False

    # ------------------------------------------------------------------ publish / release

    def _publish(self, allocation: Allocation, n_tokens: int) -> int:
        p = self.page_tokens
        limit = n_tokens // p
        if not self.config.publish_decode_pages:
            limit = min(limit, allocation.prompt_tokens // p)
        nodes = allocation._nodes
        newly = [node for node in nodes[:limit] if not node.ready]
        while len(nodes) < limit and not allocation._chain_broken:
            i = len(nodes)
            parent = nodes[-1] if nodes else self._root(allocation.namespace)
            key = allocation._packed[i * p * _TOKEN_BYTES : (i + 1) * p * _TOKEN_BYTES]
            if parent.child(key) is not None:
                allocation._chain_broken = True
                break
            node = self._new_node(key, allocation.pages[i], parent)
            node.ref_count = 1
            node.last_access = self._clock
            nodes.append(node)
            newly.append(node)
        if not newly:
            return 0
        # `newly` is a chain: each node's parent is the one before it, and the first's is
        # published (or the root), so one hash per page extends its parent's digest.
        parent = newly[0].parent
        digests = extend_chain(parent.digest, [node.key for node in newly])
        for node, digest in zip(newly, digests, strict=True):
            node.ready = True
            node.digest = digest
        if self._set_digests is not None:
            # After the KV is final (the caller's publish says so), before any peer can
            # hear of the pages: the event below is what announces them.
            self._set_digests([node.page for node in newly], digests)
        self._events.append(self._stored_event(allocation.namespace, parent.page, newly))
        self._stats.published_pages += len(newly)
        return len(newly)

    def _release(self, allocation: Allocation) -> None:
        allocation.released = True
        del self._live[id(allocation)]
        private = allocation.private_pages
        if private:
            self._allocator.free(private)
        aborted = []
        # Releasing counts as a use: a page read until a long generation ended is more
        # recent than one a short request acquired later and dropped at once.
        self._clock += 1
        for node in reversed(allocation._nodes):
            node.last_access = self._clock
            self._decref(node)
            if node.ref_count == 0 and not node.ready:
                # Never published: its request ended before computing it. Not shareable,
                # never announced, so it leaves silently.
                assert not node.children, f"pending page {node.page} has children"
                self._remove_node(node)
                aborted.append(node.page)
        if aborted:
            self._allocator.free(aborted)
            self._stats.aborted_pages += len(aborted)

    # ------------------------------------------------------------------ pages and eviction

    def _allocate(self, n: int, pinned: Sequence[_Node]) -> list[int] | None:
        """Take `n` pages, evicting if needed; `pinned` nodes are about to be referenced
        and must survive. None (nothing evicted, nothing taken) if `n` cannot be had.
        """
        if n <= 0:
            return []
        free = self._allocator.num_free
        if free < n:
            evictable = self._num_evictable - sum(1 for nd in pinned if nd.ref_count == 0)
            if free + evictable < n:
                return None
            for node in pinned:
                self._incref(node)
            self._evict(n - free, "evicted")
            for node in pinned:
                self._decref(node)
        pages = self._allocator.allocate(n)
        assert pages is not None, f"allocator refused {n} pages with {free} free"
        self._stats.allocated_pages += n
        return pages

    def _evict(self, n: int, reason: str, emit: bool = True) -> list[int]:
        removed: list[int] = []
        while len(removed) < n and self._heap:
            _, version, node = heapq.heappop(self._heap)
            if not self._is_evictable_leaf(node) or node.heap_version != version:
                continue
            parent = node.parent
            self._num_evictable -= 1
            self._remove_node(node)
            removed.append(node.page)
            if parent.parent is not None and parent.ref_count == 0 and not parent.children:
                self._push_evictable(parent)
        if removed:
            self._allocator.free(removed)
            self._stats.evictions[reason] = self._stats.evictions.get(reason, 0) + len(removed)
            if emit:
                self._events.append(PagesRemoved(tuple(removed), reason))
        return removed

    @staticmethod
    def _is_evictable_leaf(node: _Node) -> bool:
        return node.alive and node.ready and node.ref_count == 0 and not node.children

    def _push_evictable(self, node: _Node) -> None:
        # Lazy deletion: an entry is valid only while its version is the node's latest.
        # (key, version) is unique per entry, so the heap never compares two nodes.
        node.heap_version = next(self._ids)
        heapq.heappush(self._heap, (self._policy.key(node), node.heap_version, node))
        if len(self._heap) > 2 * self._num_evictable + 1024:
            self._heap = [
                e for e in self._heap if self._is_evictable_leaf(e[2]) and e[2].heap_version == e[1]
            ]
            heapq.heapify(self._heap)

    def _incref(self, node: _Node) -> None:
        if node.ref_count == 0 and node.ready:
            self._num_evictable -= 1
        node.ref_count += 1

    def _decref(self, node: _Node) -> None:
        assert node.ref_count > 0, f"page {node.page} released more often than acquired"
        node.ref_count -= 1
        if node.ref_count == 0 and node.ready:
            self._num_evictable += 1
            if not node.children:
                self._push_evictable(node)

    # ------------------------------------------------------------------ trie nodes

    def _root(self, namespace: Namespace) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node(namespace, None, None, next(self._ids))
            root.digest = root_digest(namespace, self._kv_format)
        return root

    def _new_node(self, key: bytes, page: int, parent: _Node) -> _Node:
        node = _Node(key, page, parent, next(self._ids))
        parent.add_child(node)
        self._num_nodes += 1
        return node

    def _remove_node(self, node: _Node) -> None:
        parent = node.parent
        parent.remove_child(node)
        node.alive = False
        self._num_nodes -= 1
        if parent.parent is None and not parent.children:
            del self._roots[parent.key]  # a root's key is its namespace

    def _published_nodes(self):
        for root in self._roots.values():
            stack = list(root.iter_children())
            while stack:
                node = stack.pop()
                if node.ready:
                    yield node
                stack.extend(node.iter_children())

    def _stored_event(
        self, namespace: Namespace, parent_page: int | None, run: Sequence[_Node]
    ) -> PagesStored:
        pages = tuple(node.page for node in run)
        return PagesStored(
            namespace=namespace,
            parent_page=parent_page,
            page_ids=pages,
            generations=tuple(self._allocator.generation(page) for page in pages),
            tokens=token_tuple(b"".join(node.key for node in run)),
        )

    # ------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Raise AssertionError unless every invariant of the cache holds.

        free + cached + in-use == total; each page in exactly one place; reference
        counts equal the live allocations that hold each node; published nodes hang
        under published parents; pending nodes are referenced; every evictable leaf has
        a live heap entry; every published node's digest chains from its parent's, and
        (when the allocator reports digests) is what its page records, while pending and
        private pages record none.
        """
        with self._lock:
            check = getattr(self._allocator, "check_integrity", None)
            if check is not None:
                check()
            expected_refs: dict[int, int] = {}
            private: set[int] = set()
            for allocation in self._live.values():
                assert not allocation.released
                for node in allocation._nodes:
                    assert node.alive, f"allocation holds removed page {node.page}"
                    expected_refs[node.node_id] = expected_refs.get(node.node_id, 0) + 1
                for page in allocation.private_pages:
                    assert page not in private, f"page {page} private to two allocations"
                    private.add(page)
                assert allocation.capacity >= allocation.num_tokens, (
                    f"allocation of {allocation.num_tokens} tokens has capacity "
                    f"{allocation.capacity}"
                )
            valid_heap = {id(e[2]) for e in self._heap if e[2].heap_version == e[1]}
            published: dict[int, bytes] = {}  # page -> the digest it must record
            trie_pages: set[int] = set()
            cached = referenced = nodes = 0
            for namespace, root in self._roots.items():
                assert root.parent is None and root.page is None and root.ready
                assert root.key == namespace, f"root of {namespace} keyed {root.key}"
                assert root.digest == root_digest(namespace, self._kv_format), (
                    f"root of {namespace} has a stale digest"
                )
                stack = [root]
                while stack:
                    node = stack.pop()
                    if node.by_first is not None:
                        indexed = sum(len(kids) for kids in node.by_first.values())
                        assert indexed == len(node.children), (
                            f"{indexed} children indexed by first token, {len(node.children)} held"
                        )
                    for child in node.iter_children():
                        assert child.parent is node and child.alive
                        if node.by_first is not None:
                            assert child in node.by_first[child.key[:_TOKEN_BYTES]]
                        assert child.depth == node.depth + 1
                        assert len(child.key) == self.page_tokens * _TOKEN_BYTES
                        assert node.child(child.key) is child
                        assert not child.ready or node.ready, (
                            f"published page {child.page} under pending page {node.page}"
                        )
                        refs = expected_refs.get(child.node_id, 0)
                        assert child.ref_count == refs, (
                            f"page {child.page} has {child.ref_count} references, "
                            f"{refs} allocations hold it"
                        )
                        assert child.ready or refs > 0, f"pending page {child.page} unreferenced"
                        if child.ready:
                            assert child.digest == next_digest(node.digest, child.key), (
                                f"page {child.page}: its digest does not chain from its parent's"
                            )
                            published[child.page] = child.digest
                        else:
                            assert child.digest is None, f"pending page {child.page} has a digest"
                            published[child.page] = EMPTY_DIGEST
                        assert child.page not in trie_pages and child.page not in private, (
                            f"page {child.page} is in two places"
                        )
                        trie_pages.add(child.page)
                        nodes += 1
                        if child.ref_count:
                            referenced += 1
                        else:
                            cached += 1
                        if self._is_evictable_leaf(child):
                            assert id(child) in valid_heap, f"leaf {child.page} not evictable"
                        stack.append(child)
            assert nodes == self._num_nodes, f"{nodes} nodes, counted {self._num_nodes}"
            assert cached == self._num_evictable, (
                f"{cached} unreferenced pages, counted {self._num_evictable}"
            )
            is_free = getattr(self._allocator, "is_free", None)
            if is_free is not None:
                for page in trie_pages | private:
                    assert not is_free(page), f"page {page} is both used and free"
            self._check_digests(published, private)
            free = self._allocator.num_free
            in_use = referenced + len(private)
            total = self._allocator.num_pages
            assert free + cached + in_use == total, (
                f"free {free} + cached {cached} + in use {in_use} != total {total}"
            )

    def _check_digests(self, expected: dict[int, bytes], private: set[int]) -> None:
        """Each trie page records its node's digest (pending: none), private pages none."""
        digests = getattr(self._allocator, "digests", None)
        if digests is None:
            return
        expected = {**expected, **dict.fromkeys(private, EMPTY_DIGEST)}
        pages = list(expected)
        for page, recorded in zip(pages, digests(pages), strict=True):
            assert recorded == expected[page], (
                f"page {page} records digest {recorded.hex()}, expected {expected[page].hex()}"
            )


def _pages_for(n_tokens: int, page_tokens: int) -> int:
    return -(-n_tokens // page_tokens)


_SCAN_LIMIT = 16  # children scanned one by one for a partial match before indexing them


def _common_tokens(a: bytes, b: bytes) -> int:
    """Leading tokens two packed pages share: a binary search of memcmp'd prefixes."""
    lo, hi = 0, min(len(a), len(b)) // _TOKEN_BYTES
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * _TOKEN_BYTES] == b[: mid * _TOKEN_BYTES]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _as_token_list(tokens: Sequence[int]) -> list[int]:
    """A private list of Python ints (numpy and torch arrays convert in one call)."""
    if isinstance(tokens, list):
        return list(tokens)
    tolist = getattr(tokens, "tolist", None)
    return tolist() if tolist is not None else [int(t) for t in tokens]
