"""The wire codec: typed bodies, round trips, events, limits, malformed frames, and a ZMQ loop.

Bodies are the typed messages of `cache_service.messages`; the raw-frame tests build and
mutate the msgpack wire form directly. Token packing itself is tested in test_tokens.py.

Guarantee 4 at the codec level: every malformed frame raises ProtocolError (never another
exception, never a hang, memory bounded), a server answers it with an error reply, and a
well-formed request still decodes afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import re
import struct
import threading
import tracemalloc
import typing

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from zmq.utils import z85

from cache_service import messages as message_types
from cache_service import protocol
from cache_service.events import (
    REMOVAL_REASONS,
    TIERS,
    AllCleared,
    Namespace,
    PagesDemoted,
    PagesRemoved,
    PagesStored,
)
from cache_service.messages import (
    Ack,
    ApplyResult,
    Bye,
    EpochReply,
    ErrorReply,
    GetPeer,
    GetPeers,
    GetQuarantine,
    GetStats,
    Heartbeat,
    HolderSpan,
    Match,
    MatchResult,
    NameTenant,
    PackedSpan,
    PeerEntry,
    PeerList,
    PublishEvents,
    QuarantineList,
    Register,
    Registered,
    ReportDead,
    ReportHolder,
    Resync,
    ResyncReply,
    Route,
    RouteDecision,
    StatsReply,
    TenantTokens,
)
from cache_service.protocol import (
    BAD_FIELD,
    BAD_FRAME,
    BAD_VERSION,
    DEFAULT_LIMITS,
    ERROR,
    INTERNAL,
    KIND_OF,
    MATCH,
    MESSAGES,
    OK,
    PROTOCOL_VERSION,
    TOO_DEEP,
    TOO_LARGE,
    UNKNOWN_TYPE,
    Limits,
    Message,
    ProtocolError,
    check_stored,
    decode,
    decode_event,
    encode,
    encode_event,
    error_reply,
    ok_reply,
    packed_tokens,
    request,
    stored_pages,
)
from cache_service.protocol.curve_keys import raw_key, z85_key
from cache_service.protocol.report_wire import MAX_REPORT_REASONS, MAX_REPORT_TENANTS
from cache_service.protocol.spans import check_spans
from cache_service.tokens import PackedTokens, pack_tokens, split_pages, unpack_tokens

FUZZ = settings(
    max_examples=150,
    deadline=None,  # the machine may be loaded; hangs are caught by the timeout marks
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
NS = Namespace("smollm2-135m", "", "tenant-a")
PAGE_KEY = zmq.curve_keypair()[0]  # z85, as the mesh hands keys out
SHM_NAME = "kvmesh-4242-987654-w0"
PEER_ENTRY = PeerEntry("w0", 3, "node-a", "cpu", "tcp://10.0.0.5:7001", SHM_NAME, PAGE_KEY)


def make_tokens(count: int, start: int = 0) -> list[int]:
    return list(range(start, start + count))


def make_stored(pages: int = 2, page_tokens: int = 4, parent: int | None = None) -> PagesStored:
    first = 10 if parent is None else parent + 1
    return PagesStored(
        NS,
        parent,
        tuple(range(first, first + pages)),
        (0,) * pages,
        tuple(make_tokens(pages * page_tokens, start=100)),
    )


SAMPLE_REPORT = message_types.EMPTY_REPORT._replace(
    pages_free=90,
    pages_cached=30,
    pages_in_use=8,
    evictions={"evicted": 12},
    copy_bytes_remote=1 << 20,
    tenants=(TenantTokens("salt-a", 3, 64, 16, 80), TenantTokens("", 1, 0, 0, 40)),
    ttft_hit=message_types.Observed((0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0), 0.11),
)
SAMPLE_TIERS = (
    message_types.TierFigures(
        tier="host",
        pages=38,
        capacity=128,
        bytes_written=0,
        bytes_read=1 << 16,
        demotions=0,
        evictions={"demoted": 40},
        hit_tokens=512,
        load_seconds=message_types.no_observations(message_types.LOAD_BUCKETS),
        read_ns_per_token=0,
        accepting=1,
        errors=0,
        dropped={},
    ),
    message_types.TierFigures(
        tier="disk",
        pages=40,
        capacity=4096,
        bytes_written=40 << 12,
        bytes_read=8 << 12,
        demotions=40,
        evictions={"evicted": 2, "corrupt": 1},
        hit_tokens=128,
        load_seconds=message_types.Observed((0,) * 5 + (2,) + (0,) * 7, 0.008),
        read_ns_per_token=1500,
        accepting=0,
        errors=3,
        dropped={"truncated": 1, "orphan": 2},
    ),
)
SAMPLE_REQUESTS = {
    "register": Register(
        "w0", "node-a", "cpu", "tcp://10.0.0.5:7001", SHM_NAME, PAGE_KEY, capacity=2048
    ),
    "heartbeat": Heartbeat("w0", 3, 0.25, SAMPLE_REPORT._replace(tiers=SAMPLE_TIERS)),
    "events": PublishEvents(
        "w0",
        3,
        41,
        [
            make_stored(),
            PagesDemoted((11,), (1011,), (4,), "disk"),
            PagesRemoved((1011,), "evicted", "disk"),
            make_stored(1)._replace(tier="device"),
            PagesRemoved((10,), "evicted"),
            AllCleared(),
        ],
    ),
    "resync": Resync("w0", 3, 42, [make_stored(3, 2)]),
    "match": Match(NS, pack_tokens(make_tokens(40)), "w1"),
    "route": Route(
        NS, pack_tokens(make_tokens(40)), {"w0": 0.5, "w1": 0.0}, {"w0": 32.0}, "round-robin"
    ),
    "stats": GetStats(),
    "bye": Bye("w0", 3),
    "report_dead": ReportDead("w0"),
    "name_tenant": NameTenant("salt-of-acme", "acme"),
    "peer": GetPeer("w0"),
    "peers": GetPeers("w0"),
    "report_holder": ReportHolder("w0", 3, "w9", bytes(range(32)), "page 4: error 0.9"),
    "quarantine": GetQuarantine(),
}
SAMPLE_REPLIES = {
    "register": Registered(7, 3),
    "heartbeat": EpochReply(7, 2, (3, 9), (1, 2**40)),
    "events": ApplyResult(False, True, "seq 41 after 39", 39),
    "resync": ResyncReply(3),
    "match": MatchResult(
        32,
        (
            HolderSpan("w0", "host", (10, 11, 1012), (0, 0, 3), bytes((1, 1, 2))),
            HolderSpan("w2", "device", (5,), (1,)),
        ),
    ),
    "route": RouteDecision("w0", 32, -1.5, "prefix"),
    "stats": StatsReply({"hit_rate": 0.5, "workers": {"w0": {"pages": 3}}, "tiers": ["cpu"]}),
    "bye": Ack(),
    "report_dead": Ack(),
    "name_tenant": Ack(),
    "peer": PEER_ENTRY,
    "peers": PeerList((PEER_ENTRY, PEER_ENTRY._replace(worker_id="w1", page_key=None)), True),
    "report_holder": Ack(),
    "quarantine": QuarantineList(("w8", "w9"), bytes(16), 3),
}
GOOD_MATCH = Message(MATCH, 99, SAMPLE_REQUESTS["match"])
GOOD_FRAME = encode(GOOD_MATCH)


def raw_frame(kind: str, body: object, *, request_id: object = 1, **envelope: object) -> bytes:
    """A frame built with bare msgpack, bypassing encode's own checks."""
    frame = {"v": PROTOCOL_VERSION, "t": kind, "id": request_id, "b": body, **envelope}
    return msgpack.packb(frame, use_bin_type=True)


def wire_body(kind: str, body: tuple, reply: bool = False) -> dict:
    """The typed `body` in its msgpack wire form (a map, as decode sees it), for mutating
    one field."""
    msg = Message(OK, 1, body, kind) if reply else Message(kind, 1, body)
    return msgpack.unpackb(encode(msg))["b"]


def assert_same_message(got: Message, expected: Message) -> None:
    """`got == expected`, and each body of its own class: NamedTuples compare as tuples, so
    EpochReply(3) == ResyncReply(3) and only the class tells them apart."""
    assert got == expected
    assert type(got.body) is type(expected.body), (type(got.body), type(expected.body))


def assert_rejected(frame: bytes, *codes: str, expect: str = "request") -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frame, expect)
    if codes:
        assert info.value.code in codes, info.value
    return info.value


def assert_still_serves() -> None:
    assert_same_message(decode(GOOD_FRAME), GOOD_MATCH)


# --- the message table --------------------------------------------------------------------


def test_every_request_class_has_one_message_type():
    requests = typing.get_args(message_types.Request)
    assert len(set(requests)) == len(requests) == len(MESSAGES)
    assert set(KIND_OF) == set(requests)
    for cls in requests:
        kinds = [kind for kind, schema in MESSAGES.items() if schema.request.type is cls]
        assert kinds == [KIND_OF[cls]], cls
    replies = {schema.reply.type for schema in MESSAGES.values()} | {protocol.ERROR_BODY.type}
    assert replies == set(typing.get_args(message_types.Reply))
    # Every message class of the module is a request, a reply or a part of one (a span, a
    # worker report): none is left out.
    declared = {
        value
        for value in vars(message_types).values()
        if isinstance(value, type)
        and issubclass(value, tuple)
        and value.__module__ == message_types.__name__
    }
    parts = {HolderSpan, PackedSpan}
    parts |= {message_types.WorkerReport, message_types.TenantTokens, message_types.Observed}
    parts |= {message_types.TierFigures}
    assert declared == set(requests) | replies | parts


def test_table_fields_are_the_classes_fields():
    bodies = [body for schema in MESSAGES.values() for body in schema]
    for body in [*bodies, protocol.ERROR_BODY]:
        assert tuple(body.fields) == body.type._fields, body.path
        assert [name for name, _, _ in body.checks] == list(body.type._fields)
        assert [name for name, _ in body.wires] == list(body.type._fields)
    for kind, schema in MESSAGES.items():
        assert (schema.request.path, schema.reply.path) == (kind, f"{kind}.reply")
        assert type(SAMPLE_REQUESTS[kind]) is schema.request.type
        assert type(SAMPLE_REPLIES[kind]) is schema.reply.type
    assert set(SAMPLE_REQUESTS) == set(SAMPLE_REPLIES) == set(MESSAGES)


# --- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(MESSAGES))
def test_every_request_and_reply_round_trips(kind):
    msg = request(12, SAMPLE_REQUESTS[kind])
    assert msg == Message(kind, 12, SAMPLE_REQUESTS[kind])
    assert_same_message(decode(encode(msg)), msg)
    reply = ok_reply(msg, SAMPLE_REPLIES[kind])
    assert reply.answers == kind
    assert_same_message(decode(encode(reply), "reply"), reply)


def test_request_takes_request_bodies_only():
    for body in (SAMPLE_REPLIES[MATCH], {"worker_id": "w0", "epoch": 3}, ("w0", 3), None):
        with pytest.raises(ProtocolError, match="is not a request type") as info:
            request(1, body)  # type: ignore[arg-type]
        assert info.value.code == UNKNOWN_TYPE


def test_error_reply_round_trips():
    reply = error_reply(12, ProtocolError(BAD_FIELD, "match.tokens: 3 bytes"))
    assert reply == Message(ERROR, 12, ErrorReply(BAD_FIELD, "match.tokens: 3 bytes"))
    assert type(reply.body) is ErrorReply
    assert_same_message(decode(encode(reply), "reply"), reply)


