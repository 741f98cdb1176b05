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

Dead workers (`cluster.roster`): Ray tells the front door at once when a worker's actor
is gone. The front door then stops routing to it, reports it to the service (which drops
its holdings from the index at once; liveness expiry is the backstop), tells the other
workers to forget it as a peer, and runs a request that was on it again on a live
worker: a recompute, never an error for the user. `stats()` shows it as not alive. With
`workers.max_restarts`, Ray restarts a dead worker with a fresh store; the watchdog takes
it back once it answers, and its peers learn its new store.

Keys: `connect` makes the mesh's keys (`cache_service.auth.MeshKeys`: the service's, the
front door's, one pair per worker, the mesh secret) and hands them to the actors it makes;
with `security.auth` on (the default) the service and the page servers admit those keys
only, each bound to its identity.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray

from cache_service import enroll_tokens
from cache_service.actor import (
    get_service,
    start_service,
    stop_service,
)
from cache_service.auth import MeshKeys, tenant_salt
from cluster import placement
from cluster.actors import (
    STATS_TIMEOUT_S,
    await_exit,
    find_service,
    find_workers,
    gather,
    join_ray,
    local_pids,
    model_tokenizer,
    prepare_model,
    start_workers,
    wait_ready,
)
from cluster.config import KvmeshConfig, config_from_dict, config_to_dict, load_config
from cluster.dispatch import Dispatcher
from cluster.errors import MeshError
from cluster.requests import (
    FrontRequest,
    GenerateResult,
    check_request,
    check_tenant,
    many_prompts,
    result_of,
    tokens_of,
)
from cluster.roster import Roster
from cluster.status import summarize
from cluster.streams import TokenStream, chat_prompt
from workers.service.client import (
    SERVICE_BACKOFF_S,
    ServiceClient,
    ServiceError,
    ServiceUnavailable,
    ray_resolver,
    recover,
)
from workers.serving.config import SamplingParams

__all__ = ["GenerateResult", "Mesh", "MeshError", "connect"]

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "local.yaml"
SHUTDOWN_TIMEOUT_S = 60.0  # for every worker to unlink its store and stop serving
EXIT_TIMEOUT_S = 15.0  # for killed workers' processes to exit


def connect(
    config: str | Path | KvmeshConfig | None = None,
    address: str | None = None,
    log=sys.stderr,
) -> Mesh:
    """Start kvmesh, or attach to the mesh already running in the Ray cluster.

    Args:
        config: a YAML path or a KvmeshConfig (default configs/local.yaml). An attaching
            front door uses the running mesh's configuration instead (and says so when
            the one given differs).
        address: a Ray cluster to join ("auto": the one running on this machine); None
            starts an embedded local Ray instance (unless this process is already
            connected to one).
        log: where progress goes.
    Returns:
        The Mesh; `shutdown()` stops what this call started: everything when it started
        the mesh, nothing (it only detaches) when it attached to a running one.
    Raises:
        PlacementError: the workers do not fit on the cluster (nothing is left behind).
        MeshError: the mesh found in the cluster is incomplete.
    """
    # Read (and check) the configuration before joining Ray: a bad file changes nothing.
    cfg = config if isinstance(config, KvmeshConfig | None) else load_config(config)
    started_ray = join_ray(address, log)
    try:
        service = find_service()
        if service is not None:
            return Mesh._attach(service, started_ray, cfg, log)
        return Mesh._start(cfg or load_config(DEFAULT_CONFIG), started_ray, False, log)
    except BaseException:
        if started_ray and ray.is_initialized():
            ray.shutdown()
        raise


