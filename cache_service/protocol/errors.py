"""What the codec refuses and the bounds it holds every frame to."""

from __future__ import annotations

from dataclasses import dataclass, fields

# ProtocolError codes raised by the codec. The server adds its own (e.g. "rejected");
# error replies carry any non-empty code.
BAD_FRAME = "bad_frame"  # not one well-formed msgpack envelope
TOO_LARGE = "too_large"  # over a Limits size: frame, string, list, map or token count
BAD_VERSION = "bad_version"  # a protocol version other than PROTOCOL_VERSION
UNKNOWN_TYPE = "unknown_type"  # a message type not in MESSAGES (or the wrong direction)
BAD_FIELD = "bad_field"  # a body field missing, unknown, mistyped or out of range
TOO_DEEP = "too_deep"  # nested deeper than the message's schema allows
INTERNAL = "internal"  # error_reply for an exception that is not a ProtocolError
ERROR_CODES = (BAD_FRAME, TOO_LARGE, BAD_VERSION, UNKNOWN_TYPE, BAD_FIELD, TOO_DEEP, INTERNAL)

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

# What the message table needs of any Limits (the table checks these at import): the
# keys of the largest envelope or body (a peer entry's 7), and the depth of the deepest
# fixed schema (envelope, body, report, its tiers, one tier, its histogram, the counts).
SCHEMA_MAP_KEYS = 7
SCHEMA_DEPTH = 7


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
    # 8 tokens a page. Allocation stays bounded by the frame itself (see frames.unpack).
    max_list_len: int = 1 << 17
    # Ids, names, tiers, addresses and map keys.
    max_str_len: int = 256
    # Free text (error messages, reasons): room for field names and numbers.
    max_text_len: int = 4096
    # The deepest fixed schema needs 7 levels (envelope, body, a heartbeat's report, its
    # tiers, one tier, its histogram, the counts); the free-form stats map may nest up to
    # this.
    max_depth: int = 8
    # Lists and maps in one frame, all levels together. Building them is what costs (about
    # 64 bytes and 0.3 us each, for one byte of frame), so this bounds a frame's decoding
    # at a few ms and about a MiB whatever its structure; an event costs one or two, a
    # stats reply of a full mesh a few thousand.
    max_containers: int = 16384

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if type(value) is not int or value < 1:
                raise ValueError(f"Limits.{field.name} must be a positive int, got {value!r}")
        if self.max_list_len < SCHEMA_MAP_KEYS:
            raise ValueError(
                f"Limits.max_list_len {self.max_list_len} is below {SCHEMA_MAP_KEYS}, "
                "the keys of the largest envelope or body"
            )
        if self.max_depth < SCHEMA_DEPTH:
            raise ValueError(
                f"Limits.max_depth {self.max_depth} is below {SCHEMA_DEPTH}, "
                "the depth the message schemas need"
            )


DEFAULT_LIMITS = Limits()
