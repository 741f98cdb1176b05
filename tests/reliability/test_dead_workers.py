"""Dead workers degrade to misses, quickly: a killed copy source costs no request, its pages
leave the index at once, and a cache reset reaches routing at once. A worker alive but not
serving (its serving loop failed) is routed around until its loop is back. A request
past its deadline, or whose caller left, ends on its worker and frees its pages.

Three workers on the tiny model. w0 computes the prompts; w1 and w2 copy them from it or
are routed to; w0 is killed (SIGKILL, as the kernel's OOM killer would) while requests run.
"""

from __future__ import annotations

import io
import os
import signal
import threading
import time

import pytest
import ray

import cluster
from benchmarks import faults
from cache_service.events import Namespace
from cluster.config import config_from_dict
from cluster.dispatch import ANSWER_GRACE_S
from tests.waiting import wait_until
from workers.service.client import ServiceClient, ray_resolver

pytestmark = pytest.mark.slow

CONFIG = {
    "model": {"name": "tiny"},
    "store": {"num_pages": 128},
    "workers": {"count": 3, "threads": 1, "num_cpus": 0.5, "copy_policy": "always"},
}
PROMPT_TOKENS = 48  # three 16-token pages
NEW_TOKENS = 4


def prompt(i: int) -> list[int]:
    return [(7 * i + j) % 250 + 1 for j in range(PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def mesh(ray_local):
    mesh = cluster.connect(config_from_dict(CONFIG), log=io.StringIO())
    yield mesh
    mesh.check_integrity()
    mesh.shutdown()


def front_door_client(mesh) -> ServiceClient:
    return ServiceClient(ray_resolver(), timeout_s=2.0, client_keys=mesh.keys.front_door)


def holders(client: ServiceClient, mesh, tokens: list[int], tenant: str) -> set[str]:
    namespace = Namespace(mesh.config.model.name, "", mesh.salt(tenant))
    _, spans = client.match(namespace, tokens)
    return {span.worker_id for span in spans}


def test_a_worker_whose_loop_failed_is_routed_around_until_it_serves_again(mesh):
    """w1's serving loop fails once (its scheduler raises, set inside its process for this
    test): the requests it held and those sent after run on the others, a request pinned
    to it gets a typed error at once, and once its loop is back it is routed to again."""

    def break_the_loop_once(worker, restart_delay_s: float) -> None:
        import workers.serving.loop as loop

        loop.RESTART_DELAY_S = restart_delay_s
        scheduler, schedule = worker.scheduler, worker.scheduler.schedule

        def failing():
            scheduler.schedule = schedule
            raise RuntimeError("injected: the scheduler broke")

        scheduler.schedule = failing

    prompts = [prompt(300 + i) for i in range(6)]
    reference = [
        mesh.generate(t, NEW_TOKENS, tenant="loop-ref", worker="w0", reuse=False).token_ids
        for t in prompts
    ]
    ray.get(mesh.workers["w1"].__ray_call__.remote(break_the_loop_once, 10.0))
    outputs = mesh.generate(prompts, NEW_TOKENS, tenant="loop")  # spread over w0, w1, w2
    assert [out.token_ids for out in outputs] == reference
    assert {out.stats["worker"] for out in outputs} <= {"w0", "w2"}
    health = ray.get(mesh.workers["w1"].health.remote())
    assert not health.serving and "the scheduler broke" in health.last_failure
    assert "w1" in mesh.roster.not_serving() and "w1" in mesh.live_workers()
    with pytest.raises(cluster.MeshError, match="w1.*stopped serving"):
        mesh.generate(prompts[0], NEW_TOKENS, tenant="loop", worker="w1")
    wait_until(lambda: "w1" in mesh.roster.routable(), 30, "w1 serving again")
    again = mesh.generate(prompts[0], NEW_TOKENS, tenant="loop", worker="w1")
    assert again.token_ids == reference[0]
    assert mesh.stats()["workers"]["w1"]["serving"]["restarts"] == 1


def w1_figures(mesh) -> tuple[int, int]:
    """w1's pages held by requests, and its requests ended early."""
    return ray.get(
        mesh.workers["w1"].__ray_call__.remote(
            lambda w: (w.cache.pages_referenced(), w.scheduler.ended)
        )
    )


def test_a_deadline_ends_the_request_with_a_typed_error_and_frees_its_pages(mesh):
    ray.get(faults.install(mesh.workers["w1"], "slow_passes", 0.02))
    try:
        _, ended = w1_figures(mesh)
        start = time.monotonic()
        with pytest.raises(cluster.DeadlineExceeded) as info:
            mesh.generate(prompt(400), 200, worker="w1", ignore_eos=True, timeout_s=1.0)
        assert time.monotonic() - start < 1.0 + ANSWER_GRACE_S  # the deadline, its grace
        error = info.value
        assert type(error) is cluster.DeadlineExceeded  # the worker's own, not Ray's wrapper
        assert error.phase == "decode" and error.spent["decode"] > 0, error
        wait_until(lambda: w1_figures(mesh) == (0, ended + 1), 10, "w1 to free its pages")
        with pytest.raises(ValueError, match="timeout_s must be a positive"):
            mesh.generate(prompt(400), 4, timeout_s=0)
    finally:
        ray.get(faults.install(mesh.workers["w1"], "heal"))


def test_a_stream_its_caller_leaves_is_cancelled_on_its_worker(mesh):
    ray.get(faults.install(mesh.workers["w1"], "slow_passes", 0.02))
    try:
        _, ended = w1_figures(mesh)
        stream = mesh.stream(prompt(401), 200, worker="w1", ignore_eos=True)
        for i, _chunk in enumerate(stream):
            if i == 2:
                break  # the caller leaves
        del stream, _chunk
        wait_until(lambda: w1_figures(mesh) == (0, ended + 1), 10, "w1 to cancel the stream")
        with mesh.stream(prompt(402), 200, worker="w1", ignore_eos=True) as stream:
            next(iter(stream))
        wait_until(lambda: w1_figures(mesh) == (0, ended + 2), 10, "w1 to cancel the second")
    finally:
        ray.get(faults.install(mesh.workers["w1"], "heal"))


def test_a_cache_reset_leaves_the_index_and_routing_at_once(mesh):
    tokens = prompt(100)
    mesh.generate(tokens, NEW_TOKENS, tenant="reset", worker="w2")
    mesh.flush()
    with front_door_client(mesh) as client:
        assert holders(client, mesh, tokens, "reset") == {"w2"}
        namespace = Namespace(mesh.config.model.name, "", mesh.salt("reset"))
        loads = {"w0": 0.0, "w1": 0.0, "w2": 0.0}
        assert client.route(namespace, tokens, loads).worker_id == "w2"  # it holds them
        assert ray.get(mesh.workers["w2"].clear_cache.remote()) > 0
        mesh.flush()
        assert holders(client, mesh, tokens, "reset") == set()
        decision = client.route(namespace, tokens, loads)
        assert (decision.worker_id, decision.reason) == ("w0", "least_loaded")
        pages = client.stats()["workers"]["w2"]["pages"]
        assert pages == 0  # AllCleared: every holding dropped at once


def test_a_killed_copy_source_costs_no_request(mesh):
    prompts = [prompt(i) for i in range(8)]
    for tokens in prompts:
        mesh.generate(tokens, NEW_TOKENS, tenant="kill", worker="w0")
    mesh.flush()
    requests = [(tokens + [200 + k], k % 3) for k in range(4) for tokens in prompts]
    # What a mesh without any cache answers: the outputs every request must equal.
    reference = {
        i: mesh.generate(t, NEW_TOKENS, tenant="kill-ref", worker="w2", reuse=False).token_ids
        for i, (t, _) in enumerate(requests)
    }
    _, w0_pid = ray.get(mesh.workers["w0"].process.remote())
    w0_store = ray.get(mesh.workers["w0"].info.remote()).shm_name

    answers: dict[int, list[int]] = {}
    copied: list[int] = []
    failures: list[BaseException] = []
    started = threading.Barrier(4)

    def client(lane: int) -> None:
        started.wait()
        for i, (tokens, which) in enumerate(requests):
            if which != lane:
                continue
            # Lane 0 is routed: the mesh picks w0 (it holds the prompts) until it is dead.
            # Lanes 1 and 2 run on w1 and w2, which copy the prompts out of w0's store.
            worker = None if lane == 0 else f"w{lane}"
            try:
                result = mesh.generate(tokens, NEW_TOKENS, tenant="kill", worker=worker)
                answers[i] = result.token_ids
                copied.append(result.stats["remote_hit_tokens"])
            except BaseException as exc:  # every request must succeed
                failures.append(exc)
            time.sleep(0.02)

    threads = [threading.Thread(target=client, args=(lane,)) for lane in range(3)]
    for thread in threads:
        thread.start()
    started.wait()
    time.sleep(0.3)  # some requests done, others in flight
    os.kill(w0_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(120)
    assert not failures, failures
    assert answers == reference  # no request failed, none served wrong KV
    assert max(copied) > 0  # the others did copy from w0

    # Ray reported the death; the front door routes around w0 and told the service.
    looked = time.monotonic()
    wait_until(lambda: "w0" not in mesh.live_workers(), 10, "w0 seen dead")
    detected = time.monotonic() - looked
    assert detected < 5, "the death was seen only when liveness expired"
    with front_door_client(mesh) as client:
        service = client.stats()
        assert "w0" not in {w for w, f in service["workers"].items() if f["live"]}
        assert service["workers_live"] == 2
        for tokens in prompts:
            # Nothing is served from it afterwards: no match names it.
            assert "w0" not in holders(client, mesh, tokens + [1], "kill")
    assert time.monotonic() - killed_at < 30
    stats = mesh.stats()
    assert stats["workers"]["w0"]["alive"] is False
    assert stats["workers"]["w1"]["alive"] and stats["workers"]["w2"]["alive"]
    # The peers that copied out of w0's store no longer map it; w0's node (this one)
    # unlinked it: its memory is back.
    dead_store = w0_store
    for worker_id in ("w1", "w2"):
        assert dead_store not in stats["workers"][worker_id]["attached"]
    wait_until(lambda: dead_store not in os.listdir("/dev/shm"), 10, "w0's store unlinked")
    # A request forced onto the dead worker says so; routed ones keep working.
    with pytest.raises(cluster.MeshError, match="w0"):
        mesh.generate(prompts[0], NEW_TOKENS, tenant="kill", worker="w0")
    again = mesh.generate(prompts[0] + [9], NEW_TOKENS, tenant="kill")
    assert again.stats["worker"] in ("w1", "w2")
    mesh.check_integrity()  # the dead worker is skipped, the live ones are whole
