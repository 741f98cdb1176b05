"""Where a worker computes: the device its `device` setting names, and a model moved there.

A worker's model, its batch runner's pass and its sampler run on one torch device, and
its page store keeps the pages there too (`workers.serving.batch_runner` refuses a store
elsewhere). The setting is "auto", "cpu" or "cuda"; "auto" is CUDA only for a worker that
was given a GPU (its actor reserved one) on a machine where torch sees one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["DEVICES", "on_device", "resolve_device"]


def on_device(
    model: PreTrainedModel, device: str | torch.device, dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """Move `model` to `device` (and `dtype`), in place; returns it.

    The rotary embeddings' inverse frequencies stay float32, as `from_pretrained` leaves
    them in any dtype: rounded to bfloat16 they would turn position 8000 by whole radians
    off its angle.

    Args:
        model: a HF model.
        device: where its weights go.
        dtype: their dtype; unchanged when None.

    Returns:
        `model`.
    """
    kept = {
        name: buffer
        for name, buffer in model.named_buffers()
        if name.endswith("inv_freq") and buffer.dtype == torch.float32
    }
    model.to(device=device, dtype=dtype)
    for name, buffer in kept.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, buffer.to(device))
    return model


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(setting: str, gpu_assigned: bool) -> torch.device:
    """The device a worker computes on, from its `device` setting.

    Args:
        setting: "cpu", "cuda", or "auto": CUDA when torch sees a GPU and the worker was
            given one (its actor reserved a GPU), else the CPU.
        gpu_assigned: whether the worker was given a GPU.

    Returns:
        The device.

    Raises:
        ValueError: an unknown setting (the known ones listed), or "cuda" where torch sees
            no GPU.
    """
    if setting not in DEVICES:
        raise ValueError(f"unknown device {setting!r}; known: {', '.join(DEVICES)}")
    available = torch.cuda.is_available()
    if setting == "cuda" and not available:
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device here")
    if setting == "cuda" or (setting == "auto" and available and gpu_assigned):
        return torch.device("cuda")
    return torch.device("cpu")
