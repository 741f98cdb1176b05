"""Compaction's settings, readable without torch: `CompactionConfig` (the `compaction`
section of a worker's config) and `Budget` (how much of each stream a compaction keeps).

The front door, the CLI and the typed worker API read and check a config long before any
model runs, and a process that only launches or inspects a mesh should not import torch
(seconds at every start). So this module imports none: a policy other than "none" is
checked against the registry in `policies` (torch's side) when it is named, and
`Budget.counts`, which works on tensors, imports torch where it is called.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Slack for ceil(fraction * count): 0.3 * 10 is 3.0000000000000004 in floating point and
# would keep one token too many; the slack is far below 1 / count for any real stream.
_CEIL_SLACK = 1e-9


def is_int(value: object) -> bool:
    # bool is an int subclass, and `True` as a budget is always a config mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_fraction(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1


@dataclass(frozen=True)
class Budget:
    """How much of each stream a compaction keeps: exactly one of the three fields.

    `tokens` keeps that many per stream, `fraction` that share of each stream's valid
    candidates (rounded up), `per_layer` one such share per layer (deep layers often
    tolerate more dropping than shallow ones).
    """

    tokens: int | None = None
    fraction: float | None = None
    per_layer: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        given = [f for f in ("tokens", "fraction", "per_layer") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(
                "a budget takes exactly one of tokens / fraction / per_layer; got "
                f"tokens={self.tokens!r}, fraction={self.fraction!r}, "
                f"per_layer={self.per_layer!r}"
            )
        if self.tokens is not None and not (is_int(self.tokens) and self.tokens >= 1):
            raise ValueError(f"budget tokens must be an int >= 1, got {self.tokens!r}")
        if self.fraction is not None:
            if not _is_fraction(self.fraction):
                raise ValueError(f"budget fraction must be in (0, 1], got {self.fraction!r}")
            object.__setattr__(self, "fraction", float(self.fraction))
        if self.per_layer is not None:
            shares = self.per_layer
            if not isinstance(shares, list | tuple) or not shares:
                raise ValueError(
                    f"budget per_layer must be a non-empty sequence of fractions, got {shares!r}"
                )
            bad = [(i, f) for i, f in enumerate(shares) if not _is_fraction(f)]
            if bad:
                raise ValueError(f"budget per_layer fractions must be in (0, 1], got {bad!r}")
            # A tuple keeps the frozen budget hashable when a list came from YAML.
            object.__setattr__(self, "per_layer", tuple(float(f) for f in shares))

    @classmethod
    def parse(cls, value: object) -> Budget:
        """Read a budget from a config value.

        Args:
            value: an int (tokens per stream, >= 1), a float in (0, 1] (a fraction of
                each stream) or a list / tuple of such floats (one per layer).

        Returns:
            The budget.

        Raises:
            ValueError: a bool, a string or any other type, or a number out of range.
        """
        if isinstance(value, bool):
            raise ValueError(f"a budget cannot be a bool, got {value!r}")
        if isinstance(value, int):
            return cls(tokens=value)
        if isinstance(value, float):
            return cls(fraction=value)
        if isinstance(value, list | tuple):
            return cls(per_layer=tuple(value))
        raise ValueError(
            "a budget is an int (tokens), a float in (0, 1] (fraction) or a list of floats "
            f"(per layer); got {value!r}"
        )

    def counts(self, valid: torch.Tensor) -> torch.Tensor:
        """How many candidates each stream keeps.

        Args:
            valid: (L, KVH, n) bool, False on padding.

        Returns:
            (L, KVH) long, never more than the stream's valid count.

        Raises:
            ValueError: `valid` is not a 3-D bool tensor, or `per_layer` has not L entries.
        """
        import torch  # here, not above: a config is read without torch (see the docstring)

        if valid.dim() != 3 or valid.dtype != torch.bool:
            raise ValueError(
                f"valid must be an (L, KVH, n) bool tensor, got {valid.dtype} {tuple(valid.shape)}"
            )
        n_valid = valid.sum(-1)  # (L, KVH)
        if self.tokens is not None:
            return n_valid.clamp(max=self.tokens)
        layers = valid.shape[0]
        if self.per_layer is None:
            share = torch.full((layers,), self.fraction, dtype=torch.float64)
        else:
            if len(self.per_layer) != layers:
                raise ValueError(
                    f"budget per_layer has {len(self.per_layer)} fractions for {layers} layers"
                )
            share = torch.tensor(self.per_layer, dtype=torch.float64)
        want = torch.ceil(n_valid.double() * share[:, None] - _CEIL_SLACK).long()  # (L, KVH)
        return torch.minimum(want, n_valid)


@dataclass(frozen=True)
class CompactionConfig:
    """Compaction in a worker (off unless `policy` names one)."""

    # "none", or a registered policy: streaming_llm, h2o, snapkv, or one of your own.
    policy: str = "none"
    # The policy's own settings (e.g. {"sinks": 4} or {"adaptive": true}).
    params: Mapping[str, Any] = field(default_factory=dict)
    # What each (layer, KV head) keeps of the compactable KV: a fraction, a token count,
    # or a fraction per layer. Half keeps quality close to the full cache on prose for the
    # score-based policies (see `kvmesh bench compaction`).
    budget: int | float | tuple[float, ...] = 0.5
    # Compact running sequences once their pages pass this share of the store: below it
    # the memory is there to be used, and every compaction loses a little quality.
    high_water: float = 0.9
    # Queries in SnapKV's observation window (the paper's 32 for short windows).
    window: int = 32
    # A sequence is compacted again only once this many tokens have been computed since
    # its last compaction: fewer would free less than a page per head.
    min_tokens: int = 64

    def __post_init__(self) -> None:
        if self.policy != "none":
            # The registry is torch's side; "none" (the default) is checked without it.
            from workers.serving.compaction.policies import (
                COMPACTION_POLICIES,
                make_compaction_policy,
            )
        if self.policy != "none" and self.policy not in COMPACTION_POLICIES:
            known = ", ".join(["none", *sorted(COMPACTION_POLICIES)])
            raise ValueError(f"unknown compaction policy {self.policy!r}; known: {known}")
        if self.policy != "none":
            make_compaction_policy(self.policy, **dict(self.params))  # its params, checked
        elif self.params:
            raise ValueError(f"compaction params {dict(self.params)} given without a policy")
        Budget.parse(self.budget)
        if not 0.0 < self.high_water <= 1.0:
            raise ValueError(f"high_water must be in (0, 1], got {self.high_water}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {self.min_tokens}")
