"""The Python front door: `connect()` starts (or joins) Ray, the service and the workers.

    import cluster
    mesh = cluster.connect(config="configs/local.yaml")     # embedded Ray
    result = mesh.generate("text", max_new_tokens=16, tenant="acme")
    result.token_ids, result.text, result.stats
    mesh.stats()
    mesh.shutdown()

Tenants: the front door is the server side of the system, so it derives each tenant's
salt itself (an HMAC of the tenant name under the mesh secret) and passes the salt to the
worker; a client only ever names its tenant. Different tenants therefore never share
pages, even for byte-identical prompts. The front door tells the service each tenant's
name, so the statistics show names, never salts.

Keys: `connect` makes the mesh's keys (`cache_service.auth.MeshKeys`: the service's, the
front door's, one pair per worker, and the mesh secret) and hands them to the actors it
creates; with `security.auth` on (the default) the service and the page servers admit
those keys only, each bound to its identity.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cache_service.actor import RAY_NAMESPACE, get_service, start_service, stop_service
from cache_service.auth import KeyPair, MeshKeys, tenant_salt
from cache_service.events import Namespace
from cache_service.server import ServerConfig
from cluster.config import KvmeshConfig, load_config
from workers.client import ServiceClient, ServiceUnavailable, ray_resolver
from workers.worker import Worker, WorkerSettings

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "local.yaml"


class GenerateResult(NamedTuple):
    token_ids: list[int]
    text: str
    stats: dict[str, Any]
    logits: list[float] | None = None  # the last prompt position's, when asked for


class WorkerActor(Worker):
    """The worker as a Ray actor: settings arrive as a plain dict."""

    def __init__(self, settings: dict[str, Any]):
        from workers.prefix_cache import PrefixCacheConfig

        settings = dict(settings)
        settings["cache"] = PrefixCacheConfig(**settings["cache"])
        if settings.get("keypair") is not None:
            settings["keypair"] = KeyPair(*settings["keypair"])
        settings["page_peers"] = frozenset(settings.get("page_peers", ()))
        super().__init__(WorkerSettings(**settings))


def connect(
    config: str | Path | KvmeshConfig | None = None,
    address: str | None = None,
    log=sys.stderr,
) -> Mesh:
    """Start kvmesh and wait until every worker is ready.

    Args:
        config: a YAML path or a KvmeshConfig (default configs/local.yaml).
        address: a Ray cluster to join; None starts an embedded local Ray instance
            (unless this process is already connected to one).
        log: where progress goes.
    Returns:
        The Mesh; call `shutdown()` to stop what this call started.
    """
    if config is None:
        config = DEFAULT_CONFIG
    cfg = config if isinstance(config, KvmeshConfig) else load_config(config)
    started_ray = False
    if not ray.is_initialized():
        if address is None:
            print("starting an embedded Ray instance...", file=log)
            ray.init(
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                namespace=RAY_NAMESPACE,
                log_to_driver=False,
            )
        else:
            ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)
        started_ray = True
    try:
        return Mesh._start(cfg, started_ray, log)
    except BaseException:
        if ray.is_initialized():
            stop_service()
            if started_ray:
                ray.shutdown()
        raise


class Mesh:
    """A running kvmesh: the service actor, the worker actors, and a routing client."""

    def __init__(
        self,
        cfg: KvmeshConfig,
        workers: dict[str, Any],
        tokenizer: Any,
        started_ray: bool,
        keys: MeshKeys,
    ):
        self.config = cfg
        self.workers = workers
        self.tokenizer = tokenizer
        self._started_ray = started_ray
        self._secret = keys.secret
        # The keys, when the mesh uses them (authentication on); None otherwise.
        self._keys = keys if cfg.security.auth else None
        front_door = keys.front_door if cfg.security.auth else None
        self._client = ServiceClient(
            ray_resolver(), timeout_s=2.0, retries=1, client_keys=front_door
        )
        self._named: set[str] = set()  # tenants whose names the service has
        self._inflight = dict.fromkeys(workers, 0)
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def _start(cls, cfg: KvmeshConfig, started_ray: bool, log) -> Mesh:
        service_cfg = ServerConfig(
            host=cfg.service.host,
            port=cfg.service.port,
            liveness_timeout_s=cfg.service.liveness_timeout_s,
            page_tokens=cfg.cache.page_tokens,
            load_weight=cfg.service.load_weight,
            max_workers=cfg.service.max_workers,
            max_tenants=cfg.service.max_tenants,
            max_spans=cfg.service.max_spans,
        )
        worker_ids = [f"w{i}" for i in range(cfg.workers.count)]
        keys = MeshKeys.generate(worker_ids)
        auth = cfg.security.auth
        print(f"starting the service (authentication {'on' if auth else 'off'})...", file=log)
        start_service(service_cfg, keys, auth)
        tokenizer = _prepare_model(cfg.model.name, log)
        nodes = _nodes()
        workers: dict[str, Any] = {}
        actor_cls = ray.remote(WorkerActor)
        for i, worker_id in enumerate(worker_ids):
            node = nodes[i % len(nodes)]  # spread: worker i on node i mod N, head first
            settings = {
                "worker_id": worker_id,
                "node_id": node["NodeID"],
                "host": (
                    "127.0.0.1" if cfg.workers.host == "loopback" else node["NodeManagerAddress"]
                ),
                "model": cfg.model.name,
                "num_pages": cfg.store.num_pages,
                "cache": dataclasses.asdict(cfg.cache),
                "threads": cfg.workers.threads,
                "publish_interval_s": cfg.workers.publish_interval_s,
                "keypair": tuple(keys.workers[worker_id]) if auth else None,
                "page_peers": sorted(keys.worker_publics()) if auth else [],
                "mesh_secret": keys.secret,
                "encrypt_pages": cfg.security.encrypt_pages,
            }
            workers[worker_id] = actor_cls.options(
                name=f"kvmesh-worker-{worker_id}",
                namespace=RAY_NAMESPACE,
                num_cpus=0,
                max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False),
            ).remote(settings)
        mesh = cls(cfg, workers, tokenizer, started_ray, keys)
        try:
            infos = _wait_ready(workers, log)
            ray.get([w.set_peers.remote(infos) for w in workers.values()])
        except BaseException:
            mesh.shutdown()
            raise
        return mesh

    # ------------------------------------------------------------------ requests

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 16,
        tenant: str = "default",
        worker: str | None = None,
        return_logits: bool = False,
    ) -> GenerateResult:
        """Generate from a prompt on the worker that holds most of its prefix.

        Args:
            prompt: text or token ids.
            max_new_tokens: tokens to generate (greedy).
            tenant: the tenant's name; its pages are never shared with other tenants.
            worker: run on this worker instead of routing (for tests and benchmarks).
            return_logits: also return the last prompt position's logits.
        Returns:
            GenerateResult(token_ids, text, stats); stats include local_hit_tokens,
            remote_hit_tokens, computed_tokens, ttft_s and worker.
        Raises:
            ValueError: empty prompt, unknown worker or tenant, bad max_new_tokens.
        """
        if self._closed:
            raise RuntimeError("mesh is shut down")
        tokens = self._tokens(prompt)
        if not tokens:
            raise ValueError("empty prompt")
        salt = self.salt(tenant)
        self._name_tenant(tenant, salt)
        if worker is None:
            worker = self._route(Namespace(self.config.model.name, "", salt), tokens)
        elif worker not in self.workers:
            raise ValueError(f"unknown worker {worker!r}; known: {', '.join(self.workers)}")
        with self._lock:
            self._inflight[worker] += 1
        try:
            call = self.workers[worker].generate.remote(
                tokens, max_new_tokens, salt, return_logits=return_logits
            )
            out = ray.get(call)
        finally:
            with self._lock:
                self._inflight[worker] -= 1
        return GenerateResult(out["token_ids"], out["text"], out["stats"], out.get("logits"))

    def salt(self, tenant: str) -> str:
        """The namespace salt of a tenant (derived from the mesh secret, never taken from a
        client); the same on every front door of the mesh.

        Raises:
            ValueError: an empty tenant name, or one that is not valid UTF-8.
        """
        return tenant_salt(self._secret, tenant)

    def _name_tenant(self, tenant: str, salt: str) -> None:
        """Tell the service the tenant's name once (its statistics show names, not salts)."""
        if tenant in self._named:
            return
        try:
            self._client.name_tenant(salt, tenant)
            self._named.add(tenant)
        except ServiceUnavailable:
            pass  # told on a later request

    def stats(self) -> dict[str, Any]:
        """Cluster-level figures: the service's index statistics plus each worker's."""
        try:
            service = self._client.stats()
        except ServiceUnavailable:
            service = {"unavailable": True}
        workers = dict(
            zip(
                self.workers,
                ray.get([w.stats.remote() for w in self.workers.values()]),
                strict=True,
            )
        )
        return {"service": service, "workers": workers}

    def check_integrity(self) -> None:
        ray.get([w.check_integrity.remote() for w in self.workers.values()])
        ray.get(get_service().check_integrity.remote())

    def shutdown(self) -> None:
        """Stop the workers (unlinking their page stores), the service, and Ray if
        `connect` started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            ray.get([w.shutdown.remote() for w in self.workers.values()], timeout=60)
        except Exception as exc:  # a dead worker: its segments are reclaimed below
            print(f"kvmesh: a worker did not shut down cleanly: {exc}", file=sys.stderr)
        for handle in self.workers.values():
            ray.kill(handle, no_restart=True)
        self._client.close()
        stop_service()
        if self._started_ray:
            ray.shutdown()
        from workers.page_store import reclaim_dead_segments

        reclaim_dead_segments()

    # ------------------------------------------------------------------ internals

    def _tokens(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"model {self.config.model.name!r} has no tokenizer: pass token ids"
                )
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def _route(self, namespace: Namespace, tokens: list[int]) -> str:
        with self._lock:
            total = sum(self._inflight.values()) or 1
            loads = {w: n / total for w, n in self._inflight.items()}
        try:
            decision = self._client.route(namespace, tokens, loads)
            if decision.worker_id in self.workers:
                return decision.worker_id
        except ServiceUnavailable:
            pass  # route without the index: least loaded
        return min(loads, key=lambda w: (loads[w], w))


def _prepare_model(name: str, log) -> Any:
    """Make sure the model's dequantised cache exists (once, here, rather than in every
    worker at the same time) and return its tokenizer (None for the tiny test model)."""
    if name == "tiny":
        return None
    from workers.model_runner import default_cache_dir, load_smollm2

    if not default_cache_dir().exists():
        print("preparing the model (first run: dequantising, ~20 s)...", file=log)
    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    del model
    print(f"model ready in {time.perf_counter() - start:.1f}s", file=log)
    return tokenizer


def _nodes() -> list[dict[str, Any]]:
    alive = [n for n in ray.nodes() if n["Alive"]]
    # Head first, then by id: placement is deterministic for a given cluster.
    return sorted(
        alive, key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeID"])
    )


def _wait_ready(workers: dict[str, Any], log) -> list[dict[str, Any]]:
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
