"""The page servers' wire: requests, their signatures, and reply framing.

    request   [ msgpack {"v", "id", "pages": int32 bytes, "gens": int64 bytes,
                         signed only: "ts": ns, "nonce": 16 bytes, "sig": HMAC-SHA256} ]
    header    [ msgpack {"v", "id", "n", "page_bytes"} ]  or  [ msgpack {"v", "id", "error"} ]
    page i    [ prefix "<2sBQI" (b"KP", v, id, i) | page bytes, or empty if not sent ]
    ...       (one ZMQ message per page, n of them)
    trailer   [ msgpack {"v", "id", "valid": one byte per page, "digests": 16 bytes per page} ]
              or [ msgpack {"v", "id", "error"} ] when the server gave up on the request

See `workers.transfer` for who may read and how one client cannot stall a server.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import struct
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from cache_service.auth import SECRET_BYTES, KeyPair
from workers.store.digests import DIGEST_BYTES

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

TRANSFER_VERSION = 2  # 2: one message per page, signed requests, digests in the trailer

# A request names at most this many pages, and at most this many bytes of them (one page
# is always allowed): the time and the bytes one request can hold the server for.
# `PageClient.fetch` splits larger fetches into requests of this size; at 64 MiB the
# round trip between two requests costs well under 1% of the transfer.
MAX_PAGES_PER_REQUEST = 8192
MAX_REQUEST_PAGE_BYTES = 64 << 20
MAX_REQUEST_BYTES = MAX_PAGES_PER_REQUEST * 12 + 512  # ids, generations, signature

# What may be queued for one peer before its sends are parked (SNDHWM, in pages of this
# many bytes, at least 4). The frames are zero-copy views of shared memory, so this is no
# memory; it bounds how much a reader that stops reading holds, and 4 MiB is still
# over a millisecond of loopback transfer, enough to keep the pipe full between refills.
PEER_QUEUE_BYTES = 4 << 20

# Requests in flight. A client asks one request at a time on its connection (a DEALER),
# so 4 per connection leaves room for a retry racing a late reply. A key (a worker: its
# CurveZMQ public key, which the ZAP handler vouches for) may hold 8 over all the
# connections it opens: a worker has one client per holder, 8 covers a restart's second
# connection and its retries, and a key that opens 16 connections still holds 8, not all
# 64. 64 in all is 8 keys at their limit; a request in flight costs no memory (its pages
# leave as zero-copy views) but a turn of the loop, and a stalled one is dropped after the
# server's request timeout. Without CURVE (signed or open) a request names no key the
# server can trust, so its connection is its key: a holder of the mesh secret who opens
# many connections is held only by the 64 in all.
MAX_REQUESTS_PER_PEER = 4  # per connection
MAX_REQUESTS_PER_KEY = 8  # per authenticated key, all its connections together
MAX_ACTIVE_REQUESTS = 64  # requests being served at once, all keys together

# Signed requests: a timestamp at most this far from the server's clock (nodes run NTP;
# further apart every copy is a miss, and the error header says why), and a nonce
# remembered for as long, so a request overheard on the wire cannot be replayed.
SIGNATURE_WINDOW_S = 30.0
# Nonces remembered at most, all keys together (about 13 MiB: a dict entry and a deque
# slot each): 2,184 signed requests a second over the window, far more than a mesh's
# readers send (one request at a time per connection, each of up to 64 MiB of pages).
REPLAY_CAPACITY = 1 << 16
# Keys (connections: signed requests carry no identity but the mesh secret's) with a
# window of their own at most: one per reading worker of the mesh, with room to spare.
REPLAY_KEYS = 1024
_SIGNING_DOMAIN = b"kvmesh page request v2\x00"
_NONCE_BYTES = 16

PAGE_PREFIX = struct.Struct("<2sBQI")  # magic, version, request id, page index
PAGE_MAGIC = b"KP"
_REQUEST_KEYS = frozenset(("v", "id", "pages", "gens"))
_SIGNED_KEYS = _REQUEST_KEYS | {"ts", "nonce", "sig"}


class TransferError(ValueError):
    """A malformed page request or reply (the server answers a request with an error)."""


class Refused(TransferError):
    """The server answered with an error: the socket is in step, nothing to reset."""


class ReplyTimeout(TransferError):
    """No reply in time."""


class PeerGone(TransferError):
    """The connection to the server broke while a reply was due (its process died, or its
    host went away): what arrived of the reply is never used."""


class TransferAuth(NamedTuple):
    """Who a worker is to the page servers of its mesh, and how pages travel.

    Attributes:
        keypair: this worker's own CurveZMQ key pair (also its page server's).
        peers: the public keys of the mesh's workers: who may read pages.
        secret: the mesh secret (32 bytes): the key of request signatures.
        encrypt: CurveZMQ when True; signed requests and clear page bytes when False.
    """

    keypair: KeyPair
    peers: frozenset[bytes]
    secret: bytes
    encrypt: bool


def check_auth(auth: TransferAuth) -> None:
    if len(auth.secret) != SECRET_BYTES:
        raise ValueError(f"the mesh secret is {SECRET_BYTES} bytes, got {len(auth.secret)}")
    for name, key in zip(("public", "secret"), auth.keypair, strict=True):
        if not isinstance(key, bytes) or len(key) != 40:
            raise ValueError(f"the {name} key must be 40 z85 bytes, got {key!r:.20}")


class PageRequest(NamedTuple):
    """A decoded page request; `pages` and `gens` are the raw little-endian arrays."""

    request_id: int
    pages: bytes  # int32 per page
    gens: bytes  # int64 per page
    ts_ns: int | None = None  # signed requests only
    nonce: bytes | None = None
    sig: bytes | None = None

    def page_ids(self) -> np.ndarray:
        return np.frombuffer(self.pages, "<i4").astype(np.int64)

    def generations(self) -> np.ndarray:
        return np.frombuffer(self.gens, "<i8")


def _signature(secret: bytes, request_id: int, ts_ns: int, nonce: bytes, pages, gens) -> bytes:
    # Lengths are fixed or prefixed, so no two requests sign the same bytes.
    head = struct.pack("<QqI", request_id, ts_ns, len(pages))
    message = b"".join((_SIGNING_DOMAIN, head, nonce, pages, gens))
    return hmac.new(secret, message, hashlib.sha256).digest()


def encode_request(
    request_id: int,
    page_ids: Sequence[int],
    generations: Sequence[int],
    secret: bytes | None = None,
) -> bytes:
    """One request frame; signed under `secret` when given."""
    request: dict[str, Any] = {
        "v": TRANSFER_VERSION,
        "id": request_id,
        "pages": np.asarray(page_ids, dtype="<i4").tobytes(),
        "gens": np.asarray(generations, dtype="<i8").tobytes(),
    }
    if secret is not None:
        ts_ns, nonce = time.time_ns(), os.urandom(_NONCE_BYTES)
        request["ts"], request["nonce"] = ts_ns, nonce
        request["sig"] = _signature(
            secret, request_id, ts_ns, nonce, request["pages"], request["gens"]
        )
    return msgpack.packb(request)


def decode_request(frame: bytes) -> PageRequest:
    """Parse a request frame, bounded in size and shape (not its signature).

    Raises:
        TransferError: the frame is too big, not msgpack, or not a version-2 request.
    """
    if len(frame) > MAX_REQUEST_BYTES:
        raise TransferError(f"request of {len(frame)} bytes exceeds {MAX_REQUEST_BYTES}")
    try:
        msg = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_REQUEST_BYTES,
            max_str_len=16,
            max_array_len=0,
            max_map_len=8,
            max_ext_len=0,
        )
    except Exception as exc:
        raise TransferError(f"malformed request ({type(exc).__name__})") from None
    if not isinstance(msg, dict) or set(msg) not in (_REQUEST_KEYS, _SIGNED_KEYS):
        raise TransferError("request must be a map with keys v, id, pages, gens[, ts, nonce, sig]")
    if msg["v"] != TRANSFER_VERSION:
        raise TransferError(f"transfer version {msg['v']!r}, expected {TRANSFER_VERSION}")
    request_id, pages, gens = msg["id"], msg["pages"], msg["gens"]
    if type(request_id) is not int or not 0 < request_id < 1 << 64:
        raise TransferError("id must be an int in [1, 2**64)")
    if not isinstance(pages, bytes) or not isinstance(gens, bytes):
        raise TransferError("pages and gens must be bytes")
    if len(pages) % 4 or len(gens) != 2 * len(pages):
        raise TransferError(f"{len(pages)} page bytes do not fit {len(gens)} generation bytes")
    if "sig" not in msg:
        return PageRequest(request_id, pages, gens)
    ts_ns, nonce, sig = msg["ts"], msg["nonce"], msg["sig"]
    if type(ts_ns) is not int or not isinstance(nonce, bytes) or not isinstance(sig, bytes):
        raise TransferError("ts must be an int, nonce and sig bytes")
    if len(nonce) != _NONCE_BYTES or len(sig) != hashlib.sha256().digest_size:
        raise TransferError(f"nonce of {len(nonce)} bytes, signature of {len(sig)}")
    return PageRequest(request_id, pages, gens, ts_ns, nonce, sig)


def check_signature(request: PageRequest, secret: bytes) -> None:
    """Raises TransferError unless `request` is signed under `secret`."""
    if request.sig is None:
        raise TransferError("unsigned request: this page server admits signed requests only")
    assert request.ts_ns is not None and request.nonce is not None
    expected = _signature(
        secret, request.request_id, request.ts_ns, request.nonce, request.pages, request.gens
    )
    if not hmac.compare_digest(expected, request.sig):
        raise TransferError("bad signature")


class _KeyWindow:
    """What a ReplayGuard remembers of one key: its nonces in arrival order, and its floor
    (a timestamp at or below which its requests are refused, once nonces were forgotten)."""

    __slots__ = ("order", "floor_ns")

    def __init__(self) -> None:
        self.order: collections.deque[tuple[int, bytes]] = collections.deque()
        self.floor_ns = -(1 << 63)


class ReplayGuard:
    """Admits each signed request once, and only near the server's clock; one key's
    requests never make another key's refused.

    A nonce is remembered while its timestamp is inside the window, and a nonce seen from
    any key is refused from every key. Each key (the connection a request came on) has a
    window of its own: its nonces and its floor. Memory is bounded twice:

    - at most `capacity` nonces in all: past it, the key holding the most forgets its
      oldest nonce and its own floor rises to that nonce's timestamp, so that request can
      still not be replayed on its connection (nor can anything older). The floor never
      rises past the server's clock: a request stamped in the future (within the window,
      else it is refused outright) moves no floor beyond the present. A flooding key is
      always the one holding the most, so it forgets only its own nonces. What is given up:
      a nonce forgotten this way could be replayed on another connection; the requests of
      a key that floods were its own to sign anyway.
    - at most `max_keys` keys: a key with nothing live and a floor past the window is
      forgotten; when every tracked key still has live nonces, a new key's request is
      refused ("busy") until one has none. Tracked keys are never pushed out, and a key
      holds one entry however fast it sends.
    """

    def __init__(
        self,
        window_s: float = SIGNATURE_WINDOW_S,
        capacity: int = REPLAY_CAPACITY,
        max_keys: int = REPLAY_KEYS,
    ):
        self.window_ns = int(window_s * 1e9)
        self.capacity = capacity
        self.max_keys = max_keys
        self._seen: dict[bytes, bytes] = {}  # nonce -> the key it came from
        self._keys: dict[bytes, _KeyWindow] = {}

    def admit(self, key: bytes, ts_ns: int, nonce: bytes, now_ns: int) -> None:
        """Raises TransferError for a stale, future or replayed request, or a new key when
        `max_keys` keys have live nonces; else remembers it under `key`."""
        skew_s = (ts_ns - now_ns) / 1e9
        if abs(ts_ns - now_ns) > self.window_ns:
            raise TransferError(f"request timestamp {skew_s:+.1f}s from the server's clock")
        window = self._keys.get(key)
        if window is None:
            window = self._track(key, now_ns)
        self._expire(window, now_ns)
        if nonce in self._seen or ts_ns <= window.floor_ns:
            raise TransferError("replayed request")
        if len(self._seen) >= self.capacity:
            self._sweep(now_ns)
        if len(self._seen) >= self.capacity:
            # Ties go to the asking key: it forgets its own before another's.
            busiest = max(self._keys.values(), key=lambda w: (len(w.order), w is window))
            old_ts, old_nonce = busiest.order.popleft()
            del self._seen[old_nonce]
            busiest.floor_ns = max(busiest.floor_ns, min(old_ts, now_ns))
        self._seen[nonce] = key
        window.order.append((ts_ns, nonce))

    def _track(self, key: bytes, now_ns: int) -> _KeyWindow:
        if len(self._keys) >= self.max_keys:
            self._sweep(now_ns)
        if len(self._keys) >= self.max_keys:
            raise TransferError(f"busy: signed requests of {len(self._keys)} peers in the window")
        window = self._keys[key] = _KeyWindow()
        return window

    def _expire(self, window: _KeyWindow, now_ns: int) -> None:
        # In arrival order: a nonce stamped ahead of the clock holds those behind it for a
        # little longer, within its own key.
        while window.order and window.order[0][0] < now_ns - self.window_ns:
            del self._seen[window.order.popleft()[1]]

    def _sweep(self, now_ns: int) -> None:
        """Expire every key's nonces; forget keys with nothing left to refuse."""
        for key, window in list(self._keys.items()):
            self._expire(window, now_ns)
            if not window.order and window.floor_ns < now_ns - self.window_ns:
                del self._keys[key]

    def __len__(self) -> int:
        return len(self._seen)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the guard is within its bounds and consistent."""
        assert len(self._seen) <= self.capacity, f"{len(self._seen)} nonces > {self.capacity}"
        assert len(self._keys) <= self.max_keys, f"{len(self._keys)} keys > {self.max_keys}"
        held = sum(len(w.order) for w in self._keys.values())
        assert held == len(self._seen), f"{held} nonces in windows, {len(self._seen)} seen"


def pack_map(**fields: Any) -> bytes:
    return msgpack.packb({"v": TRANSFER_VERSION, **fields})


def decode_reply(frame: bytes) -> dict:
    try:
        msg = msgpack.unpackb(
            frame,
            raw=False,
            max_bin_len=1 << 20,
            max_str_len=4096,
            max_array_len=16,
            max_map_len=16,
            max_ext_len=0,
        )
    except Exception as exc:
        raise TransferError(f"malformed reply ({type(exc).__name__})") from None
    if not isinstance(msg, dict) or msg.get("v") != TRANSFER_VERSION:
        raise TransferError("malformed reply")
    if type(msg.get("id")) is not int:
        raise TransferError("reply without an id")
    return msg


def check_lengths(page_ids, generations, dst_pages, digests) -> None:
    """Raise ValueError unless a copy's page ids, generations, targets (and digests, each
    of DIGEST_BYTES) line up."""
    if not (len(page_ids) == len(generations) == len(dst_pages)):
        raise ValueError(
            f"{len(page_ids)} pages, {len(generations)} generations, {len(dst_pages)} targets"
        )
    if digests is not None:
        if len(digests) != len(page_ids):
            raise ValueError(f"{len(digests)} digests for {len(page_ids)} pages")
        for i, digest in enumerate(digests):
            if len(digest) != DIGEST_BYTES:
                raise ValueError(f"digest {i} is {len(digest)} bytes, not {DIGEST_BYTES}")
