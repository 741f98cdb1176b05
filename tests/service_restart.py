"""Kill the service actor and wait for Ray to restart it: shared by the tests that need it."""

from __future__ import annotations

import time

import ray

from cache_service.actor import get_service


def restart_service(timeout_s: float = 60.0) -> tuple[dict, dict]:
    """Kill the service (Ray restarts it with the same arguments) and wait until a new
    incarnation answers; returns its endpoint before and after."""
    before = ray.get(get_service().endpoint.remote())
    ray.kill(get_service(), no_restart=False)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            after = ray.get(get_service().endpoint.remote(), timeout=5)
            if after["epoch"] != before["epoch"]:
                return before, after
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < deadline, "the service did not come back"
        time.sleep(0.2)
