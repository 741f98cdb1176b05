"""Who may say what to the service: keys bound to identities and roles, epochs issued by
the service, over the real server on loopback.

Findings covered: a hostile REGISTER for a live worker id dropped its holdings and locked
the real worker out for good; a BYE with a wrong epoch removed a live worker; anyone who
could reach the socket could speak for any worker.
"""

from __future__ import annotations

import pytest

from cache_service.auth import KeyPair
from cache_service.events import AllCleared, Namespace
from tests.security.service_rig import NS, serve
from workers.service.client import ServiceClient, ServiceError, ServiceUnavailable

PROMPT = list(range(13))  # 3 full pages of 4


def test_a_key_the_mesh_does_not_know_is_refused(auth_rig):
    for stranger in (auth_rig.client(KeyPair.generate()), _keyless(auth_rig)):
        with pytest.raises(ServiceUnavailable):
            stranger.stats()
        with pytest.raises(ServiceUnavailable):
            stranger.register("w9", "node-9", "cpu", "")
        with pytest.raises(ServiceUnavailable):
            stranger.peer("w0")  # nor may it learn where a worker's pages are
    assert auth_rig.server.stats()["workers_live"] == 0


def _keyless(rig) -> ServiceClient:
    """A client that knows the service's key but has no key of the mesh (a fresh pair)."""
    client = ServiceClient(rig.endpoint, timeout_s=0.5, retries=0)
    rig.track(client)
    return client


def test_a_worker_key_speaks_only_for_its_own_worker(auth_rig):
    cache, publisher = auth_rig.worker("w0")
    serve(cache, PROMPT)
    assert publisher.sync()
    w1 = auth_rig.client("w1")
    epoch = publisher.epoch
    refused = [
        lambda: w1.register("w0", "node-1", "cpu", ""),
        lambda: w1.heartbeat("w0", epoch),
        lambda: w1.publish_events("w0", epoch, publisher.seq + 1, [AllCleared()]),
        lambda: w1.resync("w0", epoch, publisher.seq + 1, []),
        lambda: w1.bye("w0", epoch),
        lambda: w1.match(NS, PROMPT, requester="w0"),
        lambda: w1.stats(),
        lambda: w1.report_dead("w0"),
        lambda: w1.name_tenant(NS.salt, "acme"),
    ]
    for call in refused:
        with pytest.raises(ServiceError) as info:
            call()
        assert info.value.code == "forbidden", info.value
    # What a worker key may do for itself and for lookups.
    assert w1.register("w1", "node-1", "cpu", "").epoch > 0
    assert w1.match(NS, PROMPT, requester="w1").matched_tokens == 12
    assert w1.match(NS, PROMPT).matched_tokens == 12
    assert w1.route(NS, PROMPT, {"w0": 0.0, "w1": 0.0}).worker_id == "w0"
    assert w1.peer("w0").epoch == epoch  # and where its peers' pages are
    assert [entry.worker_id for entry in w1.peers()] == ["w0", "w1"]
    front = auth_rig.client("front_door")
    assert front.stats()["workers"]["w0"]["pages"] == 3  # w0 kept everything
    cache.check_integrity()


def test_the_front_door_looks_up_and_reports_but_never_publishes(auth_rig):
    cache, publisher = auth_rig.worker("w0")
    serve(cache, PROMPT)
    assert publisher.sync()
    front = auth_rig.client("front_door")
    for call in (
        lambda: front.register("w0", "node-1", "cpu", ""),
        lambda: front.publish_events("w0", publisher.epoch, publisher.seq + 1, [AllCleared()]),
        lambda: front.heartbeat("w0", publisher.epoch),
        lambda: front.bye("w0", publisher.epoch),
        lambda: front.match(NS, PROMPT, requester="w0"),
    ):
        with pytest.raises(ServiceError) as info:
            call()
        assert info.value.code == "forbidden", info.value
    assert front.match(NS, PROMPT).matched_tokens == 12
    assert front.route(NS, PROMPT, {"w0": 0.0}).reason == "prefix"
    front.name_tenant(NS.salt, "acme")
    assert "acme" in front.stats()["tenants"]
    assert front.peer("w0").epoch == publisher.epoch
    front.report_dead("w0")  # the front door saw the worker's actor die
    assert front.match(NS, PROMPT).matched_tokens == 0
    assert front.peer("w0") is None
    assert front.stats()["removed_workers"] == {"reported_dead": 1}