def test_decoded_bodies_hold_typed_values():
    match = decode(encode(Message(MATCH, 1, SAMPLE_REQUESTS["match"]))).body
    assert type(match) is Match
    assert type(match.namespace) is Namespace
    assert type(match.tokens) is bytes  # the fast path: pages compared as bytes
    assert unpack_tokens(match.tokens).tolist() == make_tokens(40)
    events = decode(encode(Message("events", 1, SAMPLE_REQUESTS["events"]))).body.events
    assert [type(event).__name__ for event in events] == [
        "PagesStored",
        "PagesDemoted",
        "PagesRemoved",
        "PagesStored",
        "PagesRemoved",
        "AllCleared",
    ]
    assert isinstance(events[0], PagesStored) and events[0].tokens == make_stored().tokens
    assert [getattr(event, "tier", None) for event in events] == [
        "host",
        "disk",
        "disk",
        "device",
        "host",
        None,
    ]
    reply = decode(encode(ok_reply(GOOD_MATCH, SAMPLE_REPLIES["match"])), "reply").body
    assert type(reply) is MatchResult
    assert reply.spans == SAMPLE_REPLIES["match"].spans
    assert type(reply.spans) is tuple and type(reply.spans[1]) is HolderSpan
    assert type(reply.spans[1].page_ids) is tuple


def test_encode_accepts_plain_forms():
    body = Match(["m", "", ""], np.arange(8), None)
    got = decode(encode(Message(MATCH, 1, body))).body
    assert type(got) is Match and type(got.namespace) is Namespace
    assert got == Match(Namespace("m"), pack_tokens(range(8)), None)
    heartbeat = decode(encode(Message("heartbeat", 1, Heartbeat("w", 0, 2, SAMPLE_REPORT))))
    assert type(heartbeat.body.load) is float


@pytest.mark.parametrize(
    "msg, message",
    [
        (
            Message(MATCH, 3, SAMPLE_REQUESTS[MATCH]._asdict()),
            "match: body must be Match, got dict",
        ),
        (
            Message(MATCH, 3, tuple(SAMPLE_REQUESTS[MATCH])),
            "match: body must be Match, got tuple",
        ),
        (
            Message(MATCH, 3, SAMPLE_REQUESTS["heartbeat"]),
            "match: body must be Match, got Heartbeat",
        ),
        (Message("stats", 3, {}), "stats: body must be GetStats, got dict"),
        (
            ok_reply(Message(MATCH, 3, SAMPLE_REQUESTS[MATCH]), SAMPLE_REPLIES["resync"]),
            "match.reply: body must be MatchResult, got ResyncReply",
        ),
        (
            ok_reply(Message("resync", 3, SAMPLE_REQUESTS["resync"]), SAMPLE_REPLIES["register"]),
            "resync.reply: body must be ResyncReply, got Registered",
        ),
        (
            Message(ERROR, 3, {"code": BAD_FIELD, "message": "m"}),
            "error: body must be ErrorReply, got dict",
        ),
    ],
)
def test_encode_refuses_a_body_of_the_wrong_type(msg, message):
    with pytest.raises(ProtocolError) as info:
        encode(msg)
    assert info.value.code == BAD_FIELD and info.value.request_id == 3
    assert info.value.message == message


def test_envelope_layout():
    assert PROTOCOL_VERSION == 12  # 12: the heartbeat's reply names pages held elsewhere
    assert msgpack.unpackb(encode(ok_reply(GOOD_MATCH, MatchResult(0, ())))) == {
        "v": PROTOCOL_VERSION,
        "t": OK,
        "id": 99,
        "r": MATCH,
        "b": {"matched_tokens": 0, "spans": []},
    }


def test_spans_travel_as_packed_little_endian_ints():
    reply = ok_reply(GOOD_MATCH, SAMPLE_REPLIES[MATCH])
    assert msgpack.unpackb(encode(reply))["b"]["spans"] == [
        # Per-page tiers only where the span mixes tiers: w0's last page is on disk.
        ["w0", "host", struct.pack("<3i", 10, 11, 1012), struct.pack("<3q", 0, 0, 3), b"\1\1\2"],
        ["w2", "device", struct.pack("<i", 5), struct.pack("<q", 1)],
    ]


def test_spans_carry_per_page_tiers_only_when_they_mix():
    spans = [
        ("w0", "host", (1, 2, 3), (0, 0, 0), b"\1\1\2"),
        ("w1", "disk", (4,), (0,), b""),
        ["w2", "device", (5, 6), (0, 0), [0, 1]],  # tier indices as a list
        ["w3", "host", (7,), (0,)],  # four items: one tier
    ]
    got = decode(encode(ok_reply(GOOD_MATCH, MatchResult(12, spans))), "reply").body.spans
    assert got == (
        HolderSpan("w0", "host", (1, 2, 3), (0, 0, 0), b"\1\1\2"),
        HolderSpan("w1", "disk", (4,), (0,)),
        HolderSpan("w2", "device", (5, 6), (0, 0), b"\0\1"),
        HolderSpan("w3", "host", (7,), (0,)),
    )
    assert [got[0].tier_of(i) for i in range(3)] == ["host", "host", "disk"]
    assert [got[1].tier_of(0), got[2].tier_of(1)] == ["disk", "host"]
    wire = msgpack.unpackb(encode(ok_reply(GOOD_MATCH, MatchResult(12, got))))["b"]["spans"]
    assert [len(span) for span in wire] == [5, 4, 5, 4]
    with pytest.raises(ProtocolError, match=r"\[0\]\.tiers: expected bytes"):
        encode(ok_reply(GOOD_MATCH, MatchResult(4, [("w", "host", (1,), (0,), 5)])))


def test_encode_accepts_plain_span_forms():
    spans = [
        ["w0", "host", [10, 11], np.array([2**40, 0])],
        ("w1", "device", np.array([7], dtype=np.int32), struct.pack("<q", 3)),
        ["w2", "host", struct.pack("<i", 2**31 - 1), (2**63 - 1,)],
    ]
    got = decode(encode(ok_reply(GOOD_MATCH, MatchResult(8, spans))), "reply")
    assert got.body.spans == (
        HolderSpan("w0", "host", (10, 11), (2**40, 0)),
        HolderSpan("w1", "device", (7,), (3,)),
        HolderSpan("w2", "host", (2**31 - 1,), (2**63 - 1,)),
    )


@pytest.mark.parametrize(
    "spans, message",
    [
        ([("w0", "host", (2**31,), (0,))], r"match\.reply\.spans: \[0\]\.page_ids: not int32"),
        ([("w0", "host", (1,), (2**63,))], r"\[0\]\.generations: not int64"),
        ([("w0", "host", ("1",), (0,))], r"\[0\]\.page_ids: not int32"),
        ([("w0", "host", (1,))], r"\[0\]: expected HolderSpan"),
        ([("w0", "host", (-1,), (0,))], r"match\.reply\.spans\[0\]\.page_ids\[0\]: -1 is negative"),
        ([("w0", "host", (1, 2), (0,))], "2 page ids but 1 generations"),
        ([("w0", "host", (), ())], "at least one page"),
    ],
)
def test_encode_checks_spans(spans, message):
    with pytest.raises(ProtocolError, match=message) as info:
        encode(ok_reply(GOOD_MATCH, MatchResult(4, spans)))
    assert info.value.code == BAD_FIELD


def test_a_match_result_round_trips():
    from cache_service.index import GlobalIndex

    index = GlobalIndex(page_tokens=4)
    for worker in ("a", "b"):
        index.register(worker, node_id="node0", tier="gpu", now=0.0)
    tokens = make_tokens(12)
    a, b = index.worker_info("a").epoch, index.worker_info("b").epoch
    index.apply_events("a", a, 1, [PagesStored(NS, None, (7, 8, 9), (1, 2, 3), tuple(tokens))])
    index.apply_events("b", b, 1, [PagesStored(NS, None, (4,), (2**40,), tuple(tokens[:4]))])
    result = index.match(NS, pack_tokens(tokens + [99]), requester="b")
    assert type(result) is MatchResult
    got = decode(encode(ok_reply(GOOD_MATCH, result), check=False), "reply").body
    packed = index.match_packed(NS, pack_tokens(tokens), requester="b")
    assert type(packed) is MatchResult and type(packed.spans[0]) is PackedSpan
    assert_same_message(
        decode(encode(ok_reply(GOOD_MATCH, packed)), "reply"), ok_reply(GOOD_MATCH, got)
    )
    assert type(got) is MatchResult and got == result
    assert got.spans == (
        HolderSpan("a", "host", (7, 8, 9), (1, 2, 3)),  # the pages' tier, not the registration's
        HolderSpan("b", "host", (4,), (2**40,)),
    )
    index.check_integrity()
    # The server's unchecked encode of packed spans makes the checked encode's frame.
    reply = ok_reply(GOOD_MATCH, packed)
    assert encode(reply, check=False) == encode(reply)


names = st.text(min_size=1, max_size=12)
counts = st.integers(0, 2**63 - 1)
page_ids = st.integers(0, 2**31 - 1)  # int32: match replies carry them so
token_ids = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=48)
namespaces = st.builds(Namespace, st.text(max_size=8), st.text(max_size=8), st.text(max_size=8))


@st.composite
def stored_events(draw):
    pages = draw(st.integers(1, 4))
    page_tokens = draw(st.integers(1, 4))
    ids = tuple(draw(st.lists(page_ids, min_size=pages, max_size=pages)))
    generations = tuple(draw(st.lists(counts, min_size=pages, max_size=pages)))
    tokens = draw(
        st.lists(
            st.integers(-(2**31), 2**31 - 1),
            min_size=pages * page_tokens,
            max_size=pages * page_tokens,
        )
    )
    return PagesStored(
        draw(namespaces),
        draw(st.none() | page_ids),
        ids,
        generations,
        tuple(tokens),
        draw(st.sampled_from(TIERS)),
    )


@st.composite
def demoted_events(draw):
    pages = draw(st.integers(1, 4))
    return PagesDemoted(
        tuple(draw(st.lists(page_ids, min_size=pages, max_size=pages))),
        tuple(draw(st.lists(page_ids, min_size=pages, max_size=pages))),
        tuple(draw(st.lists(counts, min_size=pages, max_size=pages))),
        draw(st.sampled_from(TIERS)),
    )


events = st.one_of(
    stored_events(),
    st.builds(
        PagesRemoved,
        st.lists(page_ids, min_size=1, max_size=4).map(tuple),
        st.sampled_from(REMOVAL_REASONS),
        st.sampled_from(TIERS),
    ),
    demoted_events(),
    st.just(AllCleared()),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=12),
)
stats_values = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.dictionaries(st.text(max_size=6), scalars | st.lists(scalars, max_size=2), max_size=3),
)


@st.composite
def holder_spans(draw):
    pages = draw(st.integers(1, 6))
    tiers = draw(st.lists(st.integers(0, len(TIERS) - 1), min_size=pages, max_size=pages))
    return HolderSpan(
        draw(names),
        TIERS[tiers[0]],
        tuple(draw(st.lists(page_ids, min_size=pages, max_size=pages))),
        tuple(draw(st.lists(counts, min_size=pages, max_size=pages))),
        bytes(tiers) if len(set(tiers)) > 1 else b"",
    )


@st.composite
def observed(draw, bounds):
    counts = draw(
        st.lists(st.integers(0, 2**40), min_size=len(bounds) + 1, max_size=len(bounds) + 1)
    )
    return message_types.Observed(tuple(counts), draw(st.floats(0, 1e9)))


@st.composite
def tier_figures(draw, tier):
    return message_types.TierFigures(
        tier,
        *draw(st.lists(counts, min_size=5, max_size=5)),
        evictions=draw(st.dictionaries(names, counts, max_size=3)),
        hit_tokens=draw(counts),
        load_seconds=draw(observed(message_types.LOAD_BUCKETS)),
        read_ns_per_token=draw(counts),
        accepting=draw(st.sampled_from((0, 1))),
        errors=draw(counts),
        dropped=draw(st.dictionaries(names, counts, max_size=3)),
    )


