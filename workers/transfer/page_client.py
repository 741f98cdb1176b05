"""The page client: reads pages from one remote page server straight into our own pages.

Pages in host memory receive their frames directly (the only copy is the kernel's). A
store whose pages are not in shared memory (a device store) has the frames land in a host
staging buffer of the client's (pinned on a CUDA machine), and the valid ones go to the
device in one bulk copy once the trailer says which are valid.

See `workers.transfer` for the design and `workers.transfer.page_wire` for the wire.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from workers.store.digests import DIGEST_BYTES, EMPTY_DIGEST
from workers.store.page_store import SharedPageStore
from workers.store.staging import reused_rows, row_bytes
from workers.transfer.page_wire import (
    MAX_PAGES_PER_REQUEST,
    MAX_REQUEST_PAGE_BYTES,
    PAGE_MAGIC,
    PAGE_PREFIX,
    TRANSFER_VERSION,
    PeerGone,
    Refused,
    ReplyTimeout,
    TransferAuth,
    TransferError,
    check_auth,
    check_lengths,
    decode_reply,
    encode_request,
)

log = logging.getLogger(__name__)


class PageClient:
    """Reads pages from one remote `PageServer` straight into our own pages.

    A timeout, a garbled reply or a peer that is gone makes every page of that request
    invalid (a miss); the socket is then replaced so nothing stale lingers. Replies are
    matched by request id: messages left from an earlier request are skipped. A broken
    connection ends the wait at once (a monitor on the socket reports it), so a holder
    that dies in the middle of a reply costs its copiers a miss, not `timeout_s`.

    Args:
        address: the page server's address.
        timeout_s: how long one request (of at most MAX_REQUEST_PAGE_BYTES) may take.
        auth: our credentials; None talks to servers without authentication.
        server_key: the page server's public key (its worker's), for CURVE.

    Raises:
        ValueError: `auth` is malformed, or encrypts without a `server_key`.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float = 5.0,
        auth: TransferAuth | None = None,
        server_key: bytes | None = None,
    ):
        if auth is not None:
            check_auth(auth)
            if auth.encrypt and server_key is None:
                raise ValueError("an encrypting page client needs the server's public key")
        self.address = address
        self.timeout_s = timeout_s
        self.auth = auth
        self.server_key = server_key
        self.stale = 0  # messages of earlier requests skipped
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None  # the socket's connection events
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._landing: torch.Tensor | None = None  # host staging for a device store, kept

    def fetch(
        self,
        page_ids: Sequence[int],
        generations: Sequence[int],
        dst: SharedPageStore,
        dst_pages: Sequence[int],
        digests: Sequence[bytes] | None = None,
    ) -> list[bool]:
        """Copy remote pages into `dst_pages` of our store; one validity bool per page.

        Args:
            digests: optional, one expected digest per page: a page is valid only if its
                holder recorded exactly this digest for it.

        Raises:
            ValueError: the lists differ in length, or a digest is not 16 bytes (nothing
                else raises: a failed fetch is a miss).
        """
        check_lengths(page_ids, generations, dst_pages, digests)
        n = len(page_ids)
        page_bytes = dst.layout.page_bytes
        step = max(1, min(MAX_PAGES_PER_REQUEST, MAX_REQUEST_PAGE_BYTES // page_bytes))
        valid: list[bool] = []
        with self._lock:
            for start in range(0, n, step):
                stop = min(n, start + step)
                try:
                    valid += self._fetch(
                        page_ids[start:stop],
                        generations[start:stop],
                        dst,
                        dst_pages[start:stop],
                        None if digests is None else digests[start:stop],
                    )
                    continue
                except Refused as exc:
                    log.warning("page fetch from %s refused: %s", self.address, exc)
                except (zmq.ZMQError, TransferError, ValueError, KeyError, TypeError) as exc:
                    log.warning("page fetch from %s failed: %s", self.address, exc)
                    self._reset()
                # The next request would likely wait or fail as long: the rest are misses.
                valid += [False] * (n - start)
                break
        return valid

    def _fetch(self, page_ids, generations, dst, dst_pages, digests) -> list[bool]:
        socket = self._connect()
        self._drain_events()  # a connection that broke between requests has been redialled
        request_id = self._send_request(socket, page_ids, generations)
        deadline = time.monotonic() + self.timeout_s
        n, page_bytes = len(page_ids), dst.layout.page_bytes
        header = self._recv_reply(socket, request_id, deadline)
        if not isinstance(header, dict):
            raise TransferError(f"page {header} before the header")
        if "error" in header:
            raise Refused(f"server refused: {header['error']}")
        if header["n"] != n:
            raise TransferError(f"reply of {header['n']} pages for {n}")
        if header["page_bytes"] != page_bytes:
            raise TransferError(f"peer pages are {header['page_bytes']} bytes, ours {page_bytes}")
        arrived = np.zeros(n, dtype=bool)
        landing = None
        if not dst.pages_in_segment:
            landing = self._landing = reused_rows(self._landing, dst, n)
        for i, page in enumerate(dst_pages):
            index = self._recv_reply(socket, request_id, deadline)
            if isinstance(index, dict):
                raise Refused(f"server gave up: {index.get('error')}")
            if index != i:
                raise TransferError(f"page {index} where page {i} was due")
            # Straight into our page (the only copy is the kernel's), or its landing row.
            target = dst.page_buffer(page) if landing is None else row_bytes(landing, i)
            size = socket.recv_into(target, flags=zmq.NOBLOCK)
            if size not in (0, page_bytes) or socket.rcvmore:
                raise TransferError(f"a page frame of {size} bytes, expected {page_bytes}")
            arrived[i] = size == page_bytes  # empty: not sent, its generation had moved
        trailer = self._recv_reply(socket, request_id, deadline)
        if not isinstance(trailer, dict):
            raise TransferError("a page after the last one")
        if "error" in trailer:
            raise Refused(f"server gave up: {trailer['error']}")
        valid = self._verdict(trailer, arrived, digests)
        if landing is not None and any(valid):
            keep = [i for i, ok in enumerate(valid) if ok]
            dst.write_pages([dst_pages[i] for i in keep], landing[torch.tensor(keep)])
        return valid

    @staticmethod
    def _verdict(trailer: dict, arrived: np.ndarray, digests) -> list[bool]:
        n = len(arrived)
        valid, held = trailer["valid"], trailer.get("digests", b"")
        if not isinstance(valid, bytes) or len(valid) != n:
            raise TransferError("trailer does not match the request")
        ok = arrived & (np.frombuffer(valid, np.uint8) != 0)
        if digests is not None:
            if not isinstance(held, bytes) or len(held) != n * DIGEST_BYTES:
                raise TransferError(f"trailer digests of {len(held)} bytes for {n} pages")
            for i, wanted in enumerate(digests):
                digest = held[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]
                # EMPTY: nothing published, or nothing the server could vouch for.
                ok[i] &= digest != EMPTY_DIGEST and digest == bytes(wanted)
        return ok.tolist()

    def _send_request(self, socket: zmq.Socket, page_ids, generations) -> int:
        """Send one request as `fetch` does (signed when auth says so); its id."""
        request_id = next(self._ids)
        secret = None
        if self.auth is not None and not self.auth.encrypt:
            secret = self.auth.secret  # signed; CURVE authenticates the connection instead
        frame = encode_request(request_id, page_ids, generations, secret)
        try:
            socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            raise ReplyTimeout(f"cannot queue a request to {self.address}") from None
        return request_id

    def _recv_reply(self, socket: zmq.Socket, request_id: int, deadline: float) -> dict | int:
        """The next message of this request: a header or trailer map, or a page's index
        (its bytes are then the next frame). Messages of other requests are skipped."""
        while True:
            first = self._recv_frame(socket, deadline)
            if socket.rcvmore:  # a page message: prefix, then the page bytes
                if len(first) != PAGE_PREFIX.size or first[:2] != PAGE_MAGIC:
                    self._discard_rest(socket)
                    raise TransferError("a malformed page message")
                _, version, reply_id, index = PAGE_PREFIX.unpack(first)
                if version == TRANSFER_VERSION and reply_id == request_id:
                    return index
                self._discard_rest(socket)
            else:
                msg = decode_reply(first)
                if msg["id"] == request_id or (msg["id"] == 0 and "error" in msg):
                    return msg
            self.stale += 1
            if time.monotonic() > deadline:
                raise ReplyTimeout(f"no reply within {self.timeout_s}s")

    def _recv_frame(self, socket: zmq.Socket, deadline: float) -> bytes:
        """The next frame; what already arrived is read before a broken connection counts.

        Raises:
            ReplyTimeout: nothing by the deadline.
            PeerGone: the connection broke while the reply was due.
        """
        poller = None
        while True:
            try:
                return socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                pass
            if poller is None:  # only when the reply is not there yet
                poller = zmq.Poller()
                poller.register(socket, zmq.POLLIN)
                poller.register(self._monitor, zmq.POLLIN)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ReplyTimeout(f"no reply within {self.timeout_s}s")
            ready = dict(poller.poll(max(1, int(remaining * 1000))))
            if socket not in ready and self._monitor in ready and self._drain_events():
                raise PeerGone(f"the connection to {self.address} broke during a reply")

    def _drain_events(self) -> bool:
        """Read the monitor's pending events; whether one says the connection broke."""
        broke = False
        while True:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return broke
            broke |= event["event"] == zmq.EVENT_DISCONNECTED

    @staticmethod
    def _discard_rest(socket: zmq.Socket) -> None:
        while socket.rcvmore:
            socket.recv_into(bytearray(), flags=zmq.NOBLOCK)

    def _connect(self) -> zmq.Socket:
        """The socket to the server, connected on first use."""
        if self._socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.linger = 0
            if self.auth is not None and self.auth.encrypt:
                socket.curve_secretkey = self.auth.keypair.secret
                socket.curve_publickey = self.auth.keypair.public
                socket.curve_serverkey = self.server_key
            # Before connect, so that no event of this connection is missed.
            self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            socket.connect(self.address)
            self._socket = socket
        return self._socket

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._socket.close(linger=0)
            self._socket = self._monitor = None

    def close(self) -> None:
        with self._lock:
            self._reset()
