"""Page servers serve only workers of their mesh, and no client can stall or kill them.

Findings covered: a page server sent any page's bytes to anyone who connected (a wrong
generation only marked the trailer, after the bytes had left) and had no authentication;
a raw client that asked for 8,192 pages and never read stalled every other fetch from that
worker for 30 s, after which the serving thread died (an uncaught `zmq.error.NotDone`) and
every later cross-node copy from that worker was a miss.
"""

from __future__ import annotations

import ctypes
import statistics
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from cache_service.auth import KeyPair
from cache_service.zap import LateKeys
from workers.transfer import TRANSFER_VERSION, PageClient, PageServer, TransferAuth

SECRET = b"m" * 32


def mesh_auth(encrypt: bool) -> tuple[TransferAuth, TransferAuth, KeyPair]:
    """The holder's and a requester's transfer credentials in one mesh, and a stranger's key."""
    holder, requester, stranger = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    peers = frozenset((holder.public, requester.public))
    return (
        TransferAuth(holder, peers, SECRET, encrypt),
        TransferAuth(requester, peers, SECRET, encrypt),
        stranger,
    )


@pytest.mark.parametrize("encrypt", [True, False], ids=["curve", "signed"])
def test_only_workers_of_the_mesh_get_pages(holder, requester, encrypt):
    store, pages = holder
    dst_store, dst = requester
    server_auth, client_auth, stranger = mesh_auth(encrypt)
    server = PageServer(store, auth=server_auth)
    gens = store.generations(pages[:4])
    try:
        member = PageClient(
            server.address, timeout_s=2.0, auth=client_auth, server_key=server_auth.keypair.public
        )
        assert member.fetch(pages[:4], gens, dst_store, dst[:4]) == [True] * 4
        assert torch.equal(dst_store.page(dst[0]), store.page(pages[0]))
        member.close()
        outsiders = [
            PageClient(server.address, timeout_s=0.5),  # no credentials at all
            PageClient(
                server.address,
                timeout_s=0.5,
                auth=TransferAuth(stranger, frozenset(), b"x" * 32, encrypt),
                server_key=server_auth.keypair.public,
            ),
        ]
        for outsider in outsiders:
            dst_store.page_range(dst[4], dst[8]).zero_()
            assert outsider.fetch(pages[:4], gens, dst_store, dst[4:8]) == [False] * 4
            assert not dst_store.page_range(dst[4], dst[8]).any()  # not one byte arrived
            outsider.close()
        assert server.health()["pages_sent"] == 4
        server.check_integrity()
    finally:
        server.stop()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_late_keys_are_fetched_only_for_strangers_and_at_most_once_an_interval():
    joined: list[bytes] = [b"a" * 40]
    clock = Clock()
    late = LateKeys(lambda: joined, interval_s=1.0, clock=clock)
    assert late(b"a" * 40) and late.fetches == 1
    assert late(b"a" * 40) and late.fetches == 1  # known: no fetch
    joined.append(b"b" * 40)
    assert not late(b"b" * 40)  # within the interval of the last fetch: refused, no fetch
    assert not late(b"x" * 40) and late.fetches == 1
    clock.now = 1.0
    assert late(b"b" * 40) and late.fetches == 2  # it joined: the next fetch finds it
    assert not late(b"x" * 40) and late.fetches == 2
    clock.now = 2.5
    joined.clear()  # a list that cannot be read admits nobody new, and keeps no one
    assert not late(b"x" * 40) and late.fetches == 3 and not late(b"a" * 40)

    def broken():
        raise RuntimeError("the cluster's store is gone")

    failing = LateKeys(broken, interval_s=1.0, clock=clock)
    assert not failing(b"a" * 40) and failing.fetches == 1


def test_a_reader_that_joins_after_the_server_started_gets_pages(holder, requester):
    """An engine's page server admits engines enrolled after it started: the list is read
    again when an unknown key knocks, and a stranger stays out."""
    store, pages = holder
    dst_store, dst = requester
    server_pair, newcomer, stranger = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()
    enrolled: set[bytes] = set()
    late = LateKeys(lambda: set(enrolled), interval_s=0.05)
    server = PageServer(
        store, auth=TransferAuth(server_pair, frozenset(), SECRET, True), late_readers=late
    )
    gens = store.generations(pages[:4])

    def client(pair: KeyPair, timeout_s: float) -> PageClient:
        auth = TransferAuth(pair, frozenset(), SECRET, True)
        key = server_pair.public
        return PageClient(server.address, timeout_s=timeout_s, auth=auth, server_key=key)

    try:
        enrolled.add(newcomer.public)  # it enrolled after the server started
        reader = client(newcomer, 5.0)
        assert reader.fetch(pages[:4], gens, dst_store, dst[:4]) == [True] * 4
        assert torch.equal(dst_store.page(dst[3]), store.page(pages[3]))
        reader.close()
        assert late.fetches == 1
        time.sleep(0.1)  # past the interval: the stranger's knock reads the list again
        for _ in range(3):
            outsider = client(stranger, 0.5)
            dst_store.page_range(dst[4], dst[8]).zero_()
            assert outsider.fetch(pages[:4], gens, dst_store, dst[4:8]) == [False] * 4
            assert not dst_store.page_range(dst[4], dst[8]).any()  # not one byte arrived
            outsider.close()
        assert server.health()["pages_sent"] == 4
        assert 2 <= late.fetches <= 4  # once for its first knock, then once an interval at most
        server.check_integrity()
    finally:
        server.stop()


