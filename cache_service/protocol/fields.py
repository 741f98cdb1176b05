"""Field checks: each turns a decoded wire value into a body value, or raises ProtocolError.

Exact types (a bool is not an int), ranges (int64; ids, sequence numbers and counts
non-negative; page ids int32; loads finite and >= 0), bounded lengths, token payloads a
whole number of int32. A checker's signature is `(value, path, limits) -> value`; the
path names the field in error messages ("match.tokens").

Wire functions go the other way, for `encode`: a body value in any accepted form (token
ids as a list, a load as an int) -> what msgpack sends.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from cache_service.events import Namespace
from cache_service.protocol.curve_keys import KEY_BYTES, Z85_KEY_CHARS, raw_key, z85_key
from cache_service.protocol.errors import (
    BAD_FIELD,
    INT64_MAX,
    INT64_MIN,
    TOO_LARGE,
    Limits,
    ProtocolError,
)
from cache_service.tokens import INT32_MAX, pack_tokens

Checker = Callable[[Any, str, Limits], Any]
_tuple_new = tuple.__new__


def describe(value: Any) -> str:
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


def bad(path: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(BAD_FIELD, f"{path}: expected {expected}, got {describe(value)}")


# ---- scalars -------------------------------------------------------------------------------


def check_count(value: Any, path: str, limits: Limits) -> int:
    """A non-negative int64 (epochs, sequence numbers, page ids, generations, counts)."""
    if type(value) is not int or not 0 <= value <= INT64_MAX:
        raise bad(path, "int in [0, 2**63-1]", value)
    return value


def check_str(value: Any, path: str, limit: int, *, empty: bool) -> str:
    if type(value) is not str:
        raise bad(path, "str", value)
    if len(value) > limit:
        raise ProtocolError(TOO_LARGE, f"{path}: {len(value)} chars exceeds the limit {limit}")
    if not value and not empty:
        raise bad(path, "a non-empty str", value)
    return value


def check_id(value: Any, path: str, limits: Limits) -> str:
    """A non-empty name: worker id, node id, tier."""
    return check_str(value, path, limits.max_str_len, empty=False)


def check_address(value: Any, path: str, limits: Limits) -> str:
    """A page-server address; "" when the worker serves no remote reads."""
    return check_str(value, path, limits.max_str_len, empty=True)


# A page store's segment name, exactly as `workers.store.segment_names` makes them:
# kvmesh-{pid}-{process start time}-{tag}. Pids and start times are bounded here (Linux
# pids fit in 7 digits, start times in clock ticks in 20), so a name is at most 71 chars.
# Peers open it under /dev/shm: nothing but this format may reach them.
SHM_NAME_RE = re.compile(r"kvmesh-[0-9]{1,10}-[0-9]{1,20}-[a-z0-9_]{1,32}")


def check_shm_name(value: Any, path: str, limits: Limits) -> str:
    """A page store's segment name (SHM_NAME_RE), or "" when the worker has none."""
    if type(value) is not str:
        raise bad(path, "str", value)
    if value and not SHM_NAME_RE.fullmatch(value):
        raise bad(path, "a page store name kvmesh-<pid>-<start>-<tag> or empty", value)
    return value


def check_page_key(value: Any, path: str, limits: Limits) -> bytes | None:
    """A page server's public key: 32 raw bytes on the wire, b"" when authentication is
    off; the body holds it in z85 (as `cache_service.auth.KeyPair` does), or None."""
    if type(value) is not bytes or len(value) not in (0, KEY_BYTES):
        raise bad(path, f"a {KEY_BYTES}-byte key or empty bytes", value)
    return z85_key(value) if value else None


def page_key_wire(value: Any) -> Any:
    """Wire form of a page key: its z85 form (40 bytes) decoded to 32; None as b""."""
    if value is None:
        return b""
    if type(value) is not bytes or len(value) != Z85_KEY_CHARS:
        raise ProtocolError(
            BAD_FIELD, f"expected a z85 key of {Z85_KEY_CHARS} bytes or None, got {describe(value)}"
        )
    raw = raw_key(value)
    if raw is None:
        raise ProtocolError(
            BAD_FIELD, "not a z85 key (a character outside its alphabet, or a group past 2**32)"
        )
    return raw


def check_after(value: Any, path: str, limits: Limits) -> str:
    """Where a listing resumes: the last worker id of the previous page; "" from the start."""
    return check_str(value, path, limits.max_str_len, empty=True)


def check_text(value: Any, path: str, limits: Limits) -> str:
    return check_str(value, path, limits.max_text_len, empty=True)


def check_flag(value: Any, path: str, limits: Limits) -> bool:
    if type(value) is not bool:
        raise bad(path, "bool", value)
    return value


def _check_float(value: Any, path: str, *, non_negative: bool) -> float:
    # An int is accepted for a float (a client may send load 0); a bool is not.
    if type(value) is not float and type(value) is not int:
        raise bad(path, "float", value)
    number = float(value)
    if not math.isfinite(number) or (non_negative and number < 0):
        raise bad(path, "a finite float >= 0" if non_negative else "a finite float", value)
    return number


