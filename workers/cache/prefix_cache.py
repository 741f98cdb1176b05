"""The worker's local prefix cache: a page-granular radix trie over token ids.

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

The roots are namespaces (model, adapter, tenant salt), so pages are only ever shared
inside one namespace. A match compares the token ids of every page exactly (the keys are
the pages' token ids packed as int32 bytes: a dict lookup on the first page finds the
candidate run, a byte comparison of the whole run confirms it), so a hash collision can
never serve another prompt's KV. Bytes rather than tuples of ints because a bytes object
caches its hash and compares with memcmp.

One acquire lays out a request's pages like this:

    tokens  |<-------- reused -------->|<------------- computed ------------->|
            |  full pages    | part of |                                      |
    pages   [ n0 ][ n1 ][ n2 ][  c3   ][ p4 ][ p5 ][ p6 ][ p7 ][ q8 ]   [ d9 ]
             `-- trie pages, ref'd --'  `-- new trie pages, pending --' priv.  decode
                                 c3: copy-on-write of a cached page of which only
                                     the first tokens match; the rest is computed

- n0..n2 are cached pages this request reuses; its reference pins them against eviction.
- c3 is a private copy of a cached page that matched only partly: its matched token
  slots are copied, the rest are computed into it.
- c3..p7 are the request's full prompt pages: they enter the trie at once as *pending*
  pages (not yet matchable) so that `acquire_batch` can share them inside a batch, and
  become shareable when the request `publish`es them.
- q8 (the partial last page) and d9 (decode slots) stay private until they are full and
  published (decode pages only if `publish_decode_pages`).

An allocation's trie pages are always one chain from its namespace root, so it holds
them as the run that ends the chain and the number of pages in it: releasing walks up
the runs (two for the request above), not the pages.

Page accounting: every page is free (in the allocator), cached (in the trie, no
references) or in use (referenced by a live allocation, as a trie page or privately);
`check_integrity()` proves free + cached + in-use == total.

Digests: when a page becomes shareable, its chain digest (`workers.store.digests`: namespace,
the allocator's KV format, every token up to the end of the page) is computed from the
digest of the page before it, kept in its run and recorded with the allocator, so a peer
copying the page can check it holds what the peer asked for. Pending, private,
copy-on-write and unpublished decode pages record none (`EMPTY_DIGEST`).
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
from cache_service.tokens import PackedTokens, pack_tokens
from workers.cache.eviction import EVICTION_POLICIES, make_eviction_policy
from workers.store.digests import EMPTY_DIGEST, chain_digests, next_digest, root_digest
from workers.store.page_pool import PageAllocator


@dataclass(frozen=True)
class PrefixCacheConfig:
    """How the local prefix cache matches and keeps pages."""

    # 16 tokens per page: the granularity of vLLM/SGLang paged attention; smaller pages
    # match more of a prompt but cost more trie work per token.
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
    alignment_lost_tokens: int = 0  # cached, but past the last chunk boundary: computed
    computed_tokens: int = 0
    failed_acquires: int = 0  # not enough pages even after eviction
    allocated_pages: int = 0  # taken from the allocator (new KV, copies, decode slots)
    published_pages: int = 0
    aborted_pages: int = 0  # pending pages dropped because their request never published
    compacted_pages_freed: int = 0  # private pages compaction returned to the free list
    evictions: dict[str, int] = field(default_factory=dict)  # reason -> pages

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = dict(self.__dict__)
        out["evictions"] = dict(self.evictions)
        return out


class _Run:
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
        parent: _Run | None,
        first_id: int,
        first_depth: int,
    ):
        self.key = key  # the pages' token ids, packed back to back; a root's is its Namespace
        self.head = head  # the first page's packed tokens: the run's key in its parent
        self.pages = pages
        self.parent = parent
        # Created on the first child: most runs are leaves, and every container object
        # a request allocates is one more for Python's cyclic GC to walk.
        self.children: dict[bytes, _Run] | None = None
        # first token -> children starting with it, kept only for wide fan-outs (a root
        # under many distinct prompts), where a partial match would otherwise scan all.
        self.by_first: dict[bytes, list[_Run]] | None = None
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

    def child(self, head: bytes) -> _Run | None:
        return None if self.children is None else self.children.get(head)

    def add_child(self, run: _Run) -> None:
        if self.children is None:
            self.children = {}
        self.children[run.head] = run
        if self.by_first is not None:
            self.by_first.setdefault(run.head[:_TOKEN_BYTES], []).append(run)
        elif len(self.children) > _SCAN_LIMIT:
            self.by_first = {}
            for child in self.children.values():
                self.by_first.setdefault(child.head[:_TOKEN_BYTES], []).append(child)

    def replace_child(self, old: _Run, new: _Run) -> None:
        """Put `new` where `old` was (same head): the order of children is kept."""
        self.children[new.head] = new
        if self.by_first is not None:
            siblings = self.by_first[new.head[:_TOKEN_BYTES]]
            siblings[siblings.index(old)] = new

    def remove_child(self, run: _Run) -> None:
        del self.children[run.head]
        if not self.children:
            self.children = self.by_first = None
        elif self.by_first is not None:
            first = run.head[:_TOKEN_BYTES]
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


class BatchEntry(NamedTuple):
    """One request of a batch plan.

    The request computes tokens [compute_from, num_tokens); the pages before
    `compute_from` hold cached KV or KV that the requests in `depends_on` compute, so it
    must run after them (or in the same forward pass, reading their pages).
    """

    allocation: Allocation
    compute_from: int
    depends_on: tuple[int, ...]


class Compacted(NamedTuple):
    """An allocation's private part after compaction: `segment_pages` pages after its trie
    pages hold the compacted KV of tokens before `tail_start`; tokens from `tail_start`
    on are in the pages after them, one slot each."""

    segment_pages: int
    tail_start: int


class Allocation:
    """A request's pages: cached prefix pages it references plus pages it computes into.

    Attributes:
        namespace: the key root the request was matched under.
        tokens: the request's token ids so far (prompt, then decoded tokens via extend()).
        pages: page ids covering token slots [0, capacity), in order.
        cached_tokens: tokens whose KV was present at acquire; compute from here.
        prompt_tokens: the prompt length at acquire.
    """

    __slots__ = (
        "_cache",
        "namespace",
        "tokens",
        "_packed",
        "pages",
        "_tail",
        "_held",
        "cached_tokens",
        "prompt_tokens",
        "_chain_broken",
        "compacted",
        "released",
    )

    def __init__(
        self,
        cache: PrefixCache,
        namespace: Namespace,
        tokens: list[int],
        packed: bytes,
        pages: list[int],
        tail: _Run | None,
        held: int,
        cached_tokens: int,
        chain_broken: bool,
    ):
        self._cache = cache
        self.namespace = namespace
        self.tokens = tokens
        self._packed = packed  # tokens as int32 bytes: page keys are slices of it
        self.pages = pages
        # pages[0:held] are trie pages, each holding our reference: the chain of runs
        # from the namespace root down to `tail` (None: no trie pages).
        self._tail = tail
        self._held = held
        self.cached_tokens = cached_tokens
        self.prompt_tokens = len(tokens)
        # A page of this prompt collided with a page another request holds unpublished:
        # the pages after it stay private (they cannot hang under someone else's pending
        # page, which may be dropped).
        self._chain_broken = chain_broken
        # Set by `free_and_reallocate`: the private part holds a compacted segment.
        self.compacted: Compacted | None = None
        self.released = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def held_pages(self) -> int:
        """Its first pages that are trie pages (shared with other requests, or pending
        publication): never compacted, never written by anyone but their computer."""
        return self._held

    @property
    def capacity(self) -> int:
        """Token positions its pages cover: [0, capacity)."""
        p = self._cache.page_tokens
        if self.compacted is None:
            return len(self.pages) * p
        tail_pages = len(self.pages) - self._held - self.compacted.segment_pages
        return self.compacted.tail_start + tail_pages * p

    def pages_for(self, n_tokens: int) -> int:
        """Pages it needs to hold tokens [0, n_tokens)."""
        p = self._cache.page_tokens
        if self.compacted is None:
            return _pages_for(n_tokens, p)
        fixed = self._held + self.compacted.segment_pages
        return fixed + _pages_for(max(0, n_tokens - self.compacted.tail_start), p)

    @property
    def private_pages(self) -> list[int]:
        """Pages only this allocation uses (not in the trie)."""
        return self.pages[self._held :]

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
            grow = self.pages_for(len(self.tokens) + len(new_tokens)) - len(self.pages)
            if grow > 0:
                pages = self._cache._allocate(grow, pinned=())
                if pages is None:
                    return False
                self.pages.extend(pages)
            self.tokens.extend(new_tokens)
            self._packed += packed
            return True

    def free_and_reallocate(self, keep_pages: int, tail_start: int) -> list[int]:
        """Compaction packed the KV of every private token before `tail_start` into the
        first `keep_pages` private pages (a segment whose layout the compactor keeps);
        the other private pages return to the store's free list now, and tokens from
        `tail_start` on are written to pages appended after the segment.

        The allocation is private from then on: nothing past its trie pages is ever
        published (its pages no longer hold one token's KV per slot).

        Returns:
            The pages freed (the free count grew by exactly their number).
        Raises:
            ValueError: `keep_pages` outside [0, private pages], or `tail_start` before the
                trie pages' end or past the allocation's tokens.
            RuntimeError: the allocation was released.
        """
        with self._cache._lock:
            self._check_live()
            private = self.private_pages
            if not 0 <= keep_pages <= len(private):
                raise ValueError(
                    f"cannot keep {keep_pages} of an allocation's {len(private)} private pages"
                )
            start = self._held * self._cache.page_tokens
            if not start <= tail_start <= len(self.tokens):
                raise ValueError(
                    f"tail_start {tail_start} outside [{start}, {len(self.tokens)}]: the "
                    f"trie pages end at {start}, the tokens at {len(self.tokens)}"
                )
            freed = private[keep_pages:]
            del self.pages[self._held + keep_pages :]
            self._chain_broken = True
            self.compacted = Compacted(keep_pages, tail_start)
            self._cache._allocator.free(freed)
            self._cache._stats.compacted_pages_freed += len(freed)
            return freed

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


class _Match(NamedTuple):
    """What a walk of the trie found for one prompt (see `PrefixCache._match`)."""

    path: list[_Run]  # runs to reference, root's child first; their pages come first
    cow_source: _Run | None  # a one-page run whose first slots are copied, or None
    reuse: int  # tokens whose KV the request gets: the path's pages, then copied slots
    aligned_away: int  # cached tokens past the last chunk boundary (computed instead)


class PrefixCache:
    """Page-granular prefix trie over a page allocator; see the module docstring.

    Thread-safe: one re-entrant lock guards the trie, the allocations and the allocator,
    so concurrent request threads of a worker may acquire, publish and release at once.
    """

    def __init__(self, allocator: PageAllocator, config: PrefixCacheConfig | None = None):
        self.config = config or PrefixCacheConfig()
        self.page_tokens = self.config.page_tokens
        self._step = self.page_tokens * _TOKEN_BYTES  # bytes of one packed page
        self._allocator = allocator
        # An allocator that keeps no digests (none of ours) still gets digests in the
        # trie; there is just nothing to record them in.
        self._kv_format: str = getattr(allocator, "kv_format", "")
        self._set_digests = getattr(allocator, "set_digests", None)
        self._generations = getattr(allocator, "generations", None)
        self._policy = make_eviction_policy(self.config.eviction_policy)
        # Whether a run's pages, which share their access history, rank deepest first and
        # ahead of every other page (see `EvictionPolicy.evicts_runs_tail_first`): then an
        # eviction takes the pages it needs from a run at once.
        self._whole_runs = self._policy.evicts_runs_tail_first
        self._lock = threading.RLock()
        self._roots: dict[Namespace, _Run] = {}
        self._next_id = 0  # the id of the next page to enter the trie
        self._versions = itertools.count(1)
        self._clock = 0
        self._heap: list[tuple[tuple[int, ...], int, _Run]] = []
        self._num_nodes = 0  # pages in the trie
        self._num_evictable = 0  # ready pages with no references (all evictable, leaf first)
        self._live: dict[int, Allocation] = {}
        self._events: list[KvEvent] = []
        self._stats = CacheStats()

    # ------------------------------------------------------------------ public API

    def acquire(
        self,
        tokens: Sequence[int],
        namespace: Namespace,
        extra_token_slots: int = 0,
        private: bool = False,
    ) -> Allocation | None:
        """Match the longest cached prefix of `tokens` and allocate pages for the rest.

        At least the last prompt token is always left to compute (the model needs its
        logits), so a fully cached prompt reuses all but that token, through a
        copy-on-write of its last page.

        Args:
            tokens: the prompt's token ids (at least one).
            namespace: the key root (model, adapter, tenant salt).
            extra_token_slots: slots to reserve beyond the prompt for decode.
            private: the pages it computes are never published (a sequence that will be
                compacted: `free_and_reallocate`); the prefix it matches is still reused.
        Returns:
            The allocation, or None when not enough pages are free even after evicting
            every unreferenced page (nothing is then held).
        Raises:
            ValueError: empty prompt or negative extra_token_slots.
        """
        if extra_token_slots < 0:
            raise ValueError(f"extra_token_slots must be >= 0, got {extra_token_slots}")
        prompt = _as_token_list(tokens)
        if not prompt:
            raise ValueError("request 0 of the batch has no tokens")
        packed = pack_tokens(prompt)  # outside the lock: other requests' threads go on
        # A batch of one, without the batch's lists: the request path of a worker.
        with self._lock:
            entry = self._acquire_one(prompt, packed, namespace, extra_token_slots, {}, 0, private)
            return None if entry is None else entry.allocation

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
        packed = [pack_tokens(prompt) for prompt in prompts]
        with self._lock:
            owners: dict[_Run, int] = {}  # pending run -> index of the request computing it
            entries: list[BatchEntry] = []
            for index, prompt in enumerate(prompts):
                entry = self._acquire_one(
                    prompt, packed[index], namespace, extra_token_slots, owners, index
                )
                if entry is None:
                    for done in entries:
                        self._release(done.allocation)
                    return None
                entries.append(entry)
            return entries

    def match_length(self, tokens: Sequence[int], namespace: Namespace) -> int:
        """Tokens of `tokens` in full published pages, without referencing anything."""
        packed = pack_tokens(_as_token_list(tokens))
        step = self._step
        with self._lock:
            node = self._roots.get(namespace)
            matched = 0
            while node is not None and matched + step <= len(packed):
                node = node.child(packed[matched : matched + step])
                if node is None or not node.ready:
                    break
                if not packed.startswith(node.key, matched):
                    matched += _common_pages(node.key, packed, matched, step) * step
                    break
                matched += len(node.key)
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
            if not any(self._published_runs()):
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

        A chain runs on while a page has exactly one published child, across runs.
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
                    run, parent_page = stack.pop()
                    if not run.ready:
                        continue
                    chain = [run]
                    while True:
                        kids = [c for c in chain[-1].iter_children() if c.ready]
                        if len(kids) != 1:
                            break
                        chain.append(kids[0])
                    pages = [page for part in chain for page in part.pages]
                    key = b"".join(part.key for part in chain)
                    chains.append(self._stored_event(namespace, parent_page, pages, key))
                    last = chain[-1].pages[-1]
                    stack.extend((kid, last) for kid in chain[-1].iter_children())
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

    def pages_referenced(self) -> int:
        """Pages live allocations hold (referenced trie pages and private pages): what no
        eviction can free."""
        with self._lock:
            return self._allocator.num_pages - self._allocator.num_free - self._num_evictable

    @property
    def num_cached_pages(self) -> int:
        """Pages in the trie that no allocation references (free to evict)."""
        return self._num_evictable

    # ------------------------------------------------------------------ acquire

    def _acquire_one(
        self,
        tokens: list[int],
        packed: bytes,
        namespace: Namespace,
        extra_slots: int,
        owners: dict[_Run, int],
        index: int,
        private: bool = False,
    ) -> BatchEntry | None:
        p = self.page_tokens
        n = len(tokens)
        path, cow_source, reuse, aligned_away = self._match(packed, namespace, owners)
        full_ref = reuse // p  # the path's pages: it ends where the reuse's full pages do
        new_pages = _pages_for(n + extra_slots, p) - full_ref

        stats = self._stats
        stats.queries += 1
        stats.queried_tokens += n
        pinned = path if cow_source is None else [*path, cow_source]
        pages = self._allocate(new_pages, pinned)
        if pages is None:
            stats.failed_acquires += 1
            return None

        self._clock += 1
        clock = self._clock
        shared = 0  # pages a batch sibling computes
        for run in path:
            self._incref(run)
            run.last_access = clock
            if run.ready:
                run.hits += 1
            else:
                shared += len(run.pages)
        cow_tokens = reuse - full_ref * p
        if cow_source is not None:
            # The only KV copy of an acquire: the matched slots of a partly matching page
            # into the request's own page, which the model then completes.
            self._allocator.copy_page(cow_source.pages[0], pages[0], cow_tokens)
            cow_source.last_access = clock
            cow_source.hits += 1
            if self._is_evictable_leaf(cow_source):
                self._push_evictable(cow_source)  # re-rank: its key just changed

        tail = path[-1] if path else None
        held = full_ref
        chain_broken = private  # a private allocation's pages never enter the trie
        own = n // p - full_ref  # own full prompt pages: they enter the trie pending
        parent = tail if tail is not None else self._root(namespace)
        if own > 0 and not private:
            start = full_ref * self._step
            head = packed[start : start + self._step]
            if parent.child(head) is not None:
                # Another request's pending page, or a cached one this match may not
                # reference (past a chunk boundary, or the page a copy was taken from).
                chain_broken = True
            else:
                tail = self._new_run(
                    packed[start : (full_ref + own) * self._step], head, pages[:own], parent
                )
                tail.ref_count = 1
                tail.last_access = clock
                owners[tail] = index
                held += own

        stats.hit_tokens += reuse - shared * p
        stats.alignment_lost_tokens += aligned_away
        stats.cow_tokens += cow_tokens
        stats.batch_shared_tokens += shared * p
        stats.computed_tokens += n - reuse
        all_pages: list[int] = []
        for run in path:
            all_pages += run.pages
        all_pages += pages
        allocation = Allocation(
            self, namespace, tokens, packed, all_pages, tail, held, reuse, chain_broken
        )
        self._live[id(allocation)] = allocation
        depends_on = tuple(sorted({owners[run] for run in path if not run.ready})) if shared else ()
        return BatchEntry(allocation, reuse, depends_on)

    def _match(self, packed: bytes, namespace: Namespace, owners: dict[_Run, int]) -> _Match:
        """Walk the trie: the runs to reference, the page to copy from, tokens reused.

        Full pages match by exact token bytes; pending pages match only if a request of
        the same batch computes them (`owners`). Past the last full page, a published
        page sharing a first part of the next page is a copy-on-write candidate. Runs are
        split so that the path ends at a run's end and the copy source is a run of one
        page: those pages' state is about to change, and a run's pages share theirs.
        """
        p, step = self.page_tokens, self._step
        n = len(packed) // _TOKEN_BYTES
        node = self._roots.get(namespace)
        walked: list[_Run] = []  # matched runs; the last may match only its first pages
        end = 0  # bytes of packed matched by whole pages
        inside, inside_at = None, 0  # the run the prompt leaves partway, and where it begins
        while node is not None and end + step <= len(packed):
            child = node.child(packed[end : end + step])
            if child is None or not (child.ready or child in owners):
                break
            walked.append(child)
            if packed.startswith(child.key, end):
                end += len(child.key)
                node = child
                continue
            inside, inside_at = child, end
            end += _common_pages(child.key, packed, end, step) * step
            break

        partial, partial_len = None, 0
        matched = end // step
        if node is not None and matched * p < n:
            rest = packed[end : end + step]
            if inside is not None:
                # Left inside a run: its next page is the only candidate.
                if inside.ready:
                    offset = end - inside_at
                    partial_len = _common_tokens(inside.key[offset : offset + step], rest)
                    partial = inside if partial_len else None
            else:
                for child in node.starting_with(rest[:_TOKEN_BYTES]):
                    if child.ready:
                        common = _common_tokens(child.head, rest)
                        if common > partial_len:
                            partial, partial_len = child, common

        # Leave at least the last prompt token to compute: the model needs its logits.
        reuse = min(matched * p + partial_len, n - 1)
        aligned_away = reuse % self.config.chunk_tokens if self.config.chunk_tokens else 0
        reuse -= aligned_away
        full = reuse // p
        # The path: the walked runs up to page `full`, the last one split there if needed.
        # `after` is the walked run that then begins at page `full`, if any.
        path: list[_Run] = []
        depth, after = 0, None
        for run in walked:
            if depth == full:
                after = run
                break
            if depth + len(run.pages) > full:
                path.append(self._split(run, full - depth, owners))
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
                cow_source = self._split(cow_source, 1, owners)
        return _Match(path, cow_source, reuse, aligned_away)

    # ------------------------------------------------------------------ publish / release

    def _publish(self, allocation: Allocation, n_tokens: int) -> int:
        p, step = self.page_tokens, self._step
        limit = n_tokens // p
        if allocation.compacted is not None:
            limit = min(limit, allocation._held)  # compacted pages are never shareable
        if not self.config.publish_decode_pages:
            limit = min(limit, allocation.prompt_tokens // p)
        # Held pages not yet published end the held chain (none hangs under a pending
        # page): collect their runs, deepest first.
        pending: list[_Run] = []
        run = allocation._tail
        while run is not None and not run.ready:
            pending.append(run)
            run = run.parent
        start = allocation._held - sum(len(r.pages) for r in pending)
        newly: list[_Run] = []
        stop = start
        for run in reversed(pending):
            if stop >= limit:
                break
            if stop + len(run.pages) > limit:
                run = self._split(run, limit - stop, None)
            newly.append(run)
            stop += len(run.pages)
        if allocation._held < limit and not allocation._chain_broken:
            # All held pages are published: the pages computed since become trie pages.
            held = allocation._held
            parent = allocation._tail
            if parent is None:
                parent = self._root(allocation.namespace)
            head = allocation._packed[held * step : (held + 1) * step]
            if parent.child(head) is not None:
                allocation._chain_broken = True
            else:
                key = allocation._packed[held * step : limit * step]
                run = self._new_run(key, head, allocation.pages[held:limit], parent)
                run.ref_count = 1
                run.last_access = self._clock
                allocation._tail = run
                allocation._held = stop = limit
                newly.append(run)
        if not newly:
            return 0
        # `newly` is a chain: each run's parent is the one before it, and the first's is
        # published (or the root), so one hash per page extends its parent's digest.
        key = allocation._packed[start * step : stop * step]
        digests = chain_digests(newly[0].parent.digests[-1], key, p)
        at = 0
        for run in newly:
            run.ready = True
            run.digests = digests[at : at + len(run.pages)]
            at += len(run.pages)
        pages = allocation.pages[start:stop]
        if self._set_digests is not None:
            # After the KV is final (the caller's publish says so), before any peer can
            # hear of the pages: the event below is what announces them.
            self._set_digests(pages, digests)
        parent_page = allocation.pages[start - 1] if start else None
        self._events.append(self._stored_event(allocation.namespace, parent_page, pages, key))
        self._stats.published_pages += len(pages)
        return len(pages)

    def _release(self, allocation: Allocation) -> None:
        allocation.released = True
        del self._live[id(allocation)]
        private = allocation.private_pages
        if private:
            self._allocator.free(private)
        aborted: list[int] = []
        # Releasing counts as a use: a page read until a long generation ended is more
        # recent than one a short request acquired later and dropped at once.
        self._clock += 1
        run = allocation._tail
        while run is not None and run.parent is not None:
            parent = run.parent
            run.last_access = self._clock
            self._decref(run)
            if run.ref_count == 0 and not run.ready:
                # Never published: its request ended before computing it. Not shareable,
                # never announced, so it leaves silently.
                assert not run.children, f"pending page {run.pages[-1]} has children"
                self._remove_run(run)
                aborted.extend(reversed(run.pages))
            run = parent
        if aborted:
            self._allocator.free(aborted)
            self._stats.aborted_pages += len(aborted)

    # ------------------------------------------------------------------ pages and eviction

    def _allocate(self, n: int, pinned: Sequence[_Run]) -> list[int] | None:
        """Take `n` pages, evicting if needed; `pinned` runs are about to be referenced
        and must survive. None (nothing evicted, nothing taken) if `n` cannot be had.
        """
        if n <= 0:
            return []
        free = self._allocator.num_free
        if free < n:
            kept = sum(len(run.pages) for run in pinned if run.ref_count == 0)
            if free + self._num_evictable - kept < n:
                return None
            for run in pinned:
                self._incref(run)
            self._evict(n - free, "evicted")
            for run in pinned:
                self._decref(run)
        pages = self._allocator.allocate(n)
        assert pages is not None, f"allocator refused {n} pages with {free} free"
        self._stats.allocated_pages += n
        return pages

    def _evict(self, n: int, reason: str, emit: bool = True) -> list[int]:
        removed: list[int] = []
        heap, step = self._heap, self._step
        while len(removed) < n and heap:
            _, version, run = heapq.heappop(heap)
            if run.heap_version != version or not self._is_evictable_leaf(run):
                continue
            # Leaf first, one page at a time, as long as the run's next page would be the
            # policy's next choice anyway.
            take = 1
            if self._whole_runs:
                take = min(n - len(removed), len(run.pages))
            else:
                while (
                    take < len(run.pages)
                    and len(removed) + take < n
                    and (not heap or self._policy_key_after(run, take) < heap[0][0])
                ):
                    take += 1
            cut = len(run.pages) - take
            removed.extend(reversed(run.pages[cut:]))
            self._num_evictable -= take
            if cut:
                self._num_nodes -= take
                del run.pages[cut:]
                del run.digests[cut:]
                run.key = run.key[: cut * step]
                self._push_evictable(run)  # its new last page: a leaf, ranked as one
                continue
            parent = run.parent
            self._remove_run(run)
            if parent.parent is not None and parent.ref_count == 0 and not parent.children:
                self._push_evictable(parent)
        if removed:
            self._allocator.free(removed)
            self._stats.evictions[reason] = self._stats.evictions.get(reason, 0) + len(removed)
            if emit:
                self._events.append(PagesRemoved(tuple(removed), reason))
        return removed

    def _policy_key_after(self, run: _Run, take: int) -> tuple[int, ...]:
        """The policy's key of the page that ends `run` once its last `take` pages went."""
        i = len(run.pages) - take - 1
        view = _PageView(run.first_id + i, run.last_access, run.hits, run.first_depth + i)
        return self._policy.key(view)

    @staticmethod
    def _is_evictable_leaf(run: _Run) -> bool:
        return run.alive and run.ready and run.ref_count == 0 and not run.children

    def _push_evictable(self, run: _Run) -> None:
        # Lazy deletion: an entry is valid only while its version is the run's latest.
        # (key, version) is unique per entry, so the heap never compares two runs.
        run.heap_version = next(self._versions)
        heapq.heappush(self._heap, (self._policy.key(run), run.heap_version, run))
        if len(self._heap) > 2 * self._num_evictable + 1024:
            self._heap = [
                e for e in self._heap if self._is_evictable_leaf(e[2]) and e[2].heap_version == e[1]
            ]
            heapq.heapify(self._heap)

    def _incref(self, run: _Run) -> None:
        if run.ref_count == 0 and run.ready:
            self._num_evictable -= len(run.pages)
        run.ref_count += 1

    def _decref(self, run: _Run) -> None:
        assert run.ref_count > 0, f"page {run.pages[-1]} released more often than acquired"
        run.ref_count -= 1
        if run.ref_count == 0 and run.ready:
            self._num_evictable += len(run.pages)
            if not run.children:
                self._push_evictable(run)

    # ------------------------------------------------------------------ trie runs

    def _root(self, namespace: Namespace) -> _Run:
        root = self._roots.get(namespace)
        if root is None:
            # first_depth 1: the depth its first child's first page takes (see _new_run)
            root = self._roots[namespace] = _Run(namespace, None, [], None, -1, 1)
            root.digests = [root_digest(namespace, self._kv_format)]
        return root

    def _new_run(self, key: bytes, head: bytes, pages: list[int], parent: _Run) -> _Run:
        depth = parent.first_depth + len(parent.pages)
        run = _Run(key, head, pages, parent, self._next_id, depth)
        self._next_id += len(pages)
        parent.add_child(run)
        self._num_nodes += len(pages)
        return run

    def _split(self, run: _Run, k: int, owners: dict[_Run, int] | None) -> _Run:
        """Cut `run` after its first `k` pages; returns the new run of those pages.

        `run` keeps its last pages (and with them its heap entry, its rank and every
        allocation that ends in it); the new run takes its place under its parent.
        """
        assert 0 < k < len(run.pages), f"cannot split a run of {len(run.pages)} at {k}"
        step = self._step
        low = _Run(
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
        return low

    def _remove_run(self, run: _Run) -> None:
        parent = run.parent
        parent.remove_child(run)
        run.alive = False
        self._num_nodes -= len(run.pages)
        if parent.parent is None and not parent.children:
            del self._roots[parent.key]  # a root's key is its namespace

    def _published_runs(self):
        for root in self._roots.values():
            stack = list(root.iter_children())
            while stack:
                run = stack.pop()
                if run.ready:
                    yield run
                stack.extend(run.iter_children())

    def _stored_event(
        self, namespace: Namespace, parent_page: int | None, pages: list[int], key: bytes
    ) -> PagesStored:
        if self._generations is not None:
            generations = tuple(self._generations(pages))
        else:
            generations = tuple(self._allocator.generation(page) for page in pages)
        return PagesStored(namespace, parent_page, tuple(pages), generations, PackedTokens(key))

    # ------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Raise AssertionError unless every invariant of the cache holds.

        free + cached + in-use == total; each page in exactly one place; reference
        counts equal the live allocations that hold each run; each allocation's trie
        pages are the chain of runs it ends in; runs hold whole pages, never branch
        before their last page and are never empty; published runs hang under published
        parents; pending runs are referenced; every evictable leaf has a live heap entry
        ranked by its current key; every published page's digest chains from the page
        before it, and (when the allocator reports digests) is what its page records,
        while pending and private pages record none.
        """
        with self._lock:
            check = getattr(self._allocator, "check_integrity", None)
            if check is not None:
                check()
            expected_refs: dict[int, int] = {}
            private: set[int] = set()
            for allocation in self._live.values():
                assert not allocation.released
                chain: list[int] = []
                run = allocation._tail
                while run is not None and run.parent is not None:
                    assert run.alive, f"allocation holds removed page {run.pages[-1]}"
                    expected_refs[id(run)] = expected_refs.get(id(run), 0) + 1
                    chain[:0] = run.pages
                    run = run.parent
                assert run is None or self._roots.get(allocation.namespace) is run, (
                    "an allocation's chain does not start at its namespace root"
                )
                assert chain == allocation.pages[: allocation._held], (
                    f"allocation holds trie pages {chain}, lists {allocation.pages}"
                )
                for page in allocation.private_pages:
                    assert page not in private, f"page {page} private to two allocations"
                    private.add(page)
                assert allocation.capacity >= allocation.num_tokens, (
                    f"allocation of {allocation.num_tokens} tokens has capacity "
                    f"{allocation.capacity}"
                )
            valid_heap = {id(e[2]): e[0] for e in self._heap if e[2].heap_version == e[1]}
            published: dict[int, bytes] = {}  # page -> the digest it must record
            trie_pages: set[int] = set()
            cached = referenced = nodes = 0
            for namespace, root in self._roots.items():
                assert root.parent is None and not root.pages and root.ready
                assert root.key == namespace, f"root of {namespace} keyed {root.key}"
                assert root.digests == [root_digest(namespace, self._kv_format)], (
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
                    for run in node.iter_children():
                        self._check_run(node, run, expected_refs, published, valid_heap)
                        for page in run.pages:
                            assert page not in trie_pages and page not in private, (
                                f"page {page} is in two places"
                            )
                            trie_pages.add(page)
                        nodes += len(run.pages)
                        if run.ref_count:
                            referenced += len(run.pages)
                        else:
                            cached += len(run.pages)
                        stack.append(run)
            assert nodes == self._num_nodes, f"{nodes} pages in the trie, counted {self._num_nodes}"
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

    def _check_run(
        self,
        node: _Run,
        run: _Run,
        expected_refs: dict[int, int],
        published: dict[int, bytes],
        valid_heap: dict[int, tuple[int, ...]],
    ) -> None:
        """The invariants of one run under its parent `node` (see `check_integrity`)."""
        step = self._step
        assert run.parent is node and run.alive
        assert run.pages, "an empty run is in the trie"
        assert len(run.key) == len(run.pages) * step, (
            f"run of {len(run.pages)} pages keyed by {len(run.key)} bytes"
        )
        assert run.head == run.key[:step] and node.child(run.head) is run
        if node.by_first is not None:
            assert run in node.by_first[run.head[:_TOKEN_BYTES]]
        assert run.first_depth == node.first_depth + len(node.pages)
        assert node.parent is None or run.first_id > node.node_id, (
            f"page {run.pages[0]} is older than its parent page {node.pages[-1]}"
        )
        assert not run.ready or node.ready, (
            f"published page {run.pages[0]} under pending page {node.pages[-1]}"
        )
        refs = expected_refs.get(id(run), 0)
        assert run.ref_count == refs, (
            f"page {run.pages[-1]} has {run.ref_count} references, {refs} allocations hold it"
        )
        assert run.ready or refs > 0, f"pending page {run.pages[-1]} unreferenced"
        if run.ready:
            assert run.digests is not None and len(run.digests) == len(run.pages)
            parent_digest = node.digests[-1]
            for i, (page, digest) in enumerate(zip(run.pages, run.digests, strict=True)):
                assert digest == next_digest(parent_digest, run.key[i * step : (i + 1) * step]), (
                    f"page {page}: its digest does not chain from its parent's"
                )
                published[page] = parent_digest = digest
        else:
            assert run.digests is None, f"pending page {run.pages[-1]} has a digest"
            published.update(dict.fromkeys(run.pages, EMPTY_DIGEST))
        if self._is_evictable_leaf(run):
            assert id(run) in valid_heap, f"leaf {run.pages[-1]} not evictable"
            assert valid_heap[id(run)] == self._policy.key(run), (
                f"leaf {run.pages[-1]} is ranked by a stale key"
            )

    def _check_digests(self, expected: dict[int, bytes], private: set[int]) -> None:
        """Each trie page records its digest (pending: none), private pages none."""
        digests = getattr(self._allocator, "digests", None)
        if digests is None:
            return
        expected = {**expected, **dict.fromkeys(private, EMPTY_DIGEST)}
        pages = list(expected)
        for page, recorded in zip(pages, digests(pages), strict=True):
            assert recorded == expected[page], (
                f"page {page} records digest {recorded.hex()}, expected {expected[page].hex()}"
            )


class _PageView(NamedTuple):
    """One page of a run as an eviction policy sees it (`EvictionCandidate`)."""

    node_id: int
    last_access: int
    hits: int
    depth: int


def _pages_for(n_tokens: int, page_tokens: int) -> int:
    return -(-n_tokens // page_tokens)


_SCAN_LIMIT = 16  # children scanned one by one for a partial match before indexing them


def _common_pages(key: bytes, packed: bytes, at: int, step: int) -> int:
    """Leading whole pages of `key` that `packed` holds from byte `at`, by binary search
    over memcmp'd prefixes (the first page is known to match)."""
    lo, hi = 1, min(len(key), len(packed) - at) // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if packed.startswith(key[: mid * step], at):
            lo = mid
        else:
            hi = mid - 1
    return lo


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
