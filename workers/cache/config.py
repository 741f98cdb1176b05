"""How the local prefix cache is configured, and what it counts."""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.cache.eviction import EVICTION_POLICIES


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
    # Pages another worker has stored since this one did (the index says so with the
    # heartbeat's reply) are evicted before pages only this worker holds.
    cluster_eviction: bool = True

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
