"""A service killed and restarted under load: no request fails, the index is rebuilt from
the workers, and reuse across workers comes back.

Two workers on the tiny model; w0 computes a set of prompts before the kill, and w1 copies
them (through the index) before and after it.
"""

from __future__ import annotations

import io
import threading
import time

import pytest

import cluster
from cluster.config import config_from_dict
from tests.service_restart import restart_service

pytestmark = pytest.mark.slow

CONFIG = {
    "model": {"name": "tiny"},
    "store": {"num_pages": 256},
    "workers": {"count": 2, "threads": 1, "publish_interval_s": 0.2, "copy_policy": "always"},
}
NEW_TOKENS = 2


def prompt(i: int) -> list[int]:
    return [(11 * i + j) % 250 + 1 for j in range(48)]


@pytest.fixture(scope="module")
def mesh(ray_local):
    mesh = cluster.connect(config_from_dict(CONFIG), log=io.StringIO())
    yield mesh
    mesh.check_integrity()
    mesh.shutdown()


def service_figures(mesh) -> dict:
    service = mesh.stats()["service"]
    return {} if service.get("unavailable") else service


def test_a_service_restart_under_load_fails_no_request(mesh):
    loaded = [prompt(i) for i in range(6)]  # what the load sends, routed
    later = [prompt(100 + i) for i in range(6)]  # computed on w0 only, copied after
    for tokens in loaded + later:
        mesh.generate(tokens, NEW_TOKENS, tenant="s", worker="w0")
    mesh.flush()
    copied_before = mesh.generate(loaded[0] + [7], NEW_TOKENS, tenant="s", worker="w1")
    assert copied_before.stats["remote_hit_tokens"] == 48
    reference = {
        i: mesh.generate(t + [i], NEW_TOKENS, tenant="ref", worker="w1", reuse=False).token_ids
        for i, t in enumerate(loaded)
    }

    stop = threading.Event()
    failures: list[BaseException] = []
    served: list[int] = []

    def load() -> None:
        k = 0
        while not stop.is_set():
            i = k % len(loaded)
            k += 1
            try:
                out = mesh.generate(loaded[i] + [i], NEW_TOKENS, tenant="s")
                if out.token_ids != reference[i]:
                    failures.append(AssertionError(f"request {i}: wrong output"))
                served.append(i)
            except BaseException as exc:  # no request may fail
                failures.append(exc)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    before, after = restart_service()
    during = len(served)
    # The workers find the new incarnation, register again and resync their holdings.
    deadline = time.monotonic() + 30
    while service_figures(mesh).get("workers_live", 0) < 2:
        assert time.monotonic() < deadline, "the workers did not come back to the service"
        time.sleep(0.2)
    time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join(60)
    assert not failures, failures[:3]
    assert len(served) > during > 0  # requests went on through the outage and after it

    # The index is rebuilt from the workers: each one's pages, exactly.
    mesh.flush()
    stats = mesh.stats()
    for worker_id in ("w0", "w1"):
        cache = stats["workers"][worker_id]["cache"]
        assert cache["in_use_pages"] == 0
        assert stats["service"]["workers"][worker_id]["pages"] == cache["cached_pages"]
    # Reuse across workers comes back: w1 copies what w0 computed before the kill.
    for tokens in later:
        copied = mesh.generate(tokens + [9], NEW_TOKENS, tenant="s", worker="w1")
        assert copied.stats["remote_hit_tokens"] == 48
    mesh.check_integrity()
