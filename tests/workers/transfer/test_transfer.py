"""Page copies between workers: shared memory on one node, the page server across nodes."""

from __future__ import annotations

import contextlib
import threading
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from cache_service.auth import KeyPair
from workers.store.digests import EMPTY_DIGEST
from workers.store.page_store import SharedPageStore, StoreLayout
from workers.transfer import (
    TRANSFER_VERSION,
    PageClient,
    PageServer,
    RawZmqPipe,
    ReplayGuard,
    TransferAuth,
    TransferError,
    check_signature,
    contiguous_runs,
    copy_from_peer,
    decode_request,
    encode_request,
    page_client,
    page_server,
    page_wire,
)

LAYOUT = StoreLayout(num_pages=12, num_layers=2, num_kv_heads=2, page_tokens=4, head_dim=8)
SECRET = b"s" * 32


def _stores(in_segment: bool):
    """A holder with six pages written and a requester, checked and closed afterwards."""
    holder = SharedPageStore.create(LAYOUT, tag="holder", pages_in_segment=in_segment)
    requester = SharedPageStore.create(LAYOUT, tag="requester", pages_in_segment=in_segment)
    pages = holder.allocate(6)
    for page in pages:
        holder.write_page(page, torch.full(LAYOUT.page_shape, float(page + 1)))
    yield holder, requester, pages
    holder.check_integrity()
    requester.check_integrity()
    requester.close()
    holder.close()


@pytest.fixture
def stores():
    yield from _stores(in_segment=True)


@pytest.fixture(params=["shared", "private"])
def placed_stores(request):
    """`stores`, with the holder's and the requester's pages in shared memory or (standing
    in for device stores) in private memory: served by copying each burst out, received
    through the client's staging rows."""
    yield from _stores(in_segment=request.param == "shared")


@contextlib.contextmanager
def serving(store, **kwargs):
    """A page server and a client of it, both closed on the way out."""
    client_kwargs = kwargs.pop("client", {})
    server = PageServer(store, **kwargs)
    client = PageClient(server.address, **{"timeout_s": 2.0, **client_kwargs})
    try:
        yield server, client
        server.check_integrity()
    finally:
        client.close()
        server.stop()


