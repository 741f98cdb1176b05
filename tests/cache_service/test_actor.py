"""The service as a detached Ray actor: found by name, restarted, resynced by workers."""

from __future__ import annotations

import base64
import time

import pytest
import ray

from cache_service import enroll_tokens
from cache_service.actor import (
    RAY_NAMESPACE,
    SERVICE_NAME,
    get_service,
    start_service,
    stop_service,
)
from cache_service.auth import KeyPair, MeshKeys
from cache_service.events import Namespace
from cache_service.server import ServerConfig
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.service.client import ServiceClient, ServiceUnavailable, ray_resolver
from workers.service.publisher import EventPublisher
from workers.store.page_pool import PagePool

pytestmark = pytest.mark.slow
NS = Namespace("m")
P = 4


KEYS = MeshKeys.generate(["w1"])
ENROLL_KEY = enroll_tokens.new_key()  # the operator's (`kvmesh up` keeps it in a file)


@pytest.fixture
def service(ray_local):
    """The service actor (authentication on), killed for good after the test."""
    config = ServerConfig(host="loopback", page_tokens=P)
    yield start_service(config, KEYS, auth=True, enroll_key=ENROLL_KEY)
    stop_service()


def _publish(cache: PrefixCache, tokens: list[int]) -> None:
    allocation = cache.acquire(tokens, NS)
    allocation.publish(len(tokens))
    allocation.release()


def test_killed_service_restarts_and_workers_resync(service):
    first = ray.get(service.endpoint.remote())
    assert first["address"].startswith("tcp://127.0.0.1:")
    assert ray.get_actor(SERVICE_NAME, namespace=RAY_NAMESPACE) is not None

    cache = PrefixCache(PagePool(32), PrefixCacheConfig(page_tokens=P))
    client = ServiceClient(ray_resolver(), timeout_s=0.5, retries=2, client_keys=KEYS.workers["w1"])
    publisher = EventPublisher(client, cache, "w1", node_id="n1")
    _publish(cache, list(range(13)))
    assert publisher.sync()
    assert client.match(NS, list(range(13)))[0] == 12

    ray.kill(service, no_restart=False)  # the service dies; Ray restarts it
    deadline = time.monotonic() + 60
    while True:
        try:
            second = ray.get(get_service().endpoint.remote(), timeout=5)
            if second["epoch"] != first["epoch"]:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "service actor did not restart"
        time.sleep(0.2)
    assert second["server_key"] == first["server_key"] == KEYS.service.public  # same keys
    assert ray.get(get_service().stats.remote())["pages"] == 0  # a new, empty index

    # The worker notices (its old socket times out, the resolver finds the new address,
    # the epoch differs) and resyncs; its holdings are matchable again.
    assert publisher.heartbeat()
    assert client.match(NS, list(range(13)))[0] == 12
    assert publisher.resyncs == 2
    ray.get(get_service().check_integrity.remote())
    cache.check_integrity()
    publisher.stop(bye=True)
    client.close()


def _restarted(first_epoch: int) -> dict:
    deadline = time.monotonic() + 60
    while True:
        try:
            endpoint = ray.get(get_service().endpoint.remote(), timeout=5)
            if endpoint["epoch"] != first_epoch:
                return endpoint
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "service actor did not restart"
        time.sleep(0.2)


def test_a_token_for_n_engines_enrolls_n_and_no_more(service):
    token = enroll_tokens.issue(ENROLL_KEY, engines=2)
    first = ray.get(service.enroll.remote("serve-r1", token))
    second = ray.get(service.enroll.remote("serve-r2", token))
    assert first["keypair"] != second["keypair"]  # two engines, two identities
    # Each enrolls again with it (its other processes, a restart) as itself.
    assert ray.get(service.enroll.remote("serve-r1", token))["keypair"] == first["keypair"]
    with pytest.raises(ray.exceptions.RayTaskError, match="2 engines have all enrolled"):
        ray.get(service.enroll.remote("serve-r3", token))
    # The count is under the HMAC: a token rewritten to say more engines is not the mesh's.
    raw = bytearray(base64.urlsafe_b64decode(token))
    raw[16:20] = (1000).to_bytes(4, "big")
    forged = base64.urlsafe_b64encode(bytes(raw)).decode()
    with pytest.raises(ray.exceptions.RayTaskError, match="not issued for this mesh"):
        ray.get(service.enroll.remote("serve-r3", forged))
    # The refusals changed nothing: the two engines enroll as before, a third still not.
    assert ray.get(service.enroll.remote("serve-r2", token))["keypair"] == second["keypair"]
    with pytest.raises(ray.exceptions.RayTaskError, match="all enrolled"):
        ray.get(service.enroll.remote("serve-r4", token))
    ray.get(service.check_integrity.remote())


def test_an_enrolled_engine_is_admitted_again_after_a_restart(service):
    token = enroll_tokens.issue(ENROLL_KEY)
    granted = ray.get(service.enroll.remote("vllm-a", token))
    assert ray.get(service.enroll.remote("vllm-a", token))["keypair"] == granted["keypair"]
    assert granted["secret"] == KEYS.secret and granted["page_tokens"] == P
    for bad, why in (("w1", "one of the mesh's own workers"), ("a b", "an engine's worker id")):
        with pytest.raises(ray.exceptions.RayTaskError, match=why):
            ray.get(service.enroll.remote(bad, enroll_tokens.issue(ENROLL_KEY)))
    pair = KeyPair(*granted["keypair"])
    with ServiceClient(ray_resolver(), timeout_s=0.5, retries=2, client_keys=pair) as client:
        assert client.register("vllm-a", "n1").service_epoch == granted["endpoint"]["epoch"]
        ray.kill(service, no_restart=False)
        second = _restarted(granted["endpoint"]["epoch"])
        # The new incarnation admits the engine's key (kept in Ray's key-value store), and
        # the engine enrolling again with its token keeps its identity.
        assert client.register("vllm-a", "n1").service_epoch == second["epoch"]
        again = ray.get(get_service().enroll.remote("vllm-a", token))
        assert again["keypair"] == granted["keypair"]
    stop_service()
    # A mesh started afterwards in this cluster does not know the old engine.
    start_service(ServerConfig(host="loopback", page_tokens=P), KEYS, auth=True)
    with (
        ServiceClient(ray_resolver(), timeout_s=0.3, retries=0, client_keys=pair) as client,
        pytest.raises(ServiceUnavailable),
    ):
        client.register("vllm-a", "n1")
