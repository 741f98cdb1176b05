"""The models a worker can serve, by name: their KV shape, context window and loader.

The configuration names a model (`model.name`) and its dtype; everything else about its
KV (layers, KV heads, head dim) is the model's own, so it is read from here, never
configured separately: a page store laid out from a second source could disagree with
the weights it holds KV for. `load` checks the loaded model against the table.
"""

from __future__ import annotations

from typing import Any, NamedTuple

DTYPES = ("float32", "bfloat16")  # float16 matmuls are not served on CPU


class ModelShape(NamedTuple):
    """What fixes a model's page layout, and how long a sequence it takes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_tokens: int  # positions the model was trained for (prompt + generated)
    vocab_size: int


# SmolLM2-135M-Instruct: Llama architecture, grouped-query attention (9 query heads over
# 3 KV heads), an 8,192-token context. "tiny": random weights for tests (model_loader.tiny_llama).
KNOWN_MODELS = {
    "smollm2-135m": ModelShape(30, 3, 64, 8192, 49152),
    "tiny": ModelShape(2, 2, 16, 1024, 256),
}


def model_shape(name: str) -> ModelShape:
    """The KV shape of a known model.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}") from None


def load(name: str, dtype: str = "float32", device: Any = "cpu") -> tuple[Any, Any]:
    """Load a known model in eval mode: `(model, tokenizer)`; the tiny test model has no
    tokenizer (None).

    The worker loads on the CPU and moves the model to its pages' device when it has a
    device tier (`workers.serving.device.on_device`).

    Args:
        name: a name of `KNOWN_MODELS`.
        dtype: the weights' dtype, one of `DTYPES`.
        device: where the weights go (a torch device or its name).

    Raises:
        ValueError: an unknown model or dtype, or a model whose loaded shape is not the
            one `KNOWN_MODELS` says.
    """
    import torch

    from workers.serving.model_loader import load_smollm2, tiny_llama

    shape = model_shape(name)
    if dtype not in DTYPES:
        raise ValueError(f"model dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    torch_dtype = getattr(torch, dtype)
    if name == "tiny":
        model, tokenizer = tiny_llama(dtype=torch_dtype, device=device), None
    else:
        model, tokenizer = load_smollm2(dtype=torch_dtype, device=device)
    config = model.config
    loaded = ModelShape(
        config.num_hidden_layers,
        config.num_key_value_heads,
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        config.max_position_embeddings,
        config.vocab_size,
    )
    if loaded != shape:
        raise ValueError(f"model {name!r} loaded with shape {loaded}, expected {shape}")
    return model, tokenizer
