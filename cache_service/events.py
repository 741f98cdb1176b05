"""Keys and KV events shared by workers and the service.

A worker's local prefix cache emits these events as pages become shareable or leave the
cache; the service applies them to its global index. They are plain NamedTuples so they
encode to msgpack field by field (no pickle) and compare by value in tests.
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


class PagesStored(NamedTuple):
    """A chain of full pages became shareable.

    `page_ids[0]` is a child of `parent_page` (None: a child of the namespace root) and
    each following page is a child of the one before. `tokens` holds the token ids of
    all pages back to back, `page_tokens` per page, so a reader compares them exactly: a
    tuple of ints, or (as the prefix cache emits them) `cache_service.tokens.PackedTokens`,
    which equals that tuple and keeps the packed bytes for the wire.
    """

    namespace: Namespace
    parent_page: int | None
    page_ids: tuple[int, ...]
    generations: tuple[int, ...]
    tokens: tuple[int, ...] | Sequence[int]


class PagesRemoved(NamedTuple):
    """Pages left the cache (leaf first), for `reason` (one of REMOVAL_REASONS)."""

    page_ids: tuple[int, ...]
    reason: str


class AllCleared(NamedTuple):
    """Every shareable page of the worker was dropped at once."""


KvEvent = PagesStored | PagesRemoved | AllCleared

# "evicted": made room for a new allocation; "cleared": an explicit clear();
# "aborted": pages of a request that ended before publishing them (never shared).
# "quarantined": copies of a quarantined holder's pages (or of pages it tainted), dropped.
REMOVAL_REASONS = ("evicted", "cleared", "aborted", "quarantined")
