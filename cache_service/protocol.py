"""The one wire codec between workers and the service (msgpack over ZMQ, no pickle).

Every frame is one msgpack map, the envelope:

    request   {"v": 1, "t": "match", "id": 7, "b": {...body...}}
    ok reply  {"v": 1, "t": "ok",    "id": 7, "r": "match", "b": {...reply body...}}
    error     {"v": 1, "t": "error", "id": 7, "b": {"code": "bad_field", "message": "..."}}

`MESSAGES` declares each request type once: the fields of its body and of its ok reply.
`encode` / `decode` are the only way frames are made and read, so the checks live here:

- size first: a frame over `Limits.max_frame_bytes` is refused before msgpack sees it;
- bounded allocation: msgpack preallocates every array and map a header announces, so a
  truncated frame could claim huge ones level after level. A frame of short lists and maps
  (every hot message) decodes in one pass under limits that cap that at about 1 MiB; any
  other frame is first walked by msgpack's C skipper, which builds nothing, and decoded
  only if it is complete;
- msgpack decodes with explicit limits (`raw=False`, `strict_map_key=True`, no ext
  types) and every field is checked: exact field sets, exact types (a bool is not an int),
  ranges (int64; ids, sequence numbers and counts non-negative; page ids int32; loads
  finite and >= 0), token payloads a whole number of int32;
- depth: beyond msgpack's own stack limit, each message type may nest only as deep as its
  schema. Fixed schemas hold scalars at their leaves, so anything deeper fails their checks
  and a level-by-level walk (no recursion) then reports it as too_deep; the free-form stats
  map is walked up front against `Limits.max_depth`.

Any violation raises `ProtocolError(code, message)`; the server answers it with
`error_reply(exc.request_id, exc)` and keeps serving. A server socket should also set
`zmq.MAXMSGSIZE` to about `max_frame_bytes` so ZMQ drops oversized messages before they
are buffered at all.

Token ids travel packed (little-endian int32 bytes). A decoded body keeps them as bytes:
the index compares pages as bytes, so the hot path never unpacks them (`split_pages`).
A match reply lists one span per holder, [worker_id, tier, page_ids, generations], its
page ids packed as little-endian int32 and its generations as little-endian int64 (one
bytes object each, not a list of ints: a 128-page span then costs two bin fields to pack
and check), and decodes into `cache_service.index.HolderSpan` tuples.

Events travel as compact tagged lists (`encode_event`) and decode into the NamedTuples
of `cache_service.events`; `PagesStored.tokens` is a tuple of ints there (unpacked once
through numpy), and `packed_tokens(event)` still returns the bytes off the wire without
repacking.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, NamedTuple

import msgpack
import numpy as np

from cache_service.events import (
    REMOVAL_REASONS,
    AllCleared,
    KvEvent,
    Namespace,
    PagesRemoved,
    PagesStored,
)
from cache_service.index import HolderSpan

PROTOCOL_VERSION = 1

# Request types, then the two reply types.
REGISTER = "register"
HEARTBEAT = "heartbeat"
EVENTS = "events"
RESYNC = "resync"
MATCH = "match"
ROUTE = "route"
STATS = "stats"
BYE = "bye"
OK = "ok"
ERROR = "error"

# ProtocolError codes raised by this codec. The server may add its own (e.g. a stale
# epoch); error replies carry any non-empty code.
BAD_FRAME = "bad_frame"  # not one well-formed msgpack envelope
TOO_LARGE = "too_large"  # over a Limits size: frame, string, list, map or token count
BAD_VERSION = "bad_version"  # a protocol version other than PROTOCOL_VERSION
UNKNOWN_TYPE = "unknown_type"  # a message type not in MESSAGES (or the wrong direction)
BAD_FIELD = "bad_field"  # a body field missing, unknown, mistyped or out of range
TOO_DEEP = "too_deep"  # nested deeper than the message's schema allows
INTERNAL = "internal"  # error_reply for an exception that is not a ProtocolError
ERROR_CODES = (BAD_FRAME, TOO_LARGE, BAD_VERSION, UNKNOWN_TYPE, BAD_FIELD, TOO_DEEP, INTERNAL)

# Event tags of the compact wire form.
STORED_TAG = "s"
REMOVED_TAG = "r"
CLEARED_TAG = "c"

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

_TOKEN_DTYPE = np.dtype("<i4")
_ENVELOPE_KEYS = frozenset(("v", "t", "id", "b"))
_OK_ENVELOPE_KEYS = frozenset(("v", "t", "id", "r", "b"))


class ProtocolError(ValueError):
    """A frame or a value broke the protocol.

    Attributes:
        code: one of ERROR_CODES (or a server-defined code), for programs.
        message: what was wrong, naming the field and the numbers, for people.
        request_id: the id of the offending request when the envelope got that far, else 0.
    """

    def __init__(self, code: str, message: str, request_id: int = 0) -> None:
        # All three in args so the exception survives pickling (Ray ships exceptions).
        super().__init__(code, message, request_id)
        self.code = code
        self.message = message
        self.request_id = request_id

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@dataclass(frozen=True)
class Limits:
    """Bounds applied to every frame read from (or written to) the network."""

    # A max_tokens prompt packs to 4 MiB; the other half is headroom for an events batch.
    max_frame_bytes: int = 8 << 20
    # One million token ids in one field (4 MiB of int32): longer than any context we serve.
    # It bounds the pages of one match span too (a page holds at least one token).
    max_tokens: int = 1 << 20
    # Elements of one list or entries of one map: the pages of a max_tokens prompt at
    # 8 tokens a page. Allocation stays bounded by the frame itself (see _unpack).
    max_list_len: int = 1 << 17
    # Ids, names, tiers, addresses and map keys.
    max_str_len: int = 256
    # Free text (error messages, reasons): room for field names and numbers.
    max_text_len: int = 4096
    # The deepest fixed schema needs 5 levels (envelope, body, events, one event, its
    # page ids); the free-form stats map may nest up to this.
    max_depth: int = 8

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if type(value) is not int or value < 1:
                raise ValueError(f"Limits.{field.name} must be a positive int, got {value!r}")
        if self.max_list_len < _MAX_MAP_KEYS:
            raise ValueError(
                f"Limits.max_list_len {self.max_list_len} is below {_MAX_MAP_KEYS}, "
                "the keys of the largest envelope or body"
            )
        if self.max_depth < _FIXED_DEPTH:
            raise ValueError(
                f"Limits.max_depth {self.max_depth} is below {_FIXED_DEPTH}, "
                "the depth the message schemas need"
            )


class Message(NamedTuple):
    """One decoded (or to-be-encoded) frame.

    `type` is a request type or OK / ERROR. `answers` names the request type an OK reply
    answers (its body is checked against that type's reply schema); "" otherwise.
    """

    type: str
    request_id: int
    body: dict[str, Any]
    answers: str = ""


# A checker turns a decoded wire value into the body value, or raises ProtocolError.
Checker = Callable[[Any, str, Limits], Any]


class Field(NamedTuple):
    """How one body field travels.

    Attributes:
        kind: a short name of what the field holds, used in error messages.
        check: wire value (as msgpack decoded it) -> body value; raises ProtocolError.
        wire: body value -> wire value for msgpack (None: sent as is).
        depth: container levels the wire value occupies (0 for a scalar or bytes);
            None for free-form values, bounded by Limits.max_depth only.
    """

    kind: str
    check: Checker
    wire: Callable[[Any], Any] | None = None
    depth: int | None = 0


class MessageSchema(NamedTuple):
    """The body fields of one request type and of its ok reply."""

    request: dict[str, Field]
    reply: dict[str, Field]


# --- describing values in error messages --------------------------------------------------


def _describe(value: Any) -> str:
    """A short, bounded description of a wire value for an error message."""
    if value is None or type(value) in (bool, int, float):
        return repr(value)
    if type(value) is str:
        return repr(value) if len(value) <= 40 else f"str of {len(value)} chars"
    if isinstance(value, bytes | bytearray | memoryview):
        return f"{type(value).__name__} of {len(value)}"
    if isinstance(value, list | tuple):
        return f"list of {len(value)}"
    if isinstance(value, dict):
        return f"map of {len(value)}"
    return type(value).__name__


def _bad(path: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(BAD_FIELD, f"{path}: expected {expected}, got {_describe(value)}")


# --- scalar checkers ----------------------------------------------------------------------


def _check_count(value: Any, path: str, limits: Limits) -> int:
    """A non-negative int64 (epochs, sequence numbers, page ids, generations, counts)."""
    if type(value) is not int or not 0 <= value <= INT64_MAX:
        raise _bad(path, "int in [0, 2**63-1]", value)
    return value


def _check_str(value: Any, path: str, limit: int, *, empty: bool) -> str:
    if type(value) is not str:
        raise _bad(path, "str", value)
    if len(value) > limit:
        raise ProtocolError(TOO_LARGE, f"{path}: {len(value)} chars exceeds the limit {limit}")
    if not value and not empty:
        raise _bad(path, "a non-empty str", value)
    return value


def _check_id(value: Any, path: str, limits: Limits) -> str:
    """A non-empty name: worker id, node id, tier."""
    return _check_str(value, path, limits.max_str_len, empty=False)


def _check_address(value: Any, path: str, limits: Limits) -> str:
    """A page-server address; "" when the worker serves no remote reads."""
    return _check_str(value, path, limits.max_str_len, empty=True)


def _check_text(value: Any, path: str, limits: Limits) -> str:
    return _check_str(value, path, limits.max_text_len, empty=True)


def _check_flag(value: Any, path: str, limits: Limits) -> bool:
    if type(value) is not bool:
        raise _bad(path, "bool", value)
    return value


def _check_float(value: Any, path: str, *, non_negative: bool) -> float:
    # An int is accepted for a float (a client may send load 0); a bool is not.
    if type(value) is not float and type(value) is not int:
        raise _bad(path, "float", value)
    number = float(value)
    if not math.isfinite(number) or (non_negative and number < 0):
        raise _bad(path, "a finite float >= 0" if non_negative else "a finite float", value)
    return number


def _check_load(value: Any, path: str, limits: Limits) -> float:
    return _check_float(value, path, non_negative=True)


def _check_score(value: Any, path: str, limits: Limits) -> float:
    return _check_float(value, path, non_negative=False)


def _as_float(value: Any) -> Any:
    """Wire form of a float field: ints become floats; anything else is left to the check."""
    return float(value) if type(value) is int else value


def _optional(check: Checker) -> Checker:
    def check_optional(value: Any, path: str, limits: Limits) -> Any:
        return None if value is None else check(value, path, limits)

    return check_optional


# --- tokens -------------------------------------------------------------------------------


def pack_tokens(ids: Iterable[int] | np.ndarray) -> bytes:
    """Pack token ids as little-endian int32 bytes (vectorised, no per-token Python).

    Args:
        ids: a sequence, array('i'), numpy array or other iterable of integer token ids.

    Returns:
        4 bytes per token id.

    Raises:
        ProtocolError: (bad_field) not a flat sequence of integers, or an id outside int32.
    """
    if isinstance(ids, str | bytes | bytearray | memoryview):
        raise ProtocolError(BAD_FIELD, f"pack_tokens takes token ids, got {_describe(ids)}")
    try:
        array = np.asarray(ids if hasattr(ids, "__len__") else list(ids))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(BAD_FIELD, f"token ids: {exc}") from None
    if array.size == 0:
        return b""
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ProtocolError(
            BAD_FIELD,
            f"token ids must be a flat sequence of int32, got shape {array.shape} "
            f"of dtype {array.dtype}",
        )
    if array.dtype != _TOKEN_DTYPE:
        low, high = array.min(), array.max()
        if low < INT32_MIN or high > INT32_MAX:
            bad = low if low < INT32_MIN else high
            index = int(np.argmax(array == bad))
            raise ProtocolError(
                BAD_FIELD, f"token id {int(bad)} at index {index} is outside int32 range"
            )
        array = array.astype(_TOKEN_DTYPE)
    return array.tobytes()


def unpack_tokens(packed: bytes | bytearray | memoryview) -> np.ndarray:
    """Token ids from packed bytes: a read-only int32 numpy view, no copy.

    Raises:
        ProtocolError: (bad_field) the length is not a multiple of 4.
    """
    if len(packed) % 4:
        raise ProtocolError(BAD_FIELD, f"packed tokens of {len(packed)} bytes: not a multiple of 4")
    return np.frombuffer(packed, dtype=_TOKEN_DTYPE)


def split_pages(packed: bytes, page_tokens: int) -> list[bytes]:
    """The full pages of packed tokens, each as its own bytes (the index's page keys).

    A trailing partial page is left out: only full pages are shared.
    """
    if page_tokens < 1:
        raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
    step = 4 * page_tokens
    return [packed[start : start + step] for start in range(0, len(packed) - step + 1, step)]


def _check_tokens(value: Any, path: str, limits: Limits) -> bytes:
    if type(value) is not bytes:
        raise _bad(path, "packed int32 token bytes", value)
    if len(value) % 4:
        raise ProtocolError(BAD_FIELD, f"{path}: {len(value)} bytes is not a multiple of 4")
    if len(value) > 4 * limits.max_tokens:
        raise ProtocolError(
            TOO_LARGE, f"{path}: {len(value) // 4} tokens exceeds max_tokens {limits.max_tokens}"
        )
    return value


def _tokens_wire(value: Any) -> Any:
    if type(value) is bytes:
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    return pack_tokens(value)


# --- containers ---------------------------------------------------------------------------


def _check_list(value: Any, path: str, limits: Limits) -> list:
    if type(value) is not list:
        raise _bad(path, "list", value)
    if len(value) > limits.max_list_len:
        raise ProtocolError(
            TOO_LARGE, f"{path}: {len(value)} items exceeds max_list_len {limits.max_list_len}"
        )
    return value


def _check_counts(
    value: Any, path: str, limits: Limits, highest: int = INT64_MAX
) -> tuple[int, ...]:
    """A list of ints in [0, highest]: generations (int64), page ids (int32)."""
    items = _check_list(value, path, limits)
    # The whole list is checked at C speed; the slow loop only runs to name the culprit.
    if items and (not set(map(type, items)) <= {int} or min(items) < 0 or max(items) > highest):
        check = _check_count if highest == INT64_MAX else _check_page_id
        for index, item in enumerate(items):
            check(item, f"{path}[{index}]", limits)
    return tuple(items)


def _check_page_id(value: Any, path: str, limits: Limits) -> int:
    """A page id: a non-negative int32 (match replies carry page ids as int32)."""
    if type(value) is not int or not 0 <= value <= INT32_MAX:
        raise _bad(path, "int in [0, 2**31-1]", value)
    return value


def _check_page_ids(value: Any, path: str, limits: Limits) -> tuple[int, ...]:
    return _check_counts(value, path, limits, INT32_MAX)


def _check_namespace(value: Any, path: str, limits: Limits) -> Namespace:
    if type(value) is list and len(value) == 3:  # the fast way, on every match request
        model, adapter, salt = value
        if (
            type(model) is str
            and type(adapter) is str
            and type(salt) is str
            and max(len(model), len(adapter), len(salt)) <= limits.max_str_len
        ):
            return _tuple_new(Namespace, value)
    if type(value) is not list or len(value) != 3:
        raise _bad(path, "[model, adapter, salt]", value)
    model, adapter, salt = value
    return Namespace(
        _check_str(model, f"{path}.model", limits.max_str_len, empty=True),
        _check_str(adapter, f"{path}.adapter", limits.max_str_len, empty=True),
        _check_str(salt, f"{path}.salt", limits.max_str_len, empty=True),
    )


def _check_loads(value: Any, path: str, limits: Limits) -> dict[str, float]:
    """A map worker id -> load."""
    if type(value) is not dict:
        raise _bad(path, "map of worker id -> load", value)
    if len(value) > limits.max_list_len:
        raise ProtocolError(
            TOO_LARGE, f"{path}: {len(value)} entries exceeds max_list_len {limits.max_list_len}"
        )
    loads = {}
    for key, load in value.items():
        worker = _check_id(key, f"{path} key", limits)
        loads[worker] = _check_load(load, f"{path}[{worker!r}]", limits)
    return loads


def _loads_wire(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _as_float(load) for key, load in value.items()}
    return value


# --- match spans --------------------------------------------------------------------------

# bytes.translate deletes these: what is left of the top bytes of packed little-endian ints
# are the sign bytes of negative ones.
_NON_NEGATIVE_TOP_BYTES = bytes(range(0x80))
_tuple_new = tuple.__new__
# Compiled little-endian formats by element count: a compiled Struct packs a 128-page span
# in half the time of struct.pack with a format string. Counts past _CACHED_COUNT compile
# afresh each time, so no peer can grow the cache without bound.
_CACHED_COUNT = 4096
_INT32_STRUCTS: dict[int, struct.Struct] = {}
_INT64_STRUCTS: dict[int, struct.Struct] = {}


def _int_struct(count: int, code: str) -> struct.Struct:
    """The Struct of `count` little-endian int32 ("i") or int64 ("q")."""
    cache = _INT32_STRUCTS if code == "i" else _INT64_STRUCTS
    compiled = cache.get(count)
    if compiled is None:
        compiled = struct.Struct(f"<{count}{code}")
        if count <= _CACHED_COUNT:
            cache[count] = compiled
    return compiled


def _check_spans(value: Any, path: str, limits: Limits) -> tuple[HolderSpan, ...]:
    """The holders of a match: [[worker_id, tier, page_ids int32 bytes, generations int64
    bytes], ...], as HolderSpan tuples."""
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
                and not page_ids[3::4].translate(None, _NON_NEGATIVE_TOP_BYTES)
                and not generations[7::8].translate(None, _NON_NEGATIVE_TOP_BYTES)
            ):
                break
            int32 = _INT32_STRUCTS.get(count) or _int_struct(count, "i")
            int64 = _INT64_STRUCTS.get(count) or _int_struct(count, "q")
            page_ids = int32.unpack(page_ids)
            generations = int64.unpack(generations)
            spans.append(_tuple_new(HolderSpan, (worker, tier, page_ids, generations)))
        else:
            return tuple(spans)
    for index, span in enumerate(_check_list(value, path, limits)):
        _check_span(span, f"{path}[{index}]", limits)
    raise AssertionError(f"{path}: refused by the fast pass but not the slow one")


def _check_span(value: Any, path: str, limits: Limits) -> None:
    """Raise naming what is wrong with one span, if anything."""
    if type(value) is not list or len(value) != 4:
        raise _bad(path, "[worker_id, tier, page_ids, generations]", value)
    worker, tier, page_ids, generations = value
    _check_id(worker, f"{path}.worker_id", limits)
    _check_id(tier, f"{path}.tier", limits)
    counts = []
    for name, packed, size in (("page_ids", page_ids, 4), ("generations", generations, 8)):
        where = f"{path}.{name}"
        if type(packed) is not bytes:
            raise _bad(where, f"packed little-endian int{8 * size} bytes", packed)
        if len(packed) % size:
            raise ProtocolError(
                BAD_FIELD, f"{where}: {len(packed)} bytes is not a multiple of {size}"
            )
        if len(packed) > size * limits.max_tokens:
            raise ProtocolError(
                TOO_LARGE,
                f"{where}: {len(packed) // size} pages exceeds max_tokens {limits.max_tokens}",
            )
        if packed[size - 1 :: size].translate(None, _NON_NEGATIVE_TOP_BYTES):
            values = _int_struct(len(packed) // size, "iq"[size // 8]).unpack(packed)
            at = next(i for i, item in enumerate(values) if item < 0)
            raise ProtocolError(BAD_FIELD, f"{where}[{at}]: {values[at]} is negative")
        counts.append(len(packed) // size)
    if counts[0] != counts[1]:
        raise ProtocolError(BAD_FIELD, f"{path}: {counts[0]} page ids but {counts[1]} generations")
    if not counts[0]:
        raise _bad(f"{path}.page_ids", "at least one page", page_ids)


def _spans_wire(value: Any) -> Any:
    """Spans -> wire lists: HolderSpans, PackedSpans (sent as they are), or 4-item lists
    whose page ids and generations are int sequences, arrays or packed bytes."""
    if not isinstance(value, list | tuple):
        return value
    wire = []
    for index, span in enumerate(value):
        if not isinstance(span, list | tuple) or len(span) != 4:
            raise _bad(f"[{index}]", "HolderSpan(worker_id, tier, page_ids, generations)", span)
        worker, tier, page_ids, generations = span
        if type(page_ids) is bytes and type(generations) is bytes:  # a PackedSpan's
            wire.append([worker, tier, page_ids, generations])
            continue
        if type(page_ids) is tuple and type(generations) is tuple:  # a HolderSpan's
            try:
                int32 = _INT32_STRUCTS.get(len(page_ids)) or _int_struct(len(page_ids), "i")
                int64 = _INT64_STRUCTS.get(len(generations)) or _int_struct(len(generations), "q")
                wire.append([worker, tier, int32.pack(*page_ids), int64.pack(*generations)])
                continue
            except (struct.error, TypeError):
                pass  # _pack_ints names the culprit
        page_ids = _pack_ints(page_ids, "i", f"[{index}].page_ids")
        wire.append(
            [worker, tier, page_ids, _pack_ints(generations, "q", f"[{index}].generations")]
        )
    return wire


def _pack_ints(values: Any, code: str, path: str) -> Any:
    """Little-endian int32 ("i") or int64 ("q") bytes of `values`; bytes pass as they are."""
    if type(values) is bytes:
        return values
    if isinstance(values, bytearray | memoryview):
        return bytes(values)
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise _bad(path, "a 1-D integer array", values)
        values = values.tolist()
    try:
        return _int_struct(len(values), code).pack(*values)
    except (struct.error, TypeError) as exc:
        bits = 32 if code == "i" else 64
        raise ProtocolError(BAD_FIELD, f"{path}: not int{bits} values ({exc})") from None


def _check_stats(value: Any, path: str, limits: Limits) -> dict[str, Any]:
    """A free-form map of figures: str keys; None, bool, int64, float, str, list, map values.

    Walked with an explicit stack; decode has already bounded its depth.
    """
    if type(value) is not dict:
        raise _bad(path, "map", value)
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, container = stack.pop()
        if type(container) is dict:
            items = []
            for key, item in container.items():
                key = _check_str(key, f"{where} key", limits.max_str_len, empty=True)
                items.append((f"{where}[{key!r}]", item))
        else:
            items = [(f"{where}[{index}]", item) for index, item in enumerate(container)]
        for where_item, item in items:
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((where_item, item))
            elif kind is str:
                _check_text(item, where_item, limits)
            elif kind is int:
                if not INT64_MIN <= item <= INT64_MAX:
                    raise _bad(where_item, "an int64", item)
            elif item is not None and kind is not bool and kind is not float:
                raise _bad(where_item, "None, bool, int, float, str, list or map", item)
    return value


# --- events -------------------------------------------------------------------------------


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

    An event decoded here returns the bytes it arrived in (no repacking); any other
    PagesStored is packed now.
    """
    packed = getattr(event, "_packed", None)
    return packed if packed is not None else pack_tokens(event.tokens)


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
    """The compact wire form of one event.

    ["s", [model, adapter, salt], parent_page | None, page_ids, generations, tokens_bytes]
    ["r", page_ids, reason]
    ["c"]
    """
    if isinstance(event, PagesStored):
        return [
            STORED_TAG,
            list(event.namespace),
            event.parent_page,
            list(event.page_ids),
            list(event.generations),
            packed_tokens(event),
        ]
    if isinstance(event, PagesRemoved):
        return [REMOVED_TAG, list(event.page_ids), event.reason]
    if isinstance(event, AllCleared):
        return [CLEARED_TAG]
    raise ProtocolError(BAD_FIELD, f"expected a KvEvent, got {_describe(event)}")


def decode_event(value: Any, limits: Limits | None = None, path: str = "event") -> KvEvent:
    """One event from its wire form (see `encode_event`), fully checked.

    A stored chain must have at least one page, as many generations as page ids, and a
    token count that splits evenly over its pages; the exact tokens per page are checked
    by the receiver with `check_stored`.

    Raises:
        ProtocolError: (bad_field / too_large) naming the offending part.
    """
    limits = limits or DEFAULT_LIMITS
    if type(value) is not list or not value or type(value[0]) is not str:
        raise _bad(path, 'an event ["s" | "r" | "c", ...]', value)
    tag = value[0]
    if tag == STORED_TAG and len(value) == 6:
        return _decode_stored(value, path, limits)
    if tag == REMOVED_TAG and len(value) == 3:
        _, page_ids, reason = value
        ids = _check_page_ids(page_ids, f"{path}.page_ids", limits)
        if not ids:
            raise _bad(f"{path}.page_ids", "at least one page id", page_ids)
        if type(reason) is not str or reason not in REMOVAL_REASONS:
            raise _bad(f"{path}.reason", f"one of {REMOVAL_REASONS}", reason)
        return PagesRemoved(ids, reason)
    if tag == CLEARED_TAG and len(value) == 1:
        return AllCleared()
    shapes = {STORED_TAG: 6, REMOVED_TAG: 3, CLEARED_TAG: 1}
    if tag in shapes:
        raise _bad(path, f"{shapes[tag]} items for event {tag!r}", value)
    raise _bad(f"{path}[0]", "an event tag 's', 'r' or 'c'", tag)


def _decode_stored(value: list, path: str, limits: Limits) -> PagesStored:
    _, namespace, parent, page_ids, generations, tokens = value
    ids = _check_page_ids(page_ids, f"{path}.page_ids", limits)
    gens = _check_counts(generations, f"{path}.generations", limits)
    if not ids:
        raise _bad(f"{path}.page_ids", "at least one page id", page_ids)
    if len(gens) != len(ids):
        raise ProtocolError(BAD_FIELD, f"{path}: {len(ids)} page ids but {len(gens)} generations")
    packed = _check_tokens(tokens, f"{path}.tokens", limits)
    count = len(packed) // 4
    if count == 0 or count % len(ids):
        raise ProtocolError(
            BAD_FIELD, f"{path}.tokens: {count} tokens do not split evenly over {len(ids)} pages"
        )
    event = _WirePagesStored(
        _check_namespace(namespace, f"{path}.namespace", limits),
        None if parent is None else _check_page_id(parent, f"{path}.parent_page", limits),
        ids,
        gens,
        tuple(unpack_tokens(packed).tolist()),
    )
    event._packed = packed
    return event


def _check_events(value: Any, path: str, limits: Limits) -> list[KvEvent]:
    items = _check_list(value, path, limits)
    return [decode_event(item, limits, f"{path}[{index}]") for index, item in enumerate(items)]


def _check_chains(value: Any, path: str, limits: Limits) -> list[PagesStored]:
    """Resync payload: stored chains only."""
    items = _check_list(value, path, limits)
    chains = []
    for index, item in enumerate(items):
        where = f"{path}[{index}]"
        if type(item) is not list or not item or item[0] != STORED_TAG:
            raise _bad(where, 'a stored chain ["s", ...]', item)
        chains.append(decode_event(item, limits, where))
    return chains


def _events_wire(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [encode_event(event) for event in value]
    return value


# --- the message table --------------------------------------------------------------------

_COUNT = Field("count", _check_count)
_ID = Field("id", _check_id)
_OPTIONAL_ID = Field("optional id", _optional(_check_id))
_ADDRESS = Field("address", _check_address)
_TEXT = Field("text", _check_text)
_FLAG = Field("flag", _check_flag)
_LOAD = Field("load", _check_load, _as_float)
_SCORE = Field("score", _check_score, _as_float)
_TOKENS = Field("tokens", _check_tokens, _tokens_wire)
_NAMESPACE = Field("namespace", _check_namespace, None, 1)
_LOADS = Field("loads", _check_loads, _loads_wire, 1)
_EVENT_LIST = Field("events", _check_events, _events_wire, 3)  # events / event / page ids
_CHAIN_LIST = Field("chains", _check_chains, _events_wire, 3)
_SPANS = Field("spans", _check_spans, _spans_wire, 2)  # spans / span
_STATS = Field("stats", _check_stats, None, None)

_EPOCH_REPLY = {"service_epoch": _COUNT}

MESSAGES: dict[str, MessageSchema] = {
    REGISTER: MessageSchema(
        request={
            "worker_id": _ID,
            "epoch": _COUNT,
            "node_id": _ID,
            "tier": _ID,
            "address": _ADDRESS,
        },
        reply=_EPOCH_REPLY,
    ),
    HEARTBEAT: MessageSchema(
        request={"worker_id": _ID, "epoch": _COUNT, "load": _LOAD},
        reply=_EPOCH_REPLY,
    ),
    EVENTS: MessageSchema(
        request={"worker_id": _ID, "epoch": _COUNT, "seq": _COUNT, "events": _EVENT_LIST},
        reply={"applied": _FLAG, "needs_resync": _FLAG, "reason": _TEXT},
    ),
    RESYNC: MessageSchema(
        request={"worker_id": _ID, "epoch": _COUNT, "seq": _COUNT, "chains": _CHAIN_LIST},
        reply={"pages": _COUNT},
    ),
    MATCH: MessageSchema(
        request={"namespace": _NAMESPACE, "tokens": _TOKENS, "requester": _OPTIONAL_ID},
        reply={"matched_tokens": _COUNT, "spans": _SPANS},
    ),
    ROUTE: MessageSchema(
        request={"namespace": _NAMESPACE, "tokens": _TOKENS, "loads": _LOADS},
        reply={
            "worker_id": _OPTIONAL_ID,
            "matched_tokens": _COUNT,
            "score": _SCORE,
            "reason": _TEXT,
        },
    ),
    STATS: MessageSchema(request={}, reply={"stats": _STATS}),
    BYE: MessageSchema(request={"worker_id": _ID, "epoch": _COUNT}, reply={}),
}
REQUEST_TYPES = tuple(MESSAGES)
REPLY_TYPES = (OK, ERROR)
ERROR_FIELDS: dict[str, Field] = {"code": _ID, "message": _TEXT}


def _body_depth(schema: Mapping[str, Field]) -> int | None:
    """Levels a body occupies below the envelope (the body map is 1); None: free-form."""
    depths = [field.depth for field in schema.values()]
    if None in depths:
        return None
    return 1 + max(depths, default=0)


class _Body(NamedTuple):
    """How decode checks one body: its fields, each with its check and error path."""

    schema: Mapping[str, Field]
    checks: tuple[tuple[str, Checker, str], ...]  # (field name, check, path in messages)
    depth: int | None  # levels below the envelope; None: free-form, up to Limits.max_depth
    path: str


def _plan(schema: Mapping[str, Field], path: str) -> _Body:
    checks = tuple((name, field.check, f"{path}.{name}") for name, field in schema.items())
    return _Body(schema, checks, _body_depth(schema), path)


_REQUEST_BODIES = {name: _plan(schema.request, name) for name, schema in MESSAGES.items()}
_REPLY_BODIES = {name: _plan(schema.reply, f"{name}.reply") for name, schema in MESSAGES.items()}
_ERROR_BODY = _plan(ERROR_FIELDS, ERROR)
_FIXED_DEPTH = 1 + max(
    plan.depth
    for plan in (*_REQUEST_BODIES.values(), *_REPLY_BODIES.values())
    if plan.depth is not None
)
_MAX_MAP_KEYS = max(
    len(_OK_ENVELOPE_KEYS),
    *(len(schema.request) for schema in MESSAGES.values()),
    *(len(schema.reply) for schema in MESSAGES.values()),
)

DEFAULT_LIMITS = Limits()


# --- decode -------------------------------------------------------------------------------


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(BAD_FRAME, f"msgpack ext type {code} is not part of the protocol")


def _unpack(frame: Any, limits: Limits) -> Any:
    """Bytes -> msgpack objects, bounded in size, allocation and depth."""
    if type(frame) is bytes:
        size = len(frame)
    elif isinstance(frame, bytes | bytearray | memoryview):
        size = frame.nbytes if isinstance(frame, memoryview) else len(frame)
    else:
        raise ProtocolError(BAD_FRAME, f"a frame is bytes, got {type(frame).__name__}")
    if size > limits.max_frame_bytes:
        raise ProtocolError(
            TOO_LARGE, f"frame of {size} bytes exceeds max_frame_bytes {limits.max_frame_bytes}"
        )
    if size == 0:
        raise ProtocolError(BAD_FRAME, "empty frame")
    # The decoder preallocates every array and map its header announces, and headers of a
    # truncated frame may announce far more than the frame holds, level after level. With
    # short lists only (_FAST_LIST_LEN items, _FAST_MAP_LEN keys: every hot message) that
    # is at most 1,024 levels (msgpack's stack) of about 1 KiB: decode at once.
    kwargs = getattr(limits, "_fast_unpack", None) or _fast_unpack(limits)
    try:
        return msgpack.unpackb(frame, **kwargs)
    except Exception:  # a long list, or a bad frame: the careful way says which
        pass
    # Else first let msgpack's C skipper walk the frame without building anything: a
    # frame it accepts is complete, and what decoding allocates is bounded by its size.
    skipper = msgpack.Unpacker(max_buffer_size=size)
    try:
        skipper.feed(frame)
        skipper.skip()
    except msgpack.StackError:
        raise ProtocolError(
            TOO_DEEP, "frame nests deeper than the decoder's stack (1024 levels)"
        ) from None
    except msgpack.OutOfData:
        raise ProtocolError(BAD_FRAME, f"truncated frame ({size} bytes)") from None
    except Exception as exc:  # msgpack reports malformed input in several types
        raise ProtocolError(BAD_FRAME, f"malformed msgpack ({type(exc).__name__})") from None
    if skipper.tell() != size:
        raise ProtocolError(BAD_FRAME, f"{size - skipper.tell()} trailing bytes after the envelope")
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=limits.max_frame_bytes,
            max_str_len=max(limits.max_str_len, limits.max_text_len),
            max_array_len=limits.max_list_len,
            max_map_len=limits.max_list_len,
            max_ext_len=0,
            ext_hook=_reject_ext,
        )
    except Exception as exc:  # msgpack raises ValueError and friends; all are bad frames
        error = _unpack_error(exc)
    # Still answer the request that sent it, when its envelope says which one that was.
    raise ProtocolError(error.code, error.message, _peek_request_id(frame))


_FAST_LIST_LEN = 128
_FAST_MAP_LEN = 16


def _fast_unpack(limits: Limits) -> dict[str, Any]:
    """msgpack.unpackb keywords of the one-pass decode under `limits`, kept on `limits`."""
    kwargs = {
        "raw": False,
        "strict_map_key": True,
        "use_list": True,
        "max_bin_len": limits.max_frame_bytes,
        "max_str_len": max(limits.max_str_len, limits.max_text_len),
        "max_array_len": min(_FAST_LIST_LEN, limits.max_list_len),
        "max_map_len": min(_FAST_MAP_LEN, limits.max_list_len),
        "max_ext_len": 0,
        "ext_hook": _reject_ext,
    }
    object.__setattr__(limits, "_fast_unpack", kwargs)  # not a field: frozen, equal, hashed alike
    return kwargs


def _unpack_error(exc: Exception) -> ProtocolError:
    """What a msgpack decoding failure means for the sender."""
    if isinstance(exc, ProtocolError):
        return exc
    if isinstance(exc, UnicodeDecodeError):
        return ProtocolError(BAD_FRAME, f"a string is not valid UTF-8 ({exc.reason})")
    text = str(exc)
    if "max_ext_len" in text:
        return ProtocolError(BAD_FRAME, "msgpack ext types are not part of the protocol")
    if isinstance(exc, ValueError) and "exceeds max_" in text:
        return ProtocolError(TOO_LARGE, f"frame: {text}")
    return ProtocolError(BAD_FRAME, f"malformed msgpack ({type(exc).__name__}: {text[:200]})")


def _peek_request_id(frame: bytes | bytearray | memoryview) -> int:
    """The envelope's request id of a frame the strict decoder refused, else 0.

    Only called once the skipper has found the frame complete, so even without the strict
    limits what this builds is bounded by the frame's size.
    """
    try:
        envelope = msgpack.unpackb(frame, raw=True, strict_map_key=False, use_list=True)
        request_id = envelope[b"id"]
    except Exception:  # anything unreadable simply has no id
        return 0
    return request_id if type(request_id) is int and 0 <= request_id <= INT64_MAX else 0


_CONTAINERS = frozenset((list, dict))


def _too_deep(root: Any, depth: int, limit: int) -> bool:
    """Whether containers nest below `limit`, `root` being at `depth`; level by level."""
    level = [root] if type(root) in _CONTAINERS else []
    while level:
        if depth > limit:
            return True
        below = []
        for container in level:
            children = container.values() if type(container) is dict else container
            # Most containers hold only scalars; set(map(type, ...)) tells at C speed.
            if not _CONTAINERS.isdisjoint(set(map(type, children))):
                below.extend(child for child in children if type(child) in _CONTAINERS)
        level = below
        depth += 1
    return False


def _check_request_id(value: Any, lowest: int) -> int:
    if type(value) is not int or not lowest <= value <= INT64_MAX:
        raise ProtocolError(
            BAD_FRAME, f"envelope.id: expected int in [{lowest}, 2**63-1], got {_describe(value)}"
        )
    return value


def _key_set_error(where: str, got: Iterable[Any], expected: Iterable[str]) -> str:
    """What is unknown and what is missing in `got` (called once the key sets differ)."""
    got, expected = set(got), set(expected)
    parts = [f"unknown {where} {key!r}" for key in sorted(got - expected, key=repr)]
    parts += [f"missing {where} {key!r}" for key in sorted(expected - got)]
    return "; ".join(parts)


def decode(
    frame: bytes | bytearray | memoryview,
    expect: Literal["request", "reply"] = "request",
    *,
    limits: Limits = DEFAULT_LIMITS,
) -> Message:
    """Read one frame, checking everything the protocol promises.

    Args:
        frame: one ZMQ message part.
        expect: "request" on the service, "reply" on a worker.
        limits: the bounds to enforce.

    Returns:
        The Message, its body holding checked values: Namespace, packed token bytes,
        KvEvent NamedTuples, HolderSpan tuples, floats for loads.

    Raises:
        ProtocolError: with `request_id` set once the envelope's id was read (else 0).
    """
    if expect not in ("request", "reply"):
        raise ValueError(f"expect must be 'request' or 'reply', got {expect!r}")
    envelope = _unpack(frame, limits)
    if type(envelope) is not dict:
        raise ProtocolError(
            BAD_FRAME, f"a frame is one msgpack map (the envelope), got {_describe(envelope)}"
        )
    if "v" not in envelope:
        raise ProtocolError(BAD_FRAME, "envelope has no protocol version 'v'")
    version = envelope["v"]
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            BAD_VERSION,
            f"protocol version {_describe(version)}; this side speaks {PROTOCOL_VERSION}",
        )
    if "id" not in envelope:
        raise ProtocolError(BAD_FRAME, "envelope has no request id 'id'")
    request_id = _check_request_id(envelope["id"], 1 if expect == "request" else 0)
    try:
        return _decode_body(envelope, expect, request_id, limits)
    except ProtocolError as exc:  # from here on, errors name the request they answer
        raise ProtocolError(exc.code, exc.message, request_id) from None


def _decode_body(envelope: dict, expect: str, request_id: int, limits: Limits) -> Message:
    kind = envelope.get("t")
    if type(kind) is not str:
        raise ProtocolError(
            BAD_FRAME, f"envelope.t: expected a message type, got {_describe(kind)}"
        )
    wanted = REQUEST_TYPES if expect == "request" else REPLY_TYPES
    if kind not in wanted:
        raise ProtocolError(UNKNOWN_TYPE, f"{kind[:40]!r} is not a {expect} type {wanted}")
    answers = ""
    keys = _OK_ENVELOPE_KEYS if kind == OK else _ENVELOPE_KEYS
    if envelope.keys() != keys:
        raise ProtocolError(BAD_FRAME, _key_set_error("envelope key", envelope, keys))
    if kind == OK:
        answers = envelope["r"]
        if type(answers) is not str or answers not in MESSAGES:
            raise ProtocolError(
                UNKNOWN_TYPE, f"envelope.r: {_describe(answers)} is not a request type"
            )
        plan = _REPLY_BODIES[answers]
    elif kind == ERROR:
        plan = _ERROR_BODY
    else:
        plan = _REQUEST_BODIES[kind]
    body = envelope["b"]
    if plan.depth is None:  # free-form: only the depth walk bounds it
        allowed = limits.max_depth
        if _too_deep(body, 2, allowed):
            raise _deep(plan.path, allowed)
        return _tuple_new(Message, (kind, request_id, _check_body(body, plan, limits), answers))
    # A fixed schema takes scalars at its deepest level, so anything nested deeper already
    # fails the field checks: the depth walk runs only then, to name the real cause.
    # (Limits keeps max_depth >= every fixed schema's depth.)
    allowed = 1 + plan.depth
    try:
        checked = _check_body(body, plan, limits)
    except ProtocolError:
        if _too_deep(body, 2, allowed):
            raise _deep(plan.path, allowed) from None
        raise
    return _tuple_new(Message, (kind, request_id, checked, answers))


def _deep(path: str, allowed: int) -> ProtocolError:
    return ProtocolError(TOO_DEEP, f"{path}: nests deeper than the {allowed} levels allowed")


def _check_body(body: Any, plan: _Body, limits: Limits) -> dict:
    if type(body) is not dict:
        raise _bad(plan.path, "a map body", body)
    if body.keys() != plan.schema.keys():
        raise ProtocolError(BAD_FIELD, f"{plan.path}: {_key_set_error('field', body, plan.schema)}")
    return {name: check(body[name], path, limits) for name, check, path in plan.checks}


# --- encode -------------------------------------------------------------------------------


def encode(msg: Message, *, limits: Limits = DEFAULT_LIMITS, check: bool = True) -> bytes:
    """Write one frame.

    Body values may be given in their decoded form (Namespace, KvEvent, HolderSpan, packed
    token bytes) or as plain lists; token ids, page ids and generations may also be any
    int sequence or array.

    Args:
        msg: the message; an OK reply names the request type it answers in `answers`.
        limits: the bounds the frame must respect.
        check: decode the frame again before returning it, so a bad value fails here, at
            the sender, with the field named (the server's hot path may turn this off).

    Returns:
        The frame bytes.

    Raises:
        ProtocolError: an unknown type, a wrong field set, an unencodable or invalid value,
            or a frame over max_frame_bytes.
    """
    kind, request_id, body, answers = msg
    if kind in MESSAGES:
        plan, expect, lowest = _REQUEST_BODIES[kind], "request", 1
    elif kind == OK and answers in MESSAGES:
        plan, expect, lowest = _REPLY_BODIES[answers], "reply", 0
    elif kind == ERROR:
        plan, expect, lowest = _ERROR_BODY, "reply", 0
    else:
        raise ProtocolError(UNKNOWN_TYPE, f"cannot encode type {kind!r} answering {answers!r}")
    request_id = _check_request_id(request_id, lowest)
    path, schema = plan.path, plan.schema
    if type(body) is not dict and not isinstance(body, Mapping):
        raise ProtocolError(
            BAD_FIELD, f"{path}: body must be a map, got {_describe(body)}", request_id
        )
    if body.keys() != schema.keys():
        problem = _key_set_error("field", body, schema)
        raise ProtocolError(BAD_FIELD, f"{path}: {problem}", request_id)
    wire = {}
    for name, field in schema.items():
        try:
            wire[name] = body[name] if field.wire is None else field.wire(body[name])
        except ProtocolError as exc:
            raise ProtocolError(exc.code, f"{path}.{name}: {exc.message}", request_id) from None
    envelope = {"v": PROTOCOL_VERSION, "t": kind, "id": request_id, "b": wire}
    if kind == OK:
        envelope["r"] = answers
    try:
        frame = msgpack.packb(envelope, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(BAD_FIELD, f"{path}: cannot encode body: {exc}", request_id) from None
    if len(frame) > limits.max_frame_bytes:
        raise ProtocolError(
            TOO_LARGE,
            f"{path}: frame of {len(frame)} bytes exceeds max_frame_bytes {limits.max_frame_bytes}",
            request_id,
        )
    if check:
        decode(frame, expect, limits=limits)
    return frame


def ok_reply(request: Message, body: Mapping[str, Any]) -> Message:
    """The OK reply to `request` carrying `body` (checked against its reply schema on encode)."""
    return Message(OK, request.request_id, dict(body), request.type)


def error_reply(request_id: int, exc: BaseException, *, limits: Limits = DEFAULT_LIMITS) -> Message:
    """The ERROR reply for `exc`: a ProtocolError keeps its code; anything else is "internal".

    Args:
        request_id: the request answered; pass `exc.request_id` for a ProtocolError from
            decode (0 when the frame was undecodable). An invalid id becomes 0.
        exc: what went wrong.
        limits: bounds the message text is cut to, so the reply always encodes.
    """
    if isinstance(exc, ProtocolError) and type(exc.code) is str and exc.code:
        code, message = exc.code[: limits.max_str_len], str(exc.message)
    else:
        code, message = INTERNAL, f"{type(exc).__name__}: {exc}"
    if type(request_id) is not int or not 0 <= request_id <= INT64_MAX:
        request_id = 0
    return Message(ERROR, request_id, {"code": code, "message": message[: limits.max_text_len]})


__all__ = [
    "BAD_FIELD",
    "BAD_FRAME",
    "BAD_VERSION",
    "BYE",
    "CLEARED_TAG",
    "DEFAULT_LIMITS",
    "ERROR",
    "ERROR_CODES",
    "ERROR_FIELDS",
    "EVENTS",
    "HEARTBEAT",
    "INTERNAL",
    "MATCH",
    "MESSAGES",
    "OK",
    "PROTOCOL_VERSION",
    "REMOVED_TAG",
    "REGISTER",
    "REPLY_TYPES",
    "REQUEST_TYPES",
    "RESYNC",
    "ROUTE",
    "STATS",
    "STORED_TAG",
    "TOO_DEEP",
    "TOO_LARGE",
    "UNKNOWN_TYPE",
    "Checker",
    "Field",
    "HolderSpan",
    "Limits",
    "Message",
    "MessageSchema",
    "ProtocolError",
    "check_stored",
    "decode",
    "decode_event",
    "encode",
    "encode_event",
    "error_reply",
    "ok_reply",
    "pack_tokens",
    "packed_tokens",
    "split_pages",
    "stored_pages",
    "unpack_tokens",
]
