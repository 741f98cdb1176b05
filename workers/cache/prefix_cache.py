"""The worker's local prefix cache, PrefixCache: what requests acquire, publish and release.

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

The trie itself (runs, namespaces, exact matching) is described in `runs.py` and
`trie.py`; the package docstring lists every part.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from cache_service.events import (
    DEFAULT_TIER,
    TIERS,
    AllCleared,
    KvEvent,
    Namespace,
    PagesDemoted,
    PagesRemoved,
    PagesStored,
)
from cache_service.tokens import pack_tokens
from workers.cache.allocation import Allocation, BatchEntry, as_token_list
from workers.cache.config import CacheStats, PrefixCacheConfig
from workers.cache.drops import drop_chains
from workers.cache.events import generations_of, published_chains, stored_event
from workers.cache.eviction import make_eviction_policy
from workers.cache.evictor import Evictor
from workers.cache.integrity import check_cache
from workers.cache.runs import Run, pages_for
from workers.cache.tiers import LowerTier, Place, evict_down, spilled
from workers.cache.trie import Trie
from workers.store.digests import chain_digests
from workers.store.page_pool import PageAllocator

__all__ = ["Allocation", "PrefixCache", "PrefixCacheConfig"]  # what other packages import


class PrefixCache:
    """Page-granular prefix trie over a page allocator; see the module docstring.

    Thread-safe: one re-entrant lock guards the trie, the allocations and the allocator,
    so concurrent request threads of a worker may acquire, publish and release at once.
    """

    def __init__(
        self,
        allocator: PageAllocator,
        config: PrefixCacheConfig | None = None,
        lower: LowerTier | None = None,
        tier: str = DEFAULT_TIER,
    ):
        """`lower`: the tier evicted pages go down to (`workers.cache.tiers`); None: an
        evicted page is gone from the worker. `tier`: the allocator's pages' tier in
        events ("device" on a GPU worker, whose host store is then the tier below)."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
        self.config = config or PrefixCacheConfig()
        self.page_tokens = self.config.page_tokens
        self._allocator = allocator
        # An allocator that keeps no digests (none of ours) still gets digests in the
        # trie; there is just nothing to record them in.
        kv_format: str = getattr(allocator, "kv_format", "")
        self._set_digests = getattr(allocator, "set_digests", None)
        self._generations = generations_of(allocator)
        self._trie = Trie(
            self.page_tokens, self.config.chunk_tokens, kv_format, allocator.num_pages
        )
        self._step = self._trie.step  # bytes of one packed page
        self._evictor = Evictor(self._trie, make_eviction_policy(self.config.eviction_policy))
        self._lock = threading.RLock()
        self._clock = 0
        self._live: dict[int, Allocation] = {}
        self._events: list[KvEvent] = []
        self._stats = CacheStats()
        self.tier = tier
        self.lower = lower
        if lower is not None:
            lower.attach(self._emit)

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
        prompt = as_token_list(tokens)
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
        prompts = [as_token_list(tokens) for tokens in requests]
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"request {i} of the batch has no tokens")
        packed = [pack_tokens(prompt) for prompt in prompts]
        with self._lock:
            owners: dict[Run, int] = {}  # pending run -> index of the request computing it
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
        packed = pack_tokens(as_token_list(tokens))
        with self._lock:
            return self._trie.match_length(packed, namespace)

    def evict(self, n_pages: int) -> int:
        """Evict up to `n_pages` unreferenced pages by policy; returns how many went."""
        with self._lock:
            return len(self._evict(n_pages, "evicted"))

    def clear(self) -> int:
        """Drop every unreferenced page; returns how many went.

        Emits AllCleared when nothing shareable is left, else PagesRemoved("cleared").
        """
        with self._lock:
            removed = self._evict(self._evictor.num_evictable, "cleared", emit=False)
            if self.lower is not None:
                self.lower.cleared()
            if not any(self._trie.published_runs()):
                self._events.append(AllCleared())
            elif removed:
                self._events.append(PagesRemoved(tuple(removed), "cleared", self.tier))
            return len(removed)

    def drop(self, pages: Iterable[int], reason: str = "quarantined") -> tuple[int, int]:
        """Take published `pages` off the trie, with every page after them in their chains
        (their KV was computed over them): the copies of a holder found serving pages that
        do not hold what they claim. Announced as PagesRemoved(reason), leaf first.

        A page that a live request holds (it or a page after it) stays until the request
        releases it; the caller asks again later.

        Returns:
            (pages dropped, pages of `pages` kept for now because requests hold them).
        """
        with self._lock:
            dropped = drop_chains(self._trie, self._evictor, pages)
            removed = dropped.pages
            if removed:
                if self.lower is not None:
                    self.lower.dropped(dropped.digests, reason)
                self._allocator.free(removed)
                self._stats.evictions[reason] = self._stats.evictions.get(reason, 0) + len(removed)
                self._events.append(PagesRemoved(tuple(removed), reason, self.tier))
            return len(removed), dropped.held

    def _emit(self, event: KvEvent) -> None:
        """A tier below announces a change of its own (a record evicted or found corrupt),
        in order with the cache's events."""
        with self._lock:
            self._events.append(event)

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
            chains = published_chains(self._trie, self._generations, self.tier)
            if self.lower is not None:
                host = {
                    digest: page
                    for run in self._trie.published_runs()
                    for digest, page in zip(run.digests or (), run.pages, strict=False)
                }
                chains += self.lower.snapshot(host)
            return chains

    def stats(self) -> dict[str, object]:
        """Counters plus the page accounting (free / cached / in use / total)."""
        with self._lock:
            out = self._stats.as_dict()
            cached = self._evictor.num_evictable
            in_use = self._allocator.num_pages - self._allocator.num_free - cached
            out.update(
                held_elsewhere_marked_pages=len(self._evictor.marks),
                held_elsewhere_evicted_pages=self._evictor.marked_evicted,
                free_pages=self._allocator.num_free,
                cached_pages=cached,
                in_use_pages=in_use,
                total_pages=self._allocator.num_pages,
                live_allocations=len(self._live),
            )
            return out

    def held_elsewhere(self, pages: Sequence[int], generations: Sequence[int]) -> int:
        """Pages of this cache that another worker has stored since (the index's notices,
        `GlobalIndex.held_elsewhere`): when eviction must make room they go before pages
        only this worker holds, so that the mesh keeps more distinct prefixes. Ids past the
        store's are the tier below's (its own ranking, `LowerTier.held_elsewhere`). A page
        rewritten since (its generation moved on) or no longer published here is skipped;
        nothing changes with `cluster_eviction` off.

        Returns:
            How many pages were newly marked.
        """
        if not self.config.cluster_eviction or not pages:
            return 0
        total = self._allocator.num_pages
        named = [(p, g) for p, g in zip(pages, generations, strict=True) if 0 <= p < total]
        below = [(p, g) for p, g in zip(pages, generations, strict=True) if p >= total]
        marked = 0
        with self._lock:
            current = self._generations([page for page, _ in named])
            trie, evictor = self._trie, self._evictor
            for (page, generation), now in zip(named, current, strict=True):
                run = trie.run_of(page) if generation == now else None
                if run is not None and run.ready:
                    marked += evictor.mark(run, page)
            if below and self.lower is not None:  # ids past the store's: the tier below's
                marked += self.lower.held_elsewhere(*zip(*below, strict=True))
        return marked

    def pages_referenced(self) -> int:
        """Pages live allocations hold (referenced trie pages and private pages): what no
        eviction can free."""
        with self._lock:
            cached = self._evictor.num_evictable
            return self._allocator.num_pages - self._allocator.num_free - cached

    @property
    def num_cached_pages(self) -> int:
        """Pages in the trie that no allocation references (free to evict)."""
        return self._evictor.num_evictable

    # ------------------------------------------------------------------ acquire

    def _acquire_one(
        self,
        tokens: list[int],
        packed: bytes,
        namespace: Namespace,
        extra_slots: int,
        owners: dict[Run, int],
        index: int,
        private: bool = False,
    ) -> BatchEntry | None:
        p = self.page_tokens
        n = len(tokens)
        trie, evictor = self._trie, self._evictor
        path, cow_source, reuse, aligned_away = trie.match(packed, namespace, owners)
        full_ref = reuse // p  # the path's pages: it ends where the reuse's full pages do
        new_pages = pages_for(n + extra_slots, p) - full_ref

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
            evictor.incref(run)
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
            if cow_source.is_evictable_leaf():
                evictor.push(cow_source)  # re-rank: its key just changed

        tail = path[-1] if path else None
        held = full_ref
        chain_broken = private  # a private allocation's pages never enter the trie
        own = n // p - full_ref  # own full prompt pages: they enter the trie pending
        parent = tail if tail is not None else trie.root(namespace)
        if own > 0 and not private:
            start = full_ref * self._step
            head = packed[start : start + self._step]
            if parent.child(head) is not None:
                # Another request's pending page, or a cached one this match may not
                # reference (past a chunk boundary, or the page a copy was taken from).
                chain_broken = True
            else:
                tail = trie.new_run(
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
        pending: list[Run] = []
        run = allocation._tail
        while run is not None and not run.ready:
            pending.append(run)
            run = run.parent
        start = allocation._held - sum(len(r.pages) for r in pending)
        newly: list[Run] = []
        stop = start
        for run in reversed(pending):
            if stop >= limit:
                break
            if stop + len(run.pages) > limit:
                run = self._trie.split(run, limit - stop, None)
            newly.append(run)
            stop += len(run.pages)
        if allocation._held < limit and not allocation._chain_broken:
            # All held pages are published: the pages computed since become trie pages.
            held = allocation._held
            parent = allocation._tail
            if parent is None:
                parent = self._trie.root(allocation.namespace)
            head = allocation._packed[held * step : (held + 1) * step]
            if parent.child(head) is not None:
                allocation._chain_broken = True
            else:
                key = allocation._packed[held * step : limit * step]
                run = self._trie.new_run(key, head, allocation.pages[held:limit], parent)
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
        event = stored_event(
            allocation.namespace, parent_page, pages, key, self._generations, self.tier
        )
        self._events.append(event)
        self._stats.published_pages += len(pages)
        if self.lower is not None:
            self.lower.published(
                [s for run in newly for s in spilled(run, 0, len(run.pages), step)]
            )
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
        trie, evictor = self._trie, self._evictor
        run = allocation._tail
        while run is not None and run.parent is not None:
            parent = run.parent
            run.last_access = self._clock
            evictor.decref(run)
            if run.ref_count == 0 and not run.ready:
                # Never published: its request ended before computing it. Not shareable,
                # never announced, so it leaves silently.
                assert not run.children, f"pending page {run.pages[-1]} has children"
                trie.remove_run(run)
                aborted.extend(reversed(run.pages))
            run = parent
        if aborted:
            self._allocator.free(aborted)
            self._stats.aborted_pages += len(aborted)

    # ------------------------------------------------------------------ pages and eviction

    def _allocate(self, n: int, pinned: Sequence[Run]) -> list[int] | None:
        """Take `n` pages, evicting if needed; `pinned` runs are about to be referenced
        and must survive. None (nothing evicted, nothing taken) if `n` cannot be had.
        """
        if n <= 0:
            return []
        free = self._allocator.num_free
        if free < n:
            evictor = self._evictor
            kept = sum(len(run.pages) for run in pinned if run.ref_count == 0)
            if free + evictor.num_evictable - kept < n:
                return None
            for run in pinned:
                evictor.incref(run)
            self._evict(n - free, "evicted")
            for run in pinned:
                evictor.decref(run)
        pages = self._allocator.allocate(n)
        assert pages is not None, f"allocator refused {n} pages with {free} free"
        self._stats.allocated_pages += n
        return pages

    def _evict(self, n: int, reason: str, emit: bool = True) -> list[int]:
        """Evict up to `n` pages by policy and free them, counted under `reason`;
        announced as PagesRemoved unless `emit` is off. Returns the pages.

        With a tier below, evicted pages ("evicted" only) go down to it first: those it
        takes are announced as PagesDemoted and counted as "demoted"."""
        if self.lower is None or reason != "evicted":
            removed = self._evictor.evict(n)
            if removed:
                self._removed(removed, reason, emit)
            return removed
        removed, moved, gone = evict_down(self._evictor, self.lower, n, self._step)
        if not removed:
            return removed
        self._allocator.free(removed)
        if moved:
            self._stats.evictions["demoted"] = self._stats.evictions.get("demoted", 0) + len(moved)
            by_tier: dict[str, list[tuple[int, Place]]] = {}
            for page, place in moved:
                by_tier.setdefault(place.tier, []).append((page, place))
            for tier, went in by_tier.items():  # one event per tier they went to
                self._events.append(
                    PagesDemoted(
                        tuple(page for page, _ in went),
                        tuple(place.page for _, place in went),
                        tuple(place.generation for _, place in went),
                        tier,
                    )
                )
        if gone:
            self._stats.evictions[reason] = self._stats.evictions.get(reason, 0) + len(gone)
            self._events.append(PagesRemoved(tuple(gone), reason, self.tier))
        return removed

    def _removed(self, removed: list[int], reason: str, emit: bool) -> None:
        self._allocator.free(removed)
        self._stats.evictions[reason] = self._stats.evictions.get(reason, 0) + len(removed)
        if emit:
            self._events.append(PagesRemoved(tuple(removed), reason, self.tier))

    # ------------------------------------------------------------------ integrity

    def check_integrity(self) -> None:
        """Raise AssertionError unless every invariant of the cache holds: free + cached +
        in-use pages == total, each page in one place, references, runs, heap entries and
        digests as `workers.cache.integrity.check_cache` lists them."""
        with self._lock:
            check_cache(self._allocator, self._trie, self._evictor, self._live.values())
