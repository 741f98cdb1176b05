"""A worker that Ray restarts (`workers.max_restarts`) comes back as a new incarnation with
an empty store; the dead incarnations' segments are reclaimed by the product itself (the
test never calls the reclaimer), so SIGKILLs leave no growth in /dev/shm.
"""

from __future__ import annotations

import io
import os
import signal
import time

import pytest
import ray

import cluster
from cluster.config import config_from_dict
from workers.page_store import SHM_DIR

pytestmark = pytest.mark.slow

KILLS = 5
CONFIG = {
    "model": {"name": "tiny", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16},
    "store": {"num_pages": 64},
    "workers": {"count": 2, "threads": 1, "max_restarts": -1, "publish_interval_s": 0.2},
}
PROMPT = [(5 * i + 1) % 250 + 1 for i in range(40)]


def segments() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith("kvmesh-")}


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture
def mesh(ray_local):
    # The test's own: a restarted worker's new store is the test's to leave behind.
    mesh = cluster.connect(config_from_dict(CONFIG), log=io.StringIO())
    yield mesh
    mesh.shutdown()


def test_a_killed_worker_comes_back_empty_and_its_segments_go(mesh):
    before = segments()
    assert len(before) == 2
    for kill in range(KILLS):
        mesh.generate(PROMPT, 2, tenant="r", worker="w1")
        node, pid = ray.get(mesh.workers["w1"].process.remote())
        os.kill(pid, signal.SIGKILL)
        # Routed requests never fail while it is down and while it comes back.
        out = mesh.generate(PROMPT + [kill], 2, tenant="r")
        assert out.stats["worker"] in ("w0", "w1")
        wait_until(lambda: "w1" not in mesh.live_workers(), 10, "w1 seen dead")
        wait_until(lambda: "w1" in mesh.live_workers(), 60, "w1 taken back")
        _, new_pid = ray.get(mesh.workers["w1"].process.remote())
        assert new_pid != pid
        fresh = mesh.generate(PROMPT, 2, tenant="r", worker="w1")
        # A new incarnation: nothing of its predecessor's cache, only what it can copy.
        assert fresh.stats["local_hit_tokens"] == 0
        # The dead incarnation's segment is unlinked by the workers of this node.
        wait_until(lambda: len(segments()) == 2, 10, "the dead worker's segment reclaimed")
    assert mesh.stats()["workers"]["w1"]["alive"] is True
    mesh.check_integrity()
