"""The local prefix cache's invariants, checked in full (`PrefixCache.check_integrity`).

A walk of the whole trie and every live allocation: for tests, and for a worker that is
idle. It reads the cache's parts and changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from cache_service.tokens import TOKEN_BYTES
from workers.cache.allocation import Allocation
from workers.cache.evictor import MARKS_SLACK, Evictor
from workers.cache.runs import Run
from workers.cache.trie import Trie
from workers.store.digests import EMPTY_DIGEST, next_digest, root_digest
from workers.store.page_pool import PageAllocator


def check_cache(
    allocator: PageAllocator, trie: Trie, evictor: Evictor, allocations: Iterable[Allocation]
) -> None:
    """Raise AssertionError unless every invariant of the cache holds (call it under the
    cache's lock).

    free + cached + in-use == total; each page in exactly one place; reference
    counts equal the live allocations that hold each run; each allocation's trie
    pages are the chain of runs it ends in; runs hold whole pages, never branch
    before their last page and are never empty; published runs hang under published
    parents; pending runs are referenced; every evictable leaf has a live heap entry
    ranked by its current key; every published page's digest chains from the page
    before it, and (when the allocator reports digests) is what its page records,
    while pending and private pages record none.
    """
    check = getattr(allocator, "check_integrity", None)
    if check is not None:
        check()
    expected_refs: dict[int, int] = {}
    private: set[int] = set()
    for allocation in allocations:
        assert not allocation.released
        chain: list[int] = []
        run = allocation._tail
        while run is not None and run.parent is not None:
            assert run.alive, f"allocation holds removed page {run.pages[-1]}"
            expected_refs[id(run)] = expected_refs.get(id(run), 0) + 1
            chain[:0] = run.pages
            run = run.parent
        assert run is None or trie.roots.get(allocation.namespace) is run, (
            "an allocation's chain does not start at its namespace root"
        )
        assert chain == allocation.pages[: allocation._held], (
            f"allocation holds trie pages {chain}, lists {allocation.pages}"
        )
        for page in allocation.private_pages:
            assert page not in private, f"page {page} private to two allocations"
            private.add(page)
        assert allocation.capacity >= allocation.num_tokens, (
            f"allocation of {allocation.num_tokens} tokens has capacity {allocation.capacity}"
        )
    valid_heap = {
        id(e[2]): (e[0], heap is evictor.marked_heap)
        for heap in (evictor.heap, evictor.marked_heap)
        for e in heap
        if e[2].heap_version == e[1]
    }
    published: dict[int, bytes] = {}  # page -> the digest it must record
    trie_pages: set[int] = set()
    cached = referenced = nodes = 0
    for namespace, root in trie.roots.items():
        assert root.parent is None and not root.pages and root.ready
        assert root.key == namespace, f"root of {namespace} keyed {root.key}"
        assert root.digests == [root_digest(namespace, trie.kv_format)], (
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
                _check_run(node, run, trie.step, evictor, expected_refs, published, valid_heap)
                for page in run.pages:
                    assert page not in trie_pages and page not in private, (
                        f"page {page} is in two places"
                    )
                    assert trie.run_of(page) is run, f"page {page} is not found in its run"
                    trie_pages.add(page)
                nodes += len(run.pages)
                if run.ref_count:
                    referenced += len(run.pages)
                else:
                    cached += len(run.pages)
                stack.append(run)
    assert nodes == trie.num_pages, f"{nodes} pages in the trie, counted {trie.num_pages}"
    assert len(evictor.marks) <= MARKS_SLACK + 2 * nodes, f"{len(evictor.marks)} marks kept"
    assert cached == evictor.num_evictable, (
        f"{cached} unreferenced pages, counted {evictor.num_evictable}"
    )
    is_free = getattr(allocator, "is_free", None)
    if is_free is not None:
        for page in trie_pages | private:
            assert not is_free(page), f"page {page} is both used and free"
    _check_digests(allocator, published, private)
    free = allocator.num_free
    in_use = referenced + len(private)
    total = allocator.num_pages
    assert free + cached + in_use == total, (
        f"free {free} + cached {cached} + in use {in_use} != total {total}"
    )


def _check_run(
    node: Run,
    run: Run,
    step: int,
    evictor: Evictor,
    expected_refs: dict[int, int],
    published: dict[int, bytes],
    valid_heap: dict[int, tuple[int, ...]],
) -> None:
    """The invariants of one run under its parent `node` (see `check_cache`); `step`:
    bytes of one packed page."""
    assert run.parent is node and run.alive
    assert run.pages, "an empty run is in the trie"
    assert len(run.key) == len(run.pages) * step, (
        f"run of {len(run.pages)} pages keyed by {len(run.key)} bytes"
    )
    assert run.head == run.key[:step] and node.child(run.head) is run
    if node.by_first is not None:
        assert run in node.by_first[run.head[:TOKEN_BYTES]]
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
    if run.is_evictable_leaf():
        assert id(run) in valid_heap, f"leaf {run.pages[-1]} not evictable"
        marked = evictor.is_marked(run, run.pages[-1])
        assert valid_heap[id(run)] == (evictor.key(run), marked), (
            f"leaf {run.pages[-1]} is ranked by a stale key, or in the wrong heap"
        )


def _check_digests(allocator: PageAllocator, expected: dict[int, bytes], private: set[int]) -> None:
    """Each trie page records its digest (pending: none), private pages none."""
    digests = getattr(allocator, "digests", None)
    if digests is None:
        return
    expected = {**expected, **dict.fromkeys(private, EMPTY_DIGEST)}
    pages = list(expected)
    for page, recorded in zip(pages, digests(pages), strict=True):
        assert recorded == expected[page], (
            f"page {page} records digest {recorded.hex()}, expected {expected[page].hex()}"
        )
