"""Moving pages between workers: same node through shared memory, across nodes over ZMQ.

Every copy is validated against the generation the holder advertised with the page, and,
when the requester passes them, against the digests it expects (what the holder recorded
the page holds): a page that was freed, reused or rewritten while it was copied, or that
holds something else, is reported invalid and the requester recomputes it. Nothing here
ever raises on a vanished page or a silent peer: those are misses.

Same node: `copy_from_peer` attaches the holder's page store by name and copies each run
of destination pages with one validated copy (generation, memcpy, generation, digest).

Across nodes: the holder runs a `PageServer` (a ROUTER thread, `workers.page_server`) and
the requester a `PageClient` (a DEALER, `workers.page_client`). Per request (the wire is
drawn in `workers.page_wire`): a signed or CURVE-borne request, a header, one ZMQ message
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

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import zmq

from cache_service.auth import KeyPair
from workers.page_client import PageClient
from workers.page_server import PageServer
from workers.page_store import SharedPageStore
from workers.page_wire import (
    MAX_PAGES_PER_REQUEST,
    TRANSFER_VERSION,
    PageRequest,
    ReplayGuard,
    TransferAuth,
    TransferError,
    check_lengths,
    check_signature,
    decode_request,
    encode_request,
)

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

# Whether page bytes are encrypted (CURVE) or only signed, when the mesh has keys. The
# later `security.encrypt_pages` setting defaults to this.
#
# `kvmesh bench copy` (256 MiB of 720 KiB SmolLM2 pages over loopback, four runs on a
# shared, busy 2-core machine, so noisy): in the clear the page server moves 1.6-2.7 GB/s
# (0.94-1.21x the raw ZMQ pipe), signed 2.2-2.9 GB/s (signing costs nothing measurable:
# one HMAC over a few KiB of ids per request), with CURVE 0.74-0.85 GB/s (1.0-1.6x raw
# CURVE ZMQ): encryption keeps 0.28-0.5 of the throughput (`curve_cost`); libsodium's
# XSalsa20-Poly1305 on the sending and receiving I/O threads is the limit, not the page
# server. Encrypted, a page still arrives in about 1 ms, against a prefill of its 16
# tokens (SmolLM2-135M: ~4 GFLOP, several ms on a multi-core CPU) to recompute it, and
# across nodes a 10 Gbit/s network (~1.2 GB/s) narrows the gap further. KV pages are the
# prompts of every tenant, readable by anyone on the path in the clear, and DESIGN.md
# promises CurveZMQ on page servers by default. So: encrypted by default; a mesh whose
# nodes share a trusted network may switch it off for 2-3.5x the copy rate and keep every
# request signed.
ENCRYPT_PAGES_DEFAULT = True


def contiguous_runs(pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split a page list into runs of consecutive ids: (offset in list, first page, length)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1:
            runs.append((start, pages[start], i - start))
            start = i
    return runs


def copy_from_peer(
    peer: SharedPageStore,
    page_ids: Sequence[int],
    generations: Sequence[int],
    dst: SharedPageStore,
    dst_pages: Sequence[int],
    digests: Sequence[bytes] | None = None,
) -> list[bool]:
    """Copy pages of a same-node peer's store into our own pages, validated.

    Args:
        digests: optional, one expected digest per page: a page is valid only if its
            holder recorded exactly this digest for it.

    Returns:
        One bool per page: False means the page changed, vanished or holds something
        else, and must be recomputed (its destination holds garbage).
    """
    check_lengths(page_ids, generations, dst_pages, digests)
    valid: list[bool] = []
    for offset, first, length in contiguous_runs(list(dst_pages)):
        out = dst.page_range(first, first + length)
        wanted = None if digests is None else list(digests[offset : offset + length])
        verdict = peer.copy_pages_validated(
            page_ids[offset : offset + length],
            generations[offset : offset + length],
            out,
            digests=wanted,
        )
        valid.extend(verdict.valid)
    return valid


class RawZmqPipe:
    """A bare ZMQ bulk transfer over loopback TCP: the baseline for the page server.

    The same frames as a page fetch, sent zero-copy out of one buffer and received with
    `recv_into` another; sockets and buffers are set up once, outside any timing. The
    sender has a context (an I/O thread) of its own, as a page server does.

    Args:
        curve: CurveZMQ on both ends (the sender is the CURVE server, as a page server
            is), to compare with an encrypting page server.
    """

    def __init__(self, nbytes: int, frame_bytes: int, curve: bool = False):
        self._context = zmq.Context()
        self._push = self._context.socket(zmq.PUSH)
        self._pull = zmq.Context.instance().socket(zmq.PULL)
        self._push.linger = self._pull.linger = 0
        if curve:
            server, client = KeyPair.generate(), KeyPair.generate()
            self._push.curve_secretkey, self._push.curve_publickey = server.secret, server.public
            self._push.curve_server = True  # no ZAP handler in this context: any client
            self._pull.curve_secretkey, self._pull.curve_publickey = client.secret, client.public
            self._pull.curve_serverkey = server.public
        port = self._push.bind_to_random_port("tcp://127.0.0.1")
        self._pull.connect(f"tcp://127.0.0.1:{port}")
        self.frames = max(1, nbytes // frame_bytes)
        self.frame_bytes = frame_bytes
        self._src = torch.ones(self.frames * frame_bytes, dtype=torch.uint8)
        self._dst = torch.zeros_like(self._src)

    def transfer(self) -> None:
        """Move every frame once, sender in a thread, receiver here."""
        src, dst, size = (
            memoryview(self._src.numpy()),
            memoryview(self._dst.numpy()),
            self.frame_bytes,
        )

        def send() -> None:
            for i in range(self.frames):
                more = zmq.SNDMORE if i + 1 < self.frames else 0
                self._push.send(src[i * size : (i + 1) * size], more, copy=False)

        thread = threading.Thread(target=send, name="kvmesh-rawpipe")
        thread.start()
        for i in range(self.frames):
            self._pull.recv_into(dst[i * size : (i + 1) * size])
        thread.join()

    def close(self) -> None:
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._context.term()