def raw_dealer(address: str) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.rcvtimeo = 2000
    socket.connect(address)
    return socket


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def test_contiguous_runs():
    assert contiguous_runs([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]
    assert contiguous_runs([]) == []


# ---------------------------------------------------------------------- same node


def test_same_node_copy_lands_exact_bytes(stores):
    holder, requester, pages = stores
    peer = SharedPageStore.attach(holder.name)
    dst = requester.allocate(4)
    valid = copy_from_peer(peer, pages[:4], holder.generations(pages[:4]), requester, dst)
    assert valid == [True] * 4
    for src, d in zip(pages[:4], dst, strict=True):
        assert torch.equal(requester.page(d), holder.page(src))
    peer.close()


def test_same_node_copy_of_a_freed_page_is_invalid(stores):
    holder, requester, pages = stores
    peer = SharedPageStore.attach(holder.name)
    advertised = holder.generations(pages[:3])
    holder.free([pages[1]])  # the holder evicts it before we copy
    dst = [5, 1, 2]  # not contiguous: two runs
    requester.allocate(6)
    assert copy_from_peer(peer, pages[:3], advertised, requester, dst) == [True, False, True]
    peer.close()


def test_same_node_copy_checks_digests_per_run(stores):
    holder, requester, pages = stores
    held = [bytes([i + 1]) * 16 for i in range(3)]
    for page, digest in zip(pages[:3], held, strict=True):
        holder.set_digest(page, digest)
    peer = SharedPageStore.attach(holder.name)
    requester.allocate(6)
    wanted = [held[0], b"x" * 16, held[2]]
    gens = holder.generations(pages[:3])
    assert copy_from_peer(peer, pages[:3], gens, requester, [5, 1, 2], digests=wanted) == [
        True,
        False,
        True,
    ]
    with pytest.raises(ValueError, match="2 digests for 3 pages"):
        copy_from_peer(peer, pages[:3], gens, requester, [5, 1, 2], digests=wanted[:2])
    peer.close()


# ---------------------------------------------------------------------- the wire


def test_requests_round_trip_signed_and_unsigned():
    plain = decode_request(encode_request(7, [3, 4], [10, 11]))
    assert plain.request_id == 7 and plain.sig is None
    assert plain.page_ids().tolist() == [3, 4] and plain.generations().tolist() == [10, 11]
    with pytest.raises(TransferError, match="unsigned"):
        check_signature(plain, SECRET)
    signed = decode_request(encode_request(8, [3, 4], [10, 11], SECRET))
    assert signed.page_ids().tolist() == [3, 4] and len(signed.nonce) == 16
    check_signature(signed, SECRET)
    with pytest.raises(TransferError, match="bad signature"):
        check_signature(signed, b"t" * 32)  # another mesh's secret
    for forged in (
        signed._replace(pages=np.asarray([3, 5], "<i4").tobytes()),  # other pages
        signed._replace(request_id=9),
        signed._replace(ts_ns=signed.ts_ns + 1),
        signed._replace(nonce=bytes(16)),
    ):
        with pytest.raises(TransferError, match="bad signature"):
            check_signature(forged, SECRET)


@pytest.mark.parametrize(
    "frame, match",
    [
        (b"\xc1", "malformed"),
        (msgpack.packb([1, 2]), "malformed"),
        (msgpack.packb({"v": TRANSFER_VERSION}), "must be a map"),
        (msgpack.packb({"v": 1, "id": 1, "pages": b"", "gens": b""}), "version 1"),
        (msgpack.packb({"v": TRANSFER_VERSION, "id": 0, "pages": b"", "gens": b""}), "id"),
        (msgpack.packb({"v": TRANSFER_VERSION, "id": 1, "pages": b"123", "gens": b""}), "fit"),
        (b"\x00" * (page_wire.MAX_REQUEST_BYTES + 1), "exceeds"),
    ],
)
def test_malformed_requests_are_refused_with_the_reason(frame, match):
    with pytest.raises(TransferError, match=match):
        decode_request(frame)


def test_the_replay_guard_admits_each_nonce_once_and_only_near_now():
    guard = ReplayGuard(window_s=1.0, capacity=2)
    now, key = 10**12, b"k"
    guard.admit(key, now, b"a" * 16, now)
    with pytest.raises(TransferError, match="replayed"):
        guard.admit(key, now, b"a" * 16, now + 1)
    with pytest.raises(TransferError, match="replayed"):
        guard.admit(b"another", now, b"a" * 16, now + 1)  # a nonce is refused from any key
    with pytest.raises(TransferError, match=r"\+2\.0s"):
        guard.admit(key, now + 2 * 10**9, b"b" * 16, now)  # from the future
    with pytest.raises(TransferError, match=r"-2\.0s"):
        guard.admit(key, now - 2 * 10**9, b"b" * 16, now)  # too old
    guard.admit(key, now + 1, b"b" * 16, now)
    guard.admit(key, now + 2, b"c" * 16, now)  # full: "a" is forgotten, the floor rises to it
    assert len(guard) == 2
    with pytest.raises(TransferError, match="replayed"):
        guard.admit(key, now, b"a" * 16, now)
    guard.admit(key, now + 3 * 10**9, b"d" * 16, now + 3 * 10**9)  # the others expired
    assert len(guard) == 1
    guard.check_integrity()


def test_a_replay_guard_flood_raises_only_the_flooders_floor():
    guard = ReplayGuard(window_s=30.0, capacity=4)
    now = 10**12
    guard.admit(b"honest", now, b"h0".ljust(16, b"."), now)
    ahead = now + 29 * 10**9  # at the edge of the allowed skew
    for i in range(20):
        guard.admit(b"flooder", ahead, bytes([i]) * 16, now)
    assert len(guard) == 4  # the honest nonce and the flooder's newest 3
    # The flooder forgot its own nonces; its floor rose to the clock, not to its stamps.
    with pytest.raises(TransferError, match="replayed"):
        guard.admit(b"flooder", now, b"f".ljust(16, b"."), now)
    guard.admit(b"flooder", now + 1, b"g".ljust(16, b"."), now + 1)
    for i in range(1, 4):  # the honest key is never refused, however the flood goes on
        guard.admit(b"honest", now + i, f"h{i}".encode().ljust(16, b"."), now + i)
    guard.check_integrity()


def test_the_replay_guard_tracks_a_bounded_number_of_keys():
    guard = ReplayGuard(window_s=1.0, capacity=64, max_keys=2)
    now = 10**12
    guard.admit(b"a", now, b"1" * 16, now)
    guard.admit(b"b", now, b"2" * 16, now)
    with pytest.raises(TransferError, match="busy: signed requests of 2 peers"):
        guard.admit(b"c", now, b"3" * 16, now)
    guard.admit(b"a", now + 1, b"4" * 16, now + 1)  # tracked keys keep being served
    later = now + 2 * 10**9  # b's nonce expired: its entry makes room for c
    guard.admit(b"a", later, b"5" * 16, later)
    guard.admit(b"c", later, b"6" * 16, later)
    guard.check_integrity()


def test_credentials_are_checked():
    pair = KeyPair.generate()
    with pytest.raises(ValueError, match="32 bytes"):
        PageClient("tcp://127.0.0.1:1", auth=TransferAuth(pair, frozenset(), b"short", False))
    with pytest.raises(ValueError, match="public key"):
        PageClient("tcp://127.0.0.1:1", auth=TransferAuth(pair, frozenset(), SECRET, True))


# ---------------------------------------------------------------------- across nodes


def test_remote_fetch_lands_exact_bytes_and_validates(placed_stores):
    holder, requester, pages = placed_stores
    with serving(holder) as (server, client):
        dst = requester.allocate(5)
        gens = holder.generations(pages[:5])
        gens[2] += 7  # the advertised generation is stale: that page must not be trusted
        valid = client.fetch(pages[:5], gens, requester, dst)
        assert valid == [True, True, False, True, True]
        for src, d, ok in zip(pages[:5], dst, valid, strict=True):
            if ok:
                assert torch.equal(requester.page(d), holder.page(src))
        # A stale generation is known before the send: that page's bytes never left.
        assert not requester.page(dst[2]).any()
        assert server.pages_sent == 4 and server.health()["requests"] == 1


def test_a_page_rewritten_during_the_send_is_invalid(placed_stores):
    holder, requester, pages = placed_stores

    class RewrittenDuringSend:
        """The holder's store, rewriting page 1 between the first read and the trailer."""

        def __init__(self, store):
            self.store, self.reads = store, 0

        def __getattr__(self, name):
            return getattr(self.store, name)

        def generations(self, page_ids):
            self.reads += 1
            if self.reads == 2:  # the trailer's read, once ZMQ released the pages
                self.store.write_page(pages[1], torch.zeros(LAYOUT.page_shape))
            return self.store.generations(page_ids)

    dst = requester.allocate(3)
    with serving(RewrittenDuringSend(holder)) as (server, client):
        gens = holder.generations(pages[:3])
        assert client.fetch(pages[:3], gens, requester, dst) == [True, False, True]
        assert server.pages_sent == 3
    assert torch.equal(requester.page(dst[2]), torch.full(LAYOUT.page_shape, pages[2] + 1.0))


def test_remote_fetch_checks_the_holders_digests(stores):
    holder, requester, pages = stores
    held = [bytes([i + 1]) * 16 for i in range(3)]
    for page, digest in zip(pages[:3], held, strict=True):
        holder.set_digest(page, digest)
    dst = requester.allocate(4)
    gens = holder.generations(pages[:4])
    with serving(holder) as (_, client):
        wanted = [held[0], b"x" * 16, held[2], EMPTY_DIGEST]  # page 3 was never published
        assert client.fetch(pages[:4], gens, requester, dst, digests=wanted) == [
            True,
            False,
            True,
            False,
        ]
        assert client.fetch(pages[:4], gens, requester, dst) == [True] * 4  # no digests asked
        with pytest.raises(ValueError, match="1 digests for 4 pages"):
            client.fetch(pages[:4], gens, requester, dst, digests=wanted[:1])
        with pytest.raises(ValueError, match="digest 1 is 5 bytes"):
            client.fetch(pages[:2], gens[:2], requester, dst[:2], digests=[held[0], b"short"])


def test_bad_requests_get_error_and_the_server_keeps_serving(stores):
    holder, requester, pages = stores
    server = PageServer(holder)
    socket = raw_dealer(server.address)
    try:
        for frame in (
            b"garbage",
            msgpack.packb({"v": TRANSFER_VERSION, "id": 1, "pages": b"\x00" * 3, "gens": b""}),
            msgpack.packb(
                {
                    "v": TRANSFER_VERSION,
                    "id": 1,
                    "pages": (99).to_bytes(4, "little"),
                    "gens": bytes(8),
                }
            ),
            msgpack.packb({"v": TRANSFER_VERSION, "id": 1, "pages": b"", "gens": b""}),
        ):
            socket.send(frame)
            reply = socket.recv_multipart()
            assert len(reply) == 1 and "error" in msgpack.unpackb(reply[0])
        socket.send_multipart([encode_request(5, [0], [0]), b"a second frame"])
        assert "expected 1 request frame" in msgpack.unpackb(socket.recv())["error"]
        client = PageClient(server.address)
        dst = requester.allocate(1)
        assert client.fetch(pages[:1], holder.generations(pages[:1]), requester, dst) == [True]
        client.close()
        health = server.health()
        assert health["errors"] == 5 and health["requests"] == 6 and health["pages_sent"] == 1
        server.check_integrity()
    finally:
        socket.close(linger=0)
        server.stop()


def test_silent_peer_is_a_miss(stores):
    holder, requester, pages = stores
    server = PageServer(holder)
    address = server.address
    server.stop()
    client = PageClient(address, timeout_s=0.2)
    dst = requester.allocate(2)
    assert client.fetch(pages[:2], holder.generations(pages[:2]), requester, dst) == [False] * 2
    client.close()


def test_a_connection_that_breaks_during_the_reply_is_a_miss_at_once(stores):
    holder, requester, pages = stores
    # A server that sends the header and the first page of its reply, then dies.
    dying = zmq.Context.instance().socket(zmq.ROUTER)
    dying.linger = 0
    port = dying.bind_to_random_port("tcp://127.0.0.1")
    client = PageClient(f"tcp://127.0.0.1:{port}", timeout_s=30.0)
    dst = requester.allocate(3)
    outcome = []
    fetching = threading.Thread(
        target=lambda: outcome.append(
            client.fetch(pages[:3], holder.generations(pages[:3]), requester, dst)
        )
    )
    started = time.monotonic()
    fetching.start()
    identity, request = dying.recv_multipart()
    request_id = decode_request(request).request_id
    prefix = page_wire.PAGE_PREFIX.pack(page_wire.PAGE_MAGIC, TRANSFER_VERSION, request_id, 0)
    header = page_wire.pack_map(id=request_id, n=3, page_bytes=LAYOUT.page_bytes)
    dying.send_multipart([identity, header])
    dying.send_multipart([identity, prefix, holder.page(pages[0]).numpy().tobytes()])
    time.sleep(0.2)  # both delivered
    dying.close(linger=0)
    fetching.join(20)
    # Not the 30 s timeout: the broken connection ended the wait; nothing of it is valid.
    assert outcome == [[False] * 3]
    assert time.monotonic() - started < 15
    client.close()


def test_a_big_fetch_is_split_into_bounded_requests(stores, monkeypatch):
    holder, requester, pages = stores
    for module in (page_client, page_server):  # the client splits, the server refuses
        monkeypatch.setattr(module, "MAX_REQUEST_PAGE_BYTES", 2 * LAYOUT.page_bytes)
    dst = requester.allocate(5)
    with serving(holder) as (server, client):
        gens = holder.generations(pages[:5])
        assert client.fetch(pages[:5], gens, requester, dst) == [True] * 5
        assert server.health()["requests"] == 3  # 2 + 2 + 1 pages
        for src, d in zip(pages[:5], dst, strict=True):
            assert torch.equal(requester.page(d), holder.page(src))
        socket = raw_dealer(server.address)  # a client that does not split is refused
        socket.send(encode_request(1, pages[:3], gens[:3]))
        assert "exceed 2 per request" in msgpack.unpackb(socket.recv())["error"]
        socket.close(linger=0)


def test_replies_of_an_earlier_request_are_skipped(stores):
    holder, requester, pages = stores
    dst = requester.allocate(3)
    with serving(holder) as (server, client):
        socket = client._connect()
        gens = holder.generations(pages[:3])
        client._send_request(socket, pages[:3], gens)  # never read: its replies linger
        assert wait_for(lambda: server.pages_sent == 3)
        assert (
            client.fetch(pages[3:6], holder.generations(pages[3:6]), requester, dst) == [True] * 3
        )
        assert client.stale == 5  # header, 3 pages, trailer
        assert client._connect() is socket  # the same socket, still in step
        for src, d in zip(pages[3:6], dst, strict=True):
            assert torch.equal(requester.page(d), holder.page(src))


BIG = StoreLayout(num_pages=256, num_layers=4, num_kv_heads=2, page_tokens=16, head_dim=64)


def test_a_request_of_a_peer_that_left_is_dropped():
    big = BIG
    with SharedPageStore.create(big, tag="big") as store:
        all_pages = store.allocate(big.num_pages)
        with serving(store, request_timeout_s=30.0) as (server, client):
            socket = client._connect()
            socket.rcvhwm = 1
            client._send_request(socket, all_pages, store.generations(all_pages))
            assert wait_for(lambda: server.pages_sent > 0)
            client.close()  # gone mid-transfer: the server notices at its next send
            assert wait_for(lambda: server.health()["dropped"] == 1)
            assert server.health()["active"] == 0 and server.health()["alive"]
            store.check_integrity()


def test_a_peer_may_have_only_a_few_requests_in_flight():
    big = BIG
    with SharedPageStore.create(big, tag="big") as store:
        all_pages = store.allocate(big.num_pages)
        server = PageServer(store, request_timeout_s=30.0)
        socket = raw_dealer(server.address)
        socket.rcvhwm = 1
        try:
            request = encode_request(1, all_pages, store.generations(all_pages))
            for _ in range(page_wire.MAX_REQUESTS_PER_PEER + 2):
                socket.send(request)  # and never read the 16 MiB each asks for
            assert wait_for(lambda: server.health()["errors"] == 2)
            assert server.health()["active"] == page_wire.MAX_REQUESTS_PER_PEER
            server.check_integrity()
        finally:
            socket.close(linger=0)
            server.stop()
            store.check_integrity()


def test_health_reports_the_counters(stores):
    holder, requester, pages = stores
    with serving(holder, auth=signed_auth(), client={"auth": signed_auth()}) as (server, client):
        client.fetch(pages[:2], holder.generations(pages[:2]), requester, requester.allocate(2))
        assert wait_for(lambda: server.health()["active"] == 0)  # the trailer left just now
        health = server.health()
        assert health == {
            "alive": True,
            "restarts": 0,
            "errors": 0,
            "dropped": 0,
            "requests": 1,
            "pages_sent": 2,
            "active": 0,
            "encrypt": False,
            "signed": True,
        }
        assert server.ensure_running() is False  # alive: nothing to do
    assert server.health()["alive"] is False
    assert server.ensure_running() is False  # stopped on purpose: not restarted


# ---------------------------------------------------------------------- authentication


def signed_auth(secret: bytes = SECRET) -> TransferAuth:
    return TransferAuth(KeyPair.generate(), frozenset(), secret, encrypt=False)


def test_a_replayed_signed_request_gets_no_bytes(stores):
    holder, requester, pages = stores
    server = PageServer(holder, auth=signed_auth())
    socket = raw_dealer(server.address)
    try:
        frame = encode_request(3, pages[:2], holder.generations(pages[:2]), SECRET)
        socket.send(frame)
        assert len(socket.recv_multipart()) == 1  # the header; pages and trailer follow
        for _ in range(3):
            socket.recv_multipart()
        socket.send(frame)  # the same request again, as an eavesdropper would send it
        assert msgpack.unpackb(socket.recv())["error"] == "replayed request"
        assert server.health()["pages_sent"] == 2
        server.check_integrity()
    finally:
        socket.close(linger=0)
        server.stop()


def test_page_servers_in_one_process_keep_their_own_peers(stores):
    holder, requester, pages = stores
    a, b = KeyPair.generate(), KeyPair.generate()
    auth_a = TransferAuth(a, frozenset([a.public]), SECRET, encrypt=True)
    auth_b = TransferAuth(b, frozenset([b.public]), SECRET, encrypt=True)
    server_a = PageServer(holder, auth=auth_a)
    server_b = PageServer(holder, auth=auth_b)
    gens = holder.generations(pages[:2])
    dst = requester.allocate(2)
    clients = []
    try:
        for auth, server, admitted in (
            (auth_a, server_a, True),
            (auth_b, server_b, True),
            (auth_a, server_b, False),  # a's key is not one of b's peers
            (auth_b, server_a, False),
        ):
            client = PageClient(
                server.address, timeout_s=0.5, auth=auth, server_key=server.auth.keypair.public
            )
            clients.append(client)
            assert client.fetch(pages[:2], gens, requester, dst) == [admitted] * 2
        assert server_a.health()["pages_sent"] == server_b.health()["pages_sent"] == 2
    finally:
        for client in clients:
            client.close()
        server_a.stop()
        server_b.stop()


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_the_raw_pipe_moves_every_byte(curve):
    pipe = RawZmqPipe(1 << 20, 1 << 16, curve=curve)
    try:
        pipe.transfer()
        assert torch.equal(pipe._dst, pipe._src)
    finally:
        pipe.close()


def test_check_integrity_catches_a_broken_bound(stores):
    holder, _, _ = stores
    with serving(holder) as (server, _):
        server.check_integrity()
        server.errors = -1  # corrupt on purpose
        with pytest.raises(AssertionError, match="a negative counter"):
            server.check_integrity()
        server.errors = 0