@st.composite
def reports(draw):
    salts = draw(st.lists(st.text(max_size=12), max_size=4, unique=True))
    tiers = [tier for tier in message_types.TIERS if draw(st.booleans())]  # top down
    return message_types.WorkerReport(
        *draw(st.lists(counts, min_size=3, max_size=3)),
        evictions=draw(st.dictionaries(names, counts, max_size=3)),
        copy_bytes_same_node=draw(counts),
        copy_bytes_remote=draw(counts),
        tenants=tuple(
            TenantTokens(salt, *draw(st.lists(counts, min_size=4, max_size=4))) for salt in salts
        ),
        copy_seconds=draw(observed(message_types.COPY_BUCKETS)),
        ttft_hit=draw(observed(message_types.TTFT_BUCKETS)),
        ttft_miss=draw(observed(message_types.TTFT_BUCKETS)),
        **{name: draw(counts) for name in LOAD_REPORT_FIELDS},
        tiers=tuple(draw(tier_figures(tier)) for tier in tiers),
        **{name: draw(counts) for name in message_types.DECODE_FIELDS},
        route_error=draw(st.none() | observed(message_types.ROUTE_ERROR_BUCKETS)),
    )


# alignment, load, costs and health (the optional fields from the tiers on follow)
LOAD_REPORT_FIELDS = message_types.WorkerReport._fields[
    10 : message_types.WorkerReport._fields.index("tiers")
]


shm_names = st.just("") | st.builds(
    "kvmesh-{}-{}-{}".format,
    st.integers(0, 9_999_999),
    st.integers(0, 10**20 - 1),
    st.from_regex(r"[a-z0-9_]{1,32}", fullmatch=True),
)
page_keys = st.none() | st.binary(min_size=32, max_size=32).map(z85.encode)
peer_entries = st.builds(
    PeerEntry,
    worker_id=names,
    epoch=counts,
    node_id=names,
    tier=names,
    address=st.text(max_size=30),
    shm_name=shm_names,
    page_key=page_keys,
)

REQUEST_BODIES = {
    "register": st.builds(
        Register,
        worker_id=names,
        node_id=names,
        tier=names,
        address=st.text(max_size=30),
        shm_name=shm_names,
        page_key=page_keys,
        capacity=counts,
    ),
    "heartbeat": st.builds(
        Heartbeat,
        worker_id=names,
        epoch=counts,
        load=st.floats(min_value=0, allow_infinity=False),
        report=reports(),
    ),
    "events": st.builds(
        PublishEvents,
        worker_id=names,
        epoch=counts,
        seq=counts,
        events=st.lists(events, max_size=4),
    ),
    "resync": st.builds(
        Resync,
        worker_id=names,
        epoch=counts,
        seq=counts,
        chains=st.lists(stored_events(), max_size=3),
    ),
    "match": st.builds(
        Match,
        namespace=namespaces,
        tokens=token_ids.map(pack_tokens),
        requester=st.none() | names,
    ),
    "route": st.builds(
        Route,
        namespace=namespaces,
        tokens=token_ids.map(pack_tokens),
        loads=st.dictionaries(names, st.floats(min_value=0, allow_infinity=False), max_size=4),
        pending=st.dictionaries(names, st.floats(min_value=0, allow_infinity=False), max_size=4),
        policy=names,
        door=st.none() | names,
    ),
    "stats": st.builds(GetStats),
    "bye": st.builds(Bye, worker_id=names, epoch=counts),
    "report_dead": st.builds(ReportDead, worker_id=names),
    "name_tenant": st.builds(NameTenant, salt=names, name=names),
    "peer": st.builds(GetPeer, worker_id=names),
    "peers": st.builds(GetPeers, after=st.text(max_size=12)),
    "report_holder": st.builds(
        ReportHolder,
        worker_id=names,
        epoch=counts,
        holder=names,
        digests=st.binary(max_size=4).map(lambda b: b * 16),
        evidence=st.text(max_size=20),
    ),
    "quarantine": st.builds(GetQuarantine),
}
REPLY_BODIES = {
    "register": st.builds(Registered, service_epoch=counts, epoch=counts),
    "heartbeat": st.integers(0, 6).flatmap(
        lambda n: st.builds(
            EpochReply,
            service_epoch=counts,
            quarantine=counts,
            elsewhere_pages=st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n).map(tuple),
            elsewhere_generations=st.lists(counts, min_size=n, max_size=n).map(tuple),
        )
    ),
    "events": st.builds(
        ApplyResult,
        applied=st.booleans(),
        needs_resync=st.booleans(),
        reason=st.text(max_size=20),
        last_seq=counts,
    ),
    "resync": st.builds(ResyncReply, pages=counts),
    "match": st.builds(
        MatchResult,
        matched_tokens=counts,
        spans=st.lists(holder_spans(), max_size=5).map(tuple),
    ),
    "route": st.builds(
        RouteDecision,
        worker_id=st.none() | names,
        matched_tokens=counts,
        score=st.floats(allow_nan=False, allow_infinity=False),
        reason=st.text(max_size=20),
    ),
    "stats": st.builds(
        StatsReply, stats=st.dictionaries(st.text(max_size=8), stats_values, max_size=4)
    ),
    "bye": st.builds(Ack),
    "report_dead": st.builds(Ack),
    "name_tenant": st.builds(Ack),
    "peer": peer_entries,
    "peers": st.builds(
        PeerList, peers=st.lists(peer_entries, max_size=4).map(tuple), more=st.booleans()
    ),
    "report_holder": st.builds(Ack),
    "quarantine": st.builds(
        QuarantineList,
        holders=st.lists(names, max_size=3).map(tuple),
        digests=st.binary(max_size=2).map(lambda b: b * 16),
        version=counts,
    ),
}


@st.composite
def messages(draw):
    """Any valid message: a request, an ok reply or an error reply."""
    kind = draw(st.sampled_from(sorted(MESSAGES)))
    request_id = draw(st.integers(1, 2**63 - 1))
    shape = draw(st.sampled_from(["request", "ok", "error"]))
    if shape == "request":
        return Message(kind, request_id, draw(REQUEST_BODIES[kind]))
    if shape == "ok":
        return Message(OK, request_id, draw(REPLY_BODIES[kind]), kind)
    code = draw(st.sampled_from(protocol.ERROR_CODES) | names)
    return Message(ERROR, request_id, ErrorReply(code, draw(st.text(max_size=40))))


def expect_of(msg: Message) -> str:
    return "reply" if msg.type in (OK, ERROR) else "request"


@FUZZ
@given(messages())
def test_generated_messages_round_trip(msg):
    assert_same_message(decode(encode(msg), expect_of(msg)), msg)


# --- events -------------------------------------------------------------------------------

GOOD_STORED_WIRE = ["s", ["m", "", ""], None, b"\1\0\0\0", bytes(8), pack_tokens([1, 2])]


@pytest.mark.parametrize(
    "event, wire",
    [
        (PagesRemoved((4, 5), "cleared"), ["r", struct.pack("<2i", 4, 5), "cleared"]),
        (AllCleared(), ["c"]),
        (
            PagesStored(NS, 3, (4,), (2**40,), (7, 8)),
            ["s", list(NS), 3, struct.pack("<i", 4), struct.pack("<q", 2**40), pack_tokens([7, 8])],
        ),
        # A tier other than host travels last; host (the default) is left out.
        (
            PagesStored(NS, None, (4,), (1,), (7, 8), "disk"),
            [
                "s",
                list(NS),
                None,
                struct.pack("<i", 4),
                struct.pack("<q", 1),
                pack_tokens([7, 8]),
                "disk",
            ],
        ),
        (PagesRemoved((4,), "corrupt", "disk"), ["r", struct.pack("<i", 4), "corrupt", "disk"]),
        (
            PagesDemoted((4, 5), (104, 105), (2, 3), "disk"),
            [
                "d",
                struct.pack("<2i", 4, 5),
                struct.pack("<2i", 104, 105),
                struct.pack("<2q", 2, 3),
                "disk",
            ],
        ),
        (
            PagesDemoted((4,), (54,), (2,), "host"),  # from the device down to host memory
            ["d", struct.pack("<i", 4), struct.pack("<i", 54), struct.pack("<q", 2), "host"],
        ),
    ],
)
def test_event_wire_forms(event, wire):
    assert encode_event(event) == wire
    assert decode_event(msgpack.unpackb(msgpack.packb(wire))) == event


def test_events_in_the_wire_form_before_tiers_decode_in_host_memory():
    """A frame whose stored and removed events end before a tier, built by hand as senders
    wrote them before tiers, decodes with every page in host memory."""
    events = [
        ["s", list(NS), None, i32(10, 11), i64(0, 1), pack_tokens(make_tokens(8))],
        ["r", i32(11), "evicted"],
        ["c"],
    ]
    body = {"worker_id": "w0", "epoch": 3, "seq": 1, "events": events}
    decoded = decode(raw_frame("events", body)).body.events
    assert decoded == [
        PagesStored(NS, None, (10, 11), (0, 1), tuple(make_tokens(8)), "host"),
        PagesRemoved((11,), "evicted", "host"),
        AllCleared(),
    ]
    # Naming host explicitly is the same event.
    explicit = [[*events[0], "host"], [*events[1], "host"], ["c"]]
    assert decode(raw_frame("events", {**body, "events": explicit})).body.events == decoded
    # The old span form (four items) decodes in one tier, as the sender's first page's.
    spans = [["w", "host", i32(1, 2), i64(0, 5)]]
    reply = decode(raw_frame(OK, {"matched_tokens": 8, "spans": spans}, r=MATCH), "reply")
    assert reply.body.spans == (HolderSpan("w", "host", (1, 2), (0, 5)),)


@pytest.mark.parametrize(
    "wire, message",
    [
        (
            [*GOOD_STORED_WIRE, "cpu"],
            "events[0].tier: expected a tier, one of ('device', 'host', 'disk'), got 'cpu'",
        ),
        (["r", b"\1\0\0\0", "evicted", "gpu"], "events[0].tier: expected a tier"),
        (["r", b"\1\0\0\0", "evicted", None], "events[0].tier: expected a tier"),
        (["d", b"\1\0\0\0", b"\2\0\0\0", bytes(8), "tape"], "events[0].tier: expected a tier"),
        (["d", b"\1\0\0\0", b"\2\0\0\0", bytes(8)], "events[0]: expected 5 items for event 'd'"),
        (["r", b"\1\0\0\0"], "events[0]: expected 3 or 4 items for event 'r'"),
        (["x", 1], "events[0][0]: expected an event tag 's', 'r', 'd' or 'c'"),
        (
            ["d", bytes(8), b"\2\0\0\0", bytes(8), "disk"],
            "events[0]: 2 page ids, 1 new page ids and 1 generations (one of each per page)",
        ),
    ],
)
def test_bad_tiers_and_demotions_are_refused_naming_the_field(wire, message):
    body = {"worker_id": "w0", "epoch": 3, "seq": 1, "events": [wire]}
    error = assert_rejected(raw_frame("events", body, request_id=7), BAD_FIELD)
    assert error.message.startswith(f"events.{message}") and error.request_id == 7


def test_stored_chain_keeps_its_packed_tokens():
    event = decode_event(msgpack.unpackb(msgpack.packb(encode_event(make_stored(3, 4)))))
    assert packed_tokens(event) is event._packed  # no repacking for the index
    plain = copy.deepcopy(event)  # e.g. shipped to another process: a plain PagesStored
    assert type(plain) is PagesStored and plain == event
    assert "PagesStored(namespace=" in repr(event)
    assert packed_tokens(make_stored(3, 4)) == packed_tokens(event)
    assert stored_pages(event, 4) == split_pages(pack_tokens(make_tokens(12, start=100)), 4)
    # The prefix cache's events carry PackedTokens: encoded from the bytes they hold.
    held = make_stored(3, 4)._replace(tokens=PackedTokens(packed_tokens(event)))
    assert held == event and packed_tokens(held) is held.tokens.packed
    assert encode_event(held) == encode_event(make_stored(3, 4))
    check_stored(event, 4)
    with pytest.raises(ProtocolError, match="3 pages carries 12 tokens; at 2 tokens a page"):
        check_stored(event, 2)


