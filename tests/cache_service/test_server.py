"""The service over real ZMQ sockets: server loop, client, publisher, faults."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service import handlers, protocol
from cache_service.auth import KeyPair, MeshKeys
from cache_service.events import Namespace, PagesDemoted, PagesRemoved, PagesStored
from cache_service.index import OwnerError
from cache_service.messages import GetStats, HolderSpan, PeerEntry, PublishEvents, StatsReply
from cache_service.server import ServerConfig, make_server
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.service.client import ServiceClient, ServiceEndpoint, ServiceError, ServiceUnavailable
from workers.service.publisher import EventPublisher
from workers.store.page_pool import PagePool

NS = Namespace("m", salt="t1")
P = 4


class FakeClock:
    """The server's clock, moved by hand: liveness without real sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server():
    srv = make_server(ServerConfig(page_tokens=P, liveness_timeout_s=30.0))
    srv.start()
    yield srv
    srv.check_integrity()
    srv.stop()


def _client(srv, **kw) -> ServiceClient:
    kw.setdefault("timeout_s", 0.5)
    return ServiceClient(ServiceEndpoint(srv.address), **kw)


def _worker(srv, worker_id: str, pages: int = 64):
    cache = PrefixCache(PagePool(pages), PrefixCacheConfig(page_tokens=P))
    publisher = EventPublisher(_client(srv), cache, worker_id, node_id="node-1")
    assert publisher.sync()
    return cache, publisher


def _serve(cache: PrefixCache, tokens: list[int]) -> None:
    allocation = cache.acquire(tokens, NS)
    allocation.publish(len(tokens))
    allocation.release()


def test_events_reach_the_index_and_match_names_holders(server):
    cache_a, pub_a = _worker(server, "a")
    cache_b, pub_b = _worker(server, "b")
    _serve(cache_a, list(range(13)))  # 3 full pages
    _serve(cache_b, list(range(9)))  # 2 full pages of the same prefix
    assert pub_a.sync() and pub_b.sync()
    client = _client(server)
    matched, spans = client.match(NS, list(range(12)) + [99], requester="b")
    assert matched == 12
    assert [(s.worker_id, len(s.page_ids)) for s in spans] == [("a", 3), ("b", 2)]
    assert spans[0].page_ids == (0, 1, 2)
    assert client.match(Namespace("m", salt="t2"), list(range(12)), None)[0] == 0
    decision = client.route(NS, list(range(12)) + [99], {"a": 0.0, "b": 0.0})
    assert decision.worker_id == "a"
    stats = client.stats()
    assert stats["service"]["errors"] == 0
    assert stats["cluster"]["remote_hit_tokens"] == 4 and stats["cluster"]["local_hit_tokens"] == 8
    cache_a.check_integrity()
    cache_b.check_integrity()


def test_a_heartbeat_brings_back_the_pages_a_peer_stored_since(server):
    """Cluster-aware eviction over the wire: b stores a's pages (as a copy in would), and
    a's next heartbeat marks them in a's cache, which then evicts them before an older
    page only a holds."""
    cache_a, pub_a = _worker(server, "a", pages=4)
    cache_b, pub_b = _worker(server, "b")
    _serve(cache_a, list(range(100, 105)))  # page 0: only a's, and the older
    _serve(cache_a, list(range(9)))  # pages 1, 2
    _serve(cache_b, list(range(9)))
    assert pub_a.sync() and pub_b.sync()
    assert pub_a.heartbeat() and pub_b.heartbeat()
    assert pub_a.held_elsewhere == 2 and pub_b.held_elsewhere == 0
    assert cache_a.stats()["held_elsewhere_marked_pages"] == 2
    assert pub_a.heartbeat() and pub_a.held_elsewhere == 2  # each notice comes once
    _serve(cache_a, list(range(200, 209)))  # needs 3 pages: 1 free, 2 evicted
    assert cache_a.stats()["held_elsewhere_evicted_pages"] == 2
    assert cache_a.acquire(list(range(100, 105)), NS).cached_tokens == 4  # kept
    assert pub_a.sync()
    client = _client(server)
    _, spans = client.match(NS, list(range(9)))
    assert [s.worker_id for s in spans] == ["b"]  # the mesh still holds the prefix
    assert server.stats()["superseded"]["issued"] == 2
    cache_a.check_integrity()
    cache_b.check_integrity()


