"""Where a worker computes: a model moved to the device its pages are on.

A worker's model, its batch runner's pass and its sampler run on one torch device, and
its page store keeps the pages there too (`workers.serving.batch_runner` refuses a store
elsewhere). Which device that is comes from `store.device` (`workers.tier_setup`): a
worker with a device tier computes on it, every other one on the CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["on_device"]


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
