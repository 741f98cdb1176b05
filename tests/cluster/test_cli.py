"""The `kvmesh` console script, run as a user would."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _kvmesh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_bench_local_prints_one_json_line_last():
    run = _kvmesh("bench", "local", "--json")
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    # 64 requests sharing 75% of their pages: 0.25 + 0.75/64 of the base allocator's pages
    assert figures["pages_ratio"] == pytest.approx(0.25 + 0.75 / 64, abs=1e-3)
    assert figures["batch_computed_ratio"] == pytest.approx(0.25 + 0.75 / 64, abs=1e-3)
    assert figures["pages_shared"] == 96 + 64 * 32
    assert figures["warm_hit_rate"] == pytest.approx(0.75)
    assert figures["us_per_request"] > 0
    assert figures["us_per_request_evicting"] > 0


def test_unknown_benchmark_is_a_usage_error():
    run = _kvmesh("bench", "nope")
    assert run.returncode == 2
    assert "invalid choice: 'nope'" in run.stderr


def test_a_bench_option_the_benchmark_does_not_take_is_a_usage_error():
    run = _kvmesh("bench", "local", "--workload", "trace")
    assert run.returncode == 2
    assert "kvmesh bench local takes no --workload" in run.stderr
    bad = _kvmesh("bench", "serve", "--front-doors", "3")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