def test_a_hostile_register_does_not_lock_the_worker_out(rig):
    cache, publisher = rig.worker("w0")
    serve(cache, PROMPT)
    assert publisher.sync()
    hostile = rig.client("w1")  # another worker's key, or anyone without authentication
    if rig.auth:
        with pytest.raises(ServiceError, match="forbidden"):
            hostile.register("w0", "node-6", "cpu", "")
    else:
        taken = hostile.register("w0", "node-6", "cpu", "")  # a new incarnation of "w0"
        assert taken.epoch != publisher.epoch
    # The real worker carries on: at worst it notices, registers again and resyncs.
    assert publisher.heartbeat()
    serve(cache, list(range(100, 109)))
    assert publisher.sync()
    front = rig.client("front_door")
    assert front.match(NS, PROMPT, requester=None).matched_tokens == 12
    assert front.match(NS, list(range(100, 109))).matched_tokens == 8
    assert front.stats()["workers"]["w0"]["pages"] == 5
    cache.check_integrity()


def test_epochs_are_issued_by_the_service(rig):
    client = rig.client("w0")
    first = client.register("w0", "node-1", "cpu", "")
    second = client.register("w0", "node-1", "cpu", "")  # the worker restarted
    assert second.epoch > first.epoch > 0
    assert second.service_epoch == first.service_epoch == rig.server.epoch
    stale = first.epoch
    with pytest.raises(ServiceError, match="unknown_worker"):
        client.heartbeat("w0", stale)
    reply = client.publish_events("w0", stale, 1, [AllCleared()])
    assert (reply.applied, reply.needs_resync, reply.reason) == (False, True, "epoch_mismatch")
    assert client.heartbeat("w0", second.epoch).service_epoch == rig.server.epoch


def test_a_bye_with_another_epoch_leaves_the_worker_alone(rig):
    cache, publisher = rig.worker("w0")
    serve(cache, PROMPT)
    assert publisher.sync()
    speaker = rig.client("w0")
    for wrong in (publisher.epoch + 1, publisher.epoch - 1, 0):
        with pytest.raises(ServiceError, match="stale_epoch"):
            speaker.bye("w0", wrong)
    front = rig.client("front_door")
    assert front.match(NS, PROMPT).matched_tokens == 12
    speaker.bye("w0", publisher.epoch)  # the right epoch: the worker leaves
    assert front.match(NS, PROMPT).matched_tokens == 0
    assert front.stats()["removed_workers"] == {"bye": 1}


def test_a_worker_may_not_count_its_lookups_as_another_worker(rig):
    cache, publisher = rig.worker("w0")
    serve(cache, PROMPT)
    assert publisher.sync()
    rig.worker("w1")
    w1 = rig.client("w1")
    w1.match(NS, PROMPT, requester="w1")
    if rig.auth:
        with pytest.raises(ServiceError, match="forbidden"):
            w1.match(NS, PROMPT, requester="w0")
    stats = rig.client("front_door").stats()
    assert stats["workers"]["w1"]["remote_hit_tokens"] == 12
    assert stats["workers"]["w1"]["local_hit_tokens"] == 0


def test_another_tenant_namespace_is_not_a_key(rig):
    """Salts are names of namespaces, not credentials: knowing one grants nothing."""
    cache, publisher = rig.worker("w0")
    serve(cache, PROMPT)
    assert publisher.sync()
    other = Namespace("m", salt="salt-of-tenant-b")
    assert rig.client("front_door").match(other, PROMPT).matched_tokens == 0