def i32(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}i", *values)


def i64(*values: int) -> bytes:
    return struct.pack(f"<{len(values)}q", *values)


NS_WIRE = ["m", "", ""]
TOKENS8 = pack_tokens(make_tokens(8))
TOP_BIT = struct.pack("<I", 2**31)  # as int32: negative
GOOD_STORED = ["s", NS_WIRE, None, i32(1, 2), i64(0, 0), TOKENS8]
BAD_EVENTS = [
    [],
    "s",
    5,
    {"s": 1},
    ["x"],
    [1, 2],
    ["c", 1],
    ["r", i32(1)],
    ["r", i32(1), "evicted", 0],
    ["r", i32(1), "bogus"],
    ["r", i32(1), None],
    ["r", b"", "evicted"],  # no page
    ["r", i32(-1), "evicted"],
    ["r", TOP_BIT, "evicted"],  # page ids are non-negative int32
    ["r", [1], "evicted"],  # a list of ints: page ids travel packed
    ["r", "ab", "evicted"],
    ["r", i32(1)[:3], "evicted"],  # not a whole int32
    GOOD_STORED[:5],
    [*GOOD_STORED, 0],
    ["s", ["m", ""], *GOOD_STORED[2:]],
    ["s", ["m", "", 1], *GOOD_STORED[2:]],
    ["s", NS_WIRE, -1, *GOOD_STORED[3:]],
    ["s", NS_WIRE, True, *GOOD_STORED[3:]],
    ["s", NS_WIRE, 2**31, *GOOD_STORED[3:]],
    ["s", NS_WIRE, None, i32(1) + TOP_BIT, *GOOD_STORED[4:]],
    ["s", NS_WIRE, None, b"", b"", b""],
    ["s", NS_WIRE, None, i32(1, 2), i64(0), TOKENS8],
    ["s", NS_WIRE, None, i32(1, 2), i64(0, -1), TOKENS8],
    ["s", NS_WIRE, None, [1, 2], i64(0, 0), TOKENS8],
    ["s", NS_WIRE, None, i32(1, 2), [0, 0], TOKENS8],
    ["s", NS_WIRE, None, i32(1, 2)[:7], i64(0, 0), TOKENS8],
    ["s", NS_WIRE, None, i32(1, 2), i64(0, 0)[:12], TOKENS8],
    ["s", NS_WIRE, None, i32(1, 2), i64(0, 0), TOKENS8[:7]],
    ["s", NS_WIRE, None, i32(1, 2), i64(0, 0), pack_tokens([1, 2, 3])],
    ["s", NS_WIRE, None, i32(1, 2), i64(0, 0), b""],
    ["s", NS_WIRE, None, i32(1, 2), i64(0, 0), "tokens"],
    ["s", NS_WIRE, None, i32(1, 2), i64(0, 0), [1, 2]],
    [*GOOD_STORED, "cpu"],  # a tier not of TIERS
    [*GOOD_STORED, ""],
    [*GOOD_STORED, "host", 0],
    ["r", i32(1), "evicted", "Host"],
    ["r", i32(1), "evicted", "host", "disk"],
    ["d", i32(1), i32(2), i64(0)],  # a demotion always names its tier
    ["d", i32(1), i32(2), i64(0), "tape"],
    ["d", i32(1), i32(2), i64(0), 2],
    ["d", b"", b"", b"", "disk"],  # no page
    ["d", i32(1, 2), i32(3), i64(0, 0), "disk"],
    ["d", i32(1), i32(3), i64(0, 0), "disk"],
    ["d", i32(1), i32(-3), i64(0), "disk"],
    ["d", i32(1), i32(3), i64(-1), "disk"],
    ["d", [1], i32(3), i64(0), "disk"],
]


@pytest.mark.parametrize("wire", BAD_EVENTS, ids=range(len(BAD_EVENTS)))
def test_malformed_events_are_rejected(wire):
    with pytest.raises(ProtocolError) as info:
        decode_event(msgpack.unpackb(msgpack.packb(wire)))
    assert info.value.code == BAD_FIELD


def test_resync_takes_stored_chains_only():
    body = wire_body("resync", SAMPLE_REQUESTS["resync"])
    body["chains"].append(["r", [1], "evicted"])
    error = assert_rejected(raw_frame("resync", body, request_id=5), BAD_FIELD)
    assert "resync.chains[1]" in error.message and error.request_id == 5


# --- field checks -------------------------------------------------------------------------

wire_ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
ANY_OTHER = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.text(max_size=2), wire_ints, max_size=2),
)
NAN, INF = math.nan, math.inf
GOOD_SPAN = ["w", "host", struct.pack("<2i", 1, 2), struct.pack("<2q", 0, 5)]
BAD_SPANS = [
    GOOD_SPAN[:3],  # too short
    [*GOOD_SPAN, 0],  # too long
    ["w", "host", struct.pack("<2i", 1, 2), struct.pack("<q", 0)],  # 2 page ids, 1 generation
    ["w", "host", struct.pack("<i", 1), struct.pack("<2q", 0, 5)],  # 1 page id, 2 generations
    ["w", "host", GOOD_SPAN[2] + b"\x00", GOOD_SPAN[3]],  # 9 bytes of page ids
    ["w", "host", GOOD_SPAN[2], GOOD_SPAN[3][:-4]],  # 12 bytes of generations
    ["w", "host", GOOD_SPAN[2][:6], GOOD_SPAN[3][:12]],  # neither a whole number
    ["w", "host", b"", b""],  # no pages
    ["w", "host", struct.pack("<2i", 1, -2), GOOD_SPAN[3]],  # a negative page id
    ["w", "host", GOOD_SPAN[2], struct.pack("<2q", -1, 0)],  # a negative generation
    ["w", "host", [1, 2], [0, 5]],  # lists of ints, not packed bytes
    ["w", "host", "\x01\x00\x00\x00", GOOD_SPAN[3][:8]],  # str, not bytes
    ["w", "host", GOOD_SPAN[2], None],
    ["", "host", *GOOD_SPAN[2:]],  # empty worker id
    ["w", "", *GOOD_SPAN[2:]],  # empty tier
    ["x" * 257, "host", *GOOD_SPAN[2:]],  # worker id over max_str_len
    [b"w", "host", *GOOD_SPAN[2:]],
    ["w", 7, *GOOD_SPAN[2:]],
    {"worker_id": "w"},
    "span",
    None,
    ["w", "cpu", *GOOD_SPAN[2:]],  # 21: a tier not of TIERS
    [*GOOD_SPAN, b"\1"],  # 22: one tier for two pages
    [*GOOD_SPAN, b"\1\3"],  # 23: no tier 3
    [*GOOD_SPAN, b"\2\1"],  # 24: the first page's tier is not the span's
    [*GOOD_SPAN, "\1\2"],  # 25: str, not bytes
    [*GOOD_SPAN, b"\1\2", 0],  # 26: six items
]
LONG_NAME = "x" * 257
BAD_SHM_NAMES = [
    "/kvmesh-1-2-w0",  # a path, not a name
    "kvmesh-1-2-w0/../../etc",
    "../kvmesh-1-2-w0",
    "kvmesh-1-2-",
    "kvmesh-1-2-W0",  # tags are lower case
    "kvmesh-x-2-w0",
    "kvmesh-1-2-" + "t" * 33,  # a tag over 32 chars
    "kvmesh-" + "1" * 11 + "-2-w0",  # a pid over 10 digits
    "kvmesh-1-" + "2" * 21 + "-w0",
    "kvmesh-\u0661-2-w0",  # a digit, but not an ASCII one
    "kvmesh-1-2-w0\n",
    "kvmesh-1-2-" + "t" * 300,  # over max_str_len too
]
GOOD_PEER_ENTRY = ["w1", 3, "node-a", "cpu", "tcp://10.0.0.5:7001", "kvmesh-1-2-w1", b"k" * 32]
BAD_PEER_ENTRIES = [
    GOOD_PEER_ENTRY[:6],  # a field short
    [*GOOD_PEER_ENTRY, 0],  # one too many
    [*GOOD_PEER_ENTRY[:6], b"k" * 31],  # a key of 31 bytes
    [*GOOD_PEER_ENTRY[:6], b"k" * 40],  # z85 on the wire
    [*GOOD_PEER_ENTRY[:5], "/dev/shm/kvmesh-1-2-w1", b""],
    ["", *GOOD_PEER_ENTRY[1:]],
    ["w1", -1, *GOOD_PEER_ENTRY[2:]],
    [LONG_NAME, *GOOD_PEER_ENTRY[1:]],
    dict(zip(PeerEntry._fields, GOOD_PEER_ENTRY, strict=True)),
    "w1",
    None,
]


def report_with(field: str, value: object) -> list:
    """SAMPLE_REPORT's wire form (with SAMPLE_TIERS) with one field replaced."""
    report = SAMPLE_REPORT._replace(tiers=SAMPLE_TIERS)
    wire = protocol.table.MESSAGES["heartbeat"].request.fields["report"].wire(report)
    wire[message_types.WorkerReport._fields.index(field)] = value
    return wire


def tier_with(field: str, value: object, tier: str = "disk") -> list:
    """SAMPLE_TIERS' disk tier on the wire, with one field replaced."""
    wire = report_with("pages_free", 90)[-1][-1]
    assert wire[0] == "disk"
    wire[message_types.TierFigures._fields.index(field)] = value
    return [tier, *wire[1:]] if field != "tier" else wire


SAMPLE_DISK = tier_with("tier", "disk")
BAD_TIERS = [
    {"disk": SAMPLE_DISK[1:]},
    [tier_with("tier", "ssd")],  # not a tier of TIERS
    [tier_with("tier", 3)],
    [tier_with("tier", "")],
    [SAMPLE_DISK, SAMPLE_DISK],  # a tier twice
    [SAMPLE_DISK, tier_with("pages", 1, tier="host")],  # not top down
    [SAMPLE_DISK] * 4,  # more tiers than there are
    [SAMPLE_DISK[:-1]],  # a field short
    [[*SAMPLE_DISK, 0]],  # one too many
    [tier_with("pages", -1)],
    [tier_with("bytes_read", 1.5)],
    [tier_with("accepting", 2)],
    [tier_with("accepting", True)],
    [tier_with("evictions", {f"r{i}": 1 for i in range(MAX_REPORT_REASONS + 1)})],
    [tier_with("dropped", {f"r{i}": 1 for i in range(MAX_REPORT_REASONS + 1)})],
    [tier_with("dropped", {"corrupt": -1})],
    [tier_with("dropped", [["corrupt", 1]])],
    [tier_with("load_seconds", [[0] * 12, 0.0])],  # TTFT's buckets, not LOAD_BUCKETS
    [tier_with("load_seconds", [[0] * 13, NAN])],
]


BAD_REPORTS = [
    [],
    report_with("pages_free", 90)[:-2],  # a field short, even of a report without tiers
    report_with("pages_free", -1),
    report_with("pages_cached", True),
    report_with("copy_bytes_remote", 1.5),
    report_with("evictions", [["evicted", 1]]),
    report_with("evictions", {"evicted": -1}),
    report_with("evictions", {"": 1}),
    report_with("evictions", {f"r{i}": 1 for i in range(MAX_REPORT_REASONS + 1)}),
    report_with("tenants", {"salt": [1, 2, 3, 4]}),
    report_with("tenants", [["salt", 1, 2, 3]]),  # a count short
    report_with("tenants", [["salt", 1, 2, 3, -4]]),
    report_with("tenants", [[7, 1, 2, 3, 4]]),
    report_with("tenants", [["s", 1, 1, 1, 1], ["s", 1, 1, 1, 1]]),  # a salt twice
    report_with("tenants", [[f"s{i}", 1, 1, 1, 1] for i in range(MAX_REPORT_TENANTS + 1)]),
    report_with("copy_seconds", [[0] * 3, 0.0]),  # not one count per bucket
    report_with("ttft_hit", [[0] * 12]),
    report_with("ttft_hit", [[0] * 11 + [-1], 0.0]),
    report_with("ttft_miss", [[0] * 12, -1.0]),
    report_with("ttft_miss", [[0] * 12, NAN]),
    report_with("ttft_miss", [[0] * 12, "0"]),
    *(report_with("tiers", tiers) for tiers in BAD_TIERS),
]


