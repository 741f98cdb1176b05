"""The holders of a match on the wire: [worker_id, tier, page_ids, generations] per span.

Page ids travel packed as little-endian int32 and generations as little-endian int64,
one bytes object each rather than a list of ints: a 128-page span then costs two bin
fields to pack and check. A decoded span is a `HolderSpan` of int tuples.
"""

from __future__ import annotations

import struct
from typing import Any

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


def check_spans(value: Any, path: str, limits: Limits) -> tuple[HolderSpan, ...]:
    """The spans of a match reply, as HolderSpan tuples."""
    max_str, max_pages = limits.max_str_len, limits.max_tokens
    if type(value) is list and len(value) <= limits.max_list_len:
        spans = []
        for span in value:
            # One inline test per span (a match reply is read on every lookup); on any
            # failure the slow pass below names what was wrong.
            if type(span) is not list or len(span) != 4:
                break
            worker, tier, page_ids, generations = span
            if not (
                type(worker) is str
                and 0 < len(worker) <= max_str
                and type(tier) is str
                and 0 < len(tier) <= max_str
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
            int32 = INT32_STRUCTS.get(count) or int_struct(count, "i")
            int64 = INT64_STRUCTS.get(count) or int_struct(count, "q")
            page_ids = int32.unpack(page_ids)
            generations = int64.unpack(generations)
            spans.append(_tuple_new(HolderSpan, (worker, tier, page_ids, generations)))
        else:
            return tuple(spans)
    for index, span in enumerate(check_list(value, path, limits)):
        _check_span(span, f"{path}[{index}]", limits)
    raise AssertionError(f"{path}: refused by the fast pass but not the slow one")


def _check_span(value: Any, path: str, limits: Limits) -> None:
    """Raise naming what is wrong with one span, if anything."""
    if type(value) is not list or len(value) != 4:
        raise bad(path, "[worker_id, tier, page_ids, generations]", value)
    worker, tier, page_ids, generations = value
    check_id(worker, f"{path}.worker_id", limits)
    check_id(tier, f"{path}.tier", limits)
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


def spans_wire(value: Any) -> Any:
    """Spans -> wire lists: HolderSpans, PackedSpans (sent as they are), or 4-item lists
    whose page ids and generations are int sequences, arrays or packed bytes."""
    if not isinstance(value, list | tuple):
        return value
    wire = []
    for index, span in enumerate(value):
        if not isinstance(span, list | tuple) or len(span) != 4:
            raise bad(f"[{index}]", "HolderSpan(worker_id, tier, page_ids, generations)", span)
        worker, tier, page_ids, generations = span
        if type(page_ids) is bytes and type(generations) is bytes:  # a PackedSpan's
            wire.append([worker, tier, page_ids, generations])
            continue
        if type(page_ids) is tuple and type(generations) is tuple:  # a HolderSpan's
            try:
                int32 = INT32_STRUCTS.get(len(page_ids)) or int_struct(len(page_ids), "i")
                int64 = INT64_STRUCTS.get(len(generations)) or int_struct(len(generations), "q")
                wire.append([worker, tier, int32.pack(*page_ids), int64.pack(*generations)])
                continue
            except (struct.error, TypeError):
                pass  # pack_ints names the culprit
        page_ids = pack_ints(page_ids, "i", f"[{index}].page_ids")
        wire.append([worker, tier, page_ids, pack_ints(generations, "q", f"[{index}].generations")])
    return wire
