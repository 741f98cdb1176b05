"""No client can grow the service's state without bound, and STATS gives nothing away.

Findings covered: 32,767 fake registrations filled the registry and a real worker was
refused; 256 throwaway tier names were never forgotten; per-(salt, requester) tallies grew
without bound until STATS exceeded the frame limit for good (and each failed STATS held
the loop for seconds); STATS handed every tenant's salt to any client.
"""

from __future__ import annotations

import tracemalloc

import msgpack

from cache_service import protocol
from cache_service.events import Namespace
from cache_service.index import GlobalIndex
from cache_service.messages import StatsReply
from tests.security.service_rig import NS, P, ServiceRig, serve
from workers.service.client import ServiceError

PROMPT = list(range(13))


def test_fake_registrations_cannot_crowd_out_a_real_worker(rig):
    flood = rig.client("w1")
    refused = 0
    for i in range(300 if rig.auth else 2000):
        try:
            flood.register(f"fake-{i}", "node-x", "cpu", "")
        except ServiceError as exc:
            assert exc.code in ("forbidden", "registry_full"), exc
            refused += 1
    stats = rig.client("front_door").stats()
    assert stats["workers_live"] <= rig.server.config.max_workers
    if rig.auth:
        assert refused == 300 and stats["workers_live"] == 0
    cache, publisher = rig.worker("w0")  # a real worker still gets in...
    serve(cache, PROMPT)
    assert publisher.sync()
    for i in range(2000, 2000 + (0 if rig.auth else 2000)):  # ...and is not pushed out
        flood.register(f"fake-{i}", "node-x", "cpu", "")
    assert publisher.heartbeat() and publisher.resyncs == 1
    front = rig.client("front_door")
    assert front.match(NS, PROMPT).matched_tokens == 12
    assert front.stats()["workers_live"] <= rig.server.config.max_workers


def test_tier_names_are_forgotten_with_their_last_worker(rig):
    client = rig.client("w0")
    for i in range(300):
        registered = client.register("w0", "node-1", f"tier-{i}", "")
        client.bye("w0", registered.epoch)
    front = rig.client("front_door")
    no_pages = {"device": 0, "host": 0, "disk": 0}  # pages per tier: the names are fixed
    assert front.stats()["tiers"] == no_pages
    cache, publisher = rig.worker("w1")  # a registration still fits
    assert front.stats()["tiers"] == no_pages
    serve(cache, PROMPT)
    assert publisher.sync()
    assert front.stats()["tiers"] == {**no_pages, "host": 3}
    assert front.match(NS, PROMPT).spans[0].tier == "host"


def test_tallies_stay_bounded_whatever_the_requesters_and_tenants():
    index = GlobalIndex(page_tokens=P, max_workers=8, max_tenants=16)
    index.register("w0", "node-0", now=0.0)
    tokens = list(range(16))
    tracemalloc.start()
    try:
        index.match(NS, tokens, requester="w0")
        before = tracemalloc.get_traced_memory()[0]
        for i in range(150_000):
            namespace = Namespace("m", salt=f"salt-{i % 5000}")
            index.match(namespace, tokens, requester=f"ghost-{i}")  # no such worker
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 1 << 20, f"150,000 queries grew the index by {grown} bytes"
    stats = index.stats()
    assert list(stats["tenants"]) == ["(unnamed)"]  # none named: they share one tally
    assert set(stats["workers"]) <= {"w0", "(unregistered)", "(removed)"}
    assert stats["cluster"]["queries"] == 150_001
    frame = protocol.encode(protocol.Message(protocol.OK, 1, StatsReply(stats), protocol.STATS))
    assert len(frame) < 64 << 10
    index.check_integrity()


def test_stats_stay_answerable_after_many_lookups(rig):
    cache, publisher = rig.worker("w0")
    serve(cache, PROMPT)
    assert publisher.sync()
    speaker = rig.client("w0")
    for i in range(2000):
        speaker.match(Namespace("m", salt=f"salt-{i}"), PROMPT, requester="w0")
    stats = rig.client("front_door", timeout_s=2.0).stats()
    assert stats["cluster"]["queries"] == 2000
    assert len(stats["tenants"]) <= rig.server.config.max_tenants + 2


def test_stats_never_return_salts(rig):
    cache, publisher = rig.worker("w0")
    serve(cache, PROMPT)
    assert publisher.sync()
    unnamed = Namespace("m", salt="salt-of-a-tenant-nobody-named")
    front = rig.client("front_door")
    front.name_tenant(NS.salt, "acme")  # before its first request, as the front door does
    rig.client("w0").match(NS, PROMPT, requester="w0")
    rig.client("w0").match(unnamed, PROMPT, requester="w0")
    stats = front.stats()
    assert stats["tenants"]["acme"]["queries"] == 1
    assert stats["tenants"]["(unnamed)"]["queries"] == 1
    wire = msgpack.packb(stats)
    for salt in (NS.salt, unnamed.salt):
        assert salt.encode() not in wire


def test_a_match_names_a_bounded_number_of_holders():
    rig = ServiceRig(auth=False, max_spans=4)
    try:
        publishers = []
        for i in range(6):
            cache, publisher = rig.worker(f"w{i}")
            serve(cache, PROMPT[: 4 * (i + 1) + 1] if i < 3 else PROMPT)
            assert publisher.sync()
            publishers.append(publisher)
        result = rig.client().match(NS, PROMPT)
        assert result.matched_tokens == 12
        assert [span.worker_id for span in result.spans] == ["w2", "w3", "w4", "w5"]
    finally:
        rig.close()


def test_a_stats_reply_too_large_for_a_frame_is_truncated_and_says_so():
    rig = ServiceRig(auth=False, limits=protocol.Limits(max_frame_bytes=4096))
    try:
        for i in range(40):
            rig.client().register(f"worker-with-a-long-name-{i:03d}", "node-1", "cpu", "")
        stats = rig.client().stats()
        assert stats["truncated"] is True
        assert stats["workers_live"] == 40  # the totals stay whole
        assert len(stats["workers"]) < 40
    finally:
        rig.close()
