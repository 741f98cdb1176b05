"""The global prefix index: which full pages of which prompts are cached on which worker.

The service holds metadata only, never KV bytes. Workers stream `PagesStored` /
`PagesRemoved` / `PagesDemoted` / `AllCleared` events (see `cache_service.events`); the
index turns them into one page-granular trie per `Namespace` and answers, for a prompt, the
longest prefix of full pages that some live worker holds, as one span per holder, with
the tier of each page (w2's page 8 went down to its disk as page 1008):

    prompt tokens    |<- page 0 ->|<- page 1 ->|<- page 2 ->|<- page 3 ->|<-partial->|
    w2 holds         |  page 3    |  page 4    | page 1008  |            |
    w1 holds         |  page 10   |  page 11   |            |            |
    match            |<------------ matched_tokens -------->|
    requester w1     |<-- local hit ---------->|<- remote ->|<-- miss -->|<- lost -->|
    spans            HolderSpan("w2", "host", (3, 4, 1008), gens, bytes((1, 1, 2))),
                     HolderSpan("w1", "host", (10, 11), gens)

The package, along the index's seams (`GlobalIndex` is the thin facade over them):

- `keys`: chained prefix keys, one 64-bit key per page naming its whole prefix;
- `_compiled` (C++, `csrc/`, built by the package's install): the key table (key ->
  node ids, open addressing in two flat arrays), the key sums, and the trie's work over
  the node and holder columns: a match (the walk by runs of consecutive node ids, every
  holder's span along it), the writes (storing, demoting and dropping chains, pruning,
  the holders beyond the inline columns, the free list) and each worker's page map;
- `nodes`: the trie's nodes as numpy columns (structure, keys, tokens, access), grown in
  place and attached to the compiled trie;
- `holders`: who holds each node (page id, generation, tier), in four inline columns and
  beyond them (kept by the compiled trie);
- `chains`: what each event means (checked first, all of a batch), the compiled writes
  it makes, and the tallies of removals and demotions;
- `batches`: the order of each worker's event batches, and when it must resync;
- `registry`: workers, slots, liveness, reverse page maps, pages per tier, peer entries;
- `tallies`: hit statistics per tenant and per requester;
- `stats`: the index's sizes and counts as one plain dict;
- `integrity`: every invariant, checked in full;
- `owner`: the one thread that may call an index;
- `routes`: the inputs of a routing policy (`cache_service.routing`) from what the index
  holds, and the policies made so far;
- `global_index`: the facade (workers, events, match, route, stats).

The index is Python, numpy and its compiled part (built by the package's install): no
Ray, ZMQ or torch.
"""

from cache_service.index.global_index import GlobalIndex, StaleEpoch
from cache_service.index.owner import OwnerError
from cache_service.index.registry import PeerAddress, Registration, RegistryFull, WorkerInfo
from cache_service.messages import (
    ApplyResult,
    HolderSpan,
    MatchResult,
    PackedSpan,
    PeerEntry,
    RouteDecision,
)

__all__ = [
    "ApplyResult",
    "GlobalIndex",
    "HolderSpan",
    "MatchResult",
    "OwnerError",
    "PackedSpan",
    "PeerAddress",
    "PeerEntry",
    "Registration",
    "RegistryFull",
    "RouteDecision",
    "StaleEpoch",
    "WorkerInfo",
]