def test_evictions_leave_the_index(server):
    cache, pub = _worker(server, "a", pages=3)
    _serve(cache, list(range(9)))  # pages 0, 1 published; 2 private, freed
    _serve(cache, list(range(100, 109)))  # evicts the first prompt's pages
    assert pub.sync()
    client = _client(server)
    assert client.match(NS, list(range(9)))[0] == 0
    assert client.match(NS, list(range(100, 109)))[0] == 8
    cache.check_integrity()


def test_a_lost_batch_is_repaired_by_resync(server):
    cache, pub = _worker(server, "a")
    _serve(cache, list(range(9)))
    cache.take_events()  # this batch never reaches the service
    pub.seq += 1
    _serve(cache, list(range(50, 59)))
    assert pub.sync()  # gap -> the service asks for a resync -> snapshot
    assert pub.resyncs == 2
    client = _client(server)
    assert client.match(NS, list(range(9)))[0] == 8
    assert client.match(NS, list(range(50, 59)))[0] == 8


def test_duplicate_batch_is_idempotent(server):
    cache, pub = _worker(server, "a")
    _serve(cache, list(range(9)))
    events = cache.take_events()
    client = _client(server)
    first = client.publish_events("a", pub.epoch, pub.seq + 1, events)
    again = client.publish_events("a", pub.epoch, pub.seq + 1, events)
    assert (first.applied, again.applied, again.reason) == (True, False, "duplicate")
    assert first.last_seq == again.last_seq == pub.seq + 1
    assert server.stats()["pages"] == 2


def test_tiers_travel_and_a_bad_tier_gets_an_error_reply(server):
    client = _client(server)
    epoch = client.register("a", "node-1").epoch
    tokens = tuple(range(12))
    chain = PagesStored(NS, None, (0, 1, 2), (1, 1, 1), tokens)
    assert client.publish_events("a", epoch, 1, [chain]).applied
    # A batch naming a tier the service does not know, as some sender might write it:
    # refused whole with an error reply that names the field, and nothing changes.
    demoted = PagesDemoted((2,), (102,), (2,), "disk")
    frame = protocol.encode(protocol.request(1, PublishEvents("a", epoch, 2, [demoted])))
    body = msgpack.unpackb(frame)
    body["b"]["events"][0][4] = "tape"
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger, socket.rcvtimeo = 0, 2000
    socket.connect(server.address)
    try:
        socket.send(msgpack.packb(body))
        reply = protocol.decode(socket.recv(), "reply")
    finally:
        socket.close(linger=0)
    assert reply.type == protocol.ERROR and reply.body.code == protocol.BAD_FIELD
    assert reply.body.message.startswith("events.events[0].tier: expected a tier")
    # The service keeps serving, and the same seq applies once the tier is right.
    assert client.publish_events("a", epoch, 2, [demoted]).applied
    matched, spans = client.match(NS, list(tokens))
    assert (matched, spans) == (12, (HolderSpan("a", "host", (0, 1, 102), (1, 1, 2), b"\1\1\2"),))
    assert spans[0].tier_of(2) == "disk"
    assert client.publish_events("a", epoch, 3, [PagesRemoved((102,), "evicted", "disk")]).applied
    stats = client.stats()
    assert stats["tiers"] == {"device": 0, "host": 2, "disk": 0}
    assert stats["removals"] == {"disk": {"evicted": 1}} and stats["demotions"] == {"disk": 1}