def test_a_report_without_tiers_travels_as_before_tiers_and_one_with_them_round_trips():
    field = protocol.table.MESSAGES["heartbeat"].request.fields["report"]
    before = field.wire(SAMPLE_REPORT)  # tiers (): the field is left off
    assert len(before) == message_types.WorkerReport._fields.index("tiers")
    assert field.check(before, "heartbeat.report", DEFAULT_LIMITS) == SAMPLE_REPORT
    with_tiers = SAMPLE_REPORT._replace(tiers=SAMPLE_TIERS)
    decoded = decode(encode(Message("heartbeat", 4, Heartbeat("w0", 3, 0.5, with_tiers))))
    assert decoded.body.report == with_tiers
    _, disk = decoded.body.report.tiers
    assert (
        type(disk) is message_types.TierFigures
        and type(disk.load_seconds) is message_types.Observed
    )
    assert (disk.tier, disk.evictions, disk.dropped) == (
        "disk",
        {"evicted": 2, "corrupt": 1},
        {"truncated": 1, "orphan": 2},
    )


def test_a_reports_decode_figures_and_routing_error_are_optional_and_round_trip():
    field = protocol.table.MESSAGES["heartbeat"].request.fields["report"]
    fields = message_types.WorkerReport._fields
    error = message_types.Observed((1, 0, 2, *[0] * 9), 0.06)
    full = SAMPLE_REPORT._replace(
        decode_steps=12, step_ns=40_000_000, pass_tokens=4096, route_error=error
    )
    wire = field.wire(full)
    assert len(wire) == len(fields) and wire[fields.index("tiers")] == []
    decoded = decode(encode(Message("heartbeat", 4, Heartbeat("w0", 3, 0.5, full))))
    assert decoded.body.report == full
    assert type(decoded.body.report.route_error) is message_types.Observed
    # The fields go as far as the last one set; those left off decode as unknown.
    partial = SAMPLE_REPORT._replace(decode_steps=3)
    assert len(field.wire(partial)) == fields.index("decode_steps") + 1
    assert field.check(field.wire(partial), "report", DEFAULT_LIMITS) == partial
    assert partial.step_ns == 0 and partial.route_error is None


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("step_ns", -1, r"report\.step_ns"),
        ("decode_steps", 1.5, r"report\.decode_steps"),
        ("route_error", [[0] * 3, 0.0], r"report\.route_error\.counts: expected a list of 12"),
        ("route_error", None, r"report\.route_error: expected \[counts, total\]"),
    ],
)
def test_a_bad_decode_figure_or_routing_error_is_refused_naming_it(name, value, message):
    field = protocol.table.MESSAGES["heartbeat"].request.fields["report"]
    fields = message_types.WorkerReport._fields
    full = SAMPLE_REPORT._replace(route_error=message_types.Observed((0,) * 12, 0.0))
    wire = field.wire(full._replace(decode_steps=1, step_ns=1, pass_tokens=1, chunk_tokens=1))
    wire[fields.index(name)] = value
    with pytest.raises(ProtocolError, match=message):
        field.check(wire, "report", DEFAULT_LIMITS)


@pytest.mark.parametrize(
    "tiers, code, message",
    [
        ([tier_with("tier", "ssd")], BAD_FIELD, r"report\.tiers\[0\]\.tier: expected one of"),
        ([SAMPLE_DISK] * 4, TOO_LARGE, r"report\.tiers: 4 tiers exceeds the limit 3"),
        (
            [SAMPLE_DISK, tier_with("pages", 1, tier="host")],
            BAD_FIELD,
            r"report\.tiers: expected tiers top down \('device', 'host', 'disk'\), each at "
            r"most once, got list of 2",
        ),
        (
            [tier_with("dropped", {f"r{i}": 1 for i in range(MAX_REPORT_REASONS + 1)})],
            TOO_LARGE,
            rf"report\.tiers\[0\]\.dropped: {MAX_REPORT_REASONS + 1} reasons exceeds the limit",
        ),
        ([tier_with("accepting", 2)], BAD_FIELD, r"report\.tiers\[0\]\.accepting: expected 0 or 1"),
    ],
)
def test_a_bad_tier_is_refused_naming_it(tiers, code, message):
    frame = msgpack.packb(
        {
            "v": protocol.PROTOCOL_VERSION,
            "t": "heartbeat",
            "id": 5,
            "b": {
                "worker_id": "w0",
                "epoch": 3,
                "load": 0.0,
                "report": report_with("tiers", tiers),
            },
        }
    )
    with pytest.raises(ProtocolError, match=message) as refused:
        decode(frame)
    assert refused.value.code == code


INVALID = {
    "count": st.one_of(
        st.booleans(),
        st.integers(-(2**63), -1),
        st.integers(2**63, 2**64 - 1),
        st.floats(),
        st.text(max_size=3),
        st.none(),
        st.binary(max_size=3),
        st.lists(st.integers(0, 3), max_size=2),
    ),
    "id": st.one_of(
        st.sampled_from(["", LONG_NAME]),
        wire_ints,
        st.booleans(),
        st.none(),
        st.binary(max_size=4),
        st.lists(st.text(max_size=2), max_size=2),
    ),
    "optional id": st.one_of(
        st.sampled_from(["", LONG_NAME]),
        wire_ints,
        st.booleans(),
        st.binary(max_size=4),
    ),
    "address": st.one_of(
        st.just(LONG_NAME), wire_ints, st.booleans(), st.none(), st.binary(max_size=4)
    ),
    "after": st.one_of(
        st.just(LONG_NAME), wire_ints, st.booleans(), st.none(), st.binary(max_size=4)
    ),
    "shm name": st.one_of(
        st.sampled_from(BAD_SHM_NAMES),
        wire_ints,
        st.booleans(),
        st.none(),
        st.binary(max_size=4),
        st.text(min_size=1, max_size=8).filter(lambda text: not text.startswith("kvmesh-")),
    ),
    "page key": st.one_of(
        st.binary(max_size=64).filter(lambda key: len(key) not in (0, 32)),
        st.just(PAGE_KEY),  # its z85 form: 40 bytes, not the 32 the wire takes
        st.just(PAGE_KEY.decode()),
        st.none(),
        wire_ints,
        st.booleans(),
    ),
    "peers": st.one_of(
        ANY_OTHER.filter(lambda v: not isinstance(v, list) or v),
        st.sampled_from(BAD_PEER_ENTRIES).map(lambda entry: [entry]),
        st.sampled_from(BAD_PEER_ENTRIES).map(lambda entry: [GOOD_PEER_ENTRY, entry]),
    ),
    "digests": st.one_of(
        st.binary(max_size=40).filter(lambda b: len(b) % 16),
        st.just(bytes(16 * ((1 << 14) + 1))),
        st.text(max_size=3),
        st.none(),
        wire_ints,
    ),
    "page ids": st.one_of(
        st.binary(max_size=9).filter(lambda b: len(b) % 4),
        st.just(struct.pack("<2i", 3, -1)),  # a negative id
        st.lists(wire_ints, min_size=1, max_size=2),
        st.text(max_size=3),
        st.none(),
        wire_ints,
    ),
    "generations": st.one_of(
        st.binary(max_size=17).filter(lambda b: len(b) % 8),
        st.just(struct.pack("<q", -5)),
        st.lists(wire_ints, min_size=1, max_size=2),
        st.text(max_size=3),
        st.none(),
        wire_ints,
    ),
    "ids": st.one_of(
        st.lists(st.sampled_from(["", LONG_NAME]), min_size=1, max_size=2),
        st.lists(wire_ints, min_size=1, max_size=2),
        st.text(max_size=3),
        st.none(),
        wire_ints,
    ),
    "text": st.one_of(
        st.just("x" * 5000),
        wire_ints,
        st.booleans(),
        st.none(),
        st.binary(max_size=4),
        st.lists(st.text(max_size=2), max_size=2),
    ),
    "flag": st.one_of(wire_ints, st.none(), st.text(max_size=3), st.floats()),
    "load": st.one_of(
        st.booleans(),
        st.sampled_from([NAN, INF, -INF, -0.5, -1]),
        st.floats(max_value=-1e-9),
        st.text(max_size=3),
        st.none(),
        st.binary(max_size=3),
    ),
    "score": st.one_of(
        st.booleans(),
        st.sampled_from([NAN, INF, -INF]),
        st.text(max_size=3),
        st.none(),
        st.lists(st.floats(), max_size=2),
    ),
    "tokens": st.one_of(
        st.binary(max_size=30).filter(lambda b: len(b) % 4),
        st.text(max_size=3),
        st.lists(st.integers(0, 9), max_size=3),
        st.none(),
        wire_ints,
        st.booleans(),
    ),
    "namespace": st.one_of(
        st.lists(st.text(max_size=3), max_size=2),
        st.lists(st.text(max_size=3), min_size=4, max_size=5),
        st.tuples(wire_ints, st.text(max_size=2), st.text(max_size=2)).map(list),
        st.just([LONG_NAME, "", ""]),
        st.just(["m", "", None]),
        st.text(max_size=3),
        st.none(),
        st.dictionaries(st.text(max_size=2), st.text(max_size=2), max_size=2),
    ),
    "loads": st.one_of(
        st.dictionaries(
            st.text(min_size=1, max_size=4),
            st.one_of(
                st.booleans(), st.sampled_from([NAN, INF, -1.0]), st.text(max_size=2), st.none()
            ),
            min_size=1,
            max_size=3,
        ),
        st.sampled_from([{"": 1.0}, {b"w0": 1.0}, {LONG_NAME: 1.0}, {1: 1.0}, {None: 1.0}]),
        st.lists(st.floats(0, 1), max_size=2),
        st.none(),
        st.text(max_size=2),
    ),
    "events": st.one_of(
        ANY_OTHER.filter(lambda v: not isinstance(v, list) or v),
        st.lists(st.sampled_from(BAD_EVENTS), min_size=1, max_size=3),
    ),
    "chains": st.one_of(
        ANY_OTHER.filter(lambda v: not isinstance(v, list) or v),
        st.lists(
            st.sampled_from([*BAD_EVENTS, ["r", [1], "evicted"], ["c"]]), min_size=1, max_size=3
        ),
    ),
    "spans": st.one_of(
        ANY_OTHER.filter(lambda v: not isinstance(v, list) or v),
        st.sampled_from(BAD_SPANS).map(lambda span: [span]),
        st.sampled_from(BAD_SPANS).map(lambda span: [GOOD_SPAN, span]),
    ),
    "report": st.one_of(
        ANY_OTHER.filter(lambda v: not isinstance(v, list)),
        st.sampled_from(BAD_REPORTS),
    ),
    "stats": st.one_of(
        st.none(),
        st.lists(wire_ints, max_size=2),
        wire_ints,
        st.text(max_size=3),
        st.sampled_from(
            [
                {"a": b"bytes"},
                {"a": 2**63},
                {"a": [1, {"b": 2**64 - 1}]},
                {"a": {b"k": 1}},
                {1: 2},
                {"a": {"b": "x" * 5000}},
                {"a": msgpack.ExtType(3, b"x")},
            ]
        ),
    ),
}
FIELD_CASES = [
    (kind, reply, name, field.kind)
    for kind, schema in MESSAGES.items()
    for reply, body in ((False, schema.request), (True, schema.reply))
    for name, field in body.fields.items()
] + [(ERROR, True, name, field.kind) for name, field in protocol.ERROR_BODY.fields.items()]