def raw_request(socket: zmq.Socket, pages: list[int], generations: list[int]) -> None:
    """A page request as a minimal client would write it (no signature)."""
    request = {
        "v": TRANSFER_VERSION,
        "id": 1,
        "pages": np.asarray(pages, "<i4").tobytes(),
        "gens": np.asarray(generations, "<i8").tobytes(),
    }
    socket.send(msgpack.packb(request))


def test_an_unsigned_request_gets_no_bytes(holder):
    store, pages = holder
    server_auth, _, _ = mesh_auth(encrypt=False)
    server = PageServer(store, auth=server_auth)
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.rcvtimeo = 2000
    socket.connect(server.address)
    try:
        raw_request(socket, pages[:2], store.generations(pages[:2]))
        reply = socket.recv_multipart()
        assert len(reply) == 1 and "error" in msgpack.unpackb(reply[0])
        assert server.health()["pages_sent"] == 0
        server.check_integrity()
    finally:
        socket.close(linger=0)
        server.stop()


def fetch_seconds(client: PageClient, store, pages, dst_store, dst, rounds: int) -> list[float]:
    gens = store.generations(pages)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        assert all(client.fetch(pages, gens, dst_store, dst))
        times.append(time.perf_counter() - start)
    return times


@pytest.mark.parametrize("auth", [True, False], ids=["authenticated-staller", "no-auth"])
def test_a_reader_that_never_reads_stalls_no_one(holder, requester, auth):
    store, pages = holder
    dst_store, dst = requester
    server_auth, client_auth, _ = mesh_auth(encrypt=False) if auth else (None, None, None)
    server = PageServer(store, auth=server_auth, request_timeout_s=2.0)
    good = PageClient(server.address, timeout_s=5.0, auth=client_auth)
    staller = PageClient(server.address, timeout_s=60.0, auth=client_auth)
    staller_socket = staller._connect()
    staller_socket.rcvhwm = 1
    staller_socket.setsockopt(zmq.RCVBUF, 4096)
    try:
        idle = fetch_seconds(good, store, pages[:16], dst_store, dst[:16], rounds=12)
        # Ask for every page, signed as a real client would, and never read a byte.
        staller._send_request(staller_socket, pages, store.generations(pages))
        time.sleep(0.2)  # the server is now stuck on it, or has parked it
        busy = fetch_seconds(good, store, pages[:16], dst_store, dst[:16], rounds=12)
        assert statistics.median(busy) <= 2 * statistics.median(idle) + 0.005, (idle, busy)
        deadline = time.monotonic() + 10
        while server.health()["dropped"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = server.health()
        assert health["alive"] and health["dropped"] >= 1, health
        assert all(good.fetch(pages[:16], store.generations(pages[:16]), dst_store, dst[:16]))
        server.check_integrity()
    finally:
        staller.close()
        good.close()
        server.stop()


def test_the_serving_thread_is_restarted_if_it_dies(holder, requester, caplog):
    store, pages = holder
    dst_store, dst = requester
    server = PageServer(store)
    client = PageClient(server.address, timeout_s=2.0)
    try:
        assert all(client.fetch(pages[:2], store.generations(pages[:2]), dst_store, dst[:2]))
        thread = server._thread
        # Kill the thread for real: an exception no `except Exception` catches.
        killed = ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit)
        )
        assert killed == 1
        thread.join(5)
        assert not thread.is_alive()
        assert server.health()["alive"] is False
        assert server.ensure_running() is True  # restarted (the worker's publisher calls this)
        assert "page server thread died" in caplog.text
        health = server.health()
        assert health["alive"] and health["restarts"] == 1
        client.close()
        client = PageClient(server.address, timeout_s=2.0)
        assert all(client.fetch(pages[:2], store.generations(pages[:2]), dst_store, dst[:2]))
        server.check_integrity()
    finally:
        client.close()
        server.stop()


def test_malformed_requests_never_stop_the_server(holder, requester):
    store, pages = holder
    dst_store, dst = requester
    server = PageServer(store)
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.rcvtimeo = 2000
    socket.connect(server.address)
    try:
        for frame in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"v": 99})):
            socket.send(frame)
            assert "error" in msgpack.unpackb(socket.recv_multipart()[0])
        raw_request(socket, [store.num_pages + 5], [0])  # out of range
        assert "error" in msgpack.unpackb(socket.recv_multipart()[0])
        client = PageClient(server.address, timeout_s=2.0)
        assert all(client.fetch(pages[:2], store.generations(pages[:2]), dst_store, dst[:2]))
        client.close()
        assert server.health()["alive"] and server.health()["errors"] >= 5
        server.check_integrity()
    finally:
        socket.close(linger=0)
        server.stop()
