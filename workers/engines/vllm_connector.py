"""kvmesh's KV connector for vLLM: a vLLM engine shares prefixes through the mesh.

Load it with vLLM's `--kv-transfer-config` (or `LLM(kv_transfer_config=...)`):

    {"kv_connector": "KvmeshConnector",
     "kv_connector_module_path": "workers.engines.vllm_connector",
     "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"engine_id": "vllm-a", "enroll_token": "..."}}

Extra config: `enroll_token` (a token from `kvmesh enroll-token`, spent by this engine;
default $KVMESH_ENROLL_TOKEN), `engine_id` (its worker id in the mesh; default
"vllm-<host>-<a digest of its token>"), `ray_address` (the Ray cluster of a running
`kvmesh up`; default "auto"), `num_blocks` (blocks the engine's kvmesh store keeps;
default 64), `model_name` (the name engines of one model share under; default vLLM's
served model name),
`node_ip_address` (this machine's Ray node, where several Ray nodes share one machine;
default: Ray's choice), `lookup_wait_ms` (how long vLLM's scheduler waits on a lookup
before the connector answers "not yet"; default 3).

vLLM makes one connector in its scheduler process and one in each worker process:

- scheduler (`get_num_new_matched_tokens`): asks the service how many whole blocks of
  the prompt beyond vLLM's own hit are held by engines of the same model and KV format
  on this node (the last prompt token is always computed); vLLM then allocates blocks
  and `build_connector_meta` hands the worker a `LoadSpec` per hit (holders, their
  pages and generations) and a `SaveSpec` per request whose prompt blocks filled in the
  step.
- worker (`start_load_kv`, `wait_for_save`): copies the held pages, validated, into the
  engine's own kvmesh store and from there into vLLM's blocks before the forward; after
  it, copies the newly computed full prompt blocks into the store and publishes them.
  A page that fails validation (changed, freed, or holding other tokens) is reported
  through `get_block_ids_with_load_errors`, and vLLM recomputes from there
  (`kv_load_failure_policy: recompute`): never wrong KV, never a hung request.

Loads complete before the forward: on the CPU they are done when `start_load_kv`
returns (a page copy in shared memory is a memcpy, well below a prefill of the same
tokens); on CUDA they are queued on a stream of their own that the forward's stream waits
for, whole (`workers.engines.kv_copier`). vLLM's KV layout is read at `register_kv_caches`
from its tensors and its attention backend's name (`workers.engines.kv_layouts`); a
layout kvmesh does not read, or could read more than one way, stops the engine there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from workers.engines.blocks import engine_layout, kv_layers
from workers.engines.engine import EngineCache, EngineIndex, LoadSpec, SaveSpec
from workers.engines.enrollment import default_engine_id, engine_namespace, join_mesh
from workers.engines.kv_layouts import (
    KVLayout,
    KVLayoutError,
    LayerKV,
    detect_layout,
    layer_views,
    layout_of_shape_fn,
)
from workers.engines.lookups import WAIT_S as LOOKUP_WAIT_S
from workers.engines.lookups import Lookups

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

DEFAULT_NUM_BLOCKS = 64  # 64 blocks of 128 tokens: 8,192 tokens, 180 MB for SmolLM2-135M


@dataclass
class KvmeshConnectorMetadata(KVConnectorMetadata):
    """One step's work for the worker side: loads before the forward, saves after it, and
    each new request's prompt tokens by source (for the mesh's hit-rate figures)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    admitted: list[tuple[str, str, int, int, int]] = field(default_factory=list)


@dataclass
class _Tracked:
    """A running request's prompt blocks, as the scheduler side follows them."""

    namespace: Any
    prompt: tuple[int, ...]
    block_ids: list[int]
    saved: int = 0  # prompt blocks handed to the worker to save so far


class KvmeshConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        refuse_unsupported(vllm_config, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.block_size = vllm_config.cache_config.block_size
        token = extra.get("enroll_token")
        self.engine_id = str(extra.get("engine_id") or default_engine_id(token))
        self.num_blocks = int(extra.get("num_blocks", DEFAULT_NUM_BLOCKS))
        model = vllm_config.model_config
        self.model_name = str(extra.get("model_name") or model.served_model_name or model.model)
        self.enrollment = join_mesh(
            self.engine_id,
            str(extra.get("ray_address", "auto")),
            extra.get("node_ip_address"),
            token,
        )
        # The KV format: known to the worker from its caches; the scheduler derives the
        # same string from the model config (checked against the worker's at first save).
        self.kv_format = _kv_format(vllm_config, self.enrollment.page_tokens)
        self.index: EngineIndex | None = None
        self.engine: EngineCache | None = None
        self._layers: list[LayerKV] = []
        self._load_errors: set[int] = set()
        self._unfilled: dict[str, int] = {}  # req -> its first block left unloaded, this step
        self.lookups: Lookups | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.index = EngineIndex(self.enrollment, self.block_size)
            self.lookups = Lookups(
                self.index.lookup,
                (0, (), ()),
                f"kvmesh-lookups-{self.engine_id}",
                wait_s=float(extra.get("lookup_wait_ms", 1000 * LOOKUP_WAIT_S)) / 1000,
            )
        self._pending: dict[str, tuple[int, tuple, tuple, int]] = {}  # req -> its hit
        self._loads: dict[str, LoadSpec] = {}  # req -> its load, once vLLM gave it blocks
        self._tracked: dict[str, _Tracked] = {}
        self._new_hits: dict[str, tuple[int, int]] = {}  # req -> (local, external) tokens
        self._namespaces: dict[str, Any] = {}  # req -> its namespace, until scheduled
        log.info(
            "kvmesh connector (%s) joined the mesh as %s, node %s",
            role.name.lower(),
            self.engine_id,
            self.enrollment.node_id[:8],
        )

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Read vLLM's KV layout (see `kv_layouts`) and start the engine's side of the mesh.

        Raises:
            KVLayoutError: caches of a layout kvmesh does not read, or could read more
                than one way (the message names the backend, the shape and the strides).
            ValueError: caches of another KV format than the model config's.
        """
        caches = kv_layers(kv_caches)
        model = self._vllm_config.model_config
        heads = model.get_num_kv_heads(self._vllm_config.parallel_config)
        head_dim = model.get_head_size()
        backend, hint = _backend_layout(self._vllm_config, list(kv_caches), heads, head_dim)
        try:
            kv = detect_layout(caches[0], heads, head_dim, self.block_size, hint)
            self._layers = layer_views(caches, kv, head_dim)
            if kv.name == "cpu_attn":
                _check_with_cpu_kernel(kv, self._vllm_config, list(kv_caches), caches[0])
        except KVLayoutError as exc:
            raise KVLayoutError(f"vLLM's attention backend {backend}: {exc}") from exc
        log.info("kvmesh reads vLLM's KV (backend %s) as %s (%s)", backend, kv.name, kv.dims)
        layout = engine_layout(
            self._layers, self.block_size, self.enrollment.page_tokens, self.num_blocks
        )
        if layout.kv_format != self.kv_format:
            raise ValueError(
                f"vLLM's KV caches are {layout.kv_format}, the model config says "
                f"{self.kv_format}: kvmesh cannot tell which pages are whose"
            )
        self.engine = EngineCache(self.enrollment, layout, self.block_size, device=caches[0].device)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmeshConnectorMetadata)
        if self.engine is None:
            return
        loaded: dict[str, int] = {}
        self._unfilled = {}
        for spec in meta.loads:
            failed = self.engine.load(spec, self._layers)
            self._load_errors |= failed
            loaded[spec.request_id] = (spec.end - len(failed)) - spec.first
            if failed:
                self._unfilled[spec.request_id] = spec.end - len(failed)
        self.engine.loads_done()  # the forward waits for the loads, whole (see KVCopier)
        for request_id, salt, local, external, prompt in meta.admitted:
            remote = min(external, max(0, loaded.get(request_id, 0) * self.block_size))
            self.engine.admitted(salt, local, remote, prompt - local - remote)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # the forward already waits for every load (start_load_kv, KVCopier)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saved once the whole forward is done (wait_for_save)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvmeshConnectorMetadata)
        if self.engine is None:
            return
        for spec in meta.saves:
            # Blocks whose load failed hold what they held before this step (vLLM took
            # them as loaded and recomputes them later): they are never kept.
            cut = self._unfilled.get(spec.request_id, len(spec.block_ids))
            if cut < len(spec.block_ids):
                spec = spec._replace(
                    tokens=spec.tokens[: cut * self.block_size], block_ids=spec.block_ids[:cut]
                )
            if spec.block_ids:
                self.engine.save(spec, self._layers)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.lookups is not None:
            self.lookups.close()
            self.lookups = None
        if self.index is not None:
            self.index.close()
            self.index = None

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self.lookups is not None
        prompt = tuple(request.prompt_token_ids or ())
        # vLLM computes at least the prompt's last token: hits end a block before it.
        limit = (len(prompt) - 1) // self.block_size
        namespace = self._namespace(request)
        self._namespaces[request.request_id] = namespace
        self._new_hits[request.request_id] = (num_computed_tokens, 0)
        self._pending.pop(request.request_id, None)
        if limit * self.block_size <= num_computed_tokens:
            self.lookups.forget(request.request_id)
            return 0, False
        # Never a wait of the scheduler's on the service: "not yet" (None) while the
        # lookup runs, and vLLM asks again at its next step (see `lookups`).
        found = self.lookups.ask(request.request_id, namespace, prompt, limit)
        if found is None:
            return None, False
        blocks, spans, peers = found
        hit = blocks * self.block_size
        if hit <= num_computed_tokens:
            return 0, False
        self._pending[request.request_id] = (blocks, spans, peers, num_computed_tokens)
        self._new_hits[request.request_id] = (num_computed_tokens, hit - num_computed_tokens)
        return hit - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Turn the request's hit into a load into the blocks vLLM just gave it: a new
        request's, and as well a request resumed after a preemption (vLLM freed its blocks
        and asked again: its new blocks are filled by this load or computed, never left
        as they were)."""
        hit = self._pending.pop(request.request_id, None)
        if hit is None or num_external_tokens == 0:
            return
        _, spans, peers, computed = hit
        end = (computed + num_external_tokens) // self.block_size
        (block_ids,) = blocks.get_block_ids()
        self._loads[request.request_id] = LoadSpec(
            request.request_id,
            self._namespaces[request.request_id],
            tuple(request.prompt_token_ids or ())[: end * self.block_size],
            computed // self.block_size,
            tuple(block_ids[:end]),
            spans,
            peers,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvmeshConnectorMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        for new in scheduler_output.scheduled_new_reqs:
            prompt = tuple(new.prompt_token_ids or ())
            namespace = self._namespaces.pop(new.req_id, None)
            if namespace is None:
                continue  # not seen by get_num_new_matched_tokens: not ours to follow
            tracked = _Tracked(namespace, prompt, list(new.block_ids[0]))
            self._tracked[new.req_id] = tracked
            local, external = self._new_hits.pop(new.req_id, (new.num_computed_tokens, 0))
            meta.admitted.append((new.req_id, namespace.salt, local, external, len(prompt)))
            self._save_done(meta, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids:
                self._namespaces.pop(req_id, None)  # asked again: its load is in _loads
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = [] if new_blocks is None else list(new_blocks[0])
            elif new_blocks is not None:
                tracked.block_ids.extend(new_blocks[0])
            self._save_done(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        if self.lookups is not None:
            self.lookups.forget(request.request_id)
        self._new_hits.pop(request.request_id, None)
        self._namespaces.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------ internals

    def _save_done(
        self, meta: KvmeshConnectorMetadata, req_id: str, computed: int, output: SchedulerOutput
    ) -> None:
        """Hand the worker the prompt blocks that are full once this step has run."""
        tracked = self._tracked[req_id]
        done = computed + output.num_scheduled_tokens.get(req_id, 0)
        full = min(done, len(tracked.prompt)) // self.block_size
        full = min(full, len(tracked.block_ids))
        if full > tracked.saved:
            meta.saves.append(
                SaveSpec(
                    req_id,
                    tracked.namespace,
                    tracked.prompt[: full * self.block_size],
                    tuple(tracked.block_ids[:full]),
                )
            )
            tracked.saved = full
        if tracked.saved >= len(tracked.prompt) // self.block_size:
            del self._tracked[req_id]  # its prompt is kept; decode pages are not published

    def _namespace(self, request: Request):
        lora = getattr(request, "lora_request", None)
        return engine_namespace(
            self.model_name,
            self.kv_format,
            self.enrollment.secret,
            getattr(request, "cache_salt", None),
            "" if lora is None else lora.lora_name,
        )


def refuse_unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Stop the engine at its start when it runs in a way the connector would serve
    wrong KV in, or fail requests in.

    Raises:
        ValueError: tensor, pipeline or data parallelism (each rank holds a slice of the
            KV, or a scheduler of its own, under one engine id); more than one KV-cache
            group (sliding-window or hybrid models: the connector moves one group's
            blocks); a `kv_load_failure_policy` other than "recompute" (a copy that fails
            validation must be recomputed, not fail its request).
    """
    parallel = vllm_config.parallel_config
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        size = getattr(parallel, name, 1)
        if size != 1:
            raise ValueError(
                f"kvmesh's connector runs on engines of one rank: {name}={size} is not "
                "supported (each rank's KV slice would be published under one engine "
                "id); run replicas of one rank each, e.g. Ray Serve replicas"
            )
    groups = None if kv_cache_config is None else kv_cache_config.kv_cache_groups
    if groups is not None and len(groups) != 1:
        specs = sorted({type(group.kv_cache_spec).__name__ for group in groups})
        raise ValueError(
            f"the model has {len(groups)} KV-cache groups ({', '.join(specs)}): kvmesh's "
            "connector moves the blocks of one (models with sliding-window or hybrid "
            "layers are not supported)"
        )
    policy = vllm_config.kv_transfer_config.kv_load_failure_policy
    if policy != "recompute":
        raise ValueError(
            f'kv_load_failure_policy is "{policy}": kvmesh\'s connector needs "recompute" '
            "in the kv_transfer_config (a page that fails validation is recomputed, "
            "never served; vLLM's default fails the request instead)"
        )


def _kv_format(vllm_config: VllmConfig, page_tokens: int) -> str:
    """The KV format vLLM's caches will have (`StoreLayout.kv_format`), from the model
    config: what the scheduler side names namespaces with before any cache exists."""
    from workers.store.layout import StoreLayout

    model = vllm_config.model_config
    hf = model.hf_text_config
    heads = model.get_num_kv_heads(vllm_config.parallel_config)
    head_dim = model.get_head_size()
    dtype = str(vllm_config.cache_config.cache_dtype)
    if dtype == "auto":
        dtype = str(model.dtype).removeprefix("torch.")
    layers = hf.num_hidden_layers
    return StoreLayout(1, layers, heads, page_tokens, head_dim, dtype).kv_format


# vLLM versions whose caches are per-layer [B, H, N, C] views of one buffer
# (vllm/v1/kv_cache_layout.py): the backend's forward says how C holds K and V.
_VIEW_LAYOUTS = {
    "CPU_ATTN": "cpu_attn",
    "FLASH_ATTN": "per_token_kv",
    "FLASHINFER": "per_token_kv",
    "TRITON_ATTN": "per_token_kv",
    "FLEX_ATTENTION": "per_token_kv",
}


def _attention_layers(vllm_config: VllmConfig, names: list[str]) -> dict[str, Any]:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    return get_layers_from_vllm_config(vllm_config, AttentionLayerBase, names)


def _backend_layout(
    vllm_config: VllmConfig, names: list[str], heads: int, head_dim: int
) -> tuple[str, str | None]:
    """The attention backend of the registered layers, and the `kv_layouts` name of the
    layout vLLM hands for it (None where vLLM does not say: the shape must then fit one
    layout alone).

    Raises:
        KVLayoutError: the layers have more than one backend.
    """
    backends = {
        layer.get_attn_backend() for layer in _attention_layers(vllm_config, names).values()
    }
    if len(backends) != 1:
        raise KVLayoutError(
            f"KV caches of {len(backends)} attention backends "
            f"{sorted(b.get_name() for b in backends)}: kvmesh reads one"
        )
    backend = backends.pop()
    name = backend.get_name()
    try:
        import vllm.v1.kv_cache_layout  # noqa: F401 - present: the per-layer views
    except ImportError:
        shape_fn = getattr(backend, "get_kv_cache_shape", None)
        block_size = vllm_config.cache_config.block_size
        hint = (
            None if shape_fn is None else layout_of_shape_fn(shape_fn, heads, head_dim, block_size)
        )
        return name, hint
    if name not in _VIEW_LAYOUTS:
        raise KVLayoutError(
            f"vLLM's attention backend {name} is not one kvmesh reads; known: "
            f"{sorted(_VIEW_LAYOUTS)}"
        )
    return name, _VIEW_LAYOUTS[name]


def _check_with_cpu_kernel(
    layout: KVLayout, vllm_config: VllmConfig, names: list[str], cache: torch.Tensor
) -> None:
    """Write known K and V through vLLM's own CPU kernel into a scratch cache of two
    blocks shaped like `cache`, and check that `layout` reads them back: how the CPU
    kernels store a block depends on the ISA they were picked for (`layer.isa`), and a
    layout that reads another ISA's blocks would move the wrong tokens silently.

    Raises:
        KVLayoutError: the kernel stores K or V elsewhere.
    """
    from vllm import _custom_ops as ops

    layer = next(iter(_attention_layers(vllm_config, names).values()))
    isa = getattr(layer, "isa", None)
    if isa is None:
        raise KVLayoutError("vLLM's CPU attention layer has no ISA: cannot check its layout")
    _, heads, tokens, width = cache.shape
    head_dim = width // 2
    scratch = torch.zeros((2, heads, tokens, width), dtype=cache.dtype)
    # vLLM's own split of a CPU cache (CPUAttentionBackendImpl.forward)
    key_cache, value_cache = scratch.view(2, heads, 2 * tokens, head_dim).chunk(2, dim=2)
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn((2, 2 * tokens, heads, head_dim), generator=g).to(cache.dtype)
    slots = torch.arange(2 * tokens, dtype=torch.long)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    views = layout.views(scratch, head_dim)
    for name, half, wrote in (("K", views.k, key), ("V", views.v, value)):
        read = half.transpose(1, 2).reshape(2 * tokens, heads, head_dim)  # token order
        if not torch.equal(read, wrote):
            raise KVLayoutError(
                f"vLLM's CPU attention (isa {isa}) stores {name} where the {layout.name} "
                f"layout does not read it (cache of shape {tuple(cache.shape)}, "
                f"{cache.dtype})"
            )