def test_heartbeat_of_unknown_worker_is_an_error_reply(server):
    with pytest.raises(ServiceError) as info:
        _client(server).heartbeat("ghost", 1)
    assert info.value.code == "unknown_worker"


def test_silent_worker_expires():
    clock = FakeClock()
    fast = make_server(ServerConfig(page_tokens=P, liveness_timeout_s=0.3), clock=clock)
    fast.start()
    try:
        cache, pub = _worker(fast, "a")
        _serve(cache, list(range(9)))
        assert pub.sync()
        client = _client(fast)
        assert client.match(NS, list(range(9)))[0] == 8
        clock.now += 0.3  # exactly the timeout: still alive
        assert fast.run_housekeeping() == []
        clock.now += 0.01
        # The loop's own housekeeping round (on the same clock) may expire it first.
        assert fast.run_housekeeping() in (["a"], [])
        assert fast.stats()["removed_workers"] == {"expired": 1}
        assert client.match(NS, list(range(9)))[0] == 0
        assert pub.heartbeat()  # comes back: registers again and resyncs
        assert client.match(NS, list(range(9)))[0] == 8
    finally:
        fast.check_integrity()
        fast.stop()


def test_heartbeats_keep_a_worker_alive():
    clock = FakeClock()
    srv = make_server(ServerConfig(page_tokens=P, liveness_timeout_s=1.0), clock=clock)
    srv.start()
    try:
        cache, pub = _worker(srv, "a")
        for _ in range(5):  # 5 s in all, never 1 s without a heartbeat
            clock.now += 0.9
            assert pub.heartbeat()
            assert srv.run_housekeeping() == []
        assert srv.stats()["workers_live"] == 1
        assert pub.resyncs == 1  # registered once: nothing was lost
    finally:
        srv.stop()


SHM_A = "kvmesh-101-202-a"
KEY_A = KeyPair.generate().public


def _peer_worker(srv, worker_id: str, address: str, shm_name: str, page_key=None, **kw):
    """A worker's publisher as the Worker builds it: with its page server and store."""
    cache = PrefixCache(PagePool(16), PrefixCacheConfig(page_tokens=P))
    publisher = EventPublisher(
        _client(srv, **kw),
        cache,
        worker_id,
        node_id="node-1",
        tier="gpu",
        address=address,
        shm_name=shm_name,
        page_key=page_key,
    )
    assert publisher.sync()
    return publisher


def test_get_peer_answers_what_register_carried(server):
    pub = _peer_worker(server, "a", "tcp://127.0.0.1:7001", SHM_A, KEY_A)
    client = _client(server)
    entry = client.peer("a")
    assert type(entry) is PeerEntry
    assert entry == PeerEntry("a", pub.epoch, "node-1", "gpu", "tcp://127.0.0.1:7001", SHM_A, KEY_A)
    keyless = _peer_worker(server, "b", "", "")
    assert client.peer("b") == PeerEntry("b", keyless.epoch, "node-1", "gpu", "", "", None)
    assert client.peers() == [entry, client.peer("b")]
    assert client.peer("ghost") is None  # an ordinary answer, not an error for the caller
    assert client.stats()["service"]["errors"] == 1  # the service answered it with one


def test_a_reregistered_workers_entry_is_replaced(server):
    pub = _peer_worker(server, "a", "tcp://127.0.0.1:7001", SHM_A, KEY_A)
    first = pub.epoch
    # The worker restarted: a new process, a new store and page server, a new epoch.
    again = _peer_worker(server, "a", "tcp://127.0.0.1:7002", "kvmesh-303-404-a")
    client = _client(server)
    assert again.epoch > first
    assert client.peer("a") == PeerEntry(
        "a", again.epoch, "node-1", "gpu", "tcp://127.0.0.1:7002", "kvmesh-303-404-a", None
    )
    assert [entry.worker_id for entry in client.peers()] == ["a"]


