"""The mesh's Ray actors as the front door handles them: joining Ray, starting the workers
in their placement group, waiting for them, and calls to many of them at once.

Each worker is a `workers.actor.WorkerActor` in a bundle of the mesh's placement group,
named `kvmesh-worker-<id>` in Ray's kvmesh namespace (so a front door that attaches finds
it), with the typed `WorkerSettings` as its one argument.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cache_service.actor import RAY_NAMESPACE, get_service
from cache_service.auth import MeshKeys
from cluster.config import KvmeshConfig
from workers.api import WORKER_CONCURRENCY, WorkerInfo, WorkerSettings, worker_actor_name

STATS_TIMEOUT_S = 10.0  # a worker that does not answer `stats` within this is reported


def worker_settings(cfg: KvmeshConfig, keys: MeshKeys, worker_id: str) -> WorkerSettings:
    """What worker `worker_id` of a mesh with this configuration and these keys starts
    with (its node and address are filled in where it lands)."""
    auth = cfg.security.auth
    return WorkerSettings(
        worker_id=worker_id,
        node_id="",
        host=cfg.workers.host,
        model=cfg.model.name,
        dtype=cfg.model.dtype,
        copy_policy=cfg.workers.copy_policy,
        spot_check_rate=float(cfg.workers.spot_check_rate),
        share=cfg.workers.share,
        scheduler=cfg.workers.scheduler(),
        compaction=cfg.compaction,
        num_pages=cfg.store.num_pages,
        cache=cfg.cache,
        threads=cfg.workers.threads,
        publish_interval_s=cfg.workers.publish_interval_s,
        keypair=keys.workers[worker_id] if auth else None,
        page_peers=keys.worker_publics() if auth else frozenset(),
        mesh_secret=keys.secret,
        encrypt_pages=cfg.security.encrypt_pages,
        disk=cfg.store.disk.settings(cfg.store_layout().page_bytes),
        device=cfg.store.device_settings(),
    )


def start_workers(cfg: KvmeshConfig, keys: MeshKeys, group: Any, detached: bool) -> dict[str, Any]:
    """Create every worker's actor in its bundle of `group` (not awaited: `wait_ready`).

    Returns:
        worker id -> actor handle, for the mesh's worker ids (`keys.workers`, in order).
    """
    # Here, not above: the worker brings torch and the model code, which only a process
    # that starts workers needs.
    from workers.actor import WorkerActor

    bundle = group.bundle_specs[0]
    actor_cls = ray.remote(WorkerActor)
    workers = {}
    for i, worker_id in enumerate(keys.workers):
        workers[worker_id] = actor_cls.options(
            name=worker_actor_name(worker_id),
            namespace=RAY_NAMESPACE,
            lifetime="detached" if detached else None,
            num_cpus=bundle.get("CPU", 0.0),
            num_gpus=bundle.get("GPU", 0.0),
            max_restarts=cfg.workers.max_restarts,
            max_task_retries=0,  # a request in flight fails over at the front door
            # Requests in flight at once: they queue in the worker's scheduler, which
            # batches them (a serial actor would hand it one at a time).
            max_concurrency=WORKER_CONCURRENCY,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=i
            ),
        ).remote(worker_settings(cfg, keys, worker_id))
    return workers


def find_workers(worker_ids: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The named actors of these workers: (worker id -> handle, the ids not found)."""
    workers, missing = {}, []
    for worker_id in worker_ids:
        try:
            workers[worker_id] = ray.get_actor(
                worker_actor_name(worker_id), namespace=RAY_NAMESPACE
            )
        except ValueError:
            missing.append(worker_id)
    return workers, missing


def prepare_model(name: str, log) -> Any:
    """Make sure the model's dequantised cache exists (once, here, rather than in every
    worker at the same time) and return its tokenizer (None for the tiny test model)."""
    if name == "tiny":
        return None
    from workers.serving.model_loader import default_cache_dir, load_smollm2

    if not default_cache_dir().exists():
        print("preparing the model (first run: dequantising, ~20 s)...", file=log)
    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    del model
    print(f"model ready in {time.perf_counter() - start:.1f}s", file=log)
    return tokenizer


def model_tokenizer(name: str) -> Any:
    """The model's tokenizer alone (None for the tiny test model): what a front door that
    attached to a running mesh needs, without loading the weights."""
    if name == "tiny":
        return None
    from workers.serving.model_loader import load_tokenizer

    return load_tokenizer()


def find_service() -> Any | None:
    """The service actor of the mesh in this Ray cluster, or None."""
    try:
        return get_service()
    except ValueError:
        return None


def local_pids(workers: dict[str, Any]) -> list[int]:
    """The pids of the workers that run on this node (a dead one is skipped)."""
    here = ray.get_runtime_context().get_node_id()
    calls = {worker_id: w.process.remote() for worker_id, w in workers.items()}
    answers = gather(calls, STATS_TIMEOUT_S).values()
    return [a[1] for a in answers if not isinstance(a, Exception) and a[0] == here]


def gather(calls: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Each call's result, or the exception it raised (a dead actor, or no answer within
    `timeout_s` in all): one slow or dead worker costs the others nothing."""
    ray.wait(list(calls.values()), num_returns=len(calls), timeout=timeout_s)
    answers: dict[str, Any] = {}
    for key, call in calls.items():
        try:
            answers[key] = ray.get(call, timeout=0)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            answers[key] = exc
    return answers


def await_exit(pids: list[int], timeout_s: float) -> None:
    """Wait until these processes have exited (ray.kill returns before they do)."""
    deadline = time.monotonic() + timeout_s
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def join_ray(address: str | None, log) -> bool:
    """Connect this process to Ray; True when it did (and so must disconnect)."""
    if ray.is_initialized():
        current = ray.get_runtime_context().gcs_address
        if address not in (None, "auto", current):
            raise ValueError(
                f"this process is already connected to Ray at {current}; it cannot join "
                f"{address} too"
            )
        return False
    if address is None:
        print("starting an embedded Ray instance...", file=log)
        # "local": a new instance of our own, even where `ray start` left a cluster
        # running on this machine (a bare init would join that one).
        ray.init(
            address="local",
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            namespace=RAY_NAMESPACE,
            log_to_driver=False,
        )
    else:
        ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
    return True


def wait_ready(workers: dict[str, Any], log) -> list[WorkerInfo]:
    """Every worker's `info`, once each has started (with progress as they come)."""
    pending = {w.info.remote(): wid for wid, w in workers.items()}
    infos = []
    start = time.monotonic()
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=5.0)
        for ref in done:
            pending.pop(ref)
            infos.append(ray.get(ref))
        print(
            f"workers ready: {len(infos)}/{len(workers)} ({time.monotonic() - start:.0f}s)",
            file=log,
        )
    return infos
