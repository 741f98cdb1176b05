"""Hypothesis state machine: the prefix trie against a flat reference model.

The reference keeps published prefixes in a dict (prefix tuple -> page id), with no trie
at all. After every step the trie's published pages (from `snapshot()`) must equal the
reference's, every acquire must reuse exactly what the reference predicts, every reused
slot must hold the KV of exactly the right token, every published page must record the
digest of its namespace and token chain, and `check_integrity()` must pass.
Evictions are the cache's own choice: the reference learns them from the events and
checks each removed page was an unreferenced published leaf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from cache_service.events import AllCleared, Namespace, PagesRemoved, PagesStored
from tests.workers.cache_helpers import RecordingPool
from workers.cache.prefix_cache import Allocation, PrefixCache, PrefixCacheConfig
from workers.store.digests import page_digests

P = 3
NAMESPACES = (Namespace("m", salt="a"), Namespace("m", salt="b"))
Prefix = tuple[Namespace, tuple[int, ...]]
# Prompts are a cut of one of a few shared "documents" plus a random tail, so that
# prompts share whole and partial pages often.
DOCUMENTS = ((0, 1, 2, 0, 1, 2, 0, 1, 2), (0, 1, 2, 2, 2, 1, 0, 0), (1, 1, 1, 2, 0, 2, 1))
prompts = st.builds(
    lambda doc, cut, tail: list(DOCUMENTS[doc][:cut]) + tail,
    st.integers(0, len(DOCUMENTS) - 1),
    st.integers(0, 9),
    st.lists(st.integers(0, 2), max_size=4),
).filter(bool)


@dataclass
class RefAllocation:
    real: Allocation
    namespace: Namespace
    prompt_len: int
    nodes: list[tuple[int, ...]] = field(default_factory=list)  # path + own full pages
    broken: bool = False


def _lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class PrefixCacheMachine(RuleBasedStateMachine):
    allocations = Bundle("allocations")

    def __init__(self):
        super().__init__()
        self.pool = RecordingPool(12, P)
        self.cache = PrefixCache(self.pool, PrefixCacheConfig(page_tokens=P))
        self.published: dict[Prefix, int] = {}
        self.pending: set[Prefix] = set()
        self.live: list[RefAllocation] = []

    # -------------------------------------------------------------- reference helpers

    def expected_reuse(self, namespace: Namespace, tokens: list[int]) -> int:
        n = len(tokens)
        m = 0
        while (m + 1) * P <= n and (namespace, tuple(tokens[: (m + 1) * P])) in self.published:
            m += 1
        best = 0
        head = tuple(tokens[: m * P])
        for ns, prefix in self.published:
            if ns == namespace and len(prefix) == (m + 1) * P and prefix[: m * P] == head:
                best = max(best, _lcp(prefix[m * P :], tokens[m * P : (m + 1) * P]))
        return min(m * P + best, n - 1)

    def pinned_cached(self, namespace: Namespace, tokens: list[int], reuse: int) -> int:
        """Unreferenced published pages an acquire reusing `reuse` tokens keeps: counted as
        cached, but not evictable to make room for it (its path, and the page it copies
        from; every candidate source counts, so this may overcount, never undercount)."""
        full = reuse // P
        kept = {(namespace, tuple(tokens[: k * P])) for k in range(1, full + 1)}
        if reuse % P:
            head, part = tuple(tokens[: full * P]), tuple(tokens[full * P : reuse])
            kept |= {
                (ns, prefix)
                for ns, prefix in self.published
                if ns == namespace
                and len(prefix) == (full + 1) * P
                and prefix[:reuse] == head + part
            }
        referenced = self.referenced()
        return sum(1 for key in kept if key in self.published and key not in referenced)

    def referenced(self) -> set[Prefix]:
        return {(a.namespace, prefix) for a in self.live for prefix in a.nodes}

    def apply_events(self) -> None:
        for event in self.cache.take_events():
            if isinstance(event, PagesStored):
                parent = () if event.parent_page is None else self._prefix_of(event.parent_page)
                for i, page in enumerate(event.page_ids):
                    parent = parent + tuple(event.tokens[i * P : (i + 1) * P])
                    assert self.published.get((event.namespace, parent)) == page
            elif isinstance(event, PagesRemoved):
                referenced = self.referenced()
                for page in event.page_ids:
                    key = next(k for k, v in self.published.items() if v == page)
                    assert key not in referenced, f"evicted referenced page {page}"
                    assert not any(
                        ns == key[0] and len(p) > len(key[1]) and p[: len(key[1])] == key[1]
                        for ns, p in self.published
                    ), f"evicted page {page} has published children"
                    del self.published[key]
            else:
                assert isinstance(event, AllCleared)
                assert not self.referenced()
                self.published.clear()

    def _prefix_of(self, page: int) -> tuple[int, ...]:
        return next(k[1] for k, v in self.published.items() if v == page)

    # -------------------------------------------------------------- rules

    @rule(
        target=allocations,
        ns=st.sampled_from(NAMESPACES),
        tokens=prompts,
        extra=st.integers(0, 3),
    )
    def acquire(self, ns, tokens, extra):
        expected = self.expected_reuse(ns, tokens)
        free_before = self.pool.num_free + self.cache.num_cached_pages
        allocation = self.cache.acquire(tokens, ns, extra_token_slots=extra)
        if allocation is None:
            needed = -(-(len(tokens) + extra) // P) - expected // P
            pinned = self.pinned_cached(ns, tokens, expected)
            assert needed > free_before - pinned, "refused though it fits"
            self.apply_events()
            return None
        assert allocation.cached_tokens == expected
        self.pool.assert_holds(allocation, expected)  # never wrong KV
        self.pool.write(allocation, expected, len(tokens))
        ref = RefAllocation(allocation, ns, len(tokens))
        ref.nodes = [tuple(tokens[: k * P]) for k in range(1, expected // P + 1)]
        for k in range(expected // P + 1, len(tokens) // P + 1):
            prefix = (ns, tuple(tokens[: k * P]))
            if prefix in self.published or prefix in self.pending:
                ref.broken = True
                break
            self.pending.add(prefix)
            ref.nodes.append(prefix[1])
        self.live.append(ref)
        self.apply_events()
        return ref

    @rule(ns=st.sampled_from(NAMESPACES), tokens=prompts)
    def whole_request(self, ns, tokens):
        """The common life of a request: acquire, compute, publish all, release."""
        ref = self.acquire(ns, tokens, 0)
        if ref is not None:
            self.publish(ref, 1.0)
            self.release(ref)

    @rule(ref=allocations, fraction=st.one_of(st.just(1.0), st.floats(0, 1)))
    def publish(self, ref, fraction):
        if ref is None or ref.real.released:
            return
        n = int(len(ref.real.tokens) * fraction)
        ref.real.publish(n)
        tokens = ref.real.tokens
        for k in range(1, n // P + 1):
            prefix = (ref.namespace, tuple(tokens[: k * P]))
            if k <= len(ref.nodes):
                self.pending.discard(prefix)
                self.published[prefix] = ref.real.pages[k - 1]
                continue
            if ref.broken:
                break
            if prefix in self.published or prefix in self.pending:
                ref.broken = True
                break
            self.published[prefix] = ref.real.pages[k - 1]
            ref.nodes.append(prefix[1])
        self.apply_events()

    @rule(ref=allocations, new=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def extend(self, ref, new):
        if ref is None or ref.real.released:
            return
        start = ref.real.num_tokens
        if ref.real.extend(new):
            self.pool.write(ref.real, start, ref.real.num_tokens)
        else:
            assert ref.real.num_tokens == start
        self.apply_events()

    @rule(ref=consumes(allocations))
    def release(self, ref):
        if ref is None or ref.real.released:
            return
        ref.real.release()
        self.live.remove(ref)
        for prefix in ref.nodes:
            self.pending.discard((ref.namespace, prefix))
        self.apply_events()

    @rule(n=st.integers(1, 6))
    def evict(self, n):
        self.cache.evict(n)
        self.apply_events()

    @rule(pages=st.lists(st.integers(0, 13), max_size=4), stale=st.booleans())
    def held_elsewhere(self, pages, stale):
        """The index's notices (cluster-aware eviction): any page ids, current or stale
        generations; only the ranking of evictions may change."""
        generations = [self.pool.generation(page) + stale if page < 12 else 0 for page in pages]
        self.cache.held_elsewhere(pages, generations)

    # -------------------------------------------------------------- invariants

    @invariant()
    def trie_matches_reference(self):
        self.cache.check_integrity()
        derived: dict[Prefix, int] = {}
        pages_to_prefix: dict[int, tuple[int, ...]] = {}
        # Chains come parents first; resolve each chain's parent through earlier chains.
        for chain in self.cache.snapshot():
            parent = () if chain.parent_page is None else pages_to_prefix[chain.parent_page]
            for i, page in enumerate(chain.page_ids):
                parent = parent + tuple(chain.tokens[i * P : (i + 1) * P])
                derived[(chain.namespace, parent)] = page
                pages_to_prefix[page] = parent
        assert derived == self.published
        # Each published page records the digest a requester computes for its prefix
        # (free pages record none: check_integrity asks the pool).
        for (namespace, prefix), page in self.published.items():
            [recorded] = self.pool.digests([page])
            assert recorded == page_digests(namespace, "", prefix, P)[-1], f"page {page}"

    def teardown(self):
        for ref in self.live:
            ref.real.release()
        self.cache.check_integrity()


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_prefix_cache_against_reference = PrefixCacheMachine.TestCase
