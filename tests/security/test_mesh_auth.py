"""A mesh started through the front door has authentication on, keeps its keys and its
tenant secret across a service restart, and can be started with authentication off.

Findings covered: `cluster.connect` never turned on the service's CurveZMQ; page servers
had no authentication option.
"""

from __future__ import annotations

import time

import pytest
import ray

import cluster
from cache_service.actor import get_service
from cluster.config import config_from_dict
from tests.service_restart import restart_service
from workers.service.client import ServiceClient, ServiceEndpoint, ServiceUnavailable
from workers.store.page_store import SharedPageStore
from workers.transfer import PageClient

PROMPT = [(5 * i + 1) % 250 for i in range(23)]


def tiny_config(**security) -> object:
    return config_from_dict(
        {
            "model": {"name": "tiny"},
            "cache": {"page_tokens": 4},
            "store": {"num_pages": 64},
            "workers": {"count": 2, "threads": 1, "copy_policy": "always"},
            "security": security,
        }
    )


@pytest.fixture(scope="module")
def mesh(ray_local):
    mesh = cluster.connect(tiny_config())  # the default: authentication on
    yield mesh
    mesh.check_integrity()
    mesh.shutdown()


def test_authentication_is_on_by_default(mesh):
    assert config_from_dict({}).security.auth is True
    endpoint = ray.get(get_service().endpoint.remote())
    assert endpoint["server_key"]  # a CURVE server
    stranger = ServiceClient(
        ServiceEndpoint(endpoint["address"], endpoint["server_key"]), timeout_s=0.5, retries=0
    )
    with pytest.raises(ServiceUnavailable):
        stranger.stats()
    stranger.close()
    plain = ServiceClient(ServiceEndpoint(endpoint["address"]), timeout_s=0.5, retries=0)
    with pytest.raises(ServiceUnavailable):
        plain.stats()
    plain.close()
    out = mesh.generate(PROMPT, 4, tenant="a", worker="w0")
    mesh.flush()
    assert mesh.generate(PROMPT, 4, tenant="a", worker="w1").stats["remote_hit_tokens"] == 20
    assert out.stats["computed_tokens"] == len(PROMPT)


def test_page_servers_refuse_clients_outside_the_mesh(mesh):
    mesh.generate(PROMPT, 4, tenant="c", worker="w0")
    info = ray.get(mesh.workers["w0"].info.remote())
    with SharedPageStore.attach(info.shm_name) as view:
        layout = view.layout
        generations = view.generations([0, 1])
    outsider = PageClient(info.page_address, timeout_s=0.5)
    with SharedPageStore.create(layout, tag="outsider") as store:
        assert outsider.fetch([0, 1], generations, store, store.allocate(2)) == [False, False]
        assert not store.page_range(0, 2).any()
    outsider.close()


def test_keys_and_tenant_salts_survive_a_service_restart(mesh):
    salt = mesh.salt("a")
    before, after = restart_service()
    assert after["server_key"] == before["server_key"]
    assert ray.get(get_service().tenant_salt.remote("a")) == salt
    # The workers find the new incarnation with their own keys and resync; reuse goes on.
    deadline = time.monotonic() + 30
    while mesh.stats()["service"].get("pages", 0) < 5 and time.monotonic() < deadline:
        time.sleep(0.2)
    mesh.generate(PROMPT, 4, tenant="d", worker="w0")
    mesh.flush()
    copied = mesh.generate(PROMPT, 4, tenant="d", worker="w1")  # found through the new index
    assert copied.stats["remote_hit_tokens"] == 20
