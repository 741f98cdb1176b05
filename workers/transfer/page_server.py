"""The page server: serves reads of one worker's pages to workers on other nodes.

Its host pages leave straight from shared memory; with a tier of records below (`ServedDisk`:
the disk under host memory, or host memory under a device), page ids from that tier's id
base on name its records, each read and verified when its turn to be sent comes
(`workers.transfer.peer_disk`), and a record that does not verify is answered invalid,
never sent as valid. A store whose pages are not in shared memory (a device store) has
each page copied out to the host when its turn comes, between the generation reads that
validate every page.

A ROUTER thread that serves many requests interleaved, one burst of pages each per turn,
with bounded queues per peer, so a slow or stalled reader holds only its own request; it
survives every error and is restarted if it dies anyway. The design is in
`workers.transfer`; the wire in `workers.transfer.page_wire`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq

from cache_service import zap
from cache_service.addresses import check_bind_host
from workers.store.digests import EMPTY_DIGEST
from workers.store.page_store import SharedPageStore
from workers.transfer.page_wire import (
    MAX_ACTIVE_REQUESTS,
    MAX_PAGES_PER_REQUEST,
    MAX_REQUEST_BYTES,
    MAX_REQUEST_PAGE_BYTES,
    MAX_REQUESTS_PER_KEY,
    MAX_REQUESTS_PER_PEER,
    PAGE_MAGIC,
    PAGE_PREFIX,
    PEER_QUEUE_BYTES,
    TRANSFER_VERSION,
    ReplayGuard,
    TransferAuth,
    TransferError,
    check_auth,
    check_signature,
    decode_request,
    pack_map,
)
from workers.transfer.peer_disk import ServedDisk

log = logging.getLogger(__name__)

# The serving loop: pages sent to one request per turn before the next request's turn,
# the backoff of a parked request, and how long the loop sleeps with nothing to do.
_BURST_BYTES = 4 << 20
_MIN_BACKOFF_S = 20e-6
_MAX_BACKOFF_S = 5e-3
_IDLE_POLL_MS = 200


@dataclass(eq=False)
class _Serving:
    """One admitted request as the loop serves it: header, pages, then the trailer."""

    identity: bytes  # the connection (ROUTER routing id)
    key: bytes  # who asked: the CurveZMQ public key, else the connection
    request_id: int
    pages: np.ndarray  # (n,) int64 page ids
    expected: np.ndarray  # (n,) int64 generations asked for
    sendable: np.ndarray  # (n,) bool: generation matched when admitted: bytes are sent
    digests: list[bytes]  # (n,) recorded when admitted (disk pages: when read)
    deadline: float
    header: bytes | None  # still to send
    next_page: int = 0
    last_tracked: int = -1  # the last page sent with bytes (tracked); -1: none
    tracker: zmq.MessageTracker | None = None
    trailer: bytes | None = None
    sends: int = 0  # messages sent so far: progress, for the backoff
    retry_at: float = 0.0
    backoff: float = _MIN_BACKOFF_S
    staged: dict[int, np.ndarray] = field(default_factory=dict)  # device pages copied out


class PageServer:
    """Serves reads of one worker's pages to workers on other nodes (a daemon thread).

    Many requests are served interleaved, one burst of pages each per turn, so a slow or
    stalled reader holds only its own request (see the module docstring).

    Args:
        store: the worker's page store.
        host: where to listen: this node's address or loopback, never every interface.
        port: 0 picks a free one.
        auth: who may read, and whether pages are encrypted; None admits anyone.
        request_timeout_s: a request not finished by then is dropped.
        late_readers: with encryption, admits readers beyond `auth.peers` that joined the
            mesh after this server started (`cache_service.zap.LateKeys`); asked, on the
            ZAP handler's thread, only for keys not in `auth.peers`.
        disk: the worker's disk tier, whose records are served at ids from its id base.

    Raises:
        ValueError: `host` means every interface, or `auth` is malformed.
    """

    def __init__(
        self,
        store: SharedPageStore,
        host: str = "127.0.0.1",
        port: int = 0,
        auth: TransferAuth | None = None,
        request_timeout_s: float = 5.0,
        late_readers: Callable[[bytes], bool] | None = None,
        disk: ServedDisk | None = None,
    ):
        check_bind_host(host, "page server host")
        if auth is not None:
            check_auth(auth)
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be positive, got {request_timeout_s}")
        self.store = store
        self.disk = disk
        self._id_end = store.num_pages if disk is None else disk.id_end
        self.auth = auth
        self.request_timeout_s = request_timeout_s
        page_bytes = store.layout.page_bytes
        self._sndhwm = max(4, PEER_QUEUE_BYTES // page_bytes)
        self._burst = max(1, _BURST_BYTES // page_bytes)
        self._max_pages = max(1, min(MAX_PAGES_PER_REQUEST, MAX_REQUEST_PAGE_BYTES // page_bytes))
        self._signing = auth is not None and not auth.encrypt
        self._replay = ReplayGuard()
        # A context of our own: its ZAP handler is ours alone (one per context), and its
        # I/O thread moves only our pages.
        self._context = zmq.Context()
        self._zap_domain = ""
        self._host = host
        try:
            if auth is not None and auth.encrypt:
                self._zap_domain = zap.open_domain(auth.peers, self._context, late_readers)
            self._socket = self._bind(port)
        except BaseException:
            self._close_context()
            raise
        self.address = self._socket.last_endpoint.decode()
        self._port = int(self.address.rsplit(":", 1)[1])
        self.requests = 0
        self.pages_sent = 0
        self.errors = 0
        self.dropped = 0
        self.restarts = 0
        self._active: list[_Serving] = []
        self._death: BaseException | None = None
        self._lifecycle = threading.Lock()
        self._stop = threading.Event()
        self._thread = self._start_thread()

    # -- lifetime ----------------------------------------------------------------------

    def stop(self) -> None:
        """Stop serving, close the socket and the ZAP handler; idempotent."""
        with self._lifecycle:
            if self._stop.is_set():
                return
            self._stop.set()
            self._thread.join(5.0)
            if self._thread.is_alive():
                log.error("page server %s: serving thread did not stop", self.address)
                return  # its socket is still in use: leave the context to the process
            if not self._socket.closed:
                self._socket.close(linger=0)
            self._close_context()

    def _close_context(self) -> None:
        if self._zap_domain:
            zap.close_domain(self._zap_domain)
        self._context.term()

    def ensure_running(self) -> bool:
        """Restart the serving thread if it died; True when it did.

        The worker calls this from its heartbeat thread. A restart rebinds the same
        address (peers' DEALERs reconnect on their own); requests in flight are lost.
        """
        with self._lifecycle:
            if self._stop.is_set() or self._thread.is_alive():
                return False
            log.error(
                "page server thread died (%r); restarting it on %s", self._death, self.address
            )
            self._active = []
            if not self._socket.closed:  # it died before closing it
                self._socket.close(linger=0)
            try:
                self._socket = self._bind(self._port)
            except zmq.ZMQError as exc:  # the port was taken meanwhile: try again later
                log.error("page server %s: cannot bind again: %s", self.address, exc)
                return False
            self._thread = self._start_thread()
            self.restarts += 1
            return True

    def health(self) -> dict[str, Any]:
        """Counters for the worker's stats: alive, restarts, errors, dropped, requests..."""
        return {
            "alive": self._thread.is_alive(),
            "restarts": self.restarts,
            "errors": self.errors,
            "dropped": self.dropped,
            "requests": self.requests,
            "pages_sent": self.pages_sent,
            "active": len(self._active),
            "encrypt": self.auth is not None and self.auth.encrypt,
            "signed": self._signing,
        }

    def check_integrity(self) -> None:
        """Raise AssertionError unless what the server holds stays within its bounds.

        Reads the serving loop's state from another thread: a snapshot, good enough for
        bounds and counters (each request is checked on its own).
        """
        active = list(self._active)
        assert len(active) <= MAX_ACTIVE_REQUESTS, f"{len(active)} requests in flight"
        for serving in active:
            n = len(serving.pages)
            assert 0 < n <= self._max_pages, f"a request of {n} pages (most {self._max_pages})"
            assert len(serving.expected) == len(serving.sendable) == len(serving.digests) == n
            assert 0 <= serving.next_page <= n, f"page cursor {serving.next_page} of {n}"
        busiest = max(collections.Counter(s.identity for s in active).values(), default=0)
        assert busiest <= MAX_REQUESTS_PER_PEER, f"a connection has {busiest} requests in flight"
        busiest = max(collections.Counter(s.key for s in active).values(), default=0)
        assert busiest <= MAX_REQUESTS_PER_KEY, f"a key has {busiest} requests in flight"
        self._replay.check_integrity()
        counts = (self.requests, self.errors, self.dropped, self.pages_sent, self.restarts)
        assert min(counts) >= 0, f"a negative counter: {counts}"

    def _bind(self, port: int) -> zmq.Socket:
        socket = self._context.socket(zmq.ROUTER)
        socket.linger = 0
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES + 1024)
        # A full or vanished peer raises instead of blocking or silently dropping.
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        socket.sndhwm = self._sndhwm
        socket.rcvhwm = 16  # requests queued per peer; a client sends one at a time
        if self.auth is not None and self.auth.encrypt:
            socket.zap_domain = self._zap_domain.encode()
            socket.curve_secretkey = self.auth.keypair.secret
            socket.curve_publickey = self.auth.keypair.public
            socket.curve_server = True
        try:
            if not port:
                socket.bind_to_random_port(f"tcp://{self._host}")
                return socket
            # A restart rebinds the port its predecessor just closed: libzmq releases it
            # asynchronously, so retry briefly.
            deadline = time.monotonic() + 2.0
            while True:
                try:
                    socket.bind(f"tcp://{self._host}:{port}")
                    return socket
                except zmq.ZMQError as exc:
                    if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
        except BaseException:
            socket.close(linger=0)
            raise

    def _start_thread(self) -> threading.Thread:
        thread = threading.Thread(
            target=self._run, args=(self._socket,), name="kvmesh-pages", daemon=True
        )
        thread.start()
        return thread

    def _run(self, socket: zmq.Socket) -> None:
        try:
            self._loop(socket)
        except BaseException as exc:  # even SystemExit: recorded for ensure_running
            self._death = exc
            log.error("page server %s: serving thread stopped by %r", self.address, exc)
        finally:
            socket.close(linger=0)

    # -- the loop ----------------------------------------------------------------------

    def _loop(self, socket: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                self._wait(poller, time.monotonic())
                self._receive(socket)
                self._send(socket, time.monotonic())
            except zmq.ContextTerminated:
                return
            except Exception:  # a bug: never let it kill the loop, nor spin on it
                self.errors += 1
                log.exception("page server %s: error in the serving loop", self.address)
                time.sleep(0.01)

    def _wait(self, poller: zmq.Poller, now: float) -> None:
        """Sleep until a request arrives or a parked request is due."""
        if not self._active:
            poller.poll(_IDLE_POLL_MS)
            return
        wait_s = min(s.retry_at for s in self._active) - now
        if wait_s >= 1e-3:
            poller.poll(int(wait_s * 1000))  # wakes early for a new request
        elif wait_s > 0 and not poller.poll(0):
            # Sub-millisecond (a request just made progress): zmq polls in whole ms.
            time.sleep(wait_s)

    def _receive(self, socket: zmq.Socket) -> None:
        """Admit the requests that have arrived (a bounded number per turn)."""
        for _ in range(32):
            try:
                identity = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            payload: list[bytes] = []
            key = identity
            while socket.rcvmore:  # read frame by frame: a flood of frames is dropped
                frame = socket.recv(zmq.NOBLOCK, copy=False)
                if not payload and self._zap_domain:
                    key = self._key_of(frame, identity)
                if len(payload) < 2:
                    payload.append(frame.bytes)
            try:
                self._admit(socket, identity, key, payload)
            except Exception:
                self.errors += 1
                log.exception("page server %s: error admitting a request", self.address)

    @staticmethod
    def _key_of(frame: zmq.Frame, identity: bytes) -> bytes:
        """Who sent `frame`: the public key (z85) ZAP admitted its connection with."""
        try:
            return frame.get("User-Id").encode()
        except zmq.ZMQError:  # never without ZAP; should it be, the connection stands in
            return identity

    def _admit(self, socket: zmq.Socket, identity: bytes, key: bytes, payload: list[bytes]) -> None:
        self.requests += 1
        request_id = 0
        try:
            if len(payload) != 1:
                raise TransferError(f"expected 1 request frame, got {len(payload)}")
            request = decode_request(payload[0])
            request_id = request.request_id
            if self._signing:
                assert self.auth is not None
                check_signature(request, self.auth.secret)
                assert request.ts_ns is not None and request.nonce is not None
                self._replay.admit(key, request.ts_ns, request.nonce, time.time_ns())
            pages, expected = request.page_ids(), request.generations()
            self._check_pages(pages)
            self._check_capacity(identity, key)
        except TransferError as exc:
            self.errors += 1
            log.debug("page server %s refused a request: %s", self.address, exc)
            self._send_quietly(socket, identity, pack_map(id=request_id, error=str(exc)))
            return
        # The first reads, generations then digests (as `copy_pages_validated` does): a
        # page already reused is not sent at all. Disk pages are read when sent.
        host, ids = self._host_pages(pages)
        before = np.asarray(self.store.generations(ids), dtype=np.int64)
        digests = self._host_digests(host, ids, [EMPTY_DIGEST] * len(pages))
        sendable = ~host
        sendable[host] = before == expected[host]
        header = pack_map(id=request_id, n=len(pages), page_bytes=self.store.layout.page_bytes)
        serving = _Serving(
            identity,
            key,
            request_id,
            pages,
            expected,
            sendable,
            digests,
            deadline=time.monotonic() + self.request_timeout_s,
            header=header,
        )
        tracked = np.flatnonzero(sendable & host)
        serving.last_tracked = int(tracked[-1]) if len(tracked) else -1
        self._active.append(serving)

    def _check_pages(self, pages: np.ndarray) -> None:
        n, page_bytes = len(pages), self.store.layout.page_bytes
        if n == 0:
            raise TransferError("a request for no pages")
        if n > self._max_pages:
            raise TransferError(
                f"{n} pages of {page_bytes} bytes exceed {self._max_pages} per request "
                f"(at most {MAX_PAGES_PER_REQUEST} pages and {MAX_REQUEST_PAGE_BYTES} bytes)"
            )
        if pages.min() < 0 or pages.max() >= self._id_end:
            raise TransferError(f"page ids outside [0, {self._id_end})")

    def _check_capacity(self, identity: bytes, key: bytes) -> None:
        """Refuse a request past the bounds in flight: of its key (however many connections
        it opened), of its connection, or in all (see MAX_REQUESTS_PER_KEY)."""
        mine = sum(1 for s in self._active if s.key == key)
        if mine >= MAX_REQUESTS_PER_KEY:
            raise TransferError(f"busy: {mine} requests of this key in flight")
        mine = sum(1 for s in self._active if s.identity == identity)
        if mine >= MAX_REQUESTS_PER_PEER:
            raise TransferError(f"busy: {mine} requests of this connection in flight")
        if len(self._active) >= MAX_ACTIVE_REQUESTS:
            raise TransferError(f"busy: {MAX_ACTIVE_REQUESTS} requests in flight")

    def _send(self, socket: zmq.Socket, now: float) -> None:
        """Give each due request its turn; finish, park or drop it."""
        for serving in list(self._active):
            if serving.retry_at > now:
                continue
            if now > serving.deadline:
                self._drop(socket, serving, f"not done within {self.request_timeout_s}s")
                continue
            sends = serving.sends
            try:
                finished = self._advance(socket, serving)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:  # the peer disconnected
                    self._drop(socket, serving, "peer gone")
                else:
                    self._fail(socket, serving, exc)
                continue
            except Exception as exc:
                self._fail(socket, serving, exc)
                continue
            if finished:
                self._active.remove(serving)
            elif serving.sends != sends:
                # Progress: come back at once if the burst ran out, else very soon.
                serving.backoff = _MIN_BACKOFF_S
                more = serving.next_page < len(serving.pages)
                serving.retry_at = now if more else now + _MIN_BACKOFF_S
            else:  # the peer's queue is full or its pages are not released yet
                serving.backoff = min(2 * serving.backoff, _MAX_BACKOFF_S)
                serving.retry_at = now + serving.backoff

    def _advance(self, socket: zmq.Socket, serving: _Serving) -> bool:
        """Send what the peer's queue takes, up to a burst of pages; True once done."""
        try:
            if serving.header is not None:
                socket.send_multipart([serving.identity, serving.header], zmq.NOBLOCK)
                serving.header = None
                serving.sends += 1
            n = len(serving.pages)
            end = min(n, serving.next_page + self._burst)
            if not self.store.pages_in_segment and serving.next_page < end:
                self._stage(serving, serving.next_page, end)
            while serving.next_page < end:
                self._send_page(socket, serving, serving.next_page)
                serving.next_page += 1
                serving.sends += 1
            if serving.next_page < n:
                return False
            if serving.trailer is None:
                # Frames to one peer are released in order: once the last page with bytes
                # is, ZMQ has read every page, and what shared memory says now is the
                # verdict. Polled, never waited on: a stalled reader holds only this.
                if serving.tracker is not None and not serving.tracker.done:
                    return False
                serving.trailer = self._trailer(serving)
            socket.send_multipart([serving.identity, serving.trailer], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _send_page(self, socket: zmq.Socket, serving: _Serving, i: int) -> None:
        prefix = PAGE_PREFIX.pack(PAGE_MAGIC, TRANSFER_VERSION, serving.request_id, i)
        page = int(serving.pages[i])
        view = None
        if serving.sendable[i] and page >= self.store.num_pages:
            view = self._read_disk(serving, i)  # None: it did not verify, not sent
        if not serving.sendable[i]:
            socket.send_multipart([serving.identity, prefix, b""], zmq.NOBLOCK)
            return
        if view is None and not self.store.pages_in_segment:
            view = serving.staged.pop(i)  # a device page, copied out with its burst
        elif view is None:  # zero-copy: ZMQ reads the bytes straight out of shared memory
            view = self.store.page_buffer(page)
        track = i == serving.last_tracked
        socket.send(serving.identity, zmq.SNDMORE | zmq.NOBLOCK)  # may raise Again: no part sent
        socket.send(prefix, zmq.SNDMORE)
        tracker = socket.send(view, 0, copy=False, track=track)
        if track:
            serving.tracker = tracker
        self.pages_sent += 1

    def _read_disk(self, serving: _Serving, i: int) -> bytearray | None:
        """Disk page i of a request, read and verified now (its record's generation the
        one asked for) into a buffer of its own; else None and the page is not sent."""
        assert self.disk is not None  # ids past the host store's are refused without one
        out = bytearray(self.store.layout.page_bytes)
        digest = self.disk.read_page(int(serving.pages[i]), int(serving.expected[i]), out)
        if digest is None:
            serving.sendable[i] = False
            return None
        serving.digests[i] = digest
        return out

    def _stage(self, serving: _Serving, start: int, end: int) -> None:
        """Copy the device pages of a burst (those still sendable) out to host memory in
        one gather and one bulk copy, into memory of the burst's own that its frames are
        then sent from without a further copy (ZMQ holds it until it has sent them). The
        generation reads around the send cover the copy: a page rewritten before it ended
        reads a newer generation in the trailer."""
        due = [
            i
            for i in range(start, end)
            if serving.sendable[i] and serving.pages[i] < self.store.num_pages
        ]
        if not due:
            return
        rows = self.store.read_pages(serving.pages[due].tolist()).to("cpu")
        flat = rows.view(torch.uint8).numpy().reshape(len(due), -1)
        serving.staged.update(zip(due, flat, strict=True))

    def _host_pages(self, pages: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """Which of `pages` are in shared memory (not the disk's), and their ids."""
        host = pages < self.store.num_pages
        return host, pages[host].tolist()

    def _host_digests(self, host: np.ndarray, ids: list[int], digests: list[bytes]) -> list[bytes]:
        """`digests` with the host pages' replaced by what the store records now."""
        if len(ids) == len(digests):  # every page in shared memory: the store's, as they are
            return self.store.digests(ids)
        for i, digest in zip(np.flatnonzero(host).tolist(), self.store.digests(ids), strict=True):
            digests[i] = digest
        return digests

    def _trailer(self, serving: _Serving) -> bytes:
        """The verdict, once ZMQ has released every page: digests, then generations.

        A digest is reported only if it was the same before and after the send (read
        before the second generation read): a page published during the send may have
        been mid-write when its bytes left (see `SharedPageStore.copy_pages_validated`).
        """
        host, ids = self._host_pages(serving.pages)
        after = np.asarray(self.store.generations(ids), dtype=np.int64)
        valid = serving.sendable.copy()  # a disk page: read verified when it was sent
        valid[host] &= after == serving.expected[host]
        digests = self._host_digests(host, ids, list(serving.digests))
        held = b"".join(
            now if ok and now == then else EMPTY_DIGEST
            for now, then, ok in zip(digests, serving.digests, valid, strict=True)
        )
        return pack_map(id=serving.request_id, valid=valid.astype(np.uint8).tobytes(), digests=held)

    def _drop(self, socket: zmq.Socket, serving: _Serving, why: str) -> None:
        """Give up on a request; counted. The peer gets an error trailer if it has room."""
        self._active.remove(serving)
        self.dropped += 1
        log.info("page server %s dropped request %d: %s", self.address, serving.request_id, why)
        if why != "peer gone":  # an error header, or trailer, ends the request for it
            message = pack_map(id=serving.request_id, error=f"dropped: {why}")
            self._send_quietly(socket, serving.identity, message)

    def _fail(self, socket: zmq.Socket, serving: _Serving, exc: BaseException) -> None:
        self.errors += 1
        log.warning("page server %s: request %d failed: %r", self.address, serving.request_id, exc)
        self._drop(socket, serving, f"server error {type(exc).__name__}")

    @staticmethod
    def _send_quietly(socket: zmq.Socket, identity: bytes, message: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):  # full or gone: the peer times out instead
            socket.send_multipart([identity, message], zmq.NOBLOCK)
