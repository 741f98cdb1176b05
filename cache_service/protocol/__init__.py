"""The one wire codec between workers and the service (msgpack over ZMQ, no pickle).

Every frame is one msgpack map, the envelope, whose body is one of the typed messages of
`cache_service.messages` (see `codec`). The package, by role:

- `errors`: ProtocolError, its codes, and the Limits every frame is held to;
- `frames`: frame safety, the defences against frames that would make the decoder
  allocate or recurse far beyond their size;
- `fields`, `spans`, `event_wire`, `peer_wire`: field checks (exact types, ranges,
  lengths) and the wire forms of tokens, match spans, KV events and peer entries;
- `curve_keys`: CurveZMQ public keys, 32 raw bytes on the wire and z85 in bodies;
- `table`: the message table, each request type once with its body and reply types;
- `codec`: `encode` / `decode`, the only way frames are made and read.

Any violation raises `ProtocolError(code, message)`; the server answers it with
`error_reply(exc.request_id, exc)` and keeps serving. A server socket should also set
`zmq.MAXMSGSIZE` to about `max_frame_bytes` so ZMQ drops oversized messages before they
are buffered at all.

Token ids travel packed (`cache_service.tokens`); a decoded body keeps them as bytes,
since the index compares pages as bytes and the hot path never unpacks them.
"""

from cache_service.protocol.codec import (
    Message,
    decode,
    encode,
    error_reply,
    ok_reply,
    request,
)
from cache_service.protocol.errors import (
    BAD_FIELD,
    BAD_FRAME,
    BAD_VERSION,
    DEFAULT_LIMITS,
    ERROR_CODES,
    INTERNAL,
    TOO_DEEP,
    TOO_LARGE,
    UNKNOWN_TYPE,
    Limits,
    ProtocolError,
)
from cache_service.protocol.event_wire import (
    CLEARED_TAG,
    DEMOTED_TAG,
    REMOVED_TAG,
    STORED_TAG,
    check_stored,
    decode_event,
    encode_event,
    packed_tokens,
    stored_pages,
)
from cache_service.protocol.table import (
    BYE,
    ERROR,
    ERROR_BODY,
    EVENTS,
    HEARTBEAT,
    KIND_OF,
    MATCH,
    MESSAGES,
    NAME_TENANT,
    OK,
    PEER,
    PEERS,
    PROTOCOL_VERSION,
    REGISTER,
    REPLY_TYPES,
    REPORT_DEAD,
    REQUEST_TYPES,
    RESYNC,
    ROUTE,
    STATS,
    Body,
    Field,
    MessageSchema,
)

__all__ = [
    "BAD_FIELD",
    "BAD_FRAME",
    "BAD_VERSION",
    "BYE",
    "CLEARED_TAG",
    "DEFAULT_LIMITS",
    "DEMOTED_TAG",
    "ERROR",
    "ERROR_BODY",
    "ERROR_CODES",
    "EVENTS",
    "HEARTBEAT",
    "INTERNAL",
    "KIND_OF",
    "MATCH",
    "MESSAGES",
    "NAME_TENANT",
    "OK",
    "PEER",
    "PEERS",
    "PROTOCOL_VERSION",
    "REGISTER",
    "REPORT_DEAD",
    "REMOVED_TAG",
    "REPLY_TYPES",
    "REQUEST_TYPES",
    "RESYNC",
    "ROUTE",
    "STATS",
    "STORED_TAG",
    "TOO_DEEP",
    "TOO_LARGE",
    "UNKNOWN_TYPE",
    "Body",
    "Field",
    "Limits",
    "Message",
    "MessageSchema",
    "ProtocolError",
    "check_stored",
    "decode",
    "decode_event",
    "encode",
    "encode_event",
    "error_reply",
    "ok_reply",
    "packed_tokens",
    "request",
    "stored_pages",
]
