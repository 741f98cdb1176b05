"""What a request holds in the local prefix cache: its allocation, and the batch plan
entry that says which of its tokens it computes.

An allocation's first pages are trie pages, one chain of runs from its namespace root
that it holds by the run ending it (`PrefixCache` draws the layout); its other pages are
private: the partial last prompt page, decode slots and, once compacted, the segment.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from cache_service.events import Namespace
from cache_service.tokens import pack_tokens
from workers.cache.runs import Run, pages_for

if TYPE_CHECKING:
    from workers.cache.prefix_cache import PrefixCache


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
        tail: Run | None,
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
            return pages_for(n_tokens, p)
        fixed = self._held + self.compacted.segment_pages
        return fixed + pages_for(max(0, n_tokens - self.compacted.tail_start), p)

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
            new_tokens = as_token_list(new_tokens)
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


def as_token_list(tokens: Sequence[int]) -> list[int]:
    """A private list of Python ints (numpy and torch arrays convert in one call)."""
    if isinstance(tokens, list):
        return list(tokens)
    tolist = getattr(tokens, "tolist", None)
    return tolist() if tolist is not None else [int(t) for t in tokens]
