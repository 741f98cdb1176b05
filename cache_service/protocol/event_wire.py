"""KV events on the wire: compact tagged lists, decoded into `cache_service.events` values.

    ["s", [model, adapter, salt], parent_page | None, page_ids, generations, tokens, tier?]
    ["r", page_ids, reason, tier?]
    ["d", page_ids, new_page_ids, generations, tier]
    ["c"]

A stored or removed event's tier is optional and last: sent only when it is not
DEFAULT_TIER, so an event in host memory travels as it did before tiers, and one without
it decodes with DEFAULT_TIER. A tier is a name of `events.TIERS`.

Page ids travel as little-endian int32 bytes, generations as int64 bytes and tokens as
int32 bytes (see `packed`): an event costs one or two containers whatever its length, so
the frame's container budget (`Limits.max_containers`) bounds events, not pages.
Decoded, they are the tuples of ints of `cache_service.events`; `packed_tokens(event)`
still returns the token bytes off the wire without repacking.
"""

from __future__ import annotations

from typing import Any

from cache_service.events import (
    DEFAULT_TIER,
    REMOVAL_REASONS,
    TIERS,
    AllCleared,
    KvEvent,
    PagesDemoted,
    PagesRemoved,
    PagesStored,
)
from cache_service.protocol.errors import BAD_FIELD, DEFAULT_LIMITS, Limits, ProtocolError
from cache_service.protocol.fields import (
    bad,
    check_list,
    check_namespace,
    check_page_id,
    check_tokens,
    describe,
)
from cache_service.protocol.packed import check_packed, pack_ints
from cache_service.tokens import PackedTokens, pack_tokens, split_pages, token_tuple

STORED_TAG = "s"
REMOVED_TAG = "r"
DEMOTED_TAG = "d"
CLEARED_TAG = "c"
# Items per event: (without its tier, with it).
_SHAPES = {STORED_TAG: (6, 7), REMOVED_TAG: (3, 4), DEMOTED_TAG: (5, 5), CLEARED_TAG: (1, 1)}


class _WirePagesStored(PagesStored):
    """A PagesStored decoded off the wire; keeps its packed tokens for packed_tokens()."""

    # No __slots__ on purpose: the instance dict holds `_packed`.

    def __reduce__(self) -> tuple:
        # Copied or shipped to another process (Ray), it is a plain PagesStored.
        return (PagesStored, tuple(self))


# It reads as a PagesStored in reprs and logs.
_WirePagesStored.__name__ = "PagesStored"


def packed_tokens(event: PagesStored) -> bytes:
    """The tokens of a stored chain as packed int32 bytes.

    An event decoded here returns the bytes it arrived in, and one whose tokens are
    `PackedTokens` (the prefix cache's) the bytes they hold (no repacking); any other
    PagesStored is packed now.

    Raises:
        ValueError: the tokens are not int32 ids.
    """
    packed = getattr(event, "_packed", None)
    if packed is not None:
        return packed
    tokens = event.tokens
    return tokens.packed if type(tokens) is PackedTokens else pack_tokens(tokens)


def check_stored(event: PagesStored, page_tokens: int) -> None:
    """Check what only the receiver can: the chain carries exactly `page_tokens` per page.

    Raises:
        ProtocolError: (bad_field) with the page and token counts.
    """
    expected = len(event.page_ids) * page_tokens
    if len(event.tokens) != expected:
        raise ProtocolError(
            BAD_FIELD,
            f"stored chain of {len(event.page_ids)} pages carries {len(event.tokens)} tokens; "
            f"at {page_tokens} tokens a page it needs {expected}",
        )


def stored_pages(event: PagesStored, page_tokens: int) -> list[bytes]:
    """`check_stored`, then the chain's pages as packed bytes, one per page id."""
    check_stored(event, page_tokens)
    return split_pages(packed_tokens(event), page_tokens)


def encode_event(event: KvEvent) -> list:
    """The compact wire form of one event (see the module docstring)."""
    if isinstance(event, PagesStored):
        try:
            tokens = packed_tokens(event)
        except ValueError as exc:
            raise ProtocolError(BAD_FIELD, f"stored chain tokens: {exc}") from None
        wire = [
            STORED_TAG,
            list(event.namespace),
            event.parent_page,
            pack_ints(event.page_ids, "i", "stored chain page_ids"),
            pack_ints(event.generations, "q", "stored chain generations"),
            tokens,
        ]
        return wire if event.tier == DEFAULT_TIER else [*wire, event.tier]
    if isinstance(event, PagesRemoved):
        wire = [REMOVED_TAG, pack_ints(event.page_ids, "i", "removed page_ids"), event.reason]
        return wire if event.tier == DEFAULT_TIER else [*wire, event.tier]
    if isinstance(event, PagesDemoted):
        return [
            DEMOTED_TAG,
            pack_ints(event.page_ids, "i", "demoted page_ids"),
            pack_ints(event.new_page_ids, "i", "demoted new_page_ids"),
            pack_ints(event.generations, "q", "demoted generations"),
            event.tier,
        ]
    if isinstance(event, AllCleared):
        return [CLEARED_TAG]
    raise ProtocolError(BAD_FIELD, f"expected a KvEvent, got {describe(event)}")


