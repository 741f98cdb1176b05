"""Moving pages between workers: same node through shared memory, across nodes over ZMQ.

Every copy is validated against the generation the holder advertised with the page, and,
when the requester passes them, against the digests it expects (what the holder recorded
the page holds): a page that was freed, reused or rewritten while it was copied, or that
holds something else, is reported invalid and the requester recomputes it. Nothing here
ever raises on a vanished page or a silent peer: those are misses.

Same node: `copy_from_peer` attaches the holder's page store by name and copies each run
of destination pages with one validated copy (generation, memcpy, generation, digest).

Across nodes: the holder runs a `PageServer` (a ROUTER thread, `page_server`) and
the requester a `PageClient` (a DEALER, `page_client`). Per request (the wire is
drawn in `page_wire`): a signed or CURVE-borne request, a header, one ZMQ message
per page, and a trailer with the verdict and the recorded digests.

Pages leave straight from the holder's shared memory as zero-copy frames and land with
`recv_into` straight in the requester's pages: the only copies are the kernel's. A page
whose generation already differs from the one asked for is not sent at all (an empty
frame holds its place). Because the bytes are read from shared memory while they are
sent, the holder reads the digests and then each page's generation again once ZMQ has
released the buffers, and reports the verdict in the trailer; the requester trusts a page
only if the trailer says so and its digest is the one it expects.

Who may read (`TransferAuth`, off when None):

- encrypt=True: CurveZMQ. The page server is a CURVE server with its worker's key pair
  and a ZAP handler of its own (a private ZMQ context, so several page servers and the
  service in one process never compete for the ZAP endpoint) that admits only the public
  keys of the mesh's workers. A stranger never completes the handshake: no request of
  its is ever read.
- encrypt=False: no encryption, but every request is signed with HMAC-SHA256 under the
  mesh secret over its id, pages, generations, a timestamp and a nonce; the server
  refuses an unsigned, badly signed, stale or replayed request with an error header
  before it reads a single page. Page bytes then travel authenticated, in the clear.

How one client cannot stall or kill the server. The old server answered one request at a
time, to completion, with blocking sends; a reader that stopped reading blocked it (and
so every other requester) until a 30 s tracker wait timed out and killed the thread. Now:

- Each page is its own ZMQ message, so the per-peer send queue (SNDHWM, sized to
  PEER_QUEUE_BYTES of pages) bounds what is queued for a peer, and a send can be refused
  without tearing a message. Sends use ROUTER_MANDATORY + NOBLOCK: a full peer raises
  zmq.Again instead of blocking, a vanished one EHOSTUNREACH.
- The loop serves every admitted request interleaved: each turn it sends each request a
  burst of pages; a request whose peer's queue is full is parked and retried with an
  exponential backoff (20 us to 5 ms), so a healthy reader is refilled quickly and a
  stalled one costs almost nothing. A request still unfinished after `request_timeout_s`
  is dropped and counted; other peers' requests never wait on it.
- Requests are bounded: pages (MAX_PAGES_PER_REQUEST) and bytes (MAX_REQUEST_PAGE_BYTES)
  per request (the client splits bigger fetches), in-flight requests per peer
  (MAX_REQUESTS_PER_PEER) and in all (MAX_ACTIVE_REQUESTS); more is refused with an
  error header.
- The zero-copy tracker of a request's last page is polled (`tracker.done`), never
  waited on; the trailer is built only once it is done.
- Anything that goes wrong while serving one request is logged and counted, and only
  that request is lost. Should the thread die anyway (an asynchronous exception),
  `ensure_running` (called from the worker's heartbeat) rebinds the same address and
  starts a new one; `health` reports it.
"""

from workers.transfer.page_client import PageClient
from workers.transfer.page_server import PageServer
from workers.transfer.page_wire import (
    ENCRYPT_PAGES_DEFAULT,
    MAX_PAGES_PER_REQUEST,
    TRANSFER_VERSION,
    PageRequest,
    ReplayGuard,
    TransferAuth,
    TransferError,
    check_signature,
    decode_request,
    encode_request,
)
from workers.transfer.raw_pipe import RawZmqPipe
from workers.transfer.shm_copy import contiguous_runs, copy_from_peer

__all__ = [
    "ENCRYPT_PAGES_DEFAULT",
    "MAX_PAGES_PER_REQUEST",
    "TRANSFER_VERSION",
    "PageClient",
    "PageRequest",
    "PageServer",
    "RawZmqPipe",
    "ReplayGuard",
    "TransferAuth",
    "TransferError",
    "check_signature",
    "contiguous_runs",
    "copy_from_peer",
    "decode_request",
    "encode_request",
]
