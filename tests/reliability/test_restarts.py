"""Workers that Ray restarts (`workers.max_restarts`) come back as new incarnations with
an empty store; the dead incarnations' segments are reclaimed by the product itself (the
test never calls the reclaimer), so SIGKILLs leave no growth in /dev/shm.
"""

from __future__ import annotations

import io
import os
import re
import signal

import pytest
import ray

import cluster
from cluster.config import config_from_dict
from tests.waiting import wait_until
from workers.store.segment_names import SHM_DIR, owner_alive

pytestmark = pytest.mark.slow

KILLS = 24  # eight incarnations of each killed worker
KILLED = ("w1", "w2", "w3")  # killed in turn, restarting side by side; w0 is never killed
CHECK_EVERY = 12  # after so many kills, every worker must be taken back and serve
CONFIG = {
    "model": {"name": "tiny"},
    "store": {"num_pages": 64},
    "workers": {
        "count": 4,
        "threads": 1,
        "num_cpus": 0.25,
        "max_restarts": -1,
        "publish_interval_s": 0.2,
        "copy_policy": "always",
    },
}
PROMPT = [(5 * i + 1) % 250 + 1 for i in range(40)]


def segments() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith("kvmesh-")}


def live_stores(killed: set[int]) -> dict[str, int]:
    """worker tag -> pid of its running incarnation, for the workers that have made their
    store (a killed incarnation may linger a moment as a zombie: `killed` are skipped)."""
    stores = {}
    for name in segments():
        match = re.fullmatch(r"kvmesh-(\d+)-\d+-(.+)", name)
        if match and int(match[1]) not in killed and owner_alive(name):
            stores[match[2]] = int(match[1])
    return stores


@pytest.fixture
def mesh(ray_local):
    # The test's own: a restarted worker's new store is the test's to leave behind.
    mesh = cluster.connect(config_from_dict(CONFIG), log=io.StringIO())
    yield mesh
    mesh.shutdown()


def test_killed_workers_come_back_empty_and_their_segments_go(mesh):
    """24 SIGKILLs, each of an incarnation as soon as it has made its store (often before
    it has finished starting): the incarnations that follow reclaim what the dead left, so
    /dev/shm holds at most one dead store per killed worker, and none once the kills stop."""
    before = segments()
    assert len(before) == 4
    peak, kills, rounds = len(before), 0, 0
    killed: set[int] = set()
    while kills < KILLS:
        stores = wait_until(
            lambda: {t: p for t, p in live_stores(killed).items() if t in KILLED},
            120,  # a new incarnation imports torch: slow on a busy machine
            f"a killed worker's next store (after {kills} kills)",
        )
        peak = max(peak, len(segments()))
        for pid in sorted(stores.values())[: KILLS - kills]:
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
            kills += 1
        if kills // CHECK_EVERY == rounds:
            continue
        rounds = kills // CHECK_EVERY
        # Routed requests never fail while workers are down and while they come back.
        out = mesh.generate(PROMPT + [kills], 2, tenant="r")
        assert out.stats["worker"] in mesh.workers
        wait_until(lambda: len(mesh.live_workers()) == 4, 90, "every worker taken back")
        for worker_id in KILLED:
            _, pid = ray.get(mesh.workers[worker_id].process.remote())
            assert pid not in killed
            fresh = mesh.generate(PROMPT, 2, tenant="r", worker=worker_id)
            # A new incarnation: nothing of its predecessors' cache, only what it copies.
            assert fresh.stats["local_hit_tokens"] == 0
    peak = max(peak, len(segments()))
    assert peak <= len(before) + len(KILLED), f"{peak} segments at once"
    wait_until(lambda: len(segments()) == 4, 10, "the dead incarnations' segments reclaimed")
    print(f"\n{kills} SIGKILLs; at most {peak} kvmesh segments at once, {len(before)} after")
    stats = mesh.stats()
    assert all(stats["workers"][w]["alive"] for w in mesh.workers)
    mesh.check_integrity()
