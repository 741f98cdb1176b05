"""The service as a named, detached, restartable Ray actor.

Ray is used to place and find the service, never to carry its traffic: a worker asks
the actor once for its ZMQ endpoint (`endpoint()`), then talks ZMQ + msgpack. When the
actor dies Ray restarts it; the new incarnation binds a fresh socket and starts a new
epoch with an empty index, and workers, whose requests now time out, ask the actor for
the new endpoint, register again and resync their holdings.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import ray

from cache_service.server import CurveKeys, ServerConfig, make_server

SERVICE_NAME = "kvmesh-service"
RAY_NAMESPACE = "kvmesh"


class ServiceActor:
    """Plain class run as a Ray actor by `start_service` (testable without Ray)."""

    def __init__(self, config: dict[str, Any], curve: bool = False):
        config = dict(config)
        config["host"] = resolve_host(config.get("host", "loopback"))
        self.config = ServerConfig(**config)
        self.curve = CurveKeys.generate() if curve else None
        self.server = make_server(self.config, self.curve)
        self.server.start()
        self.started = time.time()

    def endpoint(self) -> dict[str, Any]:
        """Where workers reach the service: address, epoch, CurveZMQ public key or None."""
        return {
            "address": self.server.address,
            "epoch": self.server.epoch,
            "server_key": None if self.curve is None else self.curve.public,
        }

    def stats(self) -> dict[str, Any]:
        """The index's statistics (the same figures the `stats` request returns), read by
        the server's loop thread, which owns the index."""
        return self.server.stats()

    def check_integrity(self) -> None:
        """Check the index's invariants, on the server's loop thread."""
        self.server.check_integrity()

    def stop(self) -> None:
        self.server.stop()


def resolve_host(host: str) -> str:
    """ "loopback" -> 127.0.0.1; "node" -> this node's address as Ray knows it; else as is.

    Every node of a simulated cluster (and an embedded Ray) is this machine, so
    "loopback" is right there; a real multi-node cluster needs "node".
    """
    if host == "loopback":
        return "127.0.0.1"
    if host == "node":
        return ray.util.get_node_ip_address()
    return host


def start_service(config: ServerConfig | None = None, curve: bool = False) -> Any:
    """Start the service actor (or return the running one) and wait until it serves.

    Returns:
        The actor handle, named SERVICE_NAME in namespace RAY_NAMESPACE.
    """
    config = config or ServerConfig(host="loopback")
    actor_cls = ray.remote(ServiceActor)
    handle = actor_cls.options(
        name=SERVICE_NAME,
        namespace=RAY_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=-1,
        num_cpus=0,
    ).remote(dataclasses.asdict(config), curve)
    ray.get(handle.endpoint.remote())
    return handle


def get_service() -> Any:
    """The running service actor's handle.

    Raises:
        ValueError: no service is running in this Ray cluster.
    """
    return ray.get_actor(SERVICE_NAME, namespace=RAY_NAMESPACE)


def stop_service() -> None:
    """Kill the service actor for good (no restart); no-op if none runs."""
    try:
        handle = get_service()
    except ValueError:
        return
    ray.kill(handle, no_restart=True)
