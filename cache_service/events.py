"""Keys and KV events shared by workers and the service.

A worker's local prefix cache and its tiers emit these events as pages become shareable,
move down a tier, or leave the cache; the service applies them to its global index. They
are plain NamedTuples so they encode to msgpack field by field (no pickle) and compare by
value in tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Namespace(NamedTuple):
    """The root of every prefix key: pages are shared only within one namespace.

    `salt` is set by the server per tenant (never trusted from a client), so two tenants
    with byte-identical prompts never share pages.
    """

    model: str
    adapter: str = ""
    salt: str = ""


# A worker's tiers, top down: a page evicted from one goes down to the next and stays
# findable. The order is the wire's: a match span names each page's tier by its index here.
TIERS = ("device", "host", "disk")
DEFAULT_TIER = "host"  # shared memory: where a CPU worker's pages live, and events' default


class PagesStored(NamedTuple):
    """A chain of full pages became shareable, in `tier` (one of TIERS).

    `page_ids[0]` is a child of `parent_page` (None: a child of the namespace root) and
    each following page is a child of the one before. `tokens` holds the token ids of
    all pages back to back, `page_tokens` per page, so a reader compares them exactly: a
    tuple of ints, or (as the prefix cache emits them) `cache_service.tokens.PackedTokens`,
    which equals that tuple and keeps the packed bytes for the wire.

    A page the worker already holds under another id (e.g. on disk, now loaded back into
    host memory) is held under the new id, generation and tier from then on: a worker
    holds each prefix once, as the copy it named last.
    """

    namespace: Namespace
    parent_page: int | None
    page_ids: tuple[int, ...]
    generations: tuple[int, ...]
    tokens: tuple[int, ...] | Sequence[int]
    tier: str = DEFAULT_TIER


class PagesRemoved(NamedTuple):
    """Pages left the cache (leaf first), for `reason` (one of REMOVAL_REASONS); they were
    in `tier`. The ids are the pages' current ones (after any demotion)."""

    page_ids: tuple[int, ...]
    reason: str
    tier: str = DEFAULT_TIER


class PagesDemoted(NamedTuple):
    """Pages left their tier and the worker still holds them, lower down.

    `page_ids[i]` is held from now on as `new_page_ids[i]` in `tier`, with generation
    `generations[i]`: the same prefix, so the worker stays its holder (peers are told the
    new id and tier). A worker's page ids are unique across all its tiers.
    """

    page_ids: tuple[int, ...]
    new_page_ids: tuple[int, ...]  # same length as page_ids
    generations: tuple[int, ...]  # same length as page_ids
    tier: str = "disk"


class AllCleared(NamedTuple):
    """Every shareable page of the worker was dropped at once."""


KvEvent = PagesStored | PagesRemoved | PagesDemoted | AllCleared

# "evicted": made room for a new allocation (in the lowest tier, or where nothing is
# written below); "demoted": left its tier for a lower one whose copy is announced on its
# own (a worker that keeps the page sends PagesDemoted instead); "cleared": an explicit
# clear(); "aborted": pages of a request that ended before publishing them (never shared);
# "compacted": dropped by KV compaction; "corrupt": failed its check when read back (e.g. a
# disk record); "quarantined": copies of a quarantined holder's pages (or of pages it
# tainted), dropped.
REMOVAL_REASONS = (
    "evicted",
    "demoted",
    "cleared",
    "aborted",
    "compacted",
    "corrupt",
    "quarantined",
)