def test_every_field_kind_has_invalid_values():
    assert {case[3] for case in FIELD_CASES} <= set(INVALID)


def frame_with(kind: str, reply: bool, name: str, value: object, request_id: int = 7) -> bytes:
    if kind == ERROR:
        body = {"code": "bad_field", "message": "m", name: value}
        return raw_frame(ERROR, body, request_id=request_id)
    sample = (SAMPLE_REPLIES if reply else SAMPLE_REQUESTS)[kind]
    body = {**wire_body(kind, sample, reply), name: value}
    if reply:
        return raw_frame(OK, body, request_id=request_id, r=kind)
    return raw_frame(kind, body, request_id=request_id)


@pytest.mark.timeout(60)
@FUZZ
@given(st.sampled_from(FIELD_CASES), st.data())
def test_wrong_field_values_are_rejected_naming_the_field(case, data):
    kind, reply, name, field_kind = case
    value = data.draw(INVALID[field_kind], label="value")
    error = assert_rejected(
        frame_with(kind, reply, name, value),
        BAD_FIELD,
        TOO_LARGE,
        BAD_FRAME,
        TOO_DEEP,
        expect="reply" if reply else "request",
    )
    assert error.request_id == 7
    if error.code == BAD_FIELD:
        assert f".{name}" in error.message, error
    assert_still_serves()


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | wire_ints
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=9),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=4) | st.sampled_from(["s", "model"]), inner, max_size=3)
    ),
    max_leaves=12,
)


@pytest.mark.timeout(60)
@FUZZ
@given(st.sampled_from(sorted(MESSAGES)), st.booleans(), st.data())
def test_arbitrary_values_in_fields_raise_only_protocol_errors(kind, reply, data):
    """Any msgpack tree in any field: the frame decodes (if the tree happens to be valid)
    or raises ProtocolError; nothing else."""
    sample = wire_body(kind, (SAMPLE_REPLIES if reply else SAMPLE_REQUESTS)[kind], reply)
    body = {
        name: data.draw(st.just(value) | msgpack_values, label=name)
        for name, value in sample.items()
    }
    frame = raw_frame(OK, body, r=kind) if reply else raw_frame(kind, body)
    with contextlib.suppress(ProtocolError):
        decode(frame, "reply" if reply else "request")
    assert_still_serves()


@pytest.mark.parametrize(
    "case", [case for case in FIELD_CASES if case[3] == "count"], ids=lambda case: str(case[:3])
)
def test_bool_is_not_an_int(case):
    kind, reply, name, _ = case
    for value in (True, False):
        error = assert_rejected(
            frame_with(kind, reply, name, value), BAD_FIELD, expect="reply" if reply else "request"
        )
        assert f".{name}: expected int" in error.message and f"got {value}" in error.message


@pytest.mark.parametrize("kind", sorted(MESSAGES))
def test_missing_and_unknown_fields_are_named(kind):
    body = wire_body(kind, SAMPLE_REQUESTS[kind])
    error = assert_rejected(raw_frame(kind, {**body, "colour": 1}), BAD_FIELD)
    assert "unknown field 'colour'" in error.message
    for name in body:
        missing = {key: value for key, value in body.items() if key != name}
        error = assert_rejected(raw_frame(kind, missing), BAD_FIELD)
        assert f"missing field {name!r}" in error.message


@pytest.mark.parametrize(
    "span, code, message",
    [
        (BAD_SPANS[2], BAD_FIELD, r"\[1\]: 2 page ids but 1 generations"),
        (BAD_SPANS[4], BAD_FIELD, r"\[1\]\.page_ids: 9 bytes is not a multiple of 4"),
        (BAD_SPANS[5], BAD_FIELD, r"\[1\]\.generations: 12 bytes is not a multiple of 8"),
        (BAD_SPANS[7], BAD_FIELD, r"\[1\]\.page_ids: expected at least one page"),
        (BAD_SPANS[8], BAD_FIELD, r"\[1\]\.page_ids\[1\]: -2 is negative"),
        (BAD_SPANS[9], BAD_FIELD, r"\[1\]\.generations\[0\]: -1 is negative"),
        (BAD_SPANS[11], BAD_FIELD, r"\[1\]\.page_ids: expected packed little-endian int32"),
        (BAD_SPANS[0], BAD_FIELD, r"\[1\]: expected \[worker_id, tier, page_ids"),
        (BAD_SPANS[15], TOO_LARGE, r"\[1\]\.worker_id: 257 chars"),
        (BAD_SPANS[10], TOO_DEEP, r": nests deeper than the 4 levels allowed"),  # int lists
        (BAD_SPANS[21], BAD_FIELD, r"\[1\]\.tier: expected a tier, one of \('device', 'host'"),
        (BAD_SPANS[22], BAD_FIELD, r"\[1\]\.tiers: 1 tiers for 2 pages"),
        (BAD_SPANS[23], BAD_FIELD, r"\[1\]\.tiers\[1\]: 3 is not the index of a tier"),
        (BAD_SPANS[24], BAD_FIELD, r"\[1\]\.tiers\[0\]: 'disk', but the span's tier is 'host'"),
        (BAD_SPANS[25], BAD_FIELD, r"\[1\]\.tiers: expected bytes, one tier index per page"),
        (BAD_SPANS[26], BAD_FIELD, r"\[1\]: expected \[worker_id, tier, page_ids"),
    ],
)
def test_malformed_spans_are_named(span, code, message):
    body = {"matched_tokens": 8, "spans": [GOOD_SPAN, span]}
    error = assert_rejected(raw_frame(OK, body, r=MATCH), code, expect="reply")
    assert re.match(r"match\.reply(\.spans)?" + message, error.message), error.message


def test_the_lists_and_maps_of_a_frame_are_bounded_all_together():
    limits = Limits(max_containers=40)
    # 39 containers: the envelope, the body, the events list, 18 events of 2 (list and
    # namespace): 3 + 36 = 39; and one more event is over.
    fits = PublishEvents("w0", 1, 1, [make_stored(1) for _ in range(18)])
    assert decode(encode(request(3, fits)), limits=limits).body == fits
    over = fits._replace(events=[make_stored(1) for _ in range(19)])
    error = assert_rejected_with(encode(request(3, over)), limits)
    assert error.code == TOO_LARGE and error.request_id == 3
    assert "more than max_containers 40 lists and maps" in error.message
    # Both decoders count: a long list (over the one-pass decoder's 128) takes the other.
    many = over._replace(events=[PagesRemoved((i,), "evicted") for i in range(200)])
    assert assert_rejected_with(encode(request(4, many)), limits).code == TOO_LARGE
    assert decode(encode(request(4, many))).body == many  # within the default budget


def test_span_counts_are_bounded():
    limits = Limits(max_tokens=4, max_list_len=7)  # 7: the keys of the largest body
    span = ["w", "host", struct.pack("<4i", 0, 1, 2, 3), struct.pack("<4q", 0, 0, 0, 0)]
    frame = raw_frame(OK, {"matched_tokens": 16, "spans": [span] * 7}, r=MATCH)
    assert len(decode(frame, "reply", limits=limits).body.spans) == 7
    too_many = raw_frame(OK, {"matched_tokens": 16, "spans": [span] * 8}, r=MATCH)
    with pytest.raises(ProtocolError, match="8 exceeds max_array_len") as info:
        decode(too_many, "reply", limits=limits)  # refused by msgpack itself
    assert info.value.code == TOO_LARGE
    with pytest.raises(ProtocolError, match="spans: 8 items exceeds max_list_len 7") as info:
        check_spans([span] * 8, "match.reply.spans", limits)
    assert info.value.code == TOO_LARGE
    long = ["w", "host", struct.pack("<5i", *range(5)), struct.pack("<5q", *range(5))]
    too_long = raw_frame(OK, {"matched_tokens": 20, "spans": [long]}, r=MATCH)
    with pytest.raises(ProtocolError, match="page_ids: 5 pages exceeds max_tokens 4") as info:
        decode(too_long, "reply", limits=limits)
    assert info.value.code == TOO_LARGE


def test_a_string_longer_than_any_field_is_refused_with_the_bound():
    longest = max(DEFAULT_LIMITS.max_str_len, DEFAULT_LIMITS.max_text_len)
    frame = raw_frame(MATCH, {"namespace": ["m", "", "x" * (longest + 1)]})
    message = f"frame: a string of {longest + 1} bytes, longer than any field takes ({longest})"
    with pytest.raises(ProtocolError, match=re.escape(message)) as info:
        decode(frame)
    assert info.value.code == TOO_LARGE


def test_values_at_their_limits_are_accepted():
    limits = Limits(max_tokens=8, max_list_len=7, max_str_len=4)
    body = {
        "namespace": ["abcd", "", ""],
        "tokens": pack_tokens(make_tokens(8)),
        "requester": "wxyz",
    }
    assert decode(raw_frame(MATCH, body), limits=limits).body.namespace == ("abcd", "", "")
    for name, value in [("tokens", pack_tokens(make_tokens(9))), ("requester", "vwxyz")]:
        error = assert_rejected_with(raw_frame(MATCH, {**body, name: value}), limits)
        assert error.code == TOO_LARGE and f"match.{name}" in error.message
    loads = {name: 0.0 for name in "abcdefgh"}
    body = {"namespace": ["m", "", ""], "tokens": b"", "loads": loads}
    assert assert_rejected_with(raw_frame("route", body), limits).code == TOO_LARGE
    assert assert_rejected_with(GOOD_FRAME, Limits(max_frame_bytes=64)).code == TOO_LARGE
    edge = PublishEvents("w", 2**63 - 1, 0, [])
    got = decode(raw_frame("events", edge._asdict())).body
    assert type(got) is PublishEvents and got == edge


def test_register_carries_what_a_peer_needs():
    body = SAMPLE_REQUESTS["register"]
    wire = wire_body("register", body)
    assert wire["shm_name"] == SHM_NAME
    assert wire["page_key"] == z85.decode(PAGE_KEY) and len(wire["page_key"]) == 32
    assert decode(raw_frame("register", wire)).body == body
    keyless = decode(raw_frame("register", {**wire, "shm_name": "", "page_key": b""})).body
    assert (keyless.shm_name, keyless.page_key) == ("", None)
    # The page store's own names are what the codec takes, the longest tag too.
    from workers.store.segment_names import segment_name

    for tag in ("w0", "t" * 32):
        name = segment_name(tag)
        assert decode(raw_frame("register", {**wire, "shm_name": name})).body.shm_name == name


@FUZZ
@given(st.binary(min_size=32, max_size=32))
def test_keys_travel_raw_and_read_back_in_z85_as_zmq_writes_it(raw):
    assert z85_key(raw) == z85.encode(raw)
    assert raw_key(z85.encode(raw)) == raw


@pytest.mark.parametrize("name", BAD_SHM_NAMES)
def test_a_store_name_not_of_the_page_store_is_refused(name):
    wire = wire_body("register", SAMPLE_REQUESTS["register"])
    error = assert_rejected(raw_frame("register", {**wire, "shm_name": name}), BAD_FIELD)
    assert error.message.startswith("register.shm_name: expected a page store name"), error
    assert_still_serves()


@pytest.mark.parametrize("length", [1, 31, 33, 40, 64])
def test_a_page_key_of_the_wrong_length_is_refused(length):
    for kind, reply in (("register", False), ("peer", True)):
        error = assert_rejected(
            frame_with(kind, reply, "page_key", b"k" * length),
            BAD_FIELD,
            expect="reply" if reply else "request",
        )
        assert f".page_key: expected a 32-byte key or empty bytes, got bytes of {length}" in (
            error.message
        )