def test_a_worker_that_leaves_or_dies_has_no_entry(server):
    client = _client(server)
    leaving = _peer_worker(server, "a", "tcp://127.0.0.1:7001", SHM_A)
    dying = _peer_worker(server, "b", "tcp://127.0.0.1:7002", "kvmesh-303-404-b")
    leaving.stop(bye=True)
    assert client.peer("a") is None
    client.report_dead("b")
    assert client.peer("b") is None and client.peers() == []
    assert dying.heartbeat()  # it was not dead after all: it registers again
    assert client.peer("b").epoch == dying.epoch and client.peers() == [client.peer("b")]


def test_an_expired_worker_has_no_entry():
    clock = FakeClock()
    fast = make_server(ServerConfig(page_tokens=P, liveness_timeout_s=0.3), clock=clock)
    fast.start()
    try:
        _peer_worker(fast, "a", "tcp://127.0.0.1:7001", SHM_A)
        client = _client(fast)
        assert client.peer("a") is not None
        clock.now += 0.31
        fast.run_housekeeping()  # (or the loop's own round, whichever comes first)
        assert fast.stats()["removed_workers"] == {"expired": 1}
        assert client.peer("a") is None and client.peers() == []
    finally:
        fast.check_integrity()
        fast.stop()


def test_peers_come_a_page_at_a_time(server, monkeypatch):
    monkeypatch.setattr(handlers, "PEERS_PER_PAGE", 2)
    client = _client(server)
    for worker_id in ("e", "a", "d", "b", "c"):
        client.register(worker_id, "node-1", "cpu", "", f"kvmesh-1-2-{worker_id}")
    entries = client.peers()
    assert [entry.worker_id for entry in entries] == ["a", "b", "c", "d", "e"]
    assert [entry.shm_name for entry in entries] == [f"kvmesh-1-2-{w}" for w in "abcde"]
    assert server.stats()["service"]["requests"] == 5 + 3  # five registers, three pages


def test_peer_lookups_and_page_keys_under_authentication():
    keys = MeshKeys.generate(["w0", "w1"])
    srv = make_server(ServerConfig(page_tokens=P), keys=keys.server_keys())
    srv.start()
    endpoint = ServiceEndpoint(srv.address, keys.service.public)
    clients = []

    def client(pair) -> ServiceClient:
        clients.append(ServiceClient(endpoint, timeout_s=0.5, retries=0, client_keys=pair))
        return clients[-1]

    try:
        w0, w1 = client(keys.workers["w0"]), client(keys.workers["w1"])
        own = keys.workers["w0"].public
        # A worker advertises its own key for its page server, or none; never another's.
        for other in (keys.workers["w1"].public, keys.front_door.public, KEY_A):
            with pytest.raises(ServiceError, match="only its own key") as info:
                w0.register("w0", "node-1", "cpu", "tcp://127.0.0.1:7001", SHM_A, other)
            assert info.value.code == "forbidden"
        assert w0.peer("w0") is None  # nothing registered by the refusals
        registered = w0.register("w0", "node-1", "cpu", "tcp://127.0.0.1:7001", SHM_A, own)
        expected = PeerEntry(
            "w0", registered.epoch, "node-1", "cpu", "tcp://127.0.0.1:7001", SHM_A, own
        )
        assert w1.peer("w0") == expected  # a worker looks up its peers
        assert w1.peers() == [expected]
        front = client(keys.front_door)
        assert front.peer("w0") == expected and front.peers() == [expected]
        assert w1.register("w1", "node-1", "cpu", "", "", None).epoch > 0  # auth off for pages
        for stranger in (client(KeyPair.generate()), client(None)):
            with pytest.raises(ServiceUnavailable):
                stranger.peer("w0")
            with pytest.raises(ServiceUnavailable):
                stranger.peers()
    finally:
        for each in clients:
            each.close()
        srv.check_integrity()
        srv.stop()


