"""The serving settings a front door and a worker both read, without torch: how a request
samples its tokens (`SamplingParams`) and how much one forward pass takes
(`SchedulerConfig`). `sampling` and `scheduler` use them beside torch; a config file, the
CLI and the typed worker API check them without loading it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from numbers import Integral, Real
from typing import Any


@dataclass(frozen=True)
class SchedulerConfig:
    """How much one forward pass takes."""

    # Sequences in prefill or decode at once: the decode batch at most.
    max_running: int = 32
    # Tokens of one forward pass: the longest prompts run whole, and a pass stays short
    # enough that decoding sequences wait little between their steps.
    max_batch_tokens: int = 4096
    # A prompt's tokens per pass at most (0: as many as the pass has room for).
    prefill_chunk_tokens: int = 0
    # Requests that arrive together compute a prefix they share once (off: each computes
    # its whole prompt, as engines without same-batch sharing do).
    batch_sharing: bool = True
    # Copy-ins run at once, each on a thread of its own beside the serving thread: a copy
    # waits on the service and on peers, and the sequences running meanwhile go on.
    copy_threads: int = 2

    def __post_init__(self) -> None:
        if self.copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {self.copy_threads}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_batch_tokens < self.max_running:
            raise ValueError(
                f"max_batch_tokens ({self.max_batch_tokens}) must leave each of max_running "
                f"({self.max_running}) sequences a decode token"
            )
        if self.prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0, got {self.prefill_chunk_tokens}")


SEED_BOUND = 2**63  # seeds are in [0, SEED_BOUND): a non-negative int64 on any wire


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. The defaults are greedy decoding, as in vLLM.

    `temperature` and `top_p` accept any real number and are kept as `float`; `top_k`
    and `seed` accept any integral number (never a bool) and are kept as `int`. A
    `top_k` of -1 is stored as 0: both mean no top-k filter.
    """

    # 0: greedy (argmax), the deterministic default; > 0: logits / temperature before
    # the softmax, so < 1 sharpens the distribution and > 1 flattens it.
    temperature: float = 0.0
    # Nucleus filter: keep the fewest most probable tokens whose probabilities sum to at
    # least top_p. 1.0 keeps every token.
    top_p: float = 1.0
    # Keep the k highest logits (and any tied with the k-th); 0 or -1: no filter.
    top_k: int = 0
    # None: a fresh random seed per request; an int makes the request reproducible.
    seed: int | None = None

    def __post_init__(self) -> None:
        temperature = _real("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        top_p = _real("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        top_k = _integral("top_k", self.top_k)
        if top_k < -1:
            raise ValueError(f"top_k must be >= 1, or 0 or -1 for no filter, got {self.top_k!r}")
        seed = None if self.seed is None else _integral("seed", self.seed)
        if seed is not None and not 0 <= seed < SEED_BOUND:
            raise ValueError(f"seed must be None or in [0, 2**63), got {self.seed!r}")
        # Normalised so that equal settings compare (and serialise) equal.
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "top_k", max(top_k, 0))
        object.__setattr__(self, "seed", seed)

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax (temperature 0), with no randomness."""
        return self.temperature == 0

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict of floats, ints and None (JSON and msgpack safe)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """The inverse of `to_dict`; missing fields take their defaults.

        Raises:
            ValueError: `d` is not a mapping, has keys that are not fields (named in the
                message), or holds a bad value.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling params must be a mapping, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(key) for key in d if key not in known)
        if unknown:
            raise ValueError(f"unknown sampling params {unknown}; known ones are {sorted(known)}")
        return cls(**d)


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def _integral(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)
