"""The holders of a match on the wire: [worker_id, tier, page_ids, generations, tiers?].

Page ids travel packed as little-endian int32 and generations as little-endian int64,
one bytes object each rather than a list of ints: a 128-page span then costs two bin
fields to pack and check. `tier` is a name of `events.TIERS`, the tier of the span's first
page; `tiers`, one byte per page (its tier's index into TIERS), comes only when the span's
pages are not all in `tier`. A decoded span is a `HolderSpan` of int tuples.
"""

from __future__ import annotations

import struct
from typing import Any

from cache_service.events import TIERS
from cache_service.messages import HolderSpan
from cache_service.protocol.errors import BAD_FIELD, TOO_LARGE, Limits, ProtocolError
from cache_service.protocol.fields import bad, check_id, check_list
from cache_service.protocol.packed import (
    INT32_STRUCTS,
    INT64_STRUCTS,
    NON_NEGATIVE_TOP_BYTES,
    int_struct,
    pack_ints,
)

_tuple_new = tuple.__new__
_TIER_INDEX = {name: index for index, name in enumerate(TIERS)}
# bytes.translate deletes these: what is left of a span's tiers is not a tier index.
_TIER_INDICES = bytes(range(len(TIERS)))


def check_spans(value: Any, path: str, limits: Limits) -> tuple[HolderSpan, ...]:
    """The spans of a match reply, as HolderSpan tuples."""
    max_str, max_pages = limits.max_str_len, limits.max_tokens
    if type(value) is list and len(value) <= limits.max_list_len:
        spans = []
        for span in value:
            # One inline test per span (a match reply is read on every lookup); on any
            # failure the slow pass below names what was wrong.
            if type(span) is not list:
                break
            if len(span) == 4:
                worker, tier, page_ids, generations = span
                tiers = b""
            elif len(span) == 5:
                worker, tier, page_ids, generations, tiers = span
                if type(tiers) is not bytes:
                    break
            else:
                break
            if not (
                type(worker) is str
                and 0 < len(worker) <= max_str
                and tier in TIERS
                and type(page_ids) is bytes
                and type(generations) is bytes
            ):
                break
            count = len(page_ids) >> 2
            if not (
                0 < count <= max_pages
                and len(page_ids) == 4 * count
                and len(generations) == 8 * count
                and not page_ids[3::4].translate(None, NON_NEGATIVE_TOP_BYTES)
                and not generations[7::8].translate(None, NON_NEGATIVE_TOP_BYTES)
            ):
                break
            if tiers and not (
                len(tiers) == count
                and not tiers.translate(None, _TIER_INDICES)
                and tiers[0] == _TIER_INDEX[tier]
            ):
                break
            int32 = INT32_STRUCTS.get(count) or int_struct(count, "i")
            int64 = INT64_STRUCTS.get(count) or int_struct(count, "q")
            page_ids = int32.unpack(page_ids)
            generations = int64.unpack(generations)
            spans.append(_tuple_new(HolderSpan, (worker, tier, page_ids, generations, tiers)))
        else:
            return tuple(spans)
    for index, span in enumerate(check_list(value, path, limits)):
        _check_span(span, f"{path}[{index}]", limits)
    raise AssertionError(f"{path}: refused by the fast pass but not the slow one")