@pytest.mark.parametrize(
    "key, message",
    [
        (PAGE_KEY[:39], "expected a z85 key of 40 bytes or None, got bytes of 39"),
        (z85.decode(PAGE_KEY), "expected a z85 key of 40 bytes or None, got bytes of 32"),
        (PAGE_KEY.decode(), "expected a z85 key of 40 bytes or None, got"),
        (b"~" * 40, "not a z85 key"),
        (b"#" * 40, "not a z85 key"),  # z85 characters, but over 2**32 a block
    ],
    ids=["short", "raw", "str", "not-z85", "over-2**32"],  # the key is random: not its id
)
def test_encode_refuses_a_page_key_that_is_not_z85(key, message):
    body = SAMPLE_REQUESTS["register"]._replace(page_key=key)
    with pytest.raises(ProtocolError, match=re.escape(message)) as info:
        encode(request(5, body))
    assert info.value.code == BAD_FIELD and "register.page_key" in info.value.message


def test_peer_entries_travel_as_lists_with_raw_keys():
    reply = ok_reply(request(1, GetPeers("")), SAMPLE_REPLIES["peers"])
    wire = msgpack.unpackb(encode(reply))["b"]
    assert wire == {
        "peers": [
            ["w0", 3, "node-a", "cpu", "tcp://10.0.0.5:7001", SHM_NAME, z85.decode(PAGE_KEY)],
            ["w1", 3, "node-a", "cpu", "tcp://10.0.0.5:7001", SHM_NAME, b""],
        ],
        "more": True,
    }
    got = decode(encode(reply), "reply").body
    assert type(got) is PeerList and all(type(entry) is PeerEntry for entry in got.peers)


@pytest.mark.parametrize("entry", BAD_PEER_ENTRIES, ids=range(len(BAD_PEER_ENTRIES)))
def test_malformed_peer_entries_are_refused(entry):
    frame = raw_frame(OK, {"peers": [GOOD_PEER_ENTRY, entry], "more": False}, r="peers")
    error = assert_rejected(frame, BAD_FIELD, TOO_LARGE, TOO_DEEP, expect="reply")
    assert error.message.startswith("peers.reply"), error


def assert_rejected_with(frame: bytes, limits: Limits) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(frame, limits=limits)
    return info.value


def test_limits_are_validated():
    assert dataclasses.asdict(DEFAULT_LIMITS) == {
        "max_frame_bytes": 8 << 20,
        "max_tokens": 1 << 20,
        "max_list_len": 1 << 17,
        "max_str_len": 256,
        "max_text_len": 4096,
        "max_depth": 8,
        "max_containers": 16384,
    }
    with pytest.raises(ValueError, match="max_depth 6 is below 7"):
        Limits(max_depth=6)
    with pytest.raises(ValueError, match="max_tokens"):
        Limits(max_tokens=0)
    with pytest.raises(ValueError, match="max_str_len"):
        Limits(max_str_len=True)


# --- envelopes ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame, code",
    [
        (raw_frame(MATCH, {}, v=2), BAD_VERSION),  # the version before service epochs
        (raw_frame(MATCH, {}, v=3), BAD_VERSION),  # the version before worker reports
        (raw_frame(MATCH, {}, v=4), BAD_VERSION),  # the version before peer entries
        (raw_frame(MATCH, {}, v=5), BAD_VERSION),  # the version before load reports
        (raw_frame(MATCH, {}, v=6), BAD_VERSION),  # the version before routing policies
        (raw_frame(MATCH, {}, v=7), BAD_VERSION),  # the version before health in reports
        (raw_frame(MATCH, {}, v=8), BAD_VERSION),  # the version before capacities and spot checks
        (raw_frame(MATCH, {}, v=9), BAD_VERSION),  # the version before page tiers
        (raw_frame(MATCH, {}, v=10), BAD_VERSION),  # the version before front doors in routes
        (raw_frame(MATCH, {}, v=11), BAD_VERSION),  # the version before held-elsewhere notices
        (raw_frame(MATCH, {}, v=13), BAD_VERSION),
        (raw_frame(MATCH, {}, v=0), BAD_VERSION),
        (raw_frame(MATCH, {}, v=True), BAD_VERSION),
        (raw_frame(MATCH, {}, v=str(PROTOCOL_VERSION)), BAD_VERSION),
        (raw_frame(MATCH, {}, v=float(PROTOCOL_VERSION)), BAD_VERSION),
        (msgpack.packb({"t": MATCH, "id": 1, "b": {}}), BAD_FRAME),
        (raw_frame("teleport", {}), UNKNOWN_TYPE),
        (raw_frame(OK, {}, r=MATCH), UNKNOWN_TYPE),  # a reply where a request belongs
        (raw_frame(7, {}), BAD_FRAME),
        (raw_frame(MATCH, {}, request_id=0), BAD_FRAME),  # 0 is kept for undecodable frames
        (raw_frame(MATCH, {}, request_id=-3), BAD_FRAME),
        (raw_frame(MATCH, {}, request_id=True), BAD_FRAME),
        (raw_frame(MATCH, {}, request_id=2**64 - 1), BAD_FRAME),
        (raw_frame(MATCH, {}, request_id=1.0), BAD_FRAME),
        (raw_frame(MATCH, wire_body("stats", SAMPLE_REQUESTS["stats"]), x=1), BAD_FRAME),
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": MATCH, "id": 1}), BAD_FRAME),
        (msgpack.packb([1, MATCH, 1, {}]), BAD_FRAME),
        (msgpack.packb("match"), BAD_FRAME),
        (raw_frame(MATCH, [1, 2, 3]), BAD_FIELD),
        (raw_frame("stats", None), BAD_FIELD),
    ],
)
def test_bad_envelopes(frame, code):
    assert_rejected(frame, code)
    assert_still_serves()


@pytest.mark.timeout(60)
@FUZZ
@given(
    st.one_of(st.just(PROTOCOL_VERSION), msgpack_values),
    st.one_of(st.sampled_from([*MESSAGES, OK, ERROR]), st.text(max_size=12), msgpack_values),
    st.one_of(st.integers(0, 2**63 - 1), msgpack_values),
    st.one_of(st.just(wire_body("stats", SAMPLE_REQUESTS["stats"])), msgpack_values),
    st.dictionaries(st.sampled_from(["v", "t", "id", "b", "r", "x"]), msgpack_values, max_size=2),
    st.sampled_from(["request", "reply"]),
)
def test_random_envelopes_raise_only_protocol_errors(
    version, kind, request_id, body, extra, expect
):
    frame = msgpack.packb({"v": version, "t": kind, "id": request_id, "b": body, **extra})
    with contextlib.suppress(ProtocolError):
        decode(frame, expect)
    assert_still_serves()


def test_reply_envelopes():
    assert_rejected(raw_frame(MATCH, {}), UNKNOWN_TYPE, expect="reply")
    assert_rejected(raw_frame(OK, {}, r="teleport"), UNKNOWN_TYPE, expect="reply")
    assert_rejected(raw_frame(OK, {}), BAD_FRAME, expect="reply")  # no "r"
    assert_rejected(
        raw_frame(ERROR, {"code": "x", "message": "m"}, r=MATCH), BAD_FRAME, expect="reply"
    )
    undecodable = raw_frame(ERROR, {"code": BAD_FRAME, "message": "m"}, request_id=0)
    assert decode(undecodable, "reply").request_id == 0


@pytest.mark.parametrize(
    "value",
    [
        msgpack.ExtType(5, b"x"),
        msgpack.ExtType(5, b""),
        msgpack.ExtType(127, b"\x00" * 300),
        msgpack.Timestamp(1, 0),
    ],
)
def test_ext_types_are_refused_anywhere(value):
    for frame in (
        raw_frame(MATCH, {**wire_body(MATCH, SAMPLE_REQUESTS[MATCH]), "requester": value}),
        raw_frame(MATCH, {}, request_id=value),
        msgpack.packb(value),
    ):
        assert_rejected(frame, BAD_FRAME)


@pytest.mark.parametrize("key", [1, -1, None, 1.5, True, b"tokens", (1, 2)])
def test_non_str_map_keys_are_refused(key):
    body = {**wire_body(MATCH, SAMPLE_REQUESTS[MATCH]), key: 1}
    assert_rejected(raw_frame(MATCH, body), BAD_FRAME, BAD_FIELD)
    envelope = {"v": PROTOCOL_VERSION, "t": MATCH, "id": 1, "b": {}, key: 1}
    assert_rejected(msgpack.packb(envelope), BAD_FRAME)
    stats = {"stats": {"ok": 1, "nested": {key: 1}}}
    assert_rejected(raw_frame(OK, stats, r="stats"), BAD_FRAME, BAD_FIELD, expect="reply")


def test_strings_must_be_utf8():
    frame = raw_frame(MATCH, wire_body(MATCH, SAMPLE_REQUESTS[MATCH])).replace(b"w1", b"\xff\xfe")
    assert_rejected(frame, BAD_FRAME)


# --- depth --------------------------------------------------------------------------------


def nested(levels: int, leaf: object = None) -> object:
    """`leaf` inside `levels` lists."""
    value = leaf
    for _ in range(levels):
        value = [value]
    return value


def frame_ending_in(kind: str, body: dict, last: str, tail: bytes, request_id: int = 1) -> bytes:
    """A frame whose body's `last` field is the raw msgpack `tail` (msgpack's packer refuses
    to nest deeper than 511 levels, so deep values are written byte by byte)."""
    frame = raw_frame(kind, {**body, last: 0}, request_id=request_id)
    assert frame.endswith(msgpack.packb(last) + b"\x00")
    return frame[:-1] + tail


def test_ten_thousand_nested_lists_are_refused():
    assert_rejected(b"\x91" * 10_000 + b"\xc0", TOO_DEEP)
    assert_rejected(frame_ending_in(MATCH, {}, "namespace", b"\x91" * 10_000 + b"\xc0"), TOO_DEEP)
    assert_still_serves()


@pytest.mark.parametrize("levels", [1, 3, 500, 1000])
def test_nesting_below_the_schema_is_too_deep(levels):
    body = wire_body(MATCH, SAMPLE_REQUESTS[MATCH])
    del body["namespace"]
    tail = b"\x91" * levels + msgpack.packb(["m", "", ""])
    error = assert_rejected(frame_ending_in(MATCH, body, "namespace", tail, 3), TOO_DEEP)
    assert error.request_id == 3 and "3 levels" in error.message


def test_deepest_fixed_schema_fits():
    frame = encode(Message("events", 1, SAMPLE_REQUESTS["events"]))
    assert decode(frame).body.events[0] == make_stored()
    reply = ok_reply(GOOD_MATCH, SAMPLE_REPLIES["match"])
    bad = msgpack.unpackb(encode(reply))
    bad["b"]["spans"][0][0] = ["w0"]
    assert_rejected(msgpack.packb(bad), TOO_DEEP, expect="reply")


def test_stats_nest_up_to_max_depth():
    def stats_frame(levels):
        return raw_frame(OK, {"stats": {"a": nested(levels, 1)}}, r="stats")

    # envelope, body, stats map = 3 levels; 5 more reach max_depth 8.
    assert decode(stats_frame(5), "reply").body.stats["a"] == nested(5, 1)
    assert_rejected(stats_frame(6), TOO_DEEP, expect="reply")
    assert decode(stats_frame(6), "reply", limits=Limits(max_depth=9))


# --- malformed frames: fuzz ---------------------------------------------------------------


@pytest.mark.timeout(60)
@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_are_rejected(frame):
    assert_rejected(frame)
    assert_still_serves()


