"""The message table: every request type once, with its typed body and its ok reply's.

Each body is a NamedTuple of `cache_service.messages`; the table says how each of its
fields travels (a `Field`: its check on decode, its wire form on encode, its depth).
`body()` checks at import that a table entry names exactly the fields of its type, in
order, so a field added to a message and forgotten here fails at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from cache_service import messages as m
from cache_service.protocol import fields as f
from cache_service.protocol.errors import SCHEMA_DEPTH, SCHEMA_MAP_KEYS
from cache_service.protocol.event_wire import check_chains, check_events, events_wire
from cache_service.protocol.packed import packed_checker, packed_wire
from cache_service.protocol.peer_wire import check_peers, peers_wire
from cache_service.protocol.report_wire import check_report, report_wire
from cache_service.protocol.spans import check_spans, spans_wire

# 2: the events reply carries last_seq. 3: the service issues epochs (Registered); page ids
# and generations of events travel packed; ReportDead, NameTenant. 4: heartbeats carry the
# worker's report (its figures, for the service's metrics). 5: REGISTER carries what peers
# need (shared-memory store name, page server key); GetPeer and GetPeers read it back.
# 6: reports carry the worker's load and measured costs; ROUTE carries the prompt's
# tokens pending on each worker (routing estimates each worker's time to first token).
# 7: ROUTE names the routing policy. 8: reports carry the worker's health. 9: REGISTER
# carries the worker's capacity (pages its store holds); spot checks and quarantine
# (ReportHolder, GetQuarantine; the heartbeat's reply carries the quarantine's version).
# 10: pages have tiers: stored and removed events may carry theirs, demotions ("d"), and
# match spans carry each page's tier where a span mixes tiers. 12: the heartbeat's reply
# names the worker's pages that another worker has stored since (cluster-aware eviction).
PROTOCOL_VERSION = 12

# Request types, then the two reply types.
REGISTER = "register"
HEARTBEAT = "heartbeat"
EVENTS = "events"
RESYNC = "resync"
MATCH = "match"
ROUTE = "route"
STATS = "stats"
BYE = "bye"
REPORT_DEAD = "report_dead"
NAME_TENANT = "name_tenant"
PEER = "peer"
PEERS = "peers"
REPORT_HOLDER = "report_holder"
QUARANTINE = "quarantine"
OK = "ok"
ERROR = "error"

ENVELOPE_KEYS = frozenset(("v", "t", "id", "b"))
OK_ENVELOPE_KEYS = frozenset(("v", "t", "id", "r", "b"))


class Field(NamedTuple):
    """How one body field travels.

    Attributes:
        kind: a short name of what the field holds, used in error messages and tests.
        check: wire value (as msgpack decoded it) -> body value; raises ProtocolError.
        wire: body value -> wire value for msgpack (None: sent as is).
        depth: container levels the wire value occupies (0 for a scalar or bytes);
            None for free-form values, bounded by Limits.max_depth only.
    """

    kind: str
    check: f.Checker
    wire: Callable[[Any], Any] | None = None
    depth: int | None = 0


class Body(NamedTuple):
    """One message body: its type, its fields in order, and how decode checks them."""

    type: type
    fields: Mapping[str, Field]
    path: str  # how errors name it: "match", "match.reply", "error"
    checks: tuple[tuple[str, f.Checker, str], ...]  # (name, check, path of the field)
    wires: tuple[tuple[str, Callable[[Any], Any] | None], ...]  # (name, wire) in order
    depth: int | None  # levels below the envelope (the body map is 1); None: free-form


def body(cls: type, path: str, **fields: Field) -> Body:
    """The Body of `cls`, whose fields travel as given (in the type's field order)."""
    assert tuple(fields) == cls._fields, f"{path}: table fields {tuple(fields)} != {cls._fields}"
    depths = [field.depth for field in fields.values()]
    depth = None if None in depths else 1 + max(depths, default=0)
    return Body(
        cls,
        fields,
        path,
        tuple((name, field.check, f"{path}.{name}") for name, field in fields.items()),
        tuple((name, field.wire) for name, field in fields.items()),
        depth,
    )


class MessageSchema(NamedTuple):
    """A request type's body and its ok reply's body."""

    request: Body
    reply: Body


COUNT = Field("count", f.check_count)
ID = Field("id", f.check_id)
OPTIONAL_ID = Field("optional id", f.optional(f.check_id))
ADDRESS = Field("address", f.check_address)
TEXT = Field("text", f.check_text)
FLAG = Field("flag", f.check_flag)
LOAD = Field("load", f.check_load, f.as_float)
SCORE = Field("score", f.check_score, f.as_float)
TOKENS = Field("tokens", f.check_tokens, f.tokens_wire)
NAMESPACE = Field("namespace", f.check_namespace, None, 1)
LOADS = Field("loads", f.check_loads, f.loads_wire, 1)
EVENT_LIST = Field("events", check_events, events_wire, 3)  # events / event / namespace
CHAIN_LIST = Field("chains", check_chains, events_wire, 3)
SPANS = Field("spans", check_spans, spans_wire, 2)  # spans / span
STATS_MAP = Field("stats", f.check_stats, None, None)
# report / tiers / a tier / its load histogram / the histogram's counts
REPORT = Field("report", check_report, report_wire, 5)
SHM_NAME = Field("shm name", f.check_shm_name)
PAGE_KEY = Field("page key", f.check_page_key, f.page_key_wire)
AFTER = Field("after", f.check_after)
PEER_LIST = Field("peers", check_peers, peers_wire, 2)  # peers / an entry
DIGESTS = Field("digests", f.check_digests)
IDS = Field("ids", f.check_ids, list, 1)
# Page ids and generations packed as little-endian int32 and int64 bytes (`packed`).
PAGE_IDS = Field("page ids", packed_checker("i"), packed_wire("i"))
GENERATIONS = Field("generations", packed_checker("q"), packed_wire("q"))


def _ack(kind: str) -> Body:
    return body(m.Ack, f"{kind}.reply")


MESSAGES: dict[str, MessageSchema] = {
    REGISTER: MessageSchema(
        body(
            m.Register,
            REGISTER,
            worker_id=ID,
            node_id=ID,
            tier=ID,
            address=ADDRESS,
            shm_name=SHM_NAME,
            page_key=PAGE_KEY,
            capacity=COUNT,
        ),
        body(m.Registered, f"{REGISTER}.reply", service_epoch=COUNT, epoch=COUNT),
    ),
    HEARTBEAT: MessageSchema(
        body(m.Heartbeat, HEARTBEAT, worker_id=ID, epoch=COUNT, load=LOAD, report=REPORT),
        body(
            m.EpochReply,
            f"{HEARTBEAT}.reply",
            service_epoch=COUNT,
            quarantine=COUNT,
            elsewhere_pages=PAGE_IDS,
            elsewhere_generations=GENERATIONS,
        ),
    ),
    EVENTS: MessageSchema(
        body(m.PublishEvents, EVENTS, worker_id=ID, epoch=COUNT, seq=COUNT, events=EVENT_LIST),
        body(
            m.ApplyResult,
            f"{EVENTS}.reply",
            applied=FLAG,
            needs_resync=FLAG,
            reason=TEXT,
            last_seq=COUNT,
        ),
    ),
    RESYNC: MessageSchema(
        body(m.Resync, RESYNC, worker_id=ID, epoch=COUNT, seq=COUNT, chains=CHAIN_LIST),
        body(m.ResyncReply, f"{RESYNC}.reply", pages=COUNT),
    ),
    MATCH: MessageSchema(
        body(m.Match, MATCH, namespace=NAMESPACE, tokens=TOKENS, requester=OPTIONAL_ID),
        body(m.MatchResult, f"{MATCH}.reply", matched_tokens=COUNT, spans=SPANS),
    ),
    ROUTE: MessageSchema(
        body(
            m.Route,
            ROUTE,
            namespace=NAMESPACE,
            tokens=TOKENS,
            loads=LOADS,
            pending=LOADS,
            policy=ID,
            door=OPTIONAL_ID,
        ),
        body(
            m.RouteDecision,
            f"{ROUTE}.reply",
            worker_id=OPTIONAL_ID,
            matched_tokens=COUNT,
            score=SCORE,
            reason=TEXT,
        ),
    ),
    STATS: MessageSchema(
        body(m.GetStats, STATS), body(m.StatsReply, f"{STATS}.reply", stats=STATS_MAP)
    ),
    BYE: MessageSchema(body(m.Bye, BYE, worker_id=ID, epoch=COUNT), _ack(BYE)),
    REPORT_DEAD: MessageSchema(body(m.ReportDead, REPORT_DEAD, worker_id=ID), _ack(REPORT_DEAD)),
    NAME_TENANT: MessageSchema(
        body(m.NameTenant, NAME_TENANT, salt=ID, name=ID), _ack(NAME_TENANT)
    ),
    PEER: MessageSchema(
        body(m.GetPeer, PEER, worker_id=ID),
        body(
            m.PeerEntry,
            f"{PEER}.reply",
            worker_id=ID,
            epoch=COUNT,
            node_id=ID,
            tier=ID,
            address=ADDRESS,
            shm_name=SHM_NAME,
            page_key=PAGE_KEY,
        ),
    ),
    PEERS: MessageSchema(
        body(m.GetPeers, PEERS, after=AFTER),
        body(m.PeerList, f"{PEERS}.reply", peers=PEER_LIST, more=FLAG),
    ),
    REPORT_HOLDER: MessageSchema(
        body(
            m.ReportHolder,
            REPORT_HOLDER,
            worker_id=ID,
            epoch=COUNT,
            holder=ID,
            digests=DIGESTS,
            evidence=TEXT,
        ),
        _ack(REPORT_HOLDER),
    ),
    QUARANTINE: MessageSchema(
        body(m.GetQuarantine, QUARANTINE),
        body(m.QuarantineList, f"{QUARANTINE}.reply", holders=IDS, digests=DIGESTS, version=COUNT),
    ),
}
ERROR_BODY = body(m.ErrorReply, ERROR, code=ID, message=TEXT)
REQUEST_TYPES = tuple(MESSAGES)
REPLY_TYPES = (OK, ERROR)
# A request's type name from its body's class: each request class is one message type.
KIND_OF: dict[type, str] = {schema.request.type: kind for kind, schema in MESSAGES.items()}
assert len(KIND_OF) == len(MESSAGES), "two message types share a request class"

_BODIES = [
    *(schema.request for schema in MESSAGES.values()),
    *(schema.reply for schema in MESSAGES.values()),
    ERROR_BODY,
]
# Limits are validated against these (errors.py holds them as numbers, to stay below the
# table); a schema that outgrows them must raise them there.
assert 1 + max(b.depth for b in _BODIES if b.depth is not None) == SCHEMA_DEPTH
assert max(len(OK_ENVELOPE_KEYS), *(len(b.fields) for b in _BODIES)) == SCHEMA_MAP_KEYS
