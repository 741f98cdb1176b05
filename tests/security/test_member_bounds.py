"""A member of the mesh cannot grow the service's state with its own legitimate key.

Findings covered (each tried with a real worker key): a worker claimed 40 batches of
65,536 pages it did not hold and the service grew from 45 to 725 MiB; junk salts from a
worker filled the 256 tenant tallies, and a tenant the front door named afterwards showed
only as "(other)"; 254 enrollments through Ray in half a second used up the mesh's engine
places, for good (they survived a restart of the service actor).
"""

from __future__ import annotations

import pytest
import ray

from cache_service import enroll_tokens
from cache_service.actor import MAX_ENROLLED, enrolled_publics, start_service, stop_service
from cache_service.auth import KeyPair, MeshKeys
from cache_service.events import Namespace
from cache_service.messages import EMPTY_REPORT, TenantTokens
from cache_service.server import ServerConfig
from tests.cache_service.test_metrics import samples, scrape
from tests.security.service_rig import NS, P, ServiceRig, forged_chain, serve
from workers.service.client import ServiceClient, ServiceError, ray_resolver

CAPACITY = 64


def claim(pages: int, first: int = 0) -> list:
    """One chain claiming `pages` pages (ids from `first`) of made-up tokens."""
    ids = tuple(range(first, first + pages))
    return [forged_chain(NS, ids, (0,) * pages, [7 + first] * (pages * P))]


# ---- holdings bounded by capacity ------------------------------------------------------


def test_claims_past_the_registered_capacity_are_refused(rig):
    client = rig.client("w0")
    epoch = client.register("w0", "node-1", "cpu", "", capacity=CAPACITY).epoch
    front = rig.client("front_door")
    result = client.publish_events("w0", epoch, 1, claim(CAPACITY + 1))
    assert (result.applied, result.needs_resync, result.reason) == (False, True, "over_capacity")
    stats = front.stats()
    assert stats["pages"] == 0 and stats["holdings"] == 0  # the refused chain changed nothing
    assert stats["events"]["over_capacity"] == 1
    # A resync past the capacity is refused whole, with the numbers...
    with pytest.raises(ServiceError, match=f"{CAPACITY + 1} pages .* capacity of {CAPACITY}"):
        client.resync("w0", epoch, 1, claim(CAPACITY + 1))
    assert front.stats()["holdings"] == 0
    # ...and one within it is taken: the worker holds its capacity, not a page more.
    client.resync("w0", epoch, 1, claim(CAPACITY))
    result = client.publish_events("w0", epoch, 2, claim(1, first=CAPACITY))
    assert result.reason == "over_capacity"
    stats = front.stats()
    assert stats["holdings"] == CAPACITY and stats["workers"]["w0"]["pages"] == CAPACITY
    assert stats["events"]["over_capacity"] == 3
    rig.server.check_integrity()


def test_a_worker_registers_its_store_size_and_cannot_claim_beyond_it(rig):
    cache, publisher = rig.worker("w0", pages=CAPACITY)  # the publisher says 64 pages
    serve(cache, list(range(4 * 8 + 1)))
    assert publisher.sync()
    forger = rig.client("w0")  # the worker's own key, past its own publisher
    seq = publisher.seq + 1
    result = forger.publish_events("w0", publisher.epoch, seq, claim(CAPACITY, first=100))
    assert result.reason == "over_capacity"
    assert rig.client("front_door").stats()["holdings"] == 8  # what it really published
    rig.server.check_integrity()


def test_a_worker_that_names_no_capacity_gets_a_bounded_one():
    rig = ServiceRig(auth=True, max_capacity=128)
    try:
        client = rig.client("w1")
        epoch = client.register("w1", "node-1").epoch  # capacity 0: an older client
        assert client.publish_events("w1", epoch, 1, claim(129)).reason == "over_capacity"
        client.resync("w1", epoch, 1, claim(128))
        with pytest.raises(ServiceError, match="capacity of 129 pages: 0 to 128") as refused:
            client.register("w1", "node-1", capacity=129)
        assert refused.value.code == "rejected"
        assert rig.client("front_door").stats()["holdings"] == 128  # nothing changed
        rig.server.check_integrity()
    finally:
        rig.close()