def check_load(value: Any, path: str, limits: Limits) -> float:
    return _check_float(value, path, non_negative=True)


def check_score(value: Any, path: str, limits: Limits) -> float:
    return _check_float(value, path, non_negative=False)


def as_float(value: Any) -> Any:
    """Wire form of a float field: ints become floats; anything else is left to the check."""
    return float(value) if type(value) is int else value


def optional(check: Checker) -> Checker:
    def check_optional(value: Any, path: str, limits: Limits) -> Any:
        return None if value is None else check(value, path, limits)

    return check_optional


# ---- tokens --------------------------------------------------------------------------------


def check_tokens(value: Any, path: str, limits: Limits) -> bytes:
    """Packed int32 token bytes, kept as bytes: the index compares pages as bytes."""
    if type(value) is not bytes:
        raise bad(path, "packed int32 token bytes", value)
    if len(value) % 4:
        raise ProtocolError(BAD_FIELD, f"{path}: {len(value)} bytes is not a multiple of 4")
    if len(value) > 4 * limits.max_tokens:
        raise ProtocolError(
            TOO_LARGE, f"{path}: {len(value) // 4} tokens exceeds max_tokens {limits.max_tokens}"
        )
    return value


def tokens_wire(value: Any) -> Any:
    if type(value) is bytes:
        return value
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    try:
        return pack_tokens(value)
    except ValueError as exc:
        raise ProtocolError(BAD_FIELD, str(exc)) from None


# ---- containers ----------------------------------------------------------------------------


def check_list(value: Any, path: str, limits: Limits) -> list:
    if type(value) is not list:
        raise bad(path, "list", value)
    if len(value) > limits.max_list_len:
        raise ProtocolError(
            TOO_LARGE, f"{path}: {len(value)} items exceeds max_list_len {limits.max_list_len}"
        )
    return value


def check_page_id(value: Any, path: str, limits: Limits) -> int:
    """A page id: a non-negative int32 (match replies carry page ids as int32)."""
    if type(value) is not int or not 0 <= value <= INT32_MAX:
        raise bad(path, "int in [0, 2**31-1]", value)
    return value


def check_namespace(value: Any, path: str, limits: Limits) -> Namespace:
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
        raise bad(path, "[model, adapter, salt]", value)
    model, adapter, salt = value
    return Namespace(
        check_str(model, f"{path}.model", limits.max_str_len, empty=True),
        check_str(adapter, f"{path}.adapter", limits.max_str_len, empty=True),
        check_str(salt, f"{path}.salt", limits.max_str_len, empty=True),
    )


def check_loads(value: Any, path: str, limits: Limits) -> dict[str, float]:
    """A map worker id -> load."""
    if type(value) is not dict:
        raise bad(path, "map of worker id -> load", value)
    if len(value) > limits.max_list_len:
        raise ProtocolError(
            TOO_LARGE, f"{path}: {len(value)} entries exceeds max_list_len {limits.max_list_len}"
        )
    loads = {}
    for key, load in value.items():
        worker = check_id(key, f"{path} key", limits)
        loads[worker] = check_load(load, f"{path}[{worker!r}]", limits)
    return loads


def loads_wire(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: as_float(load) for key, load in value.items()}
    return value


def check_stats(value: Any, path: str, limits: Limits) -> dict[str, Any]:
    """A free-form map of figures: str keys; None, bool, int64, float, str, list, map values.

    Walked with an explicit stack; decode has already bounded its depth.
    """
    if type(value) is not dict:
        raise bad(path, "map", value)
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:
        where, container = stack.pop()
        if type(container) is dict:
            items = []
            for key, item in container.items():
                key = check_str(key, f"{where} key", limits.max_str_len, empty=True)
                items.append((f"{where}[{key!r}]", item))
        else:
            items = [(f"{where}[{index}]", item) for index, item in enumerate(container)]
        for where_item, item in items:
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((where_item, item))
            elif kind is str:
                check_text(item, where_item, limits)
            elif kind is int:
                if not INT64_MIN <= item <= INT64_MAX:
                    raise bad(where_item, "an int64", item)
            elif item is not None and kind is not bool and kind is not float:
                raise bad(where_item, "None, bool, int, float, str, list or map", item)
    return value


# Page digests in one bytes value (16 each): what a quarantine taints, bounded.
DIGEST_BYTES = 16
MAX_DIGESTS = 1 << 14


def check_digests(value: Any, path: str, limits: Limits) -> bytes:
    """Page digests back to back: bytes, a multiple of 16 long, at most MAX_DIGESTS."""
    if type(value) is not bytes or len(value) % DIGEST_BYTES:
        raise bad(path, f"bytes, a multiple of {DIGEST_BYTES} long", value)
    if len(value) > MAX_DIGESTS * DIGEST_BYTES:
        raise ProtocolError(
            TOO_LARGE, f"{path}: {len(value) // DIGEST_BYTES} digests exceeds {MAX_DIGESTS}"
        )
    return value


def check_ids(value: Any, path: str, limits: Limits) -> tuple[str, ...]:
    """A list of names (worker ids)."""
    items = check_list(value, path, limits)
    return tuple(check_id(item, f"{path}[{i}]", limits) for i, item in enumerate(items))
