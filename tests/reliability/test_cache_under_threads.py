"""A million random operations across threads against the prefix cache, checked against an
independent model of who holds which page.

Eight threads share one `PrefixCache` over a small `PagePool`, so capacity runs out all the
time and eviction never stops. Each thread acquires (alone or as a batch with a common
prefix), computes, publishes, extends and releases its own allocations, and any thread
may evict or clear. What guards guarantee 3 (pinned pages are never evicted):

- The ownership model. Per page id, the live allocations that hold it, each with the stamp
  it expects the page to carry. It is fed from the allocations' own `pages` lists, never
  from the trie: a page freshly handed out must be held by no one, and a page shared by
  several allocations must be expected to hold the same KV by all of them. The model is
  updated after the cache hands a page out and before the cache takes it back, so it never
  claims more than the cache holds and a clash is always a real one.
- Stamps. `stamps[page]` plays the page's KV. An allocation claims each page it did not get
  from a match with a stamp of its own (`(uid, index)`: nobody else may ever expect it),
  and "computes" a full page by writing the stamp of (namespace, every token up to the
  page's end) before publishing it. A page reused from a match must carry exactly that
  stamp for the reader's own tokens. Two prompts with the same prefix share the stamp, so
  legitimate sharing passes; a pinned page evicted and handed to someone else gets that
  someone's stamp, which its holder sees on its next check (after every operation, and
  before it releases). The pool's `copy_page` reads the source's stamp, so a
  copy-on-write is checked to read a computed page of the right tokens that the request
  was not just handed (its source must stay pinned while the acquire evicts).
- Pauses. Every `ROUND` operations all threads stop at a barrier, and the checker proves
  `check_integrity()` (which also proves every reference count equals the allocations
  holding the page, so none is negative) and the page accounting against the model (no
  held page free; in use == the pages the model holds, so none of them is counted
  cached), and now and then evicts or clears everything evictable while the threads are
  paused: no held page may go.

The interleaving is up to the scheduler, so a seed fixes each thread's operations but not
the order between threads; a failure reports the last operations of every thread.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections import deque

import pytest

from cache_service.events import Namespace, PagesRemoved
from workers.cache.prefix_cache import Allocation, PrefixCache, PrefixCacheConfig
from workers.store.page_pool import PagePool

pytestmark = pytest.mark.slow

P = 4  # tokens per page: small, so short prompts span several pages and ops stay cheap
NUM_PAGES = 48  # against 8 threads holding up to 3 allocations of ~5 pages: always short
THREADS = 8
TOTAL_OPS = 1_000_000
ROUND = 500  # operations per thread between two pauses
MAX_HELD = 3  # live allocations per thread
SEED = 20240611
SWITCH_INTERVAL_S = 1e-4  # switch threads often (default 5 ms), to vary the interleavings
BARRIER_TIMEOUT_S = 60.0  # a thread missing a pause this long is stuck: a deadlock
DEADLINE_S = 300.0  # the whole run; about 30 s on 2 busy cores

NAMESPACES = (Namespace("m", salt="a"), Namespace("m", salt="b"))
VOCAB = 6  # few token ids: suffixes collide, so pages are shared past the documents too


def _documents() -> list[list[int]]:
    """Shared prefixes: doc 1 shares 6 tokens with doc 0 (one page and a half, so a
    prompt cut there matches part of a page), doc 3 is doc 2 with one token changed."""
    rng = random.Random(SEED)
    doc0 = [rng.randrange(VOCAB) for _ in range(16)]
    doc1 = doc0[:6] + [rng.randrange(VOCAB) for _ in range(10)]
    doc2 = [rng.randrange(VOCAB) for _ in range(16)]
    doc3 = doc2[:9] + [(doc2[9] + 1) % VOCAB] + doc2[10:]
    return [doc0, doc1, doc2, doc3]


DOCUMENTS = _documents()


class Held:
    """One live allocation of one thread, as the test sees it.

    `keys[i]` is the stamp page `pages[i]` must carry; `computed` counts the leading pages
    whose KV is written (matched pages come computed).
    """

    __slots__ = ("uid", "thread", "alloc", "ns", "tokens", "pages", "keys", "computed")

    def __init__(self, uid: int, thread: int, alloc: Allocation, ns: Namespace, tokens):
        self.uid = uid
        self.thread = thread
        self.alloc = alloc
        self.ns = ns
        self.tokens = list(tokens)
        self.pages = list(alloc.pages)
        self.keys: list[object] = [None] * len(self.pages)
        self.computed = 0

    def full_key(self, index: int) -> tuple[Namespace, tuple[int, ...]]:
        """The stamp of a page holding the KV of every token up to its end: it names what
        it was computed from, so a reader can check a page it did not compute."""
        return (self.ns, tuple(self.tokens[: (index + 1) * P]))

    def private_key(self, index: int) -> tuple[int, int]:
        """The stamp of a page only this allocation may hold (not computed, or partial)."""
        return (self.uid, index)

    def __repr__(self) -> str:
        return f"allocation {self.uid} of thread {self.thread} ({len(self.tokens)} tokens)"


class StampedPool(PagePool):
    """A `PagePool` whose copy-on-write reads a stamp, as a real copy reads the KV.

    The copy happens inside `acquire`, under the cache's lock: what it read (and from
    which page) is kept for the acquiring thread, which checks it once `acquire` returns.
    """

    def __init__(self, num_pages: int, stamps: list[object]):
        super().__init__(num_pages)
        self.stamps = stamps
        self.local = threading.local()

    def copy_page(self, src: int, dst: int, num_tokens: int) -> None:
        assert not self.is_free(src), f"copy-on-write from free page {src}"
        assert not self.is_free(dst) and src != dst, f"copy-on-write into page {dst}"
        assert 0 < num_tokens < P, f"copy-on-write of {num_tokens} tokens"
        copies = getattr(self.local, "copies", None)
        if copies is None:
            copies = self.local.copies = []
        copies.append((src, dst, num_tokens, self.stamps[src]))

    def take_copies(self) -> list[tuple[int, int, int, object]]:
        copies = getattr(self.local, "copies", None) or []
        self.local.copies = []
        return copies


class Ownership:
    """The reference model: page -> {allocation uid: the stamp that allocation expects}."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.refs: dict[int, dict[int, object]] = {}
        self.holders: dict[int, Held] = {}
        self.cross_thread_shares = 0

    def add(self, held: Held) -> None:
        with self.lock:
            self.holders[held.uid] = held

    def claim_own(self, held: Held, index: int) -> None:
        """A page the allocation got from the allocator: nobody may hold it."""
        page = held.pages[index]
        with self.lock:
            holders = self.refs.setdefault(page, {})
            assert not holders, (
                f"page {page} handed to {held} as a new page while held by "
                f"{[self.holders[uid] for uid in holders]}"
            )
            holders[held.uid] = held.keys[index]

    def claim_shared(self, held: Held, index: int) -> None:
        """A page the allocation got from a match: every holder expects the same KV."""
        page = held.pages[index]
        key = held.keys[index]
        with self.lock:
            holders = self.refs.setdefault(page, {})
            for uid, theirs in holders.items():
                assert theirs == key, (
                    f"page {page} matched by {held} is held by {self.holders[uid]}, "
                    f"which expects other KV there"
                )
                if self.holders[uid].thread != held.thread:
                    self.cross_thread_shares += 1
            holders[held.uid] = key

    def restamp(self, held: Held, index: int) -> None:
        """The allocation computed one of its own pages: nobody else may hold it yet."""
        page = held.pages[index]
        with self.lock:
            holders = self.refs[page]
            assert list(holders) == [held.uid], (
                f"page {page} computed by {held} is also held by "
                f"{[self.holders[uid] for uid in holders if uid != held.uid]}"
            )
            holders[held.uid] = held.keys[index]

    def drop(self, held: Held) -> None:
        with self.lock:
            del self.holders[held.uid]
            for page in held.pages:
                holders = self.refs[page]
                del holders[held.uid]
                if not holders:
                    del self.refs[page]


