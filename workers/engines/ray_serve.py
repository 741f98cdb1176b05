"""kvmesh in a Ray Serve LLM deployment: its request router, and the replicas' engines.

A Ray Serve LLM app (`ray.serve.llm`) runs vLLM engines as the replicas of one
deployment, all from one `LLMConfig`. With kvmesh:

- each replica's engine is a member of the mesh through `KvmeshConnector` (the config's
  `engine_kwargs["kv_transfer_config"]`), under an engine id of its own, which
  `KvmeshReplica` (the config's `callback_config`) derives from the replica's id before
  the engine starts; the replicas share one enrollment token for as many engines
  (`kvmesh enroll-token --engines N`);
- `KvmeshRouter` (the deployment's `request_router_config`) ranks the replicas Ray Serve
  offers by kvmesh's estimate of each one's time to the first token (the routing
  registry's policy: what each engine holds of the prompt, would copy and would compute,
  against its queue), and routes as Ray Serve's default router (power of two choices)
  while the service does not answer. It only ever ranks the replicas it was offered.

`llm_config(...)` builds such an `LLMConfig`; the README's recipe writes one out.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray.llm._internal.common.callbacks.base import CallbackBase
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from cache_service.routing import DEFAULT_POLICY
from workers.engines.enrollment import SERVICE_BACKOFF_S, engine_namespace

log = logging.getLogger(__name__)

CONNECTOR = "KvmeshConnector"
CONNECTOR_MODULE = "workers.engines.vllm_connector"
ENGINE_PREFIX = "serve-"  # a replica's engine id: this, then the replica's unique id
ROUTE_TIMEOUT_S = 0.5  # the longest a routing decision waits on the service
INFLIGHT_TTL_S = 600.0  # a request routed this long ago no longer counts as in flight
MAX_INFLIGHT = 65536  # requests in flight this router keeps count of (bounded state)


def replica_engine_id(unique_id: str) -> str:
    """The mesh engine id of the replica with this unique id (`ReplicaID.unique_id`)."""
    return f"{ENGINE_PREFIX}{unique_id}"


def llm_config(
    model_id: str,
    model_source: str,
    enroll_token: str,
    num_replicas: int,
    engine_kwargs: dict[str, Any] | None = None,
    deployment_config: dict[str, Any] | None = None,
    dtype: str = "bfloat16",
    router: bool = True,
    connector: bool = True,
    connector_config: dict[str, Any] | None = None,
    **options: Any,
) -> Any:
    """A Ray Serve LLM `LLMConfig` whose replicas share prefixes through the mesh and are
    chosen by `KvmeshRouter`.

    Args:
        model_id: the served model's name (also the name its engines share pages under).
        model_source: an HF model folder (or id) vLLM loads, and the router's tokenizer.
        enroll_token: a token for `num_replicas` engines (`kvmesh enroll-token --engines`).
        engine_kwargs: more vLLM engine arguments.
        deployment_config: more Ray Serve deployment options.
        router: rank replicas with `KvmeshRouter` (else Ray Serve's default router).
        connector: share KV through `KvmeshConnector` (else only route).
        connector_config: more of the connector's `kv_connector_extra_config`
            (`ray_address`, `node_ip_address`, `num_blocks`).
        options: more `LLMConfig` fields (`placement_group_config`, `runtime_env`, ...).
    """
    from ray.serve.llm import LLMConfig

    engine = {"dtype": dtype, **(engine_kwargs or {})}
    if connector:
        engine["kv_transfer_config"] = {
            "kv_connector": CONNECTOR,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "enroll_token": enroll_token,
                "model_name": model_id,
                **(connector_config or {}),
            },
        }
        options["callback_config"] = {"callback_class": KvmeshReplica}
    deployment = {"num_replicas": num_replicas, **(deployment_config or {})}
    if router:
        deployment["request_router_config"] = {
            "request_router_class": KvmeshRouter,
            "request_router_kwargs": {
                "model_name": model_id,
                "tokenizer": model_source,
                "dtype": dtype,
            },
        }
    return LLMConfig(
        model_loading_config={"model_id": model_id, "model_source": model_source},
        engine_kwargs=engine,
        deployment_config=deployment,
        **options,
    )


class KvmeshReplica(CallbackBase):
    """Ray Serve LLM's start-up hook of a replica: its engine joins the mesh as
    `replica_engine_id(its replica id)`, the id `KvmeshRouter` knows it by.

    Raises (at the replica's start):
        ValueError: the config's `kv_transfer_config` is not kvmesh's connector.
    """

    async def on_before_node_init(self) -> None:
        from ray import serve

        config = dict(self.llm_config.engine_kwargs.get("kv_transfer_config") or {})
        if config.get("kv_connector") != CONNECTOR:
            raise ValueError(
                f"KvmeshReplica names the engine of {CONNECTOR}, but the LLMConfig's "
                f"kv_transfer_config is {config.get('kv_connector')!r}"
            )
        unique_id = serve.get_replica_context().replica_id.unique_id
        extra = dict(config.get("kv_connector_extra_config") or {})
        extra["engine_id"] = replica_engine_id(unique_id)
        config["kv_connector_extra_config"] = extra
        self.llm_config.update_engine_kwargs(kv_transfer_config=config)


class _MeshView:
    """What the router needs of the mesh: a service client with the front doors' key,
    the namespaces the engines name pages under, and the model's tokenizer."""

    def __init__(self, model_name: str, tokenizer: str, dtype: str):
        import ray
        from transformers import AutoConfig, AutoTokenizer

        from cache_service.actor import get_service
        from cache_service.auth import MeshKeys
        from workers.service.client import ServiceClient, ray_resolver

        credentials = ray.get(get_service().credentials.remote(), timeout=10)
        keys = MeshKeys.from_dict(credentials["keys"])
        self.secret = keys.secret
        self.model_name = model_name
        self.kv_format = hf_kv_format(AutoConfig.from_pretrained(tokenizer), dtype, credentials)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.client = ServiceClient(
            ray_resolver(),
            timeout_s=ROUTE_TIMEOUT_S,
            retries=0,
            client_keys=keys.front_door if credentials["auth"] else None,
            backoff_s=SERVICE_BACKOFF_S,
        )

    def prompt(self, request: Any) -> tuple[list[int], str | None]:
        """The token ids vLLM will see for an OpenAI request, and its cache_salt.

        Raises:
            ValueError: a request with neither `prompt` nor `messages`.
        """
        salt = getattr(request, "cache_salt", None) or None
        messages = getattr(request, "messages", None)
        if messages is not None:
            messages = [m if isinstance(m, dict) else m.model_dump() for m in messages]
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
            return self.tokenizer(text, add_special_tokens=False)["input_ids"], salt
        prompt = getattr(request, "prompt", None)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return list(prompt), salt
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"], salt
        raise ValueError(f"a request with no prompt or messages kvmesh reads ({type(request)})")

    def namespace(self, salt: str | None):
        return engine_namespace(self.model_name, self.kv_format, self.secret, salt)


def hf_kv_format(config: Any, dtype: str, credentials: dict[str, Any]) -> str:
    """The KV format (`StoreLayout.kv_format`) vLLM's caches of a model with this HF
    config have, one rank: what its engines' namespaces are named by."""
    from workers.store.layout import StoreLayout

    text = getattr(config, "text_config", None) or config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    layers = text.num_hidden_layers
    return StoreLayout(1, layers, heads, credentials["page_tokens"], head_dim, dtype).kv_format


class KvmeshRouter(PowerOfTwoChoicesRequestRouter):
    """Ray Serve's request router for replicas that are kvmesh engines (see the module
    docstring). `request_router_kwargs`: `model_name` (the name the engines share pages
    under: the LLMConfig's model id), `tokenizer` (the model's HF folder or id), `dtype`
    (vLLM's KV dtype), `policy` (a routing registry policy; default kvmesh's)."""

    def initialize_state(
        self,
        model_name: str = "",
        tokenizer: str = "",
        dtype: str = "bfloat16",
        policy: str = DEFAULT_POLICY,
        **kwargs: Any,
    ) -> None:
        if not model_name or not tokenizer:
            raise ValueError("KvmeshRouter needs request_router_kwargs model_name and tokenizer")
        self._model = (model_name, tokenizer, dtype)
        self._policy = policy
        self._door = f"serve-router-{uuid.uuid4().hex[:8]}"
        self._calls = ThreadPoolExecutor(1, thread_name_prefix="kvmesh-router")
        self._mesh: _MeshView | None = None
        self._mesh_lock = threading.Lock()
        self._retry_at = 0.0
        self._inflight: dict[str, tuple[str, int, float]] = {}  # request -> (engine, tokens, at)
        self.decisions: Counter[str] = Counter()  # how requests were routed: a policy reason
        super().initialize_state(**kwargs)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is None or not candidate_replicas or not pending_request.args:
            return await super().choose_replicas(candidate_replicas, pending_request)
        engines = {replica_engine_id(r.replica_id.unique_id): r for r in candidate_replicas}
        loads = self._loads(engines)
        loop = asyncio.get_running_loop()
        try:
            engine, tokens = await loop.run_in_executor(
                self._calls, self._ask, pending_request.args[0], loads
            )
        except Exception as exc:  # the service, the tokenizer: routed as Ray Serve would
            log.info("kvmesh router: routing without the mesh (%s)", exc)
            engine, tokens = None, 0
        chosen = engines.get(engine)
        if chosen is None:  # no answer, or a worker Ray Serve did not offer
            self.decisions["fallback"] += 1
            return await super().choose_replicas(candidate_replicas, pending_request)
        # Counted in flight on the chosen engine from now: Ray Serve calls
        # on_request_routed only for replicas that may reject (strict max_ongoing_requests,
        # off for LLM deployments), and on_request_completed in every case.
        self._count(pending_request.metadata.internal_request_id, engine, tokens)
        rest = [r for r in candidate_replicas if r is not chosen]
        return [[chosen], rest] if rest else [[chosen]]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        request_id = pending_request.metadata.internal_request_id
        counted = self._inflight.get(request_id)
        if counted is not None:  # the replica that took it (a later rank, when full)
            self._count(request_id, replica_engine_id(replica_id.unique_id), counted[1])

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._inflight.pop(internal_request_id, None)

    def _count(self, request_id: str, engine: str, tokens: int) -> None:
        self._inflight.pop(request_id, None)
        if len(self._inflight) >= MAX_INFLIGHT:
            self._inflight.pop(next(iter(self._inflight)))  # the oldest
        self._inflight[request_id] = (engine, tokens, time.time())

    def check_integrity(self) -> None:
        """In-flight counts are bounded, and each names a replica's engine."""
        assert len(self._inflight) <= MAX_INFLIGHT
        for request_id, (engine, tokens, _) in self._inflight.items():
            assert engine.startswith(ENGINE_PREFIX) and tokens >= 0, request_id

    def _loads(self, engines: dict[str, Any]) -> dict[str, float]:
        """Prompt tokens this router has in flight on each offered engine."""
        stale = time.time() - INFLIGHT_TTL_S
        for request_id in [r for r, (_, _, at) in self._inflight.items() if at < stale]:
            del self._inflight[request_id]  # its completion never came back
        loads = dict.fromkeys(engines, 0.0)
        for engine, tokens, _ in self._inflight.values():
            if engine in loads:
                loads[engine] += tokens
        return loads

    def _ask(self, request: Any, loads: dict[str, float]) -> tuple[str | None, int]:
        """(the engine the service picks, the prompt's tokens), on the router's thread."""
        mesh = self._connected()
        if mesh is None:
            return None, 0
        tokens, salt = mesh.prompt(request)
        decision = mesh.client.route(
            mesh.namespace(salt), tokens, loads, policy=self._policy, door=self._door
        )
        self.decisions[decision.reason] += 1
        return decision.worker_id, len(tokens)

    def _connected(self) -> _MeshView | None:
        """The mesh, found once (and looked for again every few seconds until then)."""
        with self._mesh_lock:
            if self._mesh is None and time.monotonic() >= self._retry_at:
                try:
                    self._mesh = _MeshView(*self._model)
                except Exception as exc:
                    self._retry_at = time.monotonic() + SERVICE_BACKOFF_S
                    log.warning("kvmesh router: no mesh yet (%s): routing without it", exc)
            return self._mesh
