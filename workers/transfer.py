"""Moving pages between workers: same node through shared memory, across nodes over ZMQ.

Every copy is validated against the generation the holder advertised with the page: a
page that was freed, reused or rewritten while it was copied is reported invalid, and
the requester recomputes it. Nothing here ever raises on a vanished page or a silent
peer: those are misses.

Same node: `copy_from_peer` attaches the holder's page store by name and copies each run
of destination pages with one validated copy (generation, memcpy, generation).

Across nodes: the holder runs a `PageServer` (a ROUTER thread) and the requester a
`PageClient`. The wire, per request:

    request   [ msgpack {"v", "id", "pages": int32 bytes, "gens": int64 bytes} ]
    reply 1   [ msgpack header {"v", "id", "n", "page_bytes"} | page 0 | ... | page n-1 ]
    reply 2   [ msgpack trailer {"v", "id", "valid": one byte per page} ]

Pages leave straight from the holder's shared memory as zero-copy frames and land with
`recv_into` straight in the requester's pages: the only copies are the kernel's. Because
the bytes are read from shared memory while they are sent, the holder reads each page's
generation before sending and again once ZMQ is done with the buffers, and reports the
verdict in the trailer; the requester trusts a page only if the trailer says so.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence

import msgpack
import numpy as np
import torch
import zmq

from cache_service.addresses import check_bind_host
from workers.page_store import SharedPageStore

log = logging.getLogger(__name__)

TRANSFER_VERSION = 1
MAX_PAGES_PER_REQUEST = 8192
_MAX_REQUEST_BYTES = MAX_PAGES_PER_REQUEST * 12 + 256


class TransferError(ValueError):
    """A malformed page request (the server answers it with an error header)."""


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
) -> list[bool]:
    """Copy pages of a same-node peer's store into our own pages, validated.

    Returns:
        One bool per page: False means the page changed or vanished and must be
        recomputed (its destination holds garbage).
    """
    if not (len(page_ids) == len(generations) == len(dst_pages)):
        raise ValueError(
            f"{len(page_ids)} pages, {len(generations)} generations, {len(dst_pages)} targets"
        )
    valid: list[bool] = []
    for offset, first, length in contiguous_runs(list(dst_pages)):
        out = dst.page_range(first, first + length)
        verdict = peer.copy_pages_validated(
            page_ids[offset : offset + length], generations[offset : offset + length], out
        )
        valid.extend(verdict.valid)
    return valid


# ---------------------------------------------------------------------- across nodes


def _decode_request(frame: bytes) -> tuple[int, list[int], list[int]]:
    if len(frame) > _MAX_REQUEST_BYTES:
        raise TransferError(f"request of {len(frame)} bytes exceeds {_MAX_REQUEST_BYTES}")
    try:
        msg = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_bin_len=_MAX_REQUEST_BYTES,
            max_str_len=16,
            max_array_len=0,
            max_map_len=8,
            max_ext_len=0,
        )
    except Exception as exc:
        raise TransferError(f"malformed request ({type(exc).__name__})") from None
    if not isinstance(msg, dict) or set(msg) != {"v", "id", "pages", "gens"}:
        raise TransferError("request must be a map with keys v, id, pages, gens")
    if msg["v"] != TRANSFER_VERSION:
        raise TransferError(f"transfer version {msg['v']!r}, expected {TRANSFER_VERSION}")
    request_id, pages, gens = msg["id"], msg["pages"], msg["gens"]
    if type(request_id) is not int or not isinstance(pages, bytes) or not isinstance(gens, bytes):
        raise TransferError("id must be an int, pages and gens bytes")
    if len(pages) % 4 or len(gens) != 2 * len(pages):
        raise TransferError(f"{len(pages)} page bytes do not fit {len(gens)} generation bytes")
    return request_id, np.frombuffer(pages, "<i4").tolist(), np.frombuffer(gens, "<i8").tolist()


class PageServer:
    """Serves reads of one worker's pages to workers on other nodes (a daemon thread).

    One request is served at a time; a page read is a memcpy-speed stream, so a queue of
    requesters is served in turn rather than competing for the same bandwidth.
    """

    def __init__(self, store: SharedPageStore, host: str = "127.0.0.1", port: int = 0):
        check_bind_host(host, "page server host")
        self.store = store
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.linger = 0
        self._socket.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES + 1024)
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.requests = 0
        self.pages_sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvmesh-pages", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(200):
                    frames = self._socket.recv_multipart()
                    self._serve(frames[0], frames[1:])
        finally:
            self._socket.close(linger=0)

    def _serve(self, identity: bytes, payload: list[bytes]) -> None:
        self.requests += 1
        try:
            if len(payload) != 1:
                raise TransferError(f"expected 1 request frame, got {len(payload)}")
            request_id, pages, gens = _decode_request(payload[0])
            if len(pages) > MAX_PAGES_PER_REQUEST:
                raise TransferError(f"{len(pages)} pages exceed {MAX_PAGES_PER_REQUEST}")
            if any(not 0 <= p < self.store.num_pages for p in pages):
                raise TransferError(f"page ids outside [0, {self.store.num_pages})")
        except TransferError as exc:
            header = {"v": TRANSFER_VERSION, "id": 0, "error": str(exc)}
            self._socket.send_multipart([identity, msgpack.packb(header)])
            return
        expected = np.asarray(gens, dtype=np.int64)
        before = np.asarray(self.store.generations(pages), dtype=np.int64)
        header = {
            "v": TRANSFER_VERSION,
            "id": request_id,
            "n": len(pages),
            "page_bytes": self.store.layout.page_bytes,
        }
        socket = self._socket
        socket.send(identity, zmq.SNDMORE)
        socket.send(msgpack.packb(header), zmq.SNDMORE)
        tracker = None
        for i, page in enumerate(pages):
            # Zero-copy: ZMQ reads the bytes straight out of shared memory.
            view = memoryview(self.store.page(page).numpy()).cast("B")
            flags = zmq.SNDMORE if i + 1 < len(pages) else 0
            # Frames leave in order, so once the last one is released all are.
            last = i + 1 == len(pages)
            tracker = socket.send(view, flags, copy=False, track=last)
        if tracker is not None:
            tracker.wait(30.0)  # ZMQ has read every page: now the generations tell
        after = np.asarray(self.store.generations(pages), dtype=np.int64)
        valid = ((before == expected) & (after == expected)).astype(np.uint8).tobytes()
        trailer = {"v": TRANSFER_VERSION, "id": request_id, "valid": valid}
        socket.send_multipart([identity, msgpack.packb(trailer)])
        self.pages_sent += len(pages)


class PageClient:
    """Reads pages from one remote `PageServer` straight into our own pages.

    A timeout, a garbled reply or a peer that is gone makes every page of that request
    invalid (a miss); the socket is then replaced so nothing stale lingers.
    """

    def __init__(self, address: str, timeout_s: float = 5.0):
        self.address = address
        self.timeout_s = timeout_s
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def fetch(
        self,
        page_ids: Sequence[int],
        generations: Sequence[int],
        dst: SharedPageStore,
        dst_pages: Sequence[int],
    ) -> list[bool]:
        """Copy remote pages into `dst_pages` of our store; one validity bool per page."""
        if not (len(page_ids) == len(generations) == len(dst_pages)):
            raise ValueError(
                f"{len(page_ids)} pages, {len(generations)} generations, {len(dst_pages)} targets"
            )
        if not page_ids:
            return []
        with self._lock:
            try:
                return self._fetch(page_ids, generations, dst, dst_pages)
            except (zmq.ZMQError, TransferError, ValueError, KeyError, TypeError) as exc:
                log.warning("page fetch from %s failed: %s", self.address, exc)
                self._reset()
                return [False] * len(page_ids)

    def _fetch(self, page_ids, generations, dst, dst_pages) -> list[bool]:
        socket = self._connect()
        request_id = next(self._ids)
        request = {
            "v": TRANSFER_VERSION,
            "id": request_id,
            "pages": np.asarray(page_ids, dtype="<i4").tobytes(),
            "gens": np.asarray(generations, dtype="<i8").tobytes(),
        }
        socket.send(msgpack.packb(request))
        header = self._recv_map(socket)
        if "error" in header:
            raise TransferError(f"server refused: {header['error']}")
        page_bytes = dst.layout.page_bytes
        if header["id"] != request_id or header["n"] != len(page_ids):
            raise TransferError(f"reply {header['id']}/{header['n']} for {request_id}")
        if header["page_bytes"] != page_bytes:
            raise TransferError(f"peer pages are {header['page_bytes']} bytes, ours {page_bytes}")
        for page in dst_pages:
            # Straight into our page: the only copy is the kernel's.
            target = memoryview(dst.page(page).numpy()).cast("B")
            if socket.recv_into(target) != page_bytes:
                raise TransferError("a page frame of the wrong size")
        trailer = self._recv_map(socket)
        valid = trailer["valid"]
        if trailer["id"] != request_id or len(valid) != len(page_ids):
            raise TransferError("trailer does not match the request")
        return [bool(v) for v in valid]

    def _recv_map(self, socket: zmq.Socket) -> dict:
        if not socket.poll(int(self.timeout_s * 1000)):
            raise TransferError(f"no reply within {self.timeout_s}s")
        frame = socket.recv()
        msg = msgpack.unpackb(
            frame,
            raw=False,
            max_bin_len=1 << 20,
            max_str_len=4096,
            max_array_len=16,
            max_map_len=16,
            max_ext_len=0,
        )
        if not isinstance(msg, dict) or msg.get("v") != TRANSFER_VERSION:
            raise TransferError("malformed reply")
        return msg

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.linger = 0
            socket.connect(self.address)
            self._socket = socket
        return self._socket

    def _reset(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def close(self) -> None:
        with self._lock:
            self._reset()


class RawZmqPipe:
    """A bare ZMQ bulk transfer over loopback TCP: the baseline for the page server.

    The same frames as a page fetch, sent zero-copy out of one buffer and received with
    `recv_into` another; sockets and buffers are set up once, outside any timing.
    """

    def __init__(self, nbytes: int, frame_bytes: int):
        context = zmq.Context.instance()
        self._push = context.socket(zmq.PUSH)
        self._pull = context.socket(zmq.PULL)
        self._push.linger = self._pull.linger = 0
        port = self._pull.bind_to_random_port("tcp://127.0.0.1")
        self._push.connect(f"tcp://127.0.0.1:{port}")
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

        thread = threading.Thread(target=send)
        thread.start()
        for i in range(self.frames):
            self._pull.recv_into(dst[i * size : (i + 1) * size])
        thread.join()

    def close(self) -> None:
        self._push.close(linger=0)
        self._pull.close(linger=0)
