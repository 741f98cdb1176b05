"""The stored events the local prefix cache emits, and the snapshot that replaces them
on a resync.

Every published page reaches the service as part of a PagesStored chain: its namespace,
the page it hangs under, its page ids with their generations (so a peer can tell a page
rewritten since), and the packed tokens they hold. Removals and clears are built where
they happen (`PagesRemoved`, `AllCleared`); only stored chains need the trie's layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cache_service.events import DEFAULT_TIER, Namespace, PagesStored
from cache_service.tokens import PackedTokens
from workers.cache.trie import Trie
from workers.store.page_pool import PageAllocator

Generations = Callable[[Sequence[int]], Sequence[int]]


def generations_of(allocator: PageAllocator) -> Generations:
    """How to read pages' generations from `allocator`: in one call where it can."""
    generations = getattr(allocator, "generations", None)
    if generations is not None:
        return generations
    return lambda pages: [allocator.generation(page) for page in pages]


def stored_event(
    namespace: Namespace,
    parent_page: int | None,
    pages: list[int],
    key: bytes,
    generations: Generations,
    tier: str = DEFAULT_TIER,
) -> PagesStored:
    """The event announcing `pages` (token ids `key`, packed) under `parent_page`, in `tier`."""
    gens = tuple(generations(pages))
    return PagesStored(namespace, parent_page, tuple(pages), gens, PackedTokens(key), tier)


def published_chains(
    trie: Trie, generations: Generations, tier: str = DEFAULT_TIER
) -> list[PagesStored]:
    """Every published page of `trie` as PagesStored chains in `tier`, parents before
    children.

    A chain runs on while a page has exactly one published child, across runs.
    """
    chains: list[PagesStored] = []
    for namespace, root in trie.roots.items():
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
            chains.append(stored_event(namespace, parent_page, pages, key, generations, tier))
            last = chain[-1].pages[-1]
            stack.extend((kid, last) for kid in chain[-1].iter_children())
    return chains