def decode_event(value: Any, limits: Limits | None = None, path: str = "event") -> KvEvent:
    """One event from its wire form, fully checked.

    A stored chain must have at least one page, as many generations as page ids, and a
    token count that splits evenly over its pages; the exact tokens per page are checked
    by the receiver with `check_stored`. A demotion names at least one page, and as many
    new page ids and generations as pages. A tier must be a name of TIERS.

    Raises:
        ProtocolError: (bad_field / too_large) naming the offending part.
    """
    limits = limits or DEFAULT_LIMITS
    if type(value) is not list or not value or type(value[0]) is not str:
        raise bad(path, 'an event ["s" | "r" | "d" | "c", ...]', value)
    tag = value[0]
    shape = _SHAPES.get(tag)
    if shape is None:
        raise bad(f"{path}[0]", "an event tag 's', 'r', 'd' or 'c'", tag)
    if len(value) not in shape:
        items = " or ".join(str(n) for n in sorted(set(shape)))
        raise bad(path, f"{items} items for event {tag!r}", value)
    if tag == STORED_TAG:
        return _decode_stored(value, path, limits)
    if tag == REMOVED_TAG:
        ids = _page_ids(value[1], f"{path}.page_ids", limits)
        reason = value[2]
        if type(reason) is not str or reason not in REMOVAL_REASONS:
            raise bad(f"{path}.reason", f"one of {REMOVAL_REASONS}", reason)
        return PagesRemoved(ids, reason, _tier(value, 3, path))
    if tag == DEMOTED_TAG:
        return _decode_demoted(value, path, limits)
    return AllCleared()


def _page_ids(value: Any, path: str, limits: Limits) -> tuple[int, ...]:
    """At least one packed page id."""
    ids = check_packed(value, path, limits, "i")
    if not ids:
        raise bad(path, "at least one page id", value)
    return ids


def _tier(value: list, at: int, path: str) -> str:
    """The tier at `value[at]`, DEFAULT_TIER when the event ends before it."""
    if len(value) <= at:
        return DEFAULT_TIER
    tier = value[at]
    if type(tier) is not str or tier not in TIERS:
        raise bad(f"{path}.tier", f"a tier, one of {TIERS}", tier)
    return tier


def _decode_stored(value: list, path: str, limits: Limits) -> PagesStored:
    _, namespace, parent, page_ids, generations, tokens = value[:6]
    ids = _page_ids(page_ids, f"{path}.page_ids", limits)
    gens = check_packed(generations, f"{path}.generations", limits, "q")
    if len(gens) != len(ids):
        raise ProtocolError(BAD_FIELD, f"{path}: {len(ids)} page ids but {len(gens)} generations")
    packed = check_tokens(tokens, f"{path}.tokens", limits)
    count = len(packed) // 4
    if count == 0 or count % len(ids):
        raise ProtocolError(
            BAD_FIELD, f"{path}.tokens: {count} tokens do not split evenly over {len(ids)} pages"
        )
    event = _WirePagesStored(
        check_namespace(namespace, f"{path}.namespace", limits),
        None if parent is None else check_page_id(parent, f"{path}.parent_page", limits),
        ids,
        gens,
        token_tuple(packed),
        _tier(value, 6, path),
    )
    event._packed = packed
    return event


def _decode_demoted(value: list, path: str, limits: Limits) -> PagesDemoted:
    _, page_ids, new_page_ids, generations, _ = value
    ids = _page_ids(page_ids, f"{path}.page_ids", limits)
    new_ids = check_packed(new_page_ids, f"{path}.new_page_ids", limits, "i")
    gens = check_packed(generations, f"{path}.generations", limits, "q")
    if not len(ids) == len(new_ids) == len(gens):
        raise ProtocolError(
            BAD_FIELD,
            f"{path}: {len(ids)} page ids, {len(new_ids)} new page ids and {len(gens)} "
            "generations (one of each per page)",
        )
    return PagesDemoted(ids, new_ids, gens, _tier(value, 4, path))


def check_events(value: Any, path: str, limits: Limits) -> list[KvEvent]:
    items = check_list(value, path, limits)
    return [decode_event(item, limits, f"{path}[{index}]") for index, item in enumerate(items)]


def check_chains(value: Any, path: str, limits: Limits) -> list[PagesStored]:
    """Resync payload: stored chains only."""
    items = check_list(value, path, limits)
    chains = []
    for index, item in enumerate(items):
        where = f"{path}[{index}]"
        if type(item) is not list or not item or item[0] != STORED_TAG:
            raise bad(where, 'a stored chain ["s", ...]', item)
        chains.append(decode_event(item, limits, where))
    return chains


def events_wire(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [encode_event(event) for event in value]
    return value
