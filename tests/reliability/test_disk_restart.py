"""A worker SIGKILLed in a running mesh and restarted by Ray (`workers.max_restarts`)
adopts its disk tier: its prompts are hits again, loaded from disk, with the answers they
had before the kill."""

from __future__ import annotations

import io
import os
import signal

import pytest
import ray

import cluster
from cluster.config import config_from_dict
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

PROMPTS = [[(17 * s + 7 * i) % 240 + 3 for i in range(48)] for s in range(3)]


def test_a_restarted_worker_adopts_its_disk_and_hits(ray_local, tmp_path):
    config = {
        "model": {"name": "tiny"},
        "cache": {"page_tokens": 4},
        "store": {
            "num_pages": 96,
            "disk": {
                "enabled": True,
                "path": str(tmp_path / "w0"),
                "pages": 256,
                "policy": "write_through",
            },
        },
        "workers": {
            "count": 1,
            "threads": 1,
            "max_restarts": 1,
            "publish_interval_s": 0.2,
            "copy_policy": "always",  # the tiny model recomputes faster than it reads
        },
    }
    mesh = cluster.connect(config_from_dict(config), log=io.StringIO())
    try:
        (worker_id,) = mesh.workers
        before = [mesh.generate(p + [1], 3, tenant="t") for p in PROMPTS]
        assert all(r.stats["disk_hit_tokens"] == 0 for r in before)
        _, pid = ray.get(mesh.workers[worker_id].process.remote())
        os.kill(pid, signal.SIGKILL)

        def back() -> bool:
            try:
                _, now = ray.get(mesh.workers[worker_id].process.remote(), timeout=5)
            except Exception:  # restarting: Ray answers with errors until it is back
                return False
            return now != pid and worker_id in mesh.live_workers()

        wait_until(back, 120, "the killed worker restarted and taken back")
        for prompt, first in zip(PROMPTS, before, strict=True):
            again = mesh.generate(prompt + [1], 3, tenant="t", worker=worker_id)
            assert again.stats["disk_hit_tokens"] == 48  # every full page, from disk
            assert again.stats["local_hit_tokens"] == 48
            assert again.token_ids == first.token_ids
        stats = mesh.stats()["workers"][worker_id]
        assert stats["alive"]
        mesh.check_integrity()
    finally:
        mesh.shutdown()

    left = list((tmp_path / "w0").iterdir()) if (tmp_path / "w0").exists() else []
    assert not left, f"the mesh's shutdown left the disk's files: {left}"
