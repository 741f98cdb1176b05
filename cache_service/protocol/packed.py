"""Integer lists packed as little-endian int32 ("i") or int64 ("q") bytes on the wire.

Page ids and generations travel this way (in match spans and in KV events): one bin field
instead of a list of ints is cheaper to pack, to check and to decode, and a frame of them
builds no Python object per element until the caller asks for ints.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from cache_service.protocol.errors import BAD_FIELD, TOO_LARGE, Limits, ProtocolError
from cache_service.protocol.fields import bad

# bytes.translate deletes these: what is left of the top bytes of packed little-endian ints
# are the sign bytes of negative ones.
NON_NEGATIVE_TOP_BYTES = bytes(range(0x80))
# Compiled little-endian formats by element count: a compiled Struct packs a 128-page span
# in half the time of struct.pack with a format string. Counts past _CACHED_COUNT compile
# afresh each time, so no peer can grow the cache without bound.
_CACHED_COUNT = 4096
INT32_STRUCTS: dict[int, struct.Struct] = {}
INT64_STRUCTS: dict[int, struct.Struct] = {}
_SIZES = {"i": 4, "q": 8}


def int_struct(count: int, code: str) -> struct.Struct:
    """The Struct of `count` little-endian int32 ("i") or int64 ("q")."""
    cache = INT32_STRUCTS if code == "i" else INT64_STRUCTS
    compiled = cache.get(count)
    if compiled is None:
        compiled = struct.Struct(f"<{count}{code}")
        if count <= _CACHED_COUNT:
            cache[count] = compiled
    return compiled


def check_packed(value: Any, path: str, limits: Limits, code: str) -> tuple[int, ...]:
    """Non-negative packed ints (at most max_tokens of them) -> a tuple of ints.

    Raises:
        ProtocolError: not bytes, not a whole number of ints, too many, or a negative one.
    """
    size = _SIZES[code]
    if type(value) is not bytes:
        raise bad(path, f"packed little-endian int{8 * size} bytes", value)
    if len(value) % size:
        raise ProtocolError(BAD_FIELD, f"{path}: {len(value)} bytes is not a multiple of {size}")
    count = len(value) // size
    if count > limits.max_tokens:
        raise ProtocolError(
            TOO_LARGE, f"{path}: {count} ints exceeds max_tokens {limits.max_tokens}"
        )
    values = int_struct(count, code).unpack(value)
    if value[size - 1 :: size].translate(None, NON_NEGATIVE_TOP_BYTES):
        at = next(i for i, item in enumerate(values) if item < 0)
        raise ProtocolError(BAD_FIELD, f"{path}[{at}]: {values[at]} is negative")
    return values


def pack_ints(values: Any, code: str, path: str) -> bytes:
    """Little-endian int32 ("i") or int64 ("q") bytes of `values`; bytes pass as they are.

    Raises:
        ProtocolError: (bad_field) values that are not ints of that width.
    """
    if type(values) is bytes:
        return values
    if isinstance(values, bytearray | memoryview):
        return bytes(values)
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise bad(path, "a 1-D integer array", values)
        values = values.tolist()
    try:
        return int_struct(len(values), code).pack(*values)
    except (struct.error, TypeError) as exc:
        bits = 32 if code == "i" else 64
        raise ProtocolError(BAD_FIELD, f"{path}: not int{bits} values ({exc})") from None


def packed_checker(code: str):
    """A field check: packed non-negative int32 ("i") or int64 ("q") -> a tuple of ints."""

    def check(value: Any, path: str, limits: Limits) -> tuple[int, ...]:
        return check_packed(value, path, limits, code)

    return check


def packed_wire(code: str):
    """A field's wire form: ints (or bytes as they are) -> packed int32 / int64 bytes."""

    def wire(values: Any) -> bytes:
        return pack_ints(values, code, "packed ints")

    return wire
