"""Decoding costs what the frame's size says, whatever its structure.

Finding covered: an in-limit 8 MB frame of nested empty lists pushed decoding to a 625 MiB
peak (about 75 times the frame) and held the service's loop for about 2 s before the
(correct) rejection.
"""

from __future__ import annotations

import contextlib
import statistics
import struct
import time
import tracemalloc

import msgpack
import numpy as np
import pytest
import zmq

from cache_service import protocol
from cache_service.messages import GetStats, Match
from tests.security.service_rig import NS

FRAME_LIMIT = 8 << 20
# Room for an 8 MB prompt, so that a valid MATCH of the same size exists to compare with.
LIMITS = protocol.Limits(max_tokens=FRAME_LIMIT // 4)


def array16(count: int) -> bytes:
    return b"\xdc" + struct.pack(">H", count)


def nested_empty_lists(size: int) -> bytes:
    """Lists of at most 128 items (the one-pass decoder's limit), nested four deep, of empty
    lists: one byte of frame per list built."""
    level1 = array16(128) + b"\x90" * 128
    level2 = array16(128) + level1 * 128
    level3 = array16(128) + level2 * 128
    whole, rest = divmod(size - 64, len(level3))
    return array16(whole + rest // len(level2)) + level3 * whole + level2 * (rest // len(level2))


def bomb_frame(size: int = FRAME_LIMIT - 1024) -> bytes:
    """A MATCH envelope whose namespace (its last field) is the nested lists, within the
    frame limit."""
    body = {"tokens": b"", "requester": None, "namespace": 0}
    head = msgpack.packb({"v": protocol.PROTOCOL_VERSION, "t": "match", "id": 5, "b": body})
    assert head.endswith(b"\x00")
    frame = head[:-1] + nested_empty_lists(size - len(head))
    assert len(frame) <= FRAME_LIMIT
    return frame


def valid_match_frame(size: int) -> bytes:
    tokens = np.arange((size - 128) // 4, dtype=np.int32)
    return protocol.encode(protocol.request(5, Match(NS, tokens, None)), limits=LIMITS)


def decode_seconds(frame: bytes) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        with contextlib.suppress(protocol.ProtocolError):
            protocol.decode(frame, limits=LIMITS)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def test_nested_empty_lists_cost_at_most_four_times_their_size():
    frame = bomb_frame()
    tracemalloc.start()
    try:
        with pytest.raises(protocol.ProtocolError) as info:
            protocol.decode(frame, limits=LIMITS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.code in (protocol.TOO_LARGE, protocol.BAD_FRAME, protocol.TOO_DEEP)
    assert info.value.request_id == 5
    assert peak <= 4 * len(frame), f"peak {peak / 2**20:.1f} MiB for a {len(frame)} byte frame"


def test_nested_empty_lists_decode_about_as_fast_as_a_valid_frame_of_their_size():
    frame = bomb_frame()
    valid = valid_match_frame(len(frame))
    assert abs(len(valid) - len(frame)) < 1 << 16
    assert protocol.decode(valid, limits=LIMITS).body.tokens  # it really is valid
    bomb_s, valid_s = decode_seconds(frame), decode_seconds(valid)
    assert bomb_s <= 10 * valid_s, f"{bomb_s * 1e3:.1f} ms vs {valid_s * 1e3:.1f} ms"


def test_the_service_refuses_the_frame_and_keeps_serving(rig):
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.rcvtimeo = 10_000
    if rig.auth:  # an authenticated worker that misbehaves
        socket.curve_serverkey = rig.keys.service.public
        socket.curve_publickey = rig.keys.workers["w0"].public
        socket.curve_secretkey = rig.keys.workers["w0"].secret
    socket.connect(rig.server.address)
    try:
        socket.send(bomb_frame())
        reply = protocol.decode(socket.recv(), "reply")
        assert reply.type == protocol.ERROR and reply.request_id == 5
        assert reply.body.code in (protocol.TOO_LARGE, protocol.BAD_FRAME, protocol.TOO_DEEP)
    finally:
        socket.close(linger=0)
    assert "cluster" in rig.client("front_door").stats()
    assert protocol.decode(protocol.encode(protocol.request(1, GetStats())))