def test_the_index_is_reached_only_through_the_loop(server):
    cache, pub = _worker(server, "a")
    _serve(cache, list(range(9)))
    assert pub.sync()
    with pytest.raises(OwnerError, match="owned by thread 'kvmesh-service'"):
        server.index.stats()  # the test's thread may not touch it while the loop runs
    with pytest.raises(OwnerError):
        server.index.match(NS, list(range(9)))
    stats = server.stats()  # through the loop
    assert stats["pages"] == 2 and stats["service"]["address"] == server.address
    server.check_integrity()
    results = []
    threads = [threading.Thread(target=lambda: results.append(server.stats())) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert [r["pages"] for r in results] == [2] * 8
    server.stop()
    assert server.index.num_pages == 2  # stopped: the index is the caller's again
    assert server.stats()["pages"] == 2


def test_a_failing_call_in_the_loop_raises_in_the_caller(server):
    def corrupt_and_check() -> None:
        pages = server.index._registry.workers["a"].pages  # on the loop thread, on purpose
        node = pages.pop(0)
        try:
            server.index.check_integrity()
        finally:
            pages.set(0, node)

    cache, pub = _worker(server, "a")
    _serve(cache, list(range(9)))
    assert pub.sync()
    with pytest.raises(AssertionError, match="2 holders on nodes, 1 in reverse maps"):
        server._in_loop(corrupt_and_check)
    assert "cluster" in _client(server).stats()  # the loop keeps serving


def test_restarted_service_gets_holdings_back_from_workers():
    srv = make_server(ServerConfig(page_tokens=P))
    srv.start()
    port = int(srv.address.rsplit(":", 1)[1])
    cache, pub = _worker(srv, "a")
    _serve(cache, list(range(9)))
    assert pub.sync()
    srv.stop()
    restarted = make_server(ServerConfig(page_tokens=P, port=port))
    restarted.start()
    try:
        assert restarted.stats()["pages"] == 0
        assert pub.heartbeat()  # new epoch -> register + resync
        assert restarted.stats()["pages"] == 2
        assert _client(restarted).match(NS, list(range(9)))[0] == 8
    finally:
        restarted.check_integrity()
        restarted.stop()


def test_no_service_raises_unavailable_quickly():
    context = zmq.Context.instance()
    probe = context.socket(zmq.ROUTER)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    client = ServiceClient(ServiceEndpoint(f"tcp://127.0.0.1:{port}"), timeout_s=0.1, retries=1)
    start = time.monotonic()
    with pytest.raises(ServiceUnavailable, match="after 2 tries of 0.1s"):
        client.stats()
    assert time.monotonic() - start < 2.0
    assert client.reconnects == 2


def test_late_reply_to_an_earlier_try_is_dropped():
    """A server that answers the first try too late: the client must not take that
    stale reply as the answer to its retry."""
    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: list[int] = []

    def slow_server():
        for _ in range(2):
            identity, frame = router.recv_multipart()
            request = protocol.decode(frame)
            seen.append(request.request_id)
        # the first try's reply comes only now, before the retry's
        for request_id, epoch in ((seen[0], 111), (seen[1], 222)):
            msg = protocol.Message(protocol.OK, request_id, StatsReply({"e": epoch}), "stats")
            router.send_multipart([identity, protocol.encode(msg)])

    thread = threading.Thread(target=slow_server, daemon=True)
    thread.start()
    # Same identity across reconnects is not guaranteed, so keep one socket: retries=0
    # with a first call that times out, then a second call on the same socket.
    client = ServiceClient(ServiceEndpoint(f"tcp://127.0.0.1:{port}"), timeout_s=0.3, retries=0)
    client._reset = lambda: None  # keep the socket so the late reply reaches it
    with pytest.raises(ServiceUnavailable):
        client.stats()
    assert client.stats() == {"e": 222}
    thread.join(2)
    router.close(linger=0)


def test_a_curve_server_admits_only_the_keys_of_its_mesh():
    keys = MeshKeys.generate(["w0"])
    srv = make_server(ServerConfig(page_tokens=P), keys=keys.server_keys())
    srv.start()
    try:
        endpoint = ServiceEndpoint(srv.address, keys.service.public)
        member = ServiceClient(endpoint, timeout_s=1.0, client_keys=keys.front_door)
        assert "cluster" in member.stats()
        member.close()
        outsiders = [
            ServiceClient(ServiceEndpoint(srv.address), timeout_s=0.2, retries=0),  # plain
            ServiceClient(endpoint, timeout_s=0.2, retries=0),  # a fresh key of its own
            ServiceClient(  # the wrong server key
                ServiceEndpoint(srv.address, KeyPair.generate().public),
                timeout_s=0.2,
                retries=0,
                client_keys=keys.front_door,
            ),
        ]
        for outsider in outsiders:
            with pytest.raises(ServiceUnavailable):
                outsider.stats()
            outsider.close()
    finally:
        srv.stop()


@pytest.mark.parametrize("host", ["*", "0.0.0.0", "::", "[::]", "", "0", "0.0.0.00"])
def test_server_refuses_to_bind_every_interface(host):
    with pytest.raises(ValueError, match="every interface"):
        ServerConfig(host=host)


# ---------------------------------------------------------------- malformed frames


def _frames():
    valid = protocol.encode(protocol.request(5, GetStats()))
    envelope = {
        "v": protocol.PROTOCOL_VERSION,
        "t": "match",
        "id": 9,
        "b": {"namespace": ["m", "", ""], "tokens": b"\x00" * 8, "requester": None},
    }
    return st.one_of(
        st.binary(max_size=200).map(lambda b: [b]),
        st.integers(1, len(valid) - 1).map(lambda n: [valid[:n]]),  # truncated
        st.just([valid, valid]),  # an extra frame
        st.just([]),  # no payload at all
        st.just([msgpack.packb({**envelope, "t": "nope"})]),
        st.just([msgpack.packb({**envelope, "v": protocol.PROTOCOL_VERSION + 1})]),
        st.just([msgpack.packb({**envelope, "b": {**envelope["b"], "tokens": b"\x00" * 7}})]),
        st.just([msgpack.packb({**envelope, "b": {**envelope["b"], "extra": 1}})]),
        st.just([msgpack.packb({**envelope, "b": {**envelope["b"], "namespace": True}})]),
        st.just([b"\x91" * 5000 + b"\xc0"]),  # deep nesting
        st.just([b"\xdd\xff\xff\xff\xff"]),  # an array header claiming 4 billion items
        st.just(
            [
                msgpack.packb(
                    {
                        **envelope,
                        "b": {
                            "namespace": ["m", "", ""],
                            "tokens": b"\x00" * 8,
                            "requester": "x" * 10_000,
                        },
                    }
                )
            ]
        ),
    )


@pytest.fixture(scope="module")
def shared_server():
    srv = make_server(ServerConfig(page_tokens=P))
    srv.start()
    yield srv
    srv.stop()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(frames=_frames())
def test_malformed_frames_get_error_replies_and_service_keeps_serving(shared_server, frames):
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.rcvtimeo = 2000
    socket.connect(shared_server.address)
    try:
        errors_before = shared_server.errors
        socket.send_multipart(frames) if frames else socket.send_multipart([b""])
        # the last frame is the reply (a leading empty frame is echoed as a delimiter)
        reply = protocol.decode(socket.recv_multipart()[-1], "reply")
        assert reply.type == protocol.ERROR
        assert reply.body.code in protocol.ERROR_CODES
        assert shared_server.errors == errors_before + 1
        good = protocol.encode(protocol.request(77, GetStats()))
        socket.send(good)
        ok = protocol.decode(socket.recv(), "reply")
        assert (ok.type, ok.request_id) == (protocol.OK, 77)
    finally:
        socket.close(linger=0)