@pytest.mark.timeout(60)
@FUZZ
@given(messages(), st.data())
def test_truncated_frames_are_rejected(msg, data):
    frame = encode(msg)
    cut = data.draw(st.integers(0, len(frame) - 1), label="cut")
    assert_rejected(frame[:cut], BAD_FRAME)
    assert_rejected(frame + b"\x00", BAD_FRAME)
    assert_still_serves()


@pytest.mark.timeout(60)
@FUZZ
@given(messages(), st.data())
def test_corrupted_frames_raise_only_protocol_errors(msg, data):
    """Flip, insert or drop bytes of a valid frame: the result decodes or raises ProtocolError."""
    frame = bytearray(encode(msg))
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        at = data.draw(st.integers(0, len(frame)), label="at")
        action = data.draw(st.sampled_from(["set", "insert", "drop"]), label="action")
        byte = data.draw(st.integers(0, 255), label="byte")
        if action == "insert":
            frame.insert(at, byte)
        elif at < len(frame):
            if action == "set":
                frame[at] = byte
            else:
                del frame[at]
    with contextlib.suppress(ProtocolError):
        decode(bytes(frame), expect_of(msg))
    assert_still_serves()


# Headers whose lengths a frame cannot back: bin/str/array/map of 8, 16 and 32 bits.
HEADERS = {
    "bin8": (b"\xc4", "B"),
    "bin16": (b"\xc5", ">H"),
    "bin32": (b"\xc6", ">I"),
    "str8": (b"\xd9", "B"),
    "str16": (b"\xda", ">H"),
    "str32": (b"\xdb", ">I"),
    "array16": (b"\xdc", ">H"),
    "array32": (b"\xdd", ">I"),
    "map16": (b"\xde", ">H"),
    "map32": (b"\xdf", ">I"),
}


def header(name: str, length: int) -> bytes:
    tag, fmt = HEADERS[name]
    return tag + struct.pack(fmt, min(length, 2 ** (8 * struct.calcsize(fmt)) - 1))


@pytest.mark.timeout(60)
@FUZZ
@given(
    st.sampled_from(sorted(HEADERS)),
    st.integers(0, 2**32 - 1),
    st.binary(max_size=16),
    st.sampled_from(["top", "field", "nested"]),
)
def test_oversized_length_headers_are_rejected(name, length, tail, where):
    claim = header(name, length)
    if where == "top":
        frame = claim + tail
    elif where == "field":  # the value of "tokens" in an otherwise valid envelope
        frame = raw_frame(MATCH, {"tokens": 0})[:-1] + claim + tail
    else:  # a stack of huge arrays, each claiming the most a list may hold
        frame = header("array32", DEFAULT_LIMITS.max_list_len) * 50 + claim + tail
    assert_rejected(frame)
    assert_still_serves()


def peak_bytes_while(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def test_lying_headers_do_not_allocate():
    # 1,000 nested arrays each claiming max_list_len items would make msgpack preallocate
    # about 1 GiB of list slots if decoded directly; the skipper refuses the frame first.
    frames = [
        header("array32", DEFAULT_LIMITS.max_list_len) * 1000,
        header("map32", DEFAULT_LIMITS.max_list_len) * 1000,
        header("bin32", DEFAULT_LIMITS.max_frame_bytes - 16) + b"x" * 10,
        header("str32", 2**32 - 1) + b"x",
    ]
    for frame in frames:
        peak = peak_bytes_while(lambda frame=frame: assert_rejected(frame, BAD_FRAME))
        assert peak < 1 << 20, peak
    # Short lists are decoded in one pass, without the skipper: the most that can claim is
    # 1,024 levels (msgpack's stack) of 128 slots, about 1 MiB, and then the frame is refused.
    frame = header("array16", 128) * 1000
    peak = peak_bytes_while(lambda: assert_rejected(frame, BAD_FRAME))
    assert peak < 2 << 20, peak


def test_long_lists_take_the_careful_way():
    events = [PagesRemoved((page,), "evicted") for page in range(300)]  # over 128 items
    body = PublishEvents("w0", 1, 1, events)
    assert decode(encode(Message("events", 3, body))).body.events == events
    spans = tuple(HolderSpan(f"w{i}", "host", (i,), (0,)) for i in range(200))
    reply = ok_reply(GOOD_MATCH, MatchResult(4, spans))
    assert decode(encode(reply), "reply").body.spans == spans
    loads = {f"w{i}": 0.5 for i in range(40)}  # a map of over 16 keys
    body = Route(NS, b"", loads)
    assert decode(encode(Message("route", 3, body))).body.loads == loads


def test_oversized_frames_are_refused_before_decoding():
    frame = b"\x00" * (DEFAULT_LIMITS.max_frame_bytes + 1)
    peak = peak_bytes_while(lambda: assert_rejected(frame, TOO_LARGE))
    assert peak < 1 << 20
    big = SAMPLE_REQUESTS[MATCH]._replace(tokens=b"\x00" * (4 * DEFAULT_LIMITS.max_tokens + 4))
    error = assert_rejected(raw_frame(MATCH, big._asdict()), TOO_LARGE)
    assert "match.tokens: 1048577 tokens exceeds max_tokens 1048576" in error.message
    assert_rejected(header("array32", 2**32 - 1) + b"\x00", TOO_LARGE, BAD_FRAME)


def test_a_max_size_prompt_decodes():
    body = SAMPLE_REQUESTS[MATCH]._replace(tokens=pack_tokens(np.arange(DEFAULT_LIMITS.max_tokens)))
    got = decode(encode(Message(MATCH, 1, body))).body
    assert len(got.tokens) == 4 * DEFAULT_LIMITS.max_tokens


def test_decode_takes_bytes_like_frames_only():
    assert_same_message(decode(memoryview(GOOD_FRAME)), GOOD_MATCH)
    assert_same_message(decode(bytearray(GOOD_FRAME)), GOOD_MATCH)
    assert_rejected(b"", BAD_FRAME)
    with pytest.raises(ProtocolError):
        decode("not bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expect"):
        decode(GOOD_FRAME, "question")  # type: ignore[arg-type]


# --- encode side --------------------------------------------------------------------------


def test_encode_checks_what_it_sends():
    with pytest.raises(ProtocolError) as info:
        encode(Message("teleport", 1, GetStats()))
    assert info.value.code == UNKNOWN_TYPE
    # A missing field cannot be built: the typed body carries every field or none.
    with pytest.raises(TypeError, match="requester"):
        Match(NS, b"")  # type: ignore[call-arg]
    with pytest.raises(ProtocolError, match="match: body must be Match, got dict"):
        encode(Message(MATCH, 1, {"namespace": NS, "tokens": b""}))
    with pytest.raises(ProtocolError, match=r"match\.requester: expected a non-empty str"):
        encode(Message(MATCH, 4, SAMPLE_REQUESTS[MATCH]._replace(requester="")))
    with pytest.raises(ProtocolError) as info:
        encode(Message(MATCH, 1, SAMPLE_REQUESTS[MATCH]._replace(tokens=[2**31])))
    assert info.value.code == BAD_FIELD
    assert info.value.message.startswith("match.tokens: token id 2147483648 at index 0")
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode(Message(MATCH, 1, SAMPLE_REQUESTS[MATCH]._replace(requester=object())))
    with pytest.raises(ProtocolError, match="expected a KvEvent"):
        encode(Message("events", 1, SAMPLE_REQUESTS["events"]._replace(events=[("s",)])))
    with pytest.raises(ProtocolError, match="envelope.id"):
        encode(Message(MATCH, 0, SAMPLE_REQUESTS[MATCH]))
    with pytest.raises(ProtocolError) as info:
        encode(GOOD_MATCH, limits=Limits(max_frame_bytes=64))
    assert info.value.code == TOO_LARGE and info.value.request_id == 99
    unchecked = encode(
        Message(MATCH, 4, SAMPLE_REQUESTS[MATCH]._replace(requester="")), check=False
    )
    assert_rejected(unchecked, BAD_FIELD)


def test_error_reply_for_any_exception():
    internal = error_reply(5, KeyError("w9")).body
    assert type(internal) is ErrorReply and internal == ErrorReply(INTERNAL, "KeyError: 'w9'")
    long = error_reply(5, ProtocolError("stale_epoch", "x" * 10_000))
    assert long.body.code == "stale_epoch" and len(long.body.message) == 4096
    assert_same_message(decode(encode(long), "reply"), long)
    assert error_reply(-1, ValueError("v")).request_id == 0
    assert error_reply(True, ValueError("v")).request_id == 0


def test_protocol_error_copies_with_its_fields():
    error = ProtocolError(TOO_DEEP, "deep", 12)
    clone = copy.deepcopy(error)
    assert (clone.code, clone.message, clone.request_id) == (TOO_DEEP, "deep", 12)
    assert str(clone) == "too_deep: deep" and isinstance(clone, ValueError)


# --- over a real socket -------------------------------------------------------------------


def serve(router: zmq.Socket, stop: threading.Event) -> None:
    """A ROUTER loop that answers every frame: an ok reply or the error it raised."""
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    try:
        while not stop.is_set():
            if not poller.poll(20):
                continue
            identity, frame = router.recv_multipart()
            try:
                asked = decode(frame)
                reply = ok_reply(asked, SAMPLE_REPLIES[asked.type])
            except ProtocolError as exc:
                reply = error_reply(exc.request_id, exc)
            router.send_multipart([identity, encode(reply)])
    finally:
        router.close(linger=0)


@pytest.mark.timeout(60)
def test_router_answers_every_bad_frame_and_keeps_serving():
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    server = threading.Thread(target=serve, args=(router, stop), daemon=True)
    server.start()
    dealer = context.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.rcvtimeo = 10_000
    dealer.connect(f"tcp://127.0.0.1:{port}")
    bad = [
        (b"", 0, BAD_FRAME),
        (b"\xc1garbage", 0, BAD_FRAME),
        (GOOD_FRAME[:-3], 99, BAD_FRAME),  # cut after its id: the error answers request 99
        (b"\x91" * 10_000 + b"\xc0", 0, TOO_DEEP),
        (header("array32", DEFAULT_LIMITS.max_list_len) * 1000, 0, BAD_FRAME),
        (b"\x00" * (DEFAULT_LIMITS.max_frame_bytes + 1), 0, TOO_LARGE),
        (raw_frame(MATCH, {}, v=1), 0, BAD_VERSION),
        (raw_frame("teleport", {}, request_id=11), 11, UNKNOWN_TYPE),
        (frame_with(MATCH, False, "tokens", b"\x00" * 5, request_id=12), 12, BAD_FIELD),
        (frame_with("heartbeat", False, "epoch", True, request_id=13), 13, BAD_FIELD),
        (frame_with("heartbeat", False, "load", math.nan, request_id=14), 14, BAD_FIELD),
        (raw_frame(MATCH, {"namespace": nested(50)}, request_id=15), 15, TOO_DEEP),
        (raw_frame(MATCH, {**wire_body(MATCH, SAMPLE_REQUESTS[MATCH]), 3: 1}), 1, BAD_FRAME),
        (raw_frame(MATCH, msgpack.ExtType(1, b"x"), request_id=16), 16, BAD_FRAME),
        (raw_frame(MATCH, {"tokens": "x" * 5000}, request_id=17), 17, TOO_LARGE),
    ]
    try:
        for frame, _, _ in bad:
            dealer.send(frame)
        replies = [decode(dealer.recv(), "reply") for _ in bad]
        assert [(reply.type, reply.request_id, reply.body.code) for reply in replies] == [
            (ERROR, request_id, code) for _, request_id, code in bad
        ]
        assert all(type(reply.body) is ErrorReply and reply.body.message for reply in replies)
        dealer.send(GOOD_FRAME)
        reply = decode(dealer.recv(), "reply")
        assert_same_message(reply, Message(OK, 99, SAMPLE_REPLIES[MATCH], MATCH))
    finally:
        stop.set()
        server.join(timeout=10)
        dealer.close(linger=0)
        context.term()
    assert not server.is_alive()
