"""encode / decode: the only way frames are made and read.

    request   {"v": 2, "t": "match", "id": 7, "b": {...body...}}
    ok reply  {"v": 2, "t": "ok",    "id": 7, "r": "match", "b": {...reply body...}}
    error     {"v": 2, "t": "error", "id": 7, "b": {"code": "bad_field", "message": "..."}}

A body is a map on the wire and a typed value (`cache_service.messages`) on both sides.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple

import msgpack

from cache_service import _native
from cache_service.events import Namespace
from cache_service.messages import ErrorReply, Match, MatchResult, Reply, Request
from cache_service.protocol.errors import (
    BAD_FIELD,
    BAD_FRAME,
    BAD_VERSION,
    DEFAULT_LIMITS,
    INT64_MAX,
    INTERNAL,
    TOO_DEEP,
    TOO_LARGE,
    UNKNOWN_TYPE,
    Limits,
    ProtocolError,
)
from cache_service.protocol.fields import bad, describe
from cache_service.protocol.frames import too_deep, unpack
from cache_service.protocol.table import (
    ENVELOPE_KEYS,
    ERROR,
    ERROR_BODY,
    KIND_OF,
    MATCH,
    MESSAGES,
    OK,
    OK_ENVELOPE_KEYS,
    PROTOCOL_VERSION,
    REPLY_TYPES,
    REQUEST_TYPES,
    Body,
)

_tuple_new = tuple.__new__


class Message(NamedTuple):
    """One decoded (or to-be-encoded) frame.

    `type` is a request type or OK / ERROR; `body` the typed value of that type (a request
    of `cache_service.messages`, its reply, or an ErrorReply). `answers` names the request
    type an OK reply answers; "" otherwise.
    """

    type: str
    request_id: int
    body: Request | Reply
    answers: str = ""


def request(request_id: int, body: Request) -> Message:
    """The request message carrying `body` (its type follows from the body's class).

    Raises:
        ProtocolError: (unknown_type) `body` is not a request of `cache_service.messages`.
    """
    kind = next((KIND_OF[cls] for cls in type(body).__mro__ if cls in KIND_OF), None)
    if kind is None:
        raise ProtocolError(UNKNOWN_TYPE, f"{type(body).__name__} is not a request type")
    return Message(kind, request_id, body)


def ok_reply(request: Message, body: Reply) -> Message:
    """The OK reply to `request` carrying `body` (checked against its reply type on encode)."""
    return Message(OK, request.request_id, body, request.type)


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
    return Message(ERROR, request_id, ErrorReply(code, message[: limits.max_text_len]))


# ---- decode --------------------------------------------------------------------------------


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
        The Message, its body a typed value holding checked values: Namespace, packed
        token bytes, KvEvent NamedTuples, HolderSpan tuples, floats for loads.

    Raises:
        ProtocolError: with `request_id` set once the envelope's id was read (else 0).
    """
    if expect not in ("request", "reply"):
        raise ValueError(f"expect must be 'request' or 'reply', got {expect!r}")
    if expect == "request" and type(frame) is bytes and 0 < len(frame) <= limits.max_frame_bytes:
        # One per lookup: a well-formed MATCH is read without the msgpack objects between
        # (compiled, the same checks); anything else is read below, which names the fault.
        fields = _native.read_match(frame, PROTOCOL_VERSION, *_match_limits(limits))
        if fields is not None:
            request_id, model, adapter, salt, tokens, requester = fields
            namespace = _tuple_new(Namespace, (model, adapter, salt))
            body = _tuple_new(Match, (namespace, tokens, requester))
            return _tuple_new(Message, (MATCH, request_id, body, ""))
    return _decode_frame(frame, expect, limits)


def _decode_frame(frame: bytes | bytearray | memoryview, expect: str, limits: Limits) -> Message:
    """`decode`'s general path: the frame's msgpack objects, then every check on them."""
    envelope = unpack(frame, limits)
    if type(envelope) is not dict:
        raise ProtocolError(
            BAD_FRAME, f"a frame is one msgpack map (the envelope), got {describe(envelope)}"
        )
    if "v" not in envelope:
        raise ProtocolError(BAD_FRAME, "envelope has no protocol version 'v'")
    version = envelope["v"]
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(
            BAD_VERSION,
            f"protocol version {describe(version)}; this side speaks {PROTOCOL_VERSION}",
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
        raise ProtocolError(BAD_FRAME, f"envelope.t: expected a message type, got {describe(kind)}")
    wanted = REQUEST_TYPES if expect == "request" else REPLY_TYPES
    if kind not in wanted:
        raise ProtocolError(UNKNOWN_TYPE, f"{kind[:40]!r} is not a {expect} type {wanted}")
    answers = ""
    keys = OK_ENVELOPE_KEYS if kind == OK else ENVELOPE_KEYS
    if envelope.keys() != keys:
        raise ProtocolError(BAD_FRAME, _key_set_error("envelope key", envelope, keys))
    if kind == OK:
        answers = envelope["r"]
        if type(answers) is not str or answers not in MESSAGES:
            raise ProtocolError(
                UNKNOWN_TYPE, f"envelope.r: {describe(answers)} is not a request type"
            )
        plan = MESSAGES[answers].reply
    elif kind == ERROR:
        plan = ERROR_BODY
    else:
        plan = MESSAGES[kind].request
    wire = envelope["b"]
    if plan.depth is None:  # free-form: only the depth walk bounds it
        if too_deep(wire, 2, limits.max_depth):
            raise _deep(plan.path, limits.max_depth)
        return _tuple_new(Message, (kind, request_id, _check_body(wire, plan, limits), answers))
    # A fixed schema takes scalars at its deepest level, so anything nested deeper already
    # fails the field checks: the depth walk runs only then, to name the real cause.
    # (Limits keeps max_depth >= every fixed schema's depth.)
    allowed = 1 + plan.depth
    try:
        checked = _check_body(wire, plan, limits)
    except ProtocolError:
        if too_deep(wire, 2, allowed):
            raise _deep(plan.path, allowed) from None
        raise
    return _tuple_new(Message, (kind, request_id, checked, answers))


def _check_body(wire: Any, plan: Body, limits: Limits) -> Any:
    if type(wire) is not dict:
        raise bad(plan.path, "a map body", wire)
    if wire.keys() != plan.fields.keys():
        raise ProtocolError(BAD_FIELD, f"{plan.path}: {_key_set_error('field', wire, plan.fields)}")
    return _tuple_new(
        plan.type, [check(wire[name], path, limits) for name, check, path in plan.checks]
    )


def _match_limits(limits: Limits) -> tuple[int, int, int]:
    """read_match's bounds under `limits` (kept on `limits`): the longest str msgpack reads
    (bytes), the longest name (characters), the longest packed prompt (bytes)."""
    bounds = getattr(limits, "_match_limits", None)
    if bounds is None:
        longest_read = max(limits.max_str_len, limits.max_text_len)
        bounds = (longest_read, limits.max_str_len, 4 * limits.max_tokens)
        object.__setattr__(limits, "_match_limits", bounds)  # not a field, as _fast_unpack
    return bounds


def _deep(path: str, allowed: int) -> ProtocolError:
    return ProtocolError(TOO_DEEP, f"{path}: nests deeper than the {allowed} levels allowed")


def _check_request_id(value: Any, lowest: int) -> int:
    if type(value) is not int or not lowest <= value <= INT64_MAX:
        raise ProtocolError(
            BAD_FRAME, f"envelope.id: expected int in [{lowest}, 2**63-1], got {describe(value)}"
        )
    return value


def _key_set_error(where: str, got: Iterable[Any], expected: Iterable[str]) -> str:
    """What is unknown and what is missing in `got` (called once the key sets differ)."""
    got, expected = set(got), set(expected)
    parts = [f"unknown {where} {key!r}" for key in sorted(got - expected, key=repr)]
    parts += [f"missing {where} {key!r}" for key in sorted(expected - got)]
    return "; ".join(parts)


# ---- encode --------------------------------------------------------------------------------


def encode(msg: Message, *, limits: Limits = DEFAULT_LIMITS, check: bool = True) -> bytes:
    """Write one frame.

    Body field values may be given in their decoded form (Namespace, KvEvent, HolderSpan,
    packed token bytes) or plainly (lists); token ids, page ids and generations may also be
    any int sequence or array.

    Args:
        msg: the message; an OK reply names the request type it answers in `answers`.
        limits: the bounds the frame must respect.
        check: decode the frame again before returning it, so a bad value fails here, at
            the sender, with the field named (the server's hot path turns this off).

    Returns:
        The frame bytes.

    Raises:
        ProtocolError: an unknown type, a body of the wrong type, an unencodable or invalid
            value, or a frame over max_frame_bytes.
    """
    if not check and msg[3] == MATCH and msg[0] == OK and type(msg[2]) is MatchResult:
        return _encode_match_reply(msg[1], msg[2], limits)
    frame = _encode(msg, limits)
    if check:
        decode(frame, "request" if msg[0] in MESSAGES else "reply", limits=limits)
    return frame


def _encode(msg: Message, limits: Limits) -> bytes:
    kind, request_id, body, answers = msg
    if kind in MESSAGES:
        plan, lowest = MESSAGES[kind].request, 1
    elif kind == OK and answers in MESSAGES:
        plan, lowest = MESSAGES[answers].reply, 0
    elif kind == ERROR:
        plan, lowest = ERROR_BODY, 0
    else:
        raise ProtocolError(UNKNOWN_TYPE, f"cannot encode type {kind!r} answering {answers!r}")
    request_id = _check_request_id(request_id, lowest)
    if not isinstance(body, plan.type):
        raise ProtocolError(
            BAD_FIELD,
            f"{plan.path}: body must be {plan.type.__name__}, got {type(body).__name__}",
            request_id,
        )
    wire = {}
    for (name, to_wire), value in zip(plan.wires, body, strict=True):
        try:
            wire[name] = value if to_wire is None else to_wire(value)
        except ProtocolError as exc:
            raise ProtocolError(
                exc.code, f"{plan.path}.{name}: {exc.message}", request_id
            ) from None
    envelope = {"v": PROTOCOL_VERSION, "t": kind, "id": request_id, "b": wire}
    if kind == OK:
        envelope["r"] = answers
    return _pack(envelope, plan.path, request_id, limits)


_packers = threading.local()  # a packer per thread: a Packer is not thread-safe


def _packer() -> msgpack.Packer:
    """This thread's packer. `msgpack.packb` makes a packer, and so allocates its 256 KiB
    buffer, on every call: in the service process, which keeps blocks of 128 KiB and more
    mapped (`cache_service.malloc`), that is an mmap and an munmap per frame."""
    try:
        return _packers.packer
    except AttributeError:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
        return packer


def _pack(envelope: dict, path: str, request_id: int, limits: Limits) -> bytes:
    """The envelope as a frame, within max_frame_bytes."""
    try:
        frame = _packer().pack(envelope)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(BAD_FIELD, f"{path}: cannot encode body: {exc}", request_id) from None
    if len(frame) > limits.max_frame_bytes:
        raise ProtocolError(
            TOO_LARGE,
            f"{path}: frame of {len(frame)} bytes exceeds max_frame_bytes {limits.max_frame_bytes}",
            request_id,
        )
    return frame


def _encode_match_reply(request_id: int, body: MatchResult, limits: Limits) -> bytes:
    """`encode` of an OK reply to MATCH, unchecked, as the server sends one per lookup: the
    same frame as the general path (the same envelope, in the same key order, the bytes
    msgpack's packer writes), written compiled; spans other than PackedSpans take the
    general path."""
    request_id = _check_request_id(request_id, 0)
    matched, spans = body
    frame = _native.write_match_reply(PROTOCOL_VERSION, request_id, matched, spans)
    if frame is None:
        return _encode(Message(OK, request_id, body, MATCH), limits)
    if len(frame) > limits.max_frame_bytes:
        raise ProtocolError(
            TOO_LARGE,
            f"{MATCH}.reply: frame of {len(frame)} bytes exceeds max_frame_bytes "
            f"{limits.max_frame_bytes}",
            request_id,
        )
    return frame
