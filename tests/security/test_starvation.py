"""One reader of the mesh cannot take a page server from the others.

Findings covered (an attacker holding a legitimate key, on the same machine): one key that
opened many connections took all 64 request slots of a page server, so 26 of 28 honest
fetches were refused as busy and became recomputes; in signed mode a holder of the mesh
secret who flooded fresh nonces stamped near the edge of the allowed future skew pushed the
replay guard's floor ahead, and honest signed fetches were refused as replayed for 24 s.
"""

from __future__ import annotations

import functools
import os
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from cache_service.auth import KeyPair
from workers.transfer import PageClient, PageServer, TransferAuth, page_server, page_wire
from workers.transfer.page_wire import ReplayGuard, encode_request

SECRET = b"s" * 32
HOGS = 16  # connections the attacker opens, each asking its 4 requests


@pytest.fixture
def stores(holder, requester):
    """The holder's store and pages (tests/security/conftest.py: 64 KiB each, so a request
    for all 256, 16 MiB, that is never read stays in flight); the requester's store and 8
    of its pages."""
    (store, pages), (dst_store, dst) = holder, requester
    return store, pages, dst_store, dst[:8]


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def hog(address: str, auth: TransferAuth | None, server_key: bytes | None) -> zmq.Socket:
    """A connection that reads nothing (a raw DEALER, under `auth`'s key when it encrypts)."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.rcvhwm = 1
    socket.setsockopt(zmq.RCVBUF, 4096)
    if auth is not None and auth.encrypt:
        socket.curve_secretkey = auth.keypair.secret
        socket.curve_publickey = auth.keypair.public
        socket.curve_serverkey = server_key
    socket.connect(address)
    return socket


def test_one_key_with_many_connections_holds_only_its_share(stores):
    holder, pages, requester, dst = stores
    server_key, attacker, honest = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    peers = frozenset((server_key.public, attacker.public, honest.public))
    server_auth = TransferAuth(server_key, peers, SECRET, encrypt=True)
    attacker_auth = TransferAuth(attacker, peers, SECRET, encrypt=True)
    honest_auth = TransferAuth(honest, peers, SECRET, encrypt=True)
    server = PageServer(holder, auth=server_auth, request_timeout_s=60.0)
    hogs = [hog(server.address, attacker_auth, server_key.public) for _ in range(HOGS)]
    client = PageClient(
        server.address, timeout_s=5.0, auth=honest_auth, server_key=server_key.public
    )
    try:
        everything = encode_request(1, pages, holder.generations(pages))
        for socket in hogs:
            for _ in range(page_wire.MAX_REQUESTS_PER_PEER):
                socket.send(everything)
        asked = HOGS * page_wire.MAX_REQUESTS_PER_PEER
        assert wait_for(lambda: server.health()["requests"] >= asked), server.health()
        assert server.health()["active"] <= page_wire.MAX_REQUESTS_PER_KEY, server.health()
        gens = holder.generations(pages[:4])
        for _ in range(8):  # every honest fetch is served while the hogs hold theirs
            assert client.fetch(pages[:4], gens, requester, dst[:4]) == [True] * 4
        assert torch.equal(requester.page(dst[0]), holder.page(pages[0]))
        server.check_integrity()
    finally:
        client.close()
        for socket in hogs:
            socket.close(linger=0)
        server.stop()


def signed_at(request_id: int, page_ids, gens, ts_ns: int) -> bytes:
    """A request signed under the mesh secret as `encode_request` signs it, stamped `ts_ns`
    (what a holder of the secret can send)."""
    pages = np.asarray(page_ids, "<i4").tobytes()
    generations = np.asarray(gens, "<i8").tobytes()
    nonce = os.urandom(16)
    sig = page_wire._signature(SECRET, request_id, ts_ns, nonce, pages, generations)
    request = {"v": page_wire.TRANSFER_VERSION, "id": request_id, "pages": pages}
    request.update(gens=generations, ts=ts_ns, nonce=nonce, sig=sig)
    return msgpack.packb(request)


@pytest.mark.parametrize("ahead_s", [29.0, 2.0], ids=["future-edge", "ahead-2s"])
def test_a_nonce_flood_refuses_no_other_peers_signed_requests(stores, monkeypatch, ahead_s):
    holder, pages, requester, dst = stores
    # A guard of 512 nonces: the flood overflows it in a fraction of a second (the real
    # one, 65,536, the same way in a few).
    small = functools.partial(ReplayGuard, capacity=512)
    monkeypatch.setattr(page_server, "ReplayGuard", small)
    auth = TransferAuth(KeyPair.generate(), frozenset(), SECRET, encrypt=False)
    server = PageServer(holder, auth=auth)
    flooder = hog(server.address, None, None)
    client = PageClient(server.address, timeout_s=5.0, auth=auth)
    gens = holder.generations(pages[:4])
    try:
        assert client.fetch(pages[:4], gens, requester, dst[:4]) == [True] * 4
        flood = 2000
        for i in range(flood):
            ts_ns = time.time_ns() + int(ahead_s * 1e9)
            flooder.send(signed_at(i + 1, pages[:1], gens[:1], ts_ns))
        assert wait_for(lambda: server.health()["requests"] >= flood + 1), server.health()
        for _ in range(8):
            assert client.fetch(pages[:4], gens, requester, dst[:4]) == [True] * 4
        server.check_integrity()
    finally:
        client.close()
        flooder.close(linger=0)
        server.stop()
