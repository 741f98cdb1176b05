"""The compiled msgpack scan (cache_service/csrc/msgpack_scan.hpp) that frames.py asks
before decoding: whole frames are found whole and end where msgpack's own skipper ends
them, anything cut, padded, too deep, too full of lists and maps, or holding an ext type
is refused, and a frame's decoding errors still name what is wrong."""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_service import _native, protocol
from cache_service.protocol import BAD_FRAME, TOO_DEEP, TOO_LARGE, ProtocolError

OK, CONTAINERS, TRUNCATED, TRAILING, DEEP, EXT, MALFORMED = range(7)
STACK = 1024  # msgpack's decoding stack

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(width=32, allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=300),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=5), inner, max_size=6)
    ),
    max_leaves=40,
)


def containers(value) -> int:
    if isinstance(value, list):
        return 1 + sum(map(containers, value))
    if isinstance(value, dict):
        return 1 + sum(map(containers, value.values()))
    return 0


def skip_end(frame: bytes) -> int | None:
    """Where msgpack's skipper ends the frame's first object; None when it cannot."""
    skipper = msgpack.Unpacker(max_buffer_size=max(len(frame), 1))
    skipper.feed(frame)
    try:
        skipper.skip()
    except Exception:
        return None
    return skipper.tell()


@settings(max_examples=300, deadline=None)
@given(values, st.booleans())
def test_a_whole_frame_is_whole_and_holds_as_many_containers_as_it_builds(value, single):
    frame = msgpack.packb(value, use_single_float=single)
    count = containers(value)
    assert _native.scan_msgpack(frame, count, STACK) == (OK, len(frame))
    if count:
        assert _native.scan_msgpack(frame, count - 1, STACK)[0] == CONTAINERS
    assert _native.scan_msgpack(frame + b"\xc0", count, STACK) == (TRAILING, len(frame))


@settings(max_examples=200, deadline=None)
@given(values)
def test_every_cut_of_a_frame_is_truncated(value):
    frame = msgpack.packb(value)
    for end in range(len(frame)):
        assert _native.scan_msgpack(frame[:end], 1 << 20, STACK)[0] == TRUNCATED


def test_mutated_frames_are_whole_exactly_when_msgpack_skips_them_to_the_end():
    rng = random.Random(5)
    whole = 0
    for _ in range(5000):
        frame = bytearray(
            msgpack.packb([{"a": [1, 2.5, None]}, "text", b"bin" * rng.randint(0, 30)])
        )
        for _ in range(rng.randint(1, 3)):
            frame[rng.randrange(len(frame))] = rng.randrange(256)
        frame = bytes(frame)
        status, offset = _native.scan_msgpack(frame, 1 << 20, STACK)
        end = skip_end(frame)
        if status in (OK, TRAILING):
            assert end == offset
            whole += status == OK
        elif status in (TRUNCATED, MALFORMED):
            assert end is None or end < len(frame) and status == MALFORMED
    assert whole > 100


@pytest.mark.parametrize("depth", [1, STACK - 1, STACK, STACK + 1, 10 * STACK])
def test_depth_is_refused_where_msgpack_runs_out_of_stack(depth):
    frame = b"\x91" * depth + b"\xc0"
    status = _native.scan_msgpack(frame, 1 << 20, STACK)[0]
    try:
        msgpack.unpackb(frame)
        assert status == OK
    except msgpack.StackError:
        assert status == DEEP


@pytest.mark.parametrize(
    ("frame", "status"),
    [
        (b"", TRUNCATED),
        (b"\xc1", MALFORMED),
        (b"\xd4\x01\x00", EXT),
        (b"\xc7\x01\x05x", EXT),
        (b"\xdd\xff\xff\xff\xff", TRUNCATED),  # 4 billion items announced, none there
        (b"\xdf\x00\x00\x00\x02\xc0\xc0\xc0", TRUNCATED),  # 2 entries are 4 objects
        (b"\xc6\xff\xff\xff\xff", TRUNCATED),
        (b"\xcb" + b"\x00" * 7, TRUNCATED),
        (b"\x90", OK),
    ],
)
def test_forged_headers(frame, status):
    assert _native.scan_msgpack(frame, 1 << 20, STACK)[0] == status


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError):
        _native.scan_msgpack(b"\xc0", 1)
    with pytest.raises(ValueError, match="negative limit"):
        _native.scan_msgpack(b"\xc0", -1, STACK)
    with pytest.raises(TypeError):
        _native.scan_msgpack("text", 1, STACK)


LIMITS = protocol.DEFAULT_LIMITS
BIG = b"x" * LIMITS.max_containers  # past the one-pass size: every frame below is scanned


@pytest.mark.parametrize(
    ("frame", "code", "message"),
    [
        (
            msgpack.packb({"id": 4, "pad": BIG, "x": [[]] * (LIMITS.max_containers + 1)}),
            TOO_LARGE,
            "max_containers",
        ),
        (msgpack.packb({"id": 4, "pad": BIG})[:-5], BAD_FRAME, "truncated frame"),
        (msgpack.packb({"id": 4, "pad": BIG}) + b"\xc0\xc0", BAD_FRAME, "2 trailing bytes"),
        (b"\x82\xa2id\x04\xa1x" + b"\x91" * 2000 + b"\xc0" + BIG, TOO_DEEP, "stack"),
        (msgpack.packb({"id": 4, "pad": BIG, "x": msgpack.ExtType(1, b"")}), BAD_FRAME, "ext"),
    ],
)
def test_a_large_frame_the_scan_refuses_is_named_and_answers_its_request(frame, code, message):
    with pytest.raises(ProtocolError, match=message) as info:
        protocol.decode(frame)
    assert info.value.code == code
    assert info.value.request_id == 4