def _check_span(value: Any, path: str, limits: Limits) -> None:
    """Raise naming what is wrong with one span, if anything."""
    if type(value) is not list or len(value) not in (4, 5):
        raise bad(path, "[worker_id, tier, page_ids, generations, tiers?]", value)
    worker, tier, page_ids, generations = value[:4]
    check_id(worker, f"{path}.worker_id", limits)
    if type(tier) is not str or tier not in TIERS:
        raise bad(f"{path}.tier", f"a tier, one of {TIERS}", tier)
    counts = []
    for name, packed, size in (("page_ids", page_ids, 4), ("generations", generations, 8)):
        where = f"{path}.{name}"
        if type(packed) is not bytes:
            raise bad(where, f"packed little-endian int{8 * size} bytes", packed)
        if len(packed) % size:
            raise ProtocolError(
                BAD_FIELD, f"{where}: {len(packed)} bytes is not a multiple of {size}"
            )
        if len(packed) > size * limits.max_tokens:
            raise ProtocolError(
                TOO_LARGE,
                f"{where}: {len(packed) // size} pages exceeds max_tokens {limits.max_tokens}",
            )
        if packed[size - 1 :: size].translate(None, NON_NEGATIVE_TOP_BYTES):
            values = int_struct(len(packed) // size, "iq"[size // 8]).unpack(packed)
            at = next(i for i, item in enumerate(values) if item < 0)
            raise ProtocolError(BAD_FIELD, f"{where}[{at}]: {values[at]} is negative")
        counts.append(len(packed) // size)
    if counts[0] != counts[1]:
        raise ProtocolError(BAD_FIELD, f"{path}: {counts[0]} page ids but {counts[1]} generations")
    if not counts[0]:
        raise bad(f"{path}.page_ids", "at least one page", page_ids)
    if len(value) == 5:
        _check_tiers(value[4], tier, counts[0], f"{path}.tiers")


def _check_tiers(tiers: Any, tier: str, count: int, path: str) -> None:
    """Raise naming what is wrong with a span's per-page tiers, if anything."""
    if type(tiers) is not bytes:
        raise bad(path, "bytes, one tier index per page", tiers)
    if not tiers:
        return
    if len(tiers) != count:
        raise ProtocolError(BAD_FIELD, f"{path}: {len(tiers)} tiers for {count} pages")
    at = next((i for i, code in enumerate(tiers) if code >= len(TIERS)), None)
    if at is not None:
        raise ProtocolError(
            BAD_FIELD, f"{path}[{at}]: {tiers[at]} is not the index of a tier of {TIERS}"
        )
    if TIERS[tiers[0]] != tier:
        raise ProtocolError(
            BAD_FIELD, f"{path}[0]: {TIERS[tiers[0]]!r}, but the span's tier is {tier!r}"
        )


def spans_wire(value: Any) -> Any:
    """Spans -> wire lists: HolderSpans, PackedSpans (sent as they are), or 4- or 5-item
    lists whose page ids and generations are int sequences, arrays or packed bytes, and
    whose tiers are bytes or tier indices (sent only when not empty)."""
    if not isinstance(value, list | tuple):
        return value
    wire = []
    for index, span in enumerate(value):
        if not isinstance(span, list | tuple) or len(span) not in (4, 5):
            raise bad(f"[{index}]", "HolderSpan(worker_id, tier, page_ids, generations)", span)
        worker, tier, page_ids, generations = span[:4]
        tiers = span[4] if len(span) == 5 else b""
        tail = [tiers if type(tiers) is bytes else _tiers_wire(tiers, index)] if tiers else []
        if type(page_ids) is bytes and type(generations) is bytes:  # a PackedSpan's
            wire.append([worker, tier, page_ids, generations, *tail])
            continue
        if type(page_ids) is tuple and type(generations) is tuple:  # a HolderSpan's
            try:
                int32 = INT32_STRUCTS.get(len(page_ids)) or int_struct(len(page_ids), "i")
                int64 = INT64_STRUCTS.get(len(generations)) or int_struct(len(generations), "q")
                packed = [int32.pack(*page_ids), int64.pack(*generations)]
                wire.append([worker, tier, *packed, *tail])
                continue
            except (struct.error, TypeError):
                pass  # pack_ints names the culprit
        page_ids = pack_ints(page_ids, "i", f"[{index}].page_ids")
        generations = pack_ints(generations, "q", f"[{index}].generations")
        wire.append([worker, tier, page_ids, generations, *tail])
    return wire


def _tiers_wire(tiers: Any, index: int) -> bytes:
    """Per-page tier indices (bytes, or a sequence of ints) as bytes."""
    if isinstance(tiers, bytearray | memoryview | list | tuple):
        try:
            return bytes(tiers)
        except (TypeError, ValueError):
            pass
    raise bad(f"[{index}].tiers", "bytes, one tier index per page", tiers)
