"""`kvmesh bench ray-serve`: kvmesh's request router and KV connector in a Ray Serve LLM
app, against Ray Serve's own routers, on the same vLLM replicas' workload.

The benchmark runs in the vLLM venv (`make vllm-venv`; built here when it is missing),
where vLLM, Ray Serve LLM and kvmesh import together: see `benchmarks.ray_serve_bench`
for the policies, the workload and the figures. This process starts it, passes its
progress on, and returns its figures.
"""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.vllm import REPO, model_dir, vllm_python

TIMEOUT_S = 7200.0
# Ray Serve LLM's KVAwareRouter scores replicas with NVIDIA Dynamo's selection service
# (`dynamo.llm`): installed into the vLLM venv for this benchmark only, when missing.
DYNAMO = "ai-dynamo-runtime==1.6.1"


def run(repeats: int = 2, log=sys.stderr) -> dict:
    python = vllm_python(log)
    has_dynamo = subprocess.run([str(python), "-c", "import dynamo.llm"], capture_output=True)
    if has_dynamo.returncode != 0:
        print(f"installing {DYNAMO} into the vLLM venv (KVAwareRouter needs it)", file=log)
        install = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", DYNAMO], capture_output=True, text=True
        )
        if install.returncode != 0:  # the benchmark says so in kv_aware_error
            print(f"{DYNAMO} did not install: {install.stderr[-2000:]}", file=log)
    command = [str(python), "-m", "benchmarks.ray_serve_app", "bench", "--model", str(model_dir())]
    done = subprocess.run(
        [*command, "--repeats", str(repeats)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=log if hasattr(log, "fileno") else None,
        text=True,
        timeout=TIMEOUT_S,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the Ray Serve benchmark failed (exit code {done.returncode})")
    return json.loads(lines[-1])
