"""The compiled MATCH request reader and reply writer (cache_service/csrc/match_wire.hpp)
against the general msgpack path they stand in for: the same Message for every frame the
reader takes, nothing taken that the general path refuses, and the same reply bytes."""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service import _native, protocol
from cache_service.events import Namespace
from cache_service.messages import HolderSpan, Match, MatchResult, PackedSpan
from cache_service.protocol import DEFAULT_LIMITS, PROTOCOL_VERSION, Limits, ProtocolError
from cache_service.protocol.codec import _match_limits

names = st.text(max_size=40) | st.sampled_from(["", "m", "é" * 256, "x" * 257, "\udcff"])
requesters = st.none() | st.text(min_size=0, max_size=30) | st.just("w" * 300)


def frame_of(envelope: dict) -> bytes:
    return msgpack.packb(envelope, use_bin_type=True)


def envelope_of(model, adapter, salt, tokens, requester, request_id=7, version=PROTOCOL_VERSION):
    return {
        "v": version,
        "t": "match",
        "id": request_id,
        "b": {"namespace": [model, adapter, salt], "tokens": tokens, "requester": requester},
    }


def read(frame: bytes, limits: Limits = DEFAULT_LIMITS):
    return _native.read_match(frame, PROTOCOL_VERSION, *_match_limits(limits))


def general(frame: bytes, limits: Limits = DEFAULT_LIMITS) -> protocol.Message | None:
    """The general path's reading of a request frame; None when it refuses it."""
    try:
        return protocol.codec._decode_frame(frame, "request", limits)
    except ProtocolError:
        return None


def message_of(fields: tuple) -> protocol.Message:
    request_id, model, adapter, salt, tokens, requester = fields
    body = Match(Namespace(model, adapter, salt), tokens, requester)
    return protocol.Message("match", request_id, body, "")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(names, names, names, st.binary(max_size=66), requesters, st.integers(-3, 2**64 - 1))
def test_the_reader_takes_exactly_what_the_general_path_takes_and_reads_it_alike(
    model, adapter, salt, tokens, requester, request_id
):
    try:
        frame = frame_of(envelope_of(model, adapter, salt, tokens, requester, request_id))
    except UnicodeEncodeError:
        return  # a lone surrogate: not a frame anyone can send
    fields, expected = read(frame), general(frame)
    assert (fields is None) == (expected is None), (fields, expected)
    if fields is not None:
        assert message_of(fields) == expected
        assert protocol.decode(frame, "request") == expected  # the server's way


@pytest.mark.parametrize(
    "envelope",
    [
        envelope_of("m", "", "", b"\0" * 8, None, version=PROTOCOL_VERSION + 1),
        envelope_of("m", "", "", b"\0" * 8, None, request_id=0),
        envelope_of("m", "", "", b"\0" * 7, None),
        envelope_of("m" * 257, "", "", b"\0" * 8, None),
        envelope_of("é" * 200, "", "", b"\0" * 8, None),  # 200 characters, 400 bytes: fine
        envelope_of("m", "", "", b"\0" * 8, ""),
        envelope_of("m", "", "", [1, 2], None),
        envelope_of("m", "", "", b"\0" * 8, 5),
        {**envelope_of("m", "", "", b"\0" * 8, None), "x": 1},
        {**envelope_of("m", "", "", b"\0" * 8, None), "t": "route"},
        {"v": PROTOCOL_VERSION, "t": "match", "id": True, "b": {}},
    ],
)
def test_the_reader_refuses_what_the_general_path_refuses(envelope):
    frame = frame_of(envelope)
    fields = read(frame)
    assert (fields is None) == (general(frame) is None)


def test_mutated_frames_are_never_read_differently():
    """Bytes flipped, cut or added anywhere in real frames: the reader gives up, or reads
    what the general path reads."""
    rng = random.Random(3)
    taken = 0
    for _ in range(4000):
        frame = bytearray(
            frame_of(
                envelope_of("model", "a", "tenant", rng.randbytes(4 * rng.randint(0, 9)), "w0")
            )
        )
        for _cut in range(rng.randint(1, 3)):
            if not frame:
                break
            at = rng.randrange(len(frame))
            choice = rng.random()
            if choice < 0.6:
                frame[at] = rng.randrange(256)
            elif choice < 0.8:
                del frame[at:]
            else:
                frame[at:at] = rng.randbytes(rng.randint(1, 4))
        frame = bytes(frame)
        if not frame:
            continue
        fields = read(frame)
        if fields is None:
            continue
        taken += 1
        assert general(frame) == message_of(fields), frame
    assert taken > 100  # some mutations keep a valid request (a token byte changed, say)


def test_tight_limits_bound_the_reader_too():
    limits = Limits(max_str_len=4, max_tokens=2)
    frame = frame_of(envelope_of("model", "", "", b"\0" * 8, None))
    assert read(frame, limits) is None  # a 5-character model
    frame = frame_of(envelope_of("m", "", "", b"\0" * 12, None))
    assert read(frame, limits) is None  # 3 tokens
    with pytest.raises(ProtocolError):
        protocol.decode(frame, "request", limits=limits)


spans = st.lists(
    st.tuples(
        st.text(max_size=40),
        st.sampled_from(["host", "disk", "device"]),
        st.binary(max_size=300),
        st.binary(max_size=600),
        st.binary(max_size=80),
    ),
    max_size=20,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1), spans)
def test_the_reply_writer_writes_the_bytes_msgpack_writes(request_id, matched, raw):
    body = MatchResult(matched, tuple(PackedSpan(*span) for span in raw))
    wire = [list(span) if span[4] else list(span[:4]) for span in raw]
    envelope = {
        "v": PROTOCOL_VERSION,
        "t": "ok",
        "id": request_id,
        "b": {"matched_tokens": matched, "spans": wire},
        "r": "match",
    }
    expected = msgpack.packb(envelope, use_bin_type=True)
    assert _native.write_match_reply(PROTOCOL_VERSION, request_id, matched, body.spans) == expected
    reply = protocol.Message("ok", request_id, body, "match")
    assert protocol.encode(reply, check=False) == expected


def test_the_reply_writer_leaves_unpacked_spans_to_the_general_path():
    spans = (HolderSpan("w0", "host", (1, 2), (3, 4)),)
    assert _native.write_match_reply(PROTOCOL_VERSION, 1, 8, spans) is None
    reply = protocol.Message("ok", 1, MatchResult(8, spans), "match")
    assert protocol.decode(protocol.encode(reply, check=False), "reply").body.matched_tokens == 8
