"""A mesh can be started with authentication off (a network nobody else can reach)."""

from __future__ import annotations

import ray

import cluster
from cache_service.actor import get_service
from tests.security.test_mesh_auth import PROMPT, tiny_config
from workers.service.client import ServiceClient, ServiceEndpoint


def test_authentication_can_be_switched_off(ray_local):
    plain = cluster.connect(tiny_config(auth=False))
    try:
        endpoint = ray.get(get_service().endpoint.remote())
        assert endpoint["server_key"] is None
        client = ServiceClient(ServiceEndpoint(endpoint["address"]), timeout_s=2.0)
        assert "cluster" in client.stats()
        client.close()
        plain.generate(PROMPT, 4, tenant="a", worker="w0")
        plain.flush()
        assert plain.generate(PROMPT, 4, tenant="a", worker="w1").stats["remote_hit_tokens"] == 20
    finally:
        plain.check_integrity()
        plain.shutdown()
