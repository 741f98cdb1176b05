"""Compaction configured in YAML reaches the workers of a real mesh: a long generation on
a small store is compacted under pressure instead of running out of pages."""

from __future__ import annotations

import pytest
import ray

import cluster
from cluster.config import config_from_dict

pytestmark = pytest.mark.slow


def test_a_long_generation_is_compacted_in_the_worker_and_finishes():
    config = config_from_dict(
        {
            "model": {"name": "tiny"},
            # 12 pages of 16 tokens: 192 token slots, for a 48-token prompt and 200 more.
            "store": {"num_pages": 12},
            "workers": {"count": 1, "threads": 1},
            "compaction": {
                "policy": "h2o",
                "params": {"adaptive": True},
                "budget": 32,
                "high_water": 0.5,
                "min_tokens": 32,
            },
        }
    )
    mesh = cluster.connect(config)
    try:
        result = mesh.generate(list(range(3, 51)), max_new_tokens=200, ignore_eos=True)
        assert len(result.token_ids) == 200 and result.finish_reason == "length"
        assert result.stats["preemptions"] == 0
        assert result.stats["compacted_pages_freed"] > 0
        (handle,) = mesh.workers.values()
        scheduler = ray.get(handle.stats.remote()).scheduler
        assert scheduler["compaction_policy"] == "h2o" and scheduler["compactions"] >= 2
        assert scheduler["compacted_pages_freed"] == result.stats["compacted_pages_freed"]
        mesh.check_integrity()
    finally:
        mesh.shutdown()
