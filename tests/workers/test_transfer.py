"""Page copies between workers: shared memory on one node, the page server across nodes."""

from __future__ import annotations

import msgpack
import pytest
import torch
import zmq

from workers.page_store import SharedPageStore, StoreLayout
from workers.transfer import PageClient, PageServer, contiguous_runs, copy_from_peer

LAYOUT = StoreLayout(num_pages=12, num_layers=2, num_kv_heads=2, page_tokens=4, head_dim=8)


@pytest.fixture
def stores():
    holder = SharedPageStore.create(LAYOUT, tag="holder")
    requester = SharedPageStore.create(LAYOUT, tag="requester")
    pages = holder.allocate(6)
    for page in pages:
        holder.write_page(page, torch.full(LAYOUT.page_shape, float(page + 1)))
    yield holder, requester, pages
    holder.check_integrity()
    requester.check_integrity()
    requester.close()
    holder.close()


def test_contiguous_runs():
    assert contiguous_runs([3, 4, 5, 9, 1, 2]) == [(0, 3, 3), (3, 9, 1), (4, 1, 2)]
    assert contiguous_runs([]) == []


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


def test_remote_fetch_lands_exact_bytes_and_validates(stores):
    holder, requester, pages = stores
    server = PageServer(holder)
    client = PageClient(server.address, timeout_s=2.0)
    try:
        dst = requester.allocate(5)
        gens = holder.generations(pages[:5])
        gens[2] += 7  # the advertised generation is stale: that page must not be trusted
        valid = client.fetch(pages[:5], gens, requester, dst)
        assert valid == [True, True, False, True, True]
        for src, d in zip(pages[:5], dst, strict=True):
            assert torch.equal(requester.page(d), holder.page(src))
        assert server.pages_sent == 5
    finally:
        client.close()
        server.stop()


def test_bad_requests_get_error_and_the_server_keeps_serving(stores):
    holder, requester, pages = stores
    server = PageServer(holder)
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.rcvtimeo = 2000
    socket.connect(server.address)
    try:
        for frame in (
            b"garbage",
            msgpack.packb({"v": 1, "id": 1, "pages": b"\x00" * 3, "gens": b""}),
            msgpack.packb({"v": 1, "id": 1, "pages": (99).to_bytes(4, "little"), "gens": bytes(8)}),
        ):
            socket.send(frame)
            reply = msgpack.unpackb(socket.recv())
            assert "error" in reply
        client = PageClient(server.address)
        dst = requester.allocate(1)
        assert client.fetch(pages[:1], holder.generations(pages[:1]), requester, dst) == [True]
        client.close()
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
