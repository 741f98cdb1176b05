"""Frame safety: bytes to msgpack objects, bounded in size, allocation and depth.

msgpack preallocates every array and map a header announces, and the headers of a
truncated or forged frame may announce far more than the frame holds, level after
level. So:

- size first: a frame over `Limits.max_frame_bytes` is refused before msgpack sees it;
- a frame of short lists and maps no longer than `Limits.max_containers` bytes (most hot
  messages) decodes in one pass under limits that cap what its headers can claim at about
  1 MiB; it cannot hold more lists and maps than it has bytes;
- any other frame is first walked by a compiled scan (`_native.scan_msgpack`), which
  builds nothing, stops at `Limits.max_containers` lists and maps and at msgpack's
  stack depth, and is decoded only if it is whole: what decoding allocates is then bounded
  by its size. A frame of a million tiny nested lists would otherwise build them (75
  times its size in memory, seconds of time) before any check;
- depth is checked level by level (`too_deep`, no recursion) where a schema needs it.
"""

from __future__ import annotations

import io
import re
from typing import Any

import msgpack

from cache_service import _native
from cache_service.protocol.errors import (
    BAD_FRAME,
    INT64_MAX,
    TOO_DEEP,
    TOO_LARGE,
    Limits,
    ProtocolError,
)

# One-pass decoding: at most this many items per list and keys per map. 1,024 levels
# (msgpack's stack) of 128 slots is about 1 MiB, whatever the headers claim.
_FAST_LIST_LEN = 128
_FAST_MAP_LEN = 16
_CONTAINERS = frozenset((list, dict))
# msgpack's decoding stack: a frame nested deeper is refused before decoding.
_STACK = 1024
# `_native.scan_msgpack`'s statuses.
_SCAN_CONTAINERS, _SCAN_TRUNCATED, _SCAN_TRAILING, _SCAN_DEEP, _SCAN_EXT = 1, 2, 3, 4, 5
# msgpack's message for a string over its max_str_len, which decoding sets to the longest
# string any field takes (max_str_len or max_text_len, whichever is larger).
_STRING_OVER = re.compile(r"(\d+) exceeds max_str_len\((\d+)\)")


def unpack(frame: Any, limits: Limits) -> Any:
    """One frame's msgpack objects.

    Raises:
        ProtocolError: not bytes-like, empty, over max_frame_bytes, truncated, trailing
            bytes, malformed, nested past msgpack's stack, or over a Limits length; with
            the envelope's request id when it could be read.
    """
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
    if size <= limits.max_containers:
        kwargs = getattr(limits, "_fast_unpack", None) or _fast_unpack(limits)
        # Every list and map takes a byte of the frame at least, so a frame this short
        # cannot build more than max_containers of them: one pass, nothing to count.
        try:
            return msgpack.unpackb(frame, **kwargs)
        except Exception:  # a long list, or a bad frame: the scan says which
            pass
    status, offset = _native.scan_msgpack(frame, limits.max_containers, _STACK)
    if status:
        raise _scan_error(status, offset, size, limits, _peek_request_id(frame, size))
    # Whole, and within the budget: what decoding allocates is bounded by the frame's size.
    try:
        return msgpack.unpackb(
            frame, **_unpack_kwargs(limits, limits.max_list_len, limits.max_list_len)
        )
    except Exception as exc:  # msgpack raises ValueError and friends; all are bad frames
        error = _unpack_error(exc)
    # Still answer the request that sent it, when its envelope says which one that was.
    raise ProtocolError(error.code, error.message, _peek_request_id(frame, size))


def _scan_error(
    status: int, offset: int, size: int, limits: Limits, request_id: int
) -> ProtocolError:
    """What `_native.scan_msgpack`'s status means for the sender."""
    if status == _SCAN_CONTAINERS:
        message = f"frame holds more than max_containers {limits.max_containers} lists and maps"
        return ProtocolError(TOO_LARGE, message, request_id)
    if status == _SCAN_DEEP:
        message = f"frame nests deeper than the decoder's stack ({_STACK} levels)"
        return ProtocolError(TOO_DEEP, message, request_id)
    message = {
        _SCAN_TRUNCATED: f"truncated frame ({size} bytes)",
        _SCAN_TRAILING: f"{size - offset} trailing bytes after the envelope",
        _SCAN_EXT: "msgpack ext types are not part of the protocol",
    }.get(status, "malformed msgpack (a byte that is no msgpack tag)")
    return ProtocolError(BAD_FRAME, message, request_id)


def too_deep(root: Any, depth: int, limit: int) -> bool:
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


def _unpack_kwargs(limits: Limits, max_list: int, max_map: int) -> dict[str, Any]:
    return {
        "raw": False,
        "strict_map_key": True,
        "use_list": True,
        "max_bin_len": limits.max_frame_bytes,
        "max_str_len": max(limits.max_str_len, limits.max_text_len),
        "max_array_len": min(max_list, limits.max_list_len),
        "max_map_len": min(max_map, limits.max_list_len),
        "max_ext_len": 0,
        "ext_hook": _reject_ext,
    }


def _fast_unpack(limits: Limits) -> dict[str, Any]:
    """msgpack.unpackb keywords of the one-pass decode under `limits`, kept on `limits`."""
    kwargs = _unpack_kwargs(limits, _FAST_LIST_LEN, _FAST_MAP_LEN)
    object.__setattr__(limits, "_fast_unpack", kwargs)  # not a field: frozen, equal, hashed alike
    return kwargs


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(BAD_FRAME, f"msgpack ext type {code} is not part of the protocol")


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
        too_long = _STRING_OVER.fullmatch(text)
        if too_long:  # msgpack names its own option, which no Limits field is
            length, most = too_long.groups()
            message = f"frame: a string of {length} bytes, longer than any field takes ({most})"
            return ProtocolError(TOO_LARGE, message)
        return ProtocolError(TOO_LARGE, f"frame: {text}")
    return ProtocolError(BAD_FRAME, f"malformed msgpack ({type(exc).__name__}: {text[:200]})")


class _Budget:
    """The list and map hook of one decode: counts what it builds, stops at the limit."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int):
        self.left = self.limit = limit

    def __call__(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ProtocolError(
                TOO_LARGE, f"frame holds more than max_containers {self.limit} lists and maps"
            )
        return container


def _peek_request_id(frame: bytes | bytearray | memoryview, size: int) -> int:
    """The envelope's request id of a frame the strict decoder refused, else 0.

    Reads only the envelope's top level (`read_map_header`, then key by key, skipping every
    value but the id), so even a frame of pathological structure costs nothing here.
    """
    budget = _Budget(64)  # a key or the id itself could be a nested bomb too
    reader = msgpack.Unpacker(  # reads the frame in chunks: no copy of it whole
        io.BytesIO(frame),
        read_size=min(1 << 16, size),
        raw=True,
        strict_map_key=False,
        max_buffer_size=size,
        list_hook=budget,
        object_hook=budget,
    )
    try:
        for _ in range(min(reader.read_map_header(), 8)):
            key = reader.unpack()
            if key == b"id":
                request_id = reader.unpack()
                ok = type(request_id) is int and 0 <= request_id <= INT64_MAX
                return request_id if ok else 0
            reader.skip()
    except Exception:  # anything unreadable simply has no id
        pass
    return 0