# ---- tenants only as the front door names them ----------------------------------------


def by_tenant(got: dict, sample: str) -> dict[str, float]:
    """A sample's values by their tenant label (one worker: one value a tenant)."""
    return {dict(labels)["tenant"]: v for (name, labels), v in got.items() if name == sample}


def test_junk_salts_from_a_worker_leave_a_named_tenant_its_row():
    # Tenant rows show to a tokenless scrape only when the operator allows it.
    rig = ServiceRig(auth=True, max_tenants=4, metrics_show_tenants=True)
    try:
        cache, publisher = rig.worker("w0")
        serve(cache, list(range(13)))
        assert publisher.sync()
        worker = rig.client("w0")
        junk = [f"junk-salt-{i}" for i in range(50)]
        for salt in junk:
            worker.match(Namespace("m", salt=salt), list(range(13)), requester="w0")
        front = rig.client("front_door")
        front.name_tenant(NS.salt, "acme")  # named after the junk arrived
        worker.match(NS, list(range(13)), requester="w0")
        stats = front.stats()
        assert {name: c["queries"] for name, c in stats["tenants"].items()} == {
            "acme": 1,
            "(unnamed)": 50,
        }
        assert stats["tenants"]["acme"]["hit_tokens"] == 12
        rows = tuple(TenantTokens(salt, 1, 0, 0, 13) for salt in [*junk, NS.salt])
        publisher._report = lambda: EMPTY_REPORT._replace(tenants=rows)
        assert publisher.heartbeat()
        rig.server.publish_metrics()
        got = samples(scrape(rig.server.metrics_url))
        queried = by_tenant(got, "kvmesh_index_tenant_queried_tokens_total")
        assert queried == {"acme": 13, "(unnamed)": 50 * 13}
        assert by_tenant(got, "kvmesh_requests_total") == {"acme": 1, "(unnamed)": 50}
        rig.server.check_integrity()
    finally:
        rig.close()


# ---- enrollment through the operator's tokens -----------------------------------------

KEYS = MeshKeys.generate(["w1"])
ENROLL_KEY = enroll_tokens.new_key()  # what `kvmesh up` keeps in ~/.kvmesh/enroll.key


@pytest.fixture(scope="module")
def service(ray_local):
    """The service actor (authentication on) with its enrollment key, for this module."""
    config = ServerConfig(host="loopback", page_tokens=P)
    handle = start_service(config, KEYS, auth=True, enroll_key=ENROLL_KEY)
    yield handle
    ray.get(handle.check_integrity.remote())
    stop_service()


def issue() -> str:
    """A token as the operator issues it (`kvmesh enroll-token`)."""
    return enroll_tokens.issue(ENROLL_KEY)


@pytest.mark.slow
def test_enrollment_without_a_valid_token_is_refused(service):
    with pytest.raises(ray.exceptions.RayTaskError, match="without an enrollment token"):
        ray.get(service.enroll.remote("vllm-none"))
    stranger = enroll_tokens.issue(enroll_tokens.new_key())  # another mesh's key
    for bad in (stranger, "x" * 44, "not a token", 42):
        with pytest.raises(ray.exceptions.RayTaskError, match="enrollment token"):
            ray.get(service.enroll.remote("vllm-none", bad))
    assert enrolled_publics() == frozenset()
    ray.get(service.check_integrity.remote())