class Stress:
    """The shared state of one run: the cache, the stamps, the model, the pause checker."""

    def __init__(self) -> None:
        self.stamps: list[object] = [None] * NUM_PAGES
        self.pool = StampedPool(NUM_PAGES, self.stamps)
        self.cache = PrefixCache(self.pool, PrefixCacheConfig(page_tokens=P))
        self.model = Ownership()
        self.uids = iter(range(1, sys.maxsize))
        self.uid_lock = threading.Lock()
        self.logs = [deque(maxlen=40) for _ in range(THREADS)]
        self.counts = [dict.fromkeys(COUNTERS, 0) for _ in range(THREADS)]
        self.errors: list[tuple[int, BaseException]] = []
        self.pauses = 0
        self.probe_rng = random.Random(SEED - 1)
        self.barrier = threading.Barrier(THREADS, action=self.pause_check)

    def new_uid(self) -> int:
        with self.uid_lock:
            return next(self.uids)

    # ------------------------------------------------------------------ the pause

    def pause_check(self) -> None:
        """Runs in one thread while all the others wait: the model is then exact."""
        self.pauses += 1
        cache = self.cache
        cache.check_integrity()
        self.check_accounting()
        cache.take_events()  # keep the event list bounded; the probe below reads its own
        if self.pauses % 5 == 0:
            self.probe_eviction(clear=self.pauses % 20 == 0)

    def check_accounting(self) -> None:
        stats = self.cache.stats()
        refs = self.model.refs
        total = stats["total_pages"]
        assert total == NUM_PAGES
        assert stats["free_pages"] + stats["cached_pages"] + stats["in_use_pages"] == total
        assert stats["free_pages"] == self.pool.num_free
        assert stats["live_allocations"] == len(self.model.holders)
        # A held page counted cached (evictable) would leave in_use short of the model.
        assert stats["in_use_pages"] == len(refs), (
            f"{stats['in_use_pages']} pages in use, the model holds {len(refs)}"
        )
        assert stats["cached_pages"] == total - self.pool.num_free - len(refs)
        for page, holders in refs.items():
            assert holders, f"page {page} in the model with no holder"
            assert not self.pool.is_free(page), f"held page {page} is on the free list"
            for uid, key in holders.items():
                assert self.stamps[page] == key, (
                    f"page {page} held by {self.model.holders[uid]} lost its stamp"
                )

    def probe_eviction(self, clear: bool) -> None:
        """Evict (or clear) while nothing moves: nothing held may go, and what is left
        cached after a clear is nothing."""
        cache = self.cache
        if clear:
            cache.clear()
            assert cache.stats()["cached_pages"] == 0
        else:
            cache.evict(self.probe_rng.randint(1, NUM_PAGES))
        for event in cache.take_events():
            if isinstance(event, PagesRemoved):
                held = set(event.page_ids) & set(self.model.refs)
                assert not held, f"evicted held pages {sorted(held)}"
                assert all(self.pool.is_free(page) for page in event.page_ids)
        cache.check_integrity()
        self.check_accounting()
        self.counts[0]["probes"] += 1


