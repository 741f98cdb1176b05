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
  per request (the client splits bigger fetches), in-flight requests per connection
  (MAX_REQUESTS_PER_PEER), per key over all its connections (MAX_REQUESTS_PER_KEY: the
  CurveZMQ key ZAP admitted; without CURVE the connection) and in all
  (MAX_ACTIVE_REQUESTS); more is refused with an error header. One key opening many
  connections holds its share, never every slot; the replay guard of signed requests
  keeps a window per key too (`ReplayGuard`), so one key's flood moves only its own floor.
- The zero-copy tracker of a request's last page is polled (`tracker.done`), never
  waited on; the trailer is built only once it is done.
- Anything that goes wrong while serving one request is logged and counted, and only
  that request is lost. Should the thread die anyway (an asynchronous exception),
  `ensure_running` (called from the worker's heartbeat) rebinds the same address and
  starts a new one; `health` reports it.

The names below load on first use (the page client and the same-node copy need torch; the
wire's constants and the costs do not), so a process that only reads a config never loads
torch through this package.
"""

from __future__ import annotations

from workers.lazy import lazy_exports

_HOMES = {
    "ENCRYPT_PAGES_DEFAULT": ".page_wire",
    "MAX_PAGES_PER_REQUEST": ".page_wire",
    "TRANSFER_VERSION": ".page_wire",
    "PageClient": ".page_client",
    "PageRequest": ".page_wire",
    "PageServer": ".page_server",
    "RawZmqPipe": ".raw_pipe",
    "ReplayGuard": ".page_wire",
    "TransferAuth": ".page_wire",
    "TransferError": ".page_wire",
    "check_signature": ".page_wire",
    "contiguous_runs": ".shm_copy",
    "copy_from_peer": ".shm_copy",
    "decode_request": ".page_wire",
    "encode_request": ".page_wire",
}

__all__ = sorted(_HOMES)


__getattr__ = lazy_exports(__name__, _HOMES)
