"""The GPU worker's check script on the CPU (`benchmarks/gpu_check.py --device cpu --quick`):
every section runs its code paths with the CPU standing in for the device, in a fresh
interpreter, as the GPU machine runs it (which has no Ray, ZeroMQ or gguf)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_section_passes_on_the_cpu_without_ray_zmq_or_gguf(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu"]
        + ["--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # as a script from anywhere: it finds its own packages
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == json.loads(out.read_text())
    assert result["imported"] == []
    for section in ("store", "tiers", "compute", "layouts"):
        assert result[section]["passed"], result[section]
    assert result["machine"]["device"] == "cpu"
    # On the CPU both of compute's runs are on the CPU: they agree exactly.
    compute = result["compute"]
    assert compute["max_logit_diff"] == 0.0 and compute["greedy_mismatches"] == 0
    assert compute["tokens_compared"] + compute["tokens_near_ties"] == compute["new_tokens"]
    assert compute["tokens_compared"] > 0 and compute["requests"] == 4
    for run in ("cpu_float32", "device_float32", "device_bfloat16"):
        assert compute[f"prefill_tokens_per_s_{run}"] > 0
    # No CUDA here: the peer reads the host path, and says why.
    store = result["store"]
    assert store["peer_path"] == "host_fallback" and "only CUDA pages" in store["ipc_error"]
    assert len(result["layouts"]["layouts"]) == 4
    tiers = result["tiers"]
    assert tiers["pages"] == 8 and tiers["demote_ratio"] > 0 and tiers["load_back_ratio"] > 0