COUNTERS = (
    "acquired",
    "refused",
    "batches",
    "batch_siblings",
    "cow",
    "hit_pages",
    "published_pages",
    "extended",
    "extend_refused",
    "released",
    "evicted",
    "clears",
    "probes",
)


class Worker:
    """One thread's operations, drawn from its own seeded RNG."""

    def __init__(self, stress: Stress, thread: int, num_ops: int):
        self.stress = stress
        self.cache = stress.cache
        self.stamps = stress.stamps
        self.model = stress.model
        self.thread = thread
        self.num_ops = num_ops
        self.rng = random.Random(SEED * 100 + thread)
        self.held: list[Held] = []
        self.log = stress.logs[thread]
        self.counts = stress.counts[thread]
        self.index = 0  # of the operation under way, for the log

    def run(self) -> None:
        stress = self.stress
        try:
            done = 0
            while done < self.num_ops:
                for _ in range(min(ROUND, self.num_ops - done)):
                    self.step(done)
                    done += 1
                stress.barrier.wait(BARRIER_TIMEOUT_S)
            while self.held:
                self.release(self.held[-1])
        except threading.BrokenBarrierError as exc:
            if not stress.errors:
                stress.errors.append((self.thread, exc))
        except BaseException as exc:  # noqa: BLE001 - the main thread reports it
            stress.errors.append((self.thread, exc))
            stress.barrier.abort()

    # ------------------------------------------------------------------ one operation

    def note(self, *entry) -> None:
        self.log.append((self.index, *entry))

    def step(self, index: int) -> None:
        self.index = index
        rng = self.rng
        r = rng.random()
        held = self.held
        if r < 0.30:
            if len(held) >= MAX_HELD:
                self.release(held.pop(rng.randrange(len(held))), popped=True)
            else:
                self.acquire()
        elif r < 0.34:
            if len(held) + 3 > MAX_HELD and held:  # a batch holds up to 3 allocations
                self.release(held.pop(rng.randrange(len(held))), popped=True)
            else:
                self.acquire_batch()
        elif r < 0.50:
            if held:
                self.publish(rng.choice(held))
        elif r < 0.66:
            if held:
                self.extend(rng.choice(held))
        elif r < 0.88:
            if held:
                self.release(held.pop(rng.randrange(len(held))), popped=True)
        elif r < 0.975:
            k = rng.randint(1, 6)
            got = self.cache.evict(k)
            assert 0 <= got <= k, f"evict({k}) evicted {got}"
            self.counts["evicted"] += got
            self.note("evict", k, got)
        elif r < 0.977:
            got = self.cache.clear()
            assert got >= 0
            self.counts["clears"] += 1
            self.note("clear", got)
        elif r < 0.997:
            stats = self.cache.stats()
            parts = stats["free_pages"] + stats["cached_pages"] + stats["in_use_pages"]
            assert parts == stats["total_pages"], stats
            assert min(stats["free_pages"], stats["cached_pages"], stats["in_use_pages"]) >= 0
        else:
            self.cache.check_integrity()  # under the cache's lock: valid mid-run too
        self.check_held()

    def check_held(self) -> None:
        """The cheap check after every operation: every page this thread holds still
        carries the stamp it expects."""
        stamps = self.stamps
        for h in self.held:
            if [stamps[page] for page in h.pages] != h.keys:
                bad = [
                    (i, page, stamps[page], h.keys[i])
                    for i, page in enumerate(h.pages)
                    if stamps[page] != h.keys[i]
                ]
                raise AssertionError(f"{h}: pages lost their stamps (index, page, got, want) {bad}")

    # ------------------------------------------------------------------ the operations

    def prompt(self, head: list[int] | None = None) -> list[int]:
        rng = self.rng
        if head is None:
            doc = DOCUMENTS[rng.randrange(len(DOCUMENTS))]
            head = doc[: rng.randint(0, len(doc))]
        tokens = head + [rng.randrange(VOCAB) for _ in range(rng.randint(0, 5))]
        return tokens or [rng.randrange(VOCAB)]

    def namespace(self) -> Namespace:
        return NAMESPACES[0] if self.rng.random() < 0.8 else NAMESPACES[1]

    def acquire(self) -> None:
        ns, tokens = self.namespace(), self.prompt()
        extra = self.rng.randint(0, 4)
        alloc = self.cache.acquire(tokens, ns, extra_token_slots=extra)
        self.note("acquire", ns.salt, tokens, extra, alloc and list(alloc.pages))
        copies = self.stress.pool.take_copies()
        if alloc is None:
            self.counts["refused"] += 1
            assert not copies, f"a refused acquire copied {copies}"
            return
        self.take(alloc, ns, tokens, extra, copies)

    def acquire_batch(self) -> None:
        rng = self.rng
        ns = self.namespace()
        head = self.prompt()
        prompts = [self.prompt(list(head)) for _ in range(rng.randint(2, 3))]
        extra = rng.randint(0, 2)
        entries = self.cache.acquire_batch(prompts, ns, extra_token_slots=extra)
        pages = entries and [list(entry.allocation.pages) for entry in entries]
        self.note("batch", ns.salt, prompts, extra, pages)
        copies = self.stress.pool.take_copies()
        if entries is None:
            self.counts["refused"] += 1
            return
        self.counts["batches"] += 1
        # The batch's forward pass: in order, each request computes its prompt pages, so a
        # later request reads the pages an earlier one shares with it already written.
        for i, (entry, tokens) in enumerate(zip(entries, prompts, strict=True)):
            # A batch's copies are in request order: each takes its own (at most one).
            assert entry.compute_from == entry.allocation.cached_tokens
            assert all(0 <= d < i for d in entry.depends_on), entry.depends_on
            self.counts["batch_siblings"] += bool(entry.depends_on)
            held = self.take(entry.allocation, ns, tokens, extra, copies)
            self.compute(held, len(tokens) // P)
        assert not copies, f"copies no request of the batch made: {copies}"

    def take(
        self, alloc: Allocation, ns: Namespace, tokens: list[int], extra: int, copies: list
    ) -> Held:
        """Enter a new allocation in the model: claim its own pages, check its reused ones
        (and the page its copy-on-write read, taken off `copies`)."""
        held = Held(self.stress.new_uid(), self.thread, alloc, ns, tokens)
        n = len(tokens)
        pages = held.pages
        assert alloc.tokens == tokens and alloc.namespace == ns
        assert len(pages) == -(-(n + extra) // P), f"{len(pages)} pages for {n}+{extra} slots"
        assert len(set(pages)) == len(pages), f"a page twice in one allocation: {pages}"
        assert 0 <= alloc.cached_tokens < n
        shared = alloc.cached_tokens // P
        self.counts["acquired"] += 1
        self.counts["cow"] += alloc.cached_tokens % P != 0
        self.counts["hit_pages"] += shared
        self.model.add(held)
        for i in range(shared, len(pages)):
            held.keys[i] = held.private_key(i)
            self.model.claim_own(held, i)
            self.stamps[pages[i]] = held.keys[i]
        for i in range(shared):
            held.keys[i] = held.full_key(i)
            assert self.stamps[pages[i]] == held.keys[i], (
                f"{held} reused page {pages[i]} (index {i}), which holds other KV"
            )
            self.model.claim_shared(held, i)
        held.computed = shared
        self.held.append(held)
        cow = alloc.cached_tokens % P
        if cow:
            self.check_copy(held, shared, cow, copies.pop(0) if copies else None)
        return held

    def check_copy(self, held: Held, index: int, cow: int, copy) -> None:
        """The copy-on-write read the KV of this prompt's first `cow` tokens of page
        `index`, from a page that was cached (computed, and not handed to this request)."""
        assert copy is not None, f"{held} reuses {cow} tokens of a page but copied none"
        src, dst, num_tokens, stamp = copy
        assert dst == held.pages[index] and num_tokens == cow, (copy, held.pages)
        assert src not in held.pages[index:], (
            f"{held} copied from page {src}, which it was just handed as a new page"
        )
        assert isinstance(stamp, tuple) and isinstance(stamp[0], Namespace), (
            f"{held} copied from page {src}, which holds no computed KV ({stamp})"
        )
        ns, source = stamp
        end = index * P + cow
        assert ns == held.ns and len(source) == (index + 1) * P, (held, stamp)
        assert list(source[:end]) == held.tokens[:end], (
            f"{held} copied page {src}, computed for other tokens: {source}"
        )

    def compute(self, held: Held, upto: int) -> None:
        """Write the KV of the allocation's full pages before `upto`."""
        for i in range(held.computed, upto):
            held.keys[i] = held.full_key(i)
            self.stamps[held.pages[i]] = held.keys[i]
            self.model.restamp(held, i)
        held.computed = max(held.computed, upto)

    def publish(self, held: Held) -> None:
        n = len(held.tokens)
        if self.rng.random() < 0.5:
            n = self.rng.randint(0, n)
        self.compute(held, n // P)  # only written KV is ever made shareable
        got = held.alloc.publish(n)
        assert 0 <= got <= n // P, f"publish({n}) made {got} pages shareable"
        self.counts["published_pages"] += got
        self.note("publish", held.uid, n, got)

    def extend(self, held: Held) -> None:
        self.compute(held, len(held.tokens) // P)  # decode follows the prefill
        new = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 3))]
        old_len, old_pages = len(held.tokens), len(held.pages)
        ok = held.alloc.extend(new)
        self.note("extend", held.uid, new, ok)
        alloc = held.alloc
        if not ok:
            self.counts["extend_refused"] += 1
            assert alloc.num_tokens == old_len and len(alloc.pages) == old_pages
            return
        self.counts["extended"] += 1
        held.tokens.extend(new)
        assert alloc.tokens == held.tokens
        assert alloc.pages[:old_pages] == held.pages, "extend moved pages already held"
        held.pages = list(alloc.pages)
        assert len(held.pages) == max(old_pages, -(-len(held.tokens) // P))
        assert len(set(held.pages)) == len(held.pages)
        for i in range(old_pages, len(held.pages)):
            held.keys.append(held.private_key(i))
            self.model.claim_own(held, i)
            self.stamps[held.pages[i]] = held.keys[i]
        self.compute(held, len(held.tokens) // P)  # decode wrote the new tokens' KV

    def release(self, held: Held, popped: bool = False) -> None:
        if not popped:
            self.held.remove(held)
        # Before giving the pages back: were they ours the whole time?
        assert held.alloc.pages == held.pages, "the allocation's pages changed under it"
        for i, page in enumerate(held.pages):
            assert self.stamps[page] == held.keys[i], (
                f"{held}: page {page} (index {i}) was overwritten while held"
            )
        self.model.drop(held)
        held.alloc.release()
        self.counts["released"] += 1
        self.note("release", held.uid)


def _failure_report(stress: Stress) -> str:
    lines = [f"seed {SEED}, {THREADS} threads, pause {stress.pauses}"]
    for thread, exc in stress.errors:
        lines.append(f"thread {thread}: {type(exc).__name__}: {exc}")
    for thread, log in enumerate(stress.logs):
        lines.append(f"-- last operations of thread {thread}:")
        lines.extend(f"   {entry}" for entry in list(log)[-12:])
    return "\n".join(lines)


def test_million_operations_across_threads_keep_pins_and_ownership():
    stress = Stress()
    per_thread = TOTAL_OPS // THREADS
    workers = [Worker(stress, t, per_thread) for t in range(THREADS)]
    threads = [
        threading.Thread(target=w.run, name=f"cache-stress-{w.thread}", daemon=True)
        for w in workers
    ]
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    start = time.monotonic()
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=max(1.0, DEADLINE_S - (time.monotonic() - start)))
    finally:
        sys.setswitchinterval(old_interval)
    seconds = time.monotonic() - start
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, (
        f"threads still running after {seconds:.0f} s (deadlock?): {stuck}\n"
        + _failure_report(stress)
    )
    assert not stress.errors, _failure_report(stress)

    # Everything released: nothing in use, every page free or cached.
    cache, pool = stress.cache, stress.pool
    assert not stress.model.refs and not stress.model.holders
    cache.check_integrity()
    stats = cache.stats()
    assert stats["in_use_pages"] == 0 and stats["live_allocations"] == 0
    assert stats["free_pages"] + stats["cached_pages"] == NUM_PAGES
    cache.clear()
    assert pool.num_free == NUM_PAGES
    cache.check_integrity()

    # The run did what it is for: sharing across threads and batches, copy-on-write,
    # capacity running out, eviction all the time.
    counts = {key: sum(c[key] for c in stress.counts) for key in COUNTERS}
    print(
        f"\n{per_thread * THREADS} operations, {THREADS} threads, {seconds:.1f} s, "
        f"{stress.pauses} pauses, cross-thread shares {stress.model.cross_thread_shares}, "
        f"{counts}, evictions {stats['evictions']}"
    )
    assert stress.pauses == -(-per_thread // ROUND)
    assert stress.model.cross_thread_shares > 0
    for key in COUNTERS:
        assert counts[key] > 0, f"no {key} in {counts}"
    assert counts["refused"] > counts["acquired"] // 50, counts  # exhaustion is ordinary
    assert stats["evictions"].get("evicted", 0) > 0