@pytest.mark.slow
def test_a_token_is_spent_by_the_engine_that_enrolls_with_it(service):
    token = issue()
    granted = ray.get(service.enroll.remote("vllm-a", token))
    # The same engine again (its other process, or after a restart): the same identity.
    again = ray.get(service.enroll.remote("vllm-a", token))
    assert again["keypair"] == granted["keypair"]
    with pytest.raises(ray.exceptions.RayTaskError, match="spent by another engine"):
        ray.get(service.enroll.remote("vllm-b", token))
    with pytest.raises(ray.exceptions.RayTaskError, match="enrolled with another token"):
        ray.get(service.enroll.remote("vllm-a", issue()))  # nobody takes over vllm-a's id
    pair = KeyPair(*granted["keypair"])
    with ServiceClient(ray_resolver(), timeout_s=2.0, client_keys=pair) as client:
        assert client.register("vllm-a", "n1").epoch > 0
    assert enrolled_publics() == {pair.public}
    ray.get(service.check_integrity.remote())


@pytest.mark.slow
def test_squatters_without_tokens_take_no_engine_place(service):
    before = len(enrolled_publics())
    for tokens in ([()] * (MAX_ENROLLED + 10), [("A" * 44,)] * 50):  # none, then forged
        calls = [service.enroll.remote(f"squat-{i}", *t) for i, t in enumerate(tokens)]
        for call in calls:
            with pytest.raises(ray.exceptions.RayTaskError, match="enrollment token"):
                ray.get(call)
    assert len(enrolled_publics()) == before  # nothing kept, nothing to outlive a restart
    granted = ray.get(service.enroll.remote("vllm-late", issue()))  # a real engine gets in
    assert granted["keypair"] is not None
    assert len(enrolled_publics()) == before + 1
    ray.get(service.check_integrity.remote())


# ---- an engine outside Ray once enrolled -----------------------------------------------

JOIN = """
import json, sys, ray
from workers.engines.enrollment import join_mesh
from workers.service.client import ServiceClient
from cache_service.auth import KeyPair
engine = join_mesh("vllm-joined", sys.argv[1], token=sys.argv[2])
out = {"in_ray": ray.is_initialized(), "address": engine.endpoint().address}
with ServiceClient(engine.endpoint, timeout_s=5.0, client_keys=engine.keypair) as client:
    out["epoch"] = client.register("vllm-joined", engine.node_id).epoch
out["admits_itself"] = engine.late_readers(engine.keypair.public)
out["admits_a_stranger"] = engine.late_readers(KeyPair.generate().public)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_an_engine_leaves_ray_once_enrolled_and_finds_the_service_without_it(service):
    """vLLM processes kept as Ray drivers cost the cluster (`workers.engines.mesh_directory`):
    an engine enrolls through Ray, leaves, and still reaches the service and knows who is
    enrolled, from the GCS."""
    import json
    import subprocess
    import sys

    import msgpack
    from ray.experimental import internal_kv

    from cache_service.actor import ENDPOINT_KEY, RAY_NAMESPACE

    gcs = ray.get_runtime_context().gcs_address
    # Whoever writes the kept endpoint names an address, never the service's key: the
    # engine keeps the one its enrollment gave it (a forged key here would lose it the
    # service: its CurveZMQ handshake would fail).
    real = ray.get(service.endpoint.remote())
    forged = {**real, "server_key": KeyPair.generate().public}
    internal_kv._internal_kv_put(ENDPOINT_KEY, msgpack.packb(forged), namespace=RAY_NAMESPACE)
    try:
        reply = subprocess.run(
            [sys.executable, "-c", JOIN, gcs, issue()],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        internal_kv._internal_kv_put(ENDPOINT_KEY, msgpack.packb(real), namespace=RAY_NAMESPACE)
    assert reply.returncode == 0, reply.stderr[-2000:]
    out = json.loads(reply.stdout.strip().splitlines()[-1])
    assert out["in_ray"] is False
    assert out["address"] == ray.get(service.endpoint.remote())["address"]
    assert out["epoch"] > 0  # its enrolled key, at the address read from the GCS
    assert out["admits_itself"] is True and out["admits_a_stranger"] is False
    ray.get(service.check_integrity.remote())
