"""`kvmesh demo` as a user runs it: its own embedded Ray, the tiny model, `--json`.

The demo runs in a process of its own with Ray's temp directory set to one of the test's
(`RAY_TMPDIR`), so every Ray process it starts names that directory on its command line
and can be told from Ray instances that other tests on this machine may run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cluster.demo import (
    SYSTEM_PROMPTS,
    Encoder,
    system_turn,
    user_turn,
    workload,
)
from cluster.demo_prompts import QUESTIONS, TENANT_QUESTIONS, TENANT_SYSTEM, TENANTS
from tests.cluster.test_launch import processes_mentioning
from tests.conftest import kvmesh_segments

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = """\
model: {name: tiny}
store: {num_pages: 512}
workers: {count: 2, threads: 1, copy_policy: always}
"""
SCALE = 0.4  # 2 questions per system prompt, 3 turns per conversation, 2 per tenant
TINY_VOCAB = 256  # workers.serving.model_loader.tiny_llama
KEYS = {
    "requests",
    "prompt_tokens",
    "hit_rate",
    "local_hit_tokens",
    "remote_hit_tokens",
    "computed_tokens",
    "ttft_cold_s",
    "ttft_reuse_s",
    "ttft_no_cache_s",
    "speedup",
    "cross_tenant_hit_tokens",
    "dashboard_url",
    "metrics_url",
    "phases",
}


@pytest.fixture
def ray_tmp():
    # Short: Ray's unix sockets live under it, and their paths must stay under 108 bytes.
    path = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run_demo(config: Path, ray_tmp: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_DISABLE_USAGE_STATS": "1", "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)  # an embedded Ray of its own, whatever the caller runs
    return subprocess.run(
        [sys.executable, "-m", "cluster.cli", "demo", "--config", str(config), "--json",
         "--scale", str(SCALE)],
        env=env, capture_output=True, text=True, timeout=180, cwd=ROOT,
    )  # fmt: skip


def expected_prompt_tokens(phase: str) -> int:
    """Prompt tokens of the phases whose prompts do not depend on the model's replies."""
    encode = Encoder(None, TINY_VOCAB)
    plan = workload(SCALE)
    if phase == "prompts":
        return sum(
            len(encode(system_turn(SYSTEM_PROMPTS[name]))) + len(encode(user_turn(q)))
            for name in SYSTEM_PROMPTS
            for q in QUESTIONS[name][: plan.questions]
        )
    system = len(encode(system_turn(SYSTEM_PROMPTS[TENANT_SYSTEM])))
    per_tenant = sum(
        system + len(encode(user_turn(q))) for q in TENANT_QUESTIONS[: plan.tenant_questions]
    )
    return len(TENANTS) * per_tenant


def settled(probe, deadline_s: float = 10.0):
    """`probe()` once it is empty, or its last value after `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while (value := probe()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def test_demo_runs_the_workload_and_leaves_nothing(tmp_path, ray_tmp):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    segments_before = kvmesh_segments()
    start = time.monotonic()
    run = run_demo(config, ray_tmp)
    took = time.monotonic() - start
    assert run.returncode == 0, run.stderr[-4000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert not KEYS - set(figures), KEYS - set(figures)

    plan = workload(SCALE)
    assert figures["requests"] == plan.requests == 16
    for phase, counts in figures["phases"].items():
        assert counts["requests"] == plan.size(phase)
        assert (
            counts["local_hit_tokens"] + counts["remote_hit_tokens"] + counts["computed_tokens"]
            == counts["prompt_tokens"]
        )
    for phase in ("prompts", "tenants"):
        assert figures["phases"][phase]["prompt_tokens"] == expected_prompt_tokens(phase)
    sent = sum(counts["prompt_tokens"] for counts in figures["phases"].values())
    assert figures["prompt_tokens"] == sent
    tokens = (figures[f"{s}_tokens"] for s in ("local_hit", "remote_hit", "computed"))
    assert sum(tokens) == sent

    assert figures["local_hit_tokens"] > 0  # later questions on a system prompt's worker
    assert figures["phases"]["turns"]["remote_hit_tokens"] > 0  # turns copied across workers
    assert figures["remote_hit_tokens"] == figures["phases"]["turns"]["remote_hit_tokens"]
    assert figures["cross_tenant_hit_tokens"] == 0
    assert 0 < figures["hit_rate"] < 1
    assert figures["hit_rate"] == pytest.approx(
        (figures["local_hit_tokens"] + figures["remote_hit_tokens"]) / sent, abs=1e-4
    )
    assert figures["ttft_cold_s"] > 0 and figures["ttft_reuse_s"] > 0
    assert figures["speedup"] > 0
    assert figures["metrics_url"].startswith("http://127.0.0.1:")

    # The tables and the progress went to stderr; stdout is the JSON line alone.
    assert len(run.stdout.strip().splitlines()) == 1
    for title in ("shared system prompts", "multi-turn conversations", "two tenants"):
        assert title in run.stderr
    assert "with the cache and without it" in run.stderr and "speedup" in run.stderr

    # Nothing left behind: no Ray process of the demo's (each names its temp directory),
    # no shared-memory segment.
    assert list(Path(ray_tmp).glob("ray/session_*")), "the demo did not use RAY_TMPDIR"
    assert settled(lambda: processes_mentioning(ray_tmp)) == []
    assert settled(lambda: kvmesh_segments() - segments_before) == set()
    print(f"kvmesh demo (tiny, scale {SCALE}): {took:.1f}s")


def test_demo_rejects_a_bad_scale():
    run = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "demo", "--scale", "0"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 2
    assert "--scale must be > 0" in run.stderr