class Mesh:
    """A running kvmesh: the service actor, the worker actors, and a routing client.

    A Mesh either started what it fronts (`owned`: `shutdown()` stops it) or attached to
    a mesh started elsewhere (`kvmesh up`, another process's `connect`): `shutdown()`
    then only detaches, and `stop()` stops the mesh for everyone.
    """

    def __init__(
        self,
        cfg: KvmeshConfig,
        workers: dict[str, Any],
        tokenizer: Any,
        started_ray: bool,
        keys: MeshKeys,
        owned: bool,
    ):
        self.config = cfg
        self.roster = Roster(workers, cfg.workers.max_restarts != 0, self._report_dead)
        self.workers = workers  # worker id -> actor handle
        self._tokenizer = tokenizer
        self._tokenizer_lock = threading.Lock()
        self.owned = owned
        self._started_ray = started_ray
        self._secret = keys.secret
        # The mesh's keys, when it uses them (authentication on); None otherwise.
        self.keys = keys if cfg.security.auth else None
        front_door = keys.front_door if cfg.security.auth else None
        # Routing asks the service on every request: one short try, then skip it for a
        # while when it is down (requests are routed on what this front door knows).
        self.service_client = ServiceClient(
            ray_resolver(),
            timeout_s=1.0,
            retries=0,
            client_keys=front_door,
            backoff_s=SERVICE_BACKOFF_S,
            probe=False,  # the watchdog probes, off the request path
        )
        self._prober = ServiceClient(
            ray_resolver(), timeout_s=1.0, retries=0, client_keys=front_door
        )
        # What routing knows at once: this front door's requests in flight.
        self.dispatcher = Dispatcher.of(cfg, self.roster, self.service_client)
        self._named: set[str] = set()  # tenants whose names the service has
        self._closed = False
        self._group = None  # the workers' placement group, when this Mesh reserved it
        # The key of the enrollment tokens engines join with: only a Mesh that started
        # the service has it (`enrollment_token`); `kvmesh up` keeps it in a file.
        self.enroll_key: bytes | None = None
        self._local_pids: list[int] = []  # the workers' processes on this node

    @classmethod
    def _start(cls, cfg: KvmeshConfig, started_ray: bool, detached: bool, log) -> Mesh:
        """Reserve the workers' resources, start the service and the workers; on any
        failure stop what was started."""
        service_cfg = cfg.server_config()
        worker_ids = [f"w{i}" for i in range(cfg.workers.count)]
        keys = MeshKeys.generate(worker_ids)
        auth = cfg.security.auth
        # Placement first: a mesh that cannot be placed starts nothing.
        group = placement.reserve(cfg.workers, detached, log)
        workers: dict[str, Any] = {}
        mesh = cls(cfg, workers, None, started_ray, keys, owned=True)
        mesh._group = group
        mesh.enroll_key = enroll_tokens.new_key()
        try:
            manifest = {
                "config": config_to_dict(cfg),
                "workers": worker_ids,
                "launcher": "kvmesh up" if detached else "connect",
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started_at": time.time(),
            }
            print(f"starting the service (authentication {'on' if auth else 'off'})...", file=log)
            head = placement.live_nodes()[0].node_id  # the service runs on the head node
            start_service(service_cfg, keys, auth, manifest, head, mesh.enroll_key)
            mesh._tokenizer = prepare_model(cfg.model.name, log)
            workers.update(start_workers(cfg, keys, group, detached))
            infos = wait_ready(workers, log)
            mesh.roster.met({info.worker_id: info for info in infos})
            ray.get([w.set_peers.remote(infos) for w in workers.values()])
            mesh._local_pids = local_pids(workers)
            mesh.roster.start_watchdog(mesh._probe_service)
        except BaseException:
            mesh.stop()
            raise
        return mesh

    @classmethod
    def _attach(
        cls,
        service: Any,
        started_ray: bool,
        cfg: KvmeshConfig | None,
        log,
        partial: bool = False,
    ) -> Mesh:
        """Front the mesh that `service` belongs to: its configuration, keys and workers
        come from the cluster (through Ray), nothing is started. `partial`: take the
        workers that are left, when some are gone (to stop the rest)."""
        manifest = ray.get(service.describe.remote())
        if not manifest:
            raise MeshError(
                "a kvmesh service runs in this Ray cluster without workers around it; "
                "stop it (`kvmesh down --address ...`) or attach with the process that "
                "started it"
            )
        running = config_from_dict(manifest["config"])
        if cfg is not None and cfg != running:
            print(
                f"attaching to the mesh started by {manifest['launcher']} on "
                f"{manifest['host']}: its configuration is used, not the one given",
                file=log,
            )
        credentials = ray.get(service.credentials.remote())
        keys = MeshKeys.from_dict(credentials["keys"])
        workers, missing = find_workers(manifest["workers"])
        if missing and not partial:
            raise MeshError(
                f"the mesh in this Ray cluster has lost workers {', '.join(missing)} "
                f"(of {', '.join(manifest['workers'])}); stop it with `kvmesh down` and "
                "start it again"
            )
        print(
            f"attached to the mesh started by {manifest['launcher']} on {manifest['host']} "
            f"({len(workers)} workers)",
            file=log,
        )
        mesh = cls(running, workers, None, started_ray, keys, owned=False)
        mesh._local_pids = local_pids(workers)
        infos = gather({wid: w.info.remote() for wid, w in workers.items()}, STATS_TIMEOUT_S)
        mesh.roster.met(
            {w: i for w, i in infos.items() if not isinstance(i, Exception)},
            dead={w for w, i in infos.items() if isinstance(i, ray.exceptions.RayActorError)},
        )
        mesh.roster.start_watchdog(mesh._probe_service)
        return mesh

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (None for the tiny test model); an attached front door
        loads it (the tokenizer alone) on first use, once however many threads ask."""
        if self._tokenizer is None and self.config.model.name != "tiny":
            with self._tokenizer_lock:
                if self._tokenizer is None:
                    self._tokenizer = model_tokenizer(self.config.model.name)
        return self._tokenizer

    # ------------------------------------------------------------------ requests

    def generate(
        self,
        prompt: str | Sequence[int] | Sequence[str | Sequence[int]],
        max_new_tokens: int = 16,
        tenant: str = "default",
        worker: str | None = None,
        return_logits: bool = False,
        reuse: bool = True,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        timeout_s: float | None = None,
    ) -> GenerateResult | list[GenerateResult]:
        """Generate from a prompt on the worker that should take it: the one whose cached
        and copyable prefix, against its load, gets the first token out soonest.

        Generation stops at the model's end-of-sequence token(s) (returned as the last
        token, left out of `text`), at one of `stop_token_ids`, or after `max_new_tokens`.
        Many prompts (a list of texts or of token-id lists) are routed each, sent to each
        worker together (so a prefix they share is computed once) and batched there; the
        results come back in order. Calls from several threads run at once.

        Args:
            prompt: text or token ids, or a list of them.
            max_new_tokens: tokens to generate at most.
            tenant: the tenant's name; its pages are never shared with other tenants.
            worker: run on this worker instead of routing (for tests and benchmarks).
            return_logits: also return the last prompt position's logits.
            reuse: False computes the whole prompt and shares nothing (a baseline).
            temperature: 0 (the default) samples greedily; > 0 samples from the softmax.
            top_p: nucleus sampling: the most probable tokens up to this total probability.
            top_k: sample among the k most probable tokens (0: all).
            seed: the same seed gives the same tokens, whatever the cache supplied.
            stop_token_ids: more tokens that end generation.
            ignore_eos: generate past the end-of-sequence tokens (to max_new_tokens).
            timeout_s: the deadline, in seconds from this call to the last token (None:
                the config's `requests.timeout_s`, 600 s by default).
        Returns:
            GenerateResult(token_ids, text, stats, logits, finish_reason) (a list of them
            for a list of prompts): finish_reason "stop" or "length"; stats include
            local_hit_tokens, remote_hit_tokens, computed_tokens, batch_shared_tokens,
            ttft_client_s (as the caller saw it: routing and queueing included), ttft_s
            and queue_s (from its arrival at the worker) and worker.
        Raises:
            ValueError: an empty prompt, token ids outside the vocabulary, max_new_tokens
                not an int >= 1 or past the model's context window, bad sampling
                settings, an unknown worker, or a tenant name that cannot be encoded.
                Nothing is held or routed then.
            MeshError: no live worker is left, or the worker named by `worker` is dead.
            DeadlineExceeded: the deadline passed (the error names the phase the request
                was in and where its time went); it released everything it held.
        """
        start = time.perf_counter()
        options = {
            "sampling": SamplingParams(
                temperature=temperature, top_p=top_p, top_k=top_k, seed=seed
            ),
            "stop_token_ids": stop_token_ids,
            "reuse": reuse,
            "ignore_eos": ignore_eos,
            "return_logits": return_logits,
        }
        many = many_prompts(prompt)
        requests = [
            self._request(p, max_new_tokens, tenant, worker, timeout_s, **options)
            for p in (prompt if many else [prompt])
        ]
        outputs = self.dispatcher.generate(requests, worker)
        results = [result_of(output, start) for output in outputs]
        return results if many else results[0]

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 16,
        tenant: str = "default",
        worker: str | None = None,
        reuse: bool = True,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        timeout_s: float | None = None,
    ) -> TokenStream:
        """`generate`, with the tokens handed over as they are decoded.

            stream = mesh.stream("Once upon a time", max_new_tokens=32)
            for chunk in stream:           # StreamChunk(token_id, text): text is what
                print(chunk.text, end="")  # the token adds to the decoded output
            stream.result                  # the GenerateResult, once the stream ended

        Same arguments, checks and errors as `generate` (raised here, before anything
        runs). A routed request whose worker dies before its first token runs again on a
        live worker; after it, the stream raises MeshError. Leaving the loop early,
        `stream.close()` or dropping the stream cancels the request on its worker (its
        pages are freed); the deadline (`timeout_s`) runs from this call to the last
        token.
        """
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        request = self._request(
            prompt, max_new_tokens, tenant, worker, timeout_s, sampling=sampling,
            stop_token_ids=stop_token_ids, reuse=reuse, ignore_eos=ignore_eos,
        )  # fmt: skip
        return TokenStream(self.dispatcher.stream(request, worker), self.tokenizer, result_of)

    def chat(
        self,
        messages: Sequence[dict[str, str]],
        max_new_tokens: int = 64,
        tenant: str = "default",
        *,
        stream: bool = False,
        **options: Any,
    ) -> GenerateResult | TokenStream:
        """Answer a conversation: the model's chat template turns `messages` into the
        prompt (with the assistant's turn opened), then `generate` (or `stream`) runs it.
        A conversation that grows turn by turn reuses its earlier turns' pages.

        Args:
            messages: [{"role": "system" | "user" | "assistant", "content": str}, ...].
            max_new_tokens, tenant: as `generate`.
            stream: return a TokenStream instead of waiting for the whole answer.
            options: the other keyword arguments of `generate` / `stream`.
        Raises:
            ValueError: malformed messages, a model without a chat template, or what
                `generate` raises.
        """
        tokens = chat_prompt(self.tokenizer, messages, self.config.model.name)
        run = self.stream if stream else self.generate
        return run(tokens, max_new_tokens, tenant, **options)

    def _request(
        self, prompt, max_new_tokens, tenant, worker, timeout_s, **options
    ) -> FrontRequest:
        """Check everything a worker would, before anything is routed or held (`options`:
        `check_request`'s sampling, stop tokens and flags)."""
        if self._closed:
            raise RuntimeError("mesh is shut down")
        model = self.config.model.name
        tokens = tokens_of(prompt, self.tokenizer, model)
        if worker is not None and worker not in self.workers:
            raise ValueError(f"unknown worker {worker!r}; known: {', '.join(self.workers)}")
        salt = self.salt(tenant)
        check_tenant(tenant)
        if timeout_s is None:
            timeout_s = self.config.requests.timeout_s
        request = check_request(tokens, model, salt, max_new_tokens, timeout_s=timeout_s, **options)
        self._name_tenant(tenant, salt)
        return request

    def flush(self, timeout_s: float = STATS_TIMEOUT_S) -> None:
        """Wait until every live worker's events are applied by the service (workers
        publish in the background, a moment after each request): for tests and
        benchmarks that need the index to be current.

        Raises:
            MeshError: a live worker could not bring the service up to date in time.
        """
        calls = {w: self.workers[w].flush.remote() for w in self.live_workers()}
        failed = []
        for worker_id, answer in gather(calls, timeout_s).items():
            if isinstance(answer, ray.exceptions.RayActorError):
                self.roster.lost(worker_id, answer)
            elif answer is not True:
                failed.append(f"{worker_id} ({answer or 'the service did not answer'})")
        if failed:
            raise MeshError(f"the index is not up to date with {', '.join(failed)}")

    def enrollment_token(self, engines: int = 1) -> str:
        """A new token for `engines` vLLM engines (replicas share one) to join this mesh.

        Raises:
            MeshError: this front door attached to a mesh started elsewhere: tokens come
                from `kvmesh enroll-token` where `kvmesh up` ran.
        """
        if self.enroll_key is None:
            raise MeshError(
                "only the process that started the mesh issues enrollment tokens here; "
                "run `kvmesh enroll-token` where `kvmesh up` ran"
            )
        return enroll_tokens.issue(self.enroll_key, engines)

    def live_workers(self) -> list[str]:
        """The workers not known to be dead, by id."""
        return self.roster.live()

    def _report_dead(self, worker_id: str) -> None:
        """The service drops a dead worker's holdings at once; without the service they
        leave the index when its liveness expires."""
        with contextlib.suppress(ServiceUnavailable, ServiceError):
            self.service_client.report_dead(worker_id)

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
            self.service_client.name_tenant(salt, tenant)
            self._named.add(tenant)
        except ServiceUnavailable:
            pass  # told on a later request

    def stats(self) -> dict[str, Any]:
        """Cluster-level figures, the same as `kvmesh status --json`: workers per node,
        pages, hit rates (cluster, per worker, per tenant), the service epoch, and the
        raw service and worker figures (see `cluster.status.summarize`). A worker that
        does not answer is reported as not alive, with the error."""
        try:
            service = self.service_client.stats()
        except ServiceUnavailable as exc:
            service = {"unavailable": True, "error": str(exc)}
        answers = gather(
            {wid: w.stats.remote() for wid, w in self.workers.items()}, STATS_TIMEOUT_S
        )
        for worker_id, answer in answers.items():
            if isinstance(answer, ray.exceptions.RayActorError):
                self.roster.lost(worker_id, answer)
        workers = {
            worker_id: (
                {"alive": False, "error": f"{type(answer).__name__}: {answer}"}
                if isinstance(answer, Exception)
                else answer.as_dict()
            )
            for worker_id, answer in answers.items()
        }
        nodes = {node.node_id: node.address for node in placement.live_nodes()}
        address = ray.get_runtime_context().gcs_address
        return summarize(service, workers, nodes, address, self.config.security.auth)

    def check_integrity(self) -> None:
        """Check every live worker's and the service's invariants (raises what they raise);
        a worker found dead is skipped (and routed around from now on)."""
        calls = {wid: w.check_integrity.remote() for wid, w in self.workers.items()}
        for worker_id, answer in gather(calls, STATS_TIMEOUT_S).items():
            if isinstance(answer, ray.exceptions.RayActorError):
                self.roster.lost(worker_id, answer)
            elif isinstance(answer, ray.exceptions.RayTaskError):
                raise answer.as_instanceof_cause()
            elif isinstance(answer, Exception):
                raise answer
        ray.get(get_service().check_integrity.remote())
        self.dispatcher.inflight.check_integrity()

    def shutdown(self) -> None:
        """Stop what `connect` started: the whole mesh when it started it (`stop()`), or
        only this front door when it attached to a running mesh (`detach()`). Idempotent."""
        if self.owned:
            self.stop()
        else:
            self.detach()

    def detach(self) -> None:
        """Leave the mesh running and close this front door (and leave Ray if `connect`
        joined it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.roster.stop_watchdog()
        self.service_client.close()
        self._prober.close()
        if self._started_ray:
            ray.shutdown()

    def stop(self) -> None:
        """Stop the mesh for everyone: the workers (each unlinks its page store), the
        service, the workers' placement group; then leave Ray if `connect` joined it.
        A worker that is already dead (or does not stop) is killed, and its segments on
        this node are reclaimed once its process has exited. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.roster.stop_watchdog()
        calls = {worker_id: w.shutdown.remote() for worker_id, w in self.workers.items()}
        for worker_id, answer in gather(calls, SHUTDOWN_TIMEOUT_S).items():
            if isinstance(answer, Exception):
                print(f"kvmesh: worker {worker_id} did not stop cleanly: {answer}", file=sys.stderr)
        for handle in self.workers.values():
            ray.kill(handle, no_restart=True)
        self.service_client.close()
        self._prober.close()
        stop_service()
        group = self._group or placement.find_group()
        if group is not None:
            placement.release(group)
        # ray.kill returns before the process exits; a dead owner's segments can only be
        # told from a live one's after that.
        await_exit(self._local_pids, EXIT_TIMEOUT_S)
        from workers.store.segment_names import reclaim_dead_segments

        reclaim_dead_segments()
        if self._started_ray:
            ray.shutdown()

    # ------------------------------------------------------------------ internals

    def _probe_service(self) -> None:
        """While routing skips the service (it did not answer), ask it here, off the
        request path, whether it is back; when it answers, routing asks it again."""
        recover(self.service_client, self._prober)
