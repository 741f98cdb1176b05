"""Token-dropping (KV cache compaction) policies, behind a tiny registry.

A compaction looks at the compactable KV of one sequence as one stream per (layer, KV
head). Each stream holds candidate tokens with their logical positions and the attention
scores the runner tracked for them; `Budget` says how many a stream keeps, a policy says
which:

    stream (l, h)   positions  [ 3  4  5  6  7  9 | pad pad ]   ascending, valid entries first
    select(...)     kept       [ 1  0  0  1  1  1 |  0   0  ]   kept ⊆ valid

Uniform policies keep exactly keep[l, h] per stream. Adaptive ones (AdaKV) keep the
layer's total, sum_h keep[l, h], but move budget from heads whose attention sits on a few
tokens to heads whose attention is spread out.

Every ranking sorts on a key whose last part is the position, so equal scores always go
to the more recent candidate and the result does not depend on the backend (`topk`
promises no order among equal values).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, TypeVar

import torch
import torch.nn.functional as F

from workers.serving.compaction.config import is_int

# The scores a runner can track for a policy; a policy's `needs` names a subset.
SCORES = frozenset({"accumulated", "window"})

# AdaKV's safeguard: every head keeps at least floor(0.2 * keep[l, h]) of its own best
# candidates, so a head whose scores look flat next to a concentrated one is never starved.
# Kept as a divisor so the floor is exact integer arithmetic (k // 5), not float rounding.
_FLOOR_DIVISOR = 5

# Sort keys pack a float32 score's bits above a 32-bit position (see `_sort_key`).
_MAX_POSITION = 2**31 - 1
_FORCED_BITS = 2**31 - 1  # above every float32 bit pattern but NaN's: forced beats any score
_PADDING_KEY = torch.iinfo(torch.long).min  # below every valid candidate's key


class Candidates(NamedTuple):
    """The compactable KV of one sequence, as streams per (layer, KV head).

    Streams may have different lengths; the shorter ones are padded at the end.
    """

    positions: torch.Tensor  # (L, KVH, n) long: logical positions, ascending over valid entries
    valid: torch.Tensor  # (L, KVH, n) bool: False on padding
    accumulated: torch.Tensor  # (L, KVH, n) float32: weight received from every query (H2O)
    window: torch.Tensor  # (L, KVH, n) float32: weight from the last window_queries queries,
    # summed over those queries and the KV head's query heads (SnapKV's observation window)
    window_queries: int  # queries in that window (0: none recorded)
    next_position: int  # the sequence's length; every candidate position is below it


class CompactionPolicy(ABC):
    """Chooses which candidates of each stream survive a compaction.

    `select` never keeps padding. A uniform policy keeps exactly min(keep[l, h], valid)
    candidates of stream (l, h); an adaptive one keeps exactly min(sum_h keep[l, h], valid
    in layer l) per layer, shared among its heads, never more than a stream's valid count.
    The result depends only on the inputs (no randomness, ties to the more recent token).
    """

    name: ClassVar[str]
    # The scores `select` reads (a subset of SCORES): the runner tracks only what some
    # configured policy needs, and the other fields of Candidates may be left empty.
    needs: ClassVar[frozenset[str]]

    @abstractmethod
    def select(self, candidates: Candidates, keep: torch.Tensor) -> torch.Tensor:
        """Pick the candidates to keep.

        Args:
            candidates: the streams of one sequence.
            keep: (L, KVH) integer counts, from `Budget.counts`.

        Returns:
            (L, KVH, n) bool, True on the kept candidates (a subset of `candidates.valid`).

        Raises:
            ValueError: shapes that do not match, negative counts, or scores the policy
                needs but the candidates do not carry.
        """


_Policy = TypeVar("_Policy", bound=type[CompactionPolicy])

COMPACTION_POLICIES: dict[str, type[CompactionPolicy]] = {}


def register_compaction_policy(cls: _Policy) -> _Policy:
    """Class decorator adding a policy to the registry under `cls.name`.

    Raises:
        ValueError: the name is taken, or `needs` names a score no runner tracks.
    """
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"compaction policy {cls.__name__} has no name")
    needs = getattr(cls, "needs", None)
    if not isinstance(needs, frozenset) or not needs <= SCORES:
        raise ValueError(
            f"compaction policy {name!r} needs {needs!r}; must be a frozenset of "
            f"{', '.join(sorted(SCORES))}"
        )
    if name in COMPACTION_POLICIES:
        raise ValueError(f"compaction policy {name!r} is already registered")
    COMPACTION_POLICIES[name] = cls
    return cls


def make_compaction_policy(name: str, **params: object) -> CompactionPolicy:
    """Build a registered policy by name.

    Args:
        name: the policy's registered name.
        **params: the policy's parameters (e.g. `recent=0.3` for "h2o").

    Returns:
        The policy.

    Raises:
        ValueError: unknown name (the message lists the known ones), a parameter the
            policy does not take (named, with the ones it takes) or a bad value.
    """
    try:
        cls = COMPACTION_POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(COMPACTION_POLICIES))
        raise ValueError(f"unknown compaction policy {name!r}; known: {known}") from None
    takes = _parameter_names(cls)
    unknown = sorted(set(params) - takes) if takes is not None else []
    if unknown:
        raise ValueError(
            f"compaction policy {name!r} takes no parameter {', '.join(unknown)}; "
            f"it takes: {', '.join(sorted(takes)) or 'none'}"
        )
    return cls(**params)


def _parameter_names(cls: type) -> set[str] | None:
    """The keyword parameters `cls(...)` accepts; None when it takes **kwargs."""
    parameters = inspect.signature(cls).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in parameters if p.kind in keyword}


# --- shared machinery ---------------------------------------------------------------------


def _check_inputs(
    candidates: Candidates, keep: torch.Tensor, needs: frozenset[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate what a policy reads.

    Returns:
        `keep` as long, and each stream's valid count, (L, KVH) long.

    Raises:
        ValueError: mismatched shapes, negative counts, or streams that break the layout
            (valid entries first, positions strictly ascending over them, within [0, 2^31)).
    """
    positions, valid = candidates.positions, candidates.valid
    if positions.dim() != 3:
        raise ValueError(f"positions must be (L, KVH, n), got {tuple(positions.shape)}")
    shape = positions.shape
    for field in ("valid", *sorted(needs)):
        tensor = getattr(candidates, field)
        if tensor.shape != shape:
            raise ValueError(
                f"candidates.{field} is {tuple(tensor.shape)}, positions are {tuple(shape)}"
            )
    if valid.dtype != torch.bool or positions.dtype.is_floating_point:
        raise ValueError(
            f"valid must be bool and positions integers, got {valid.dtype}, {positions.dtype}"
        )
    if keep.shape != shape[:2] or keep.dtype.is_floating_point or keep.dtype == torch.bool:
        raise ValueError(
            f"keep must be (L, KVH) = {tuple(shape[:2])} integers, "
            f"got {keep.dtype} {tuple(keep.shape)}"
        )
    if keep.numel() and int(keep.min()) < 0:
        raise ValueError(f"keep counts must be >= 0, got a minimum of {int(keep.min())}")
    # The policies read recency off the candidate order and pack positions into 32 bits of
    # a sort key; both are O(n) to check and silently wrong if the layout is broken.
    later = valid[..., 1:]
    if bool((later & ~valid[..., :-1]).any()):
        raise ValueError("candidates.valid must put each stream's valid entries first")
    if bool((later & (positions[..., 1:] <= positions[..., :-1])).any()):
        raise ValueError("candidate positions must be strictly ascending within a stream")
    low = int(positions.masked_fill(~valid, 0).min()) if positions.numel() else 0
    high = int(positions.masked_fill(~valid, 0).max()) if positions.numel() else 0
    if low < 0 or high > _MAX_POSITION:
        raise ValueError(f"candidate positions must be in [0, 2^31), got {low}..{high}")
    return keep.long(), valid.sum(-1)


def _sort_key(
    score: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    forced: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 keys that order candidates by score, then position, both descending.

    Forced candidates rank above every score (newest first among them), padding below
    everything. One integer sort replaces a chain of stable sorts (the float32 score's
    bits in the high half, the position in the low half), which is what keeps a
    compaction of 30 x 3 streams of 2000 candidates within a few milliseconds.
    """
    # +0.0 turns -0.0 into 0.0 so that the two compare equal, as they do as floats.
    bits = (score.float() + 0.0).contiguous().view(torch.int32).long()
    # IEEE floats order like sign-magnitude integers: reverse the negatives' magnitudes.
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    if forced is not None:
        bits = bits.masked_fill(forced, _FORCED_BITS)
    key = (bits << 32) | positions.long().clamp(0, _MAX_POSITION)
    return key.masked_fill(~valid, _PADDING_KEY)


def _keep_best(key: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Mask of the counts[...] highest keys along the last dim."""
    # Stable, so that equal keys (the same score and position in two heads of a layer's
    # pool) go to the lower head every time.
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    chosen = torch.arange(key.shape[-1]).expand_as(order) < counts[..., None]
    return torch.zeros_like(chosen).scatter_(-1, order, chosen)


def _select_adaptive(
    candidates: Candidates,
    keep: torch.Tensor,
    n_valid: torch.Tensor,
    forced: torch.Tensor,
    score: torch.Tensor,
) -> torch.Tensor:
    """AdaKV: each layer's total budget goes to the highest normalised scores of its heads.

    Each head first keeps its forced candidates and a floor of its own best ones (never
    more than keep[l, h] together); the rest of the layer's budget goes to the highest
    scores over all its heads, each head's scores divided by their sum. A head whose
    attention sits on a few tokens then offers a few high scores and a long tail of low
    ones, and a head with spread-out attention wins that tail.
    """
    layers, heads, n = candidates.positions.shape
    positions, valid = candidates.positions, candidates.valid
    capped = torch.minimum(keep, n_valid)  # (L, KVH)
    own = torch.minimum(capped, forced.sum(-1) + capped // _FLOOR_DIVISOR)  # (L, KVH)
    kept = _keep_best(_sort_key(score, positions, valid, forced), own)  # (L, KVH, n)

    budget = torch.minimum(keep.sum(-1), n_valid.sum(-1))  # (L,)
    rest = budget - own.sum(-1)  # (L,)
    valid_score = score.float().masked_fill(~valid, 0)
    total = valid_score.sum(-1, keepdim=True)  # (L, KVH, 1)
    # A head whose scores are all zero offers zeros rather than NaNs.
    normalised = valid_score / total.clamp_min(torch.finfo(torch.float32).tiny)
    pool = _sort_key(normalised, positions, valid & ~kept).reshape(layers, heads * n)
    won = _keep_best(pool, rest).reshape(layers, heads, n)
    return kept | won


def _pool(scores: torch.Tensor, valid: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """1-D pooling along each stream's candidate order (stride 1, length kept).

    Padding never leaks into valid entries: max pooling sees it as -inf, average pooling
    divides by the valid entries under the kernel only. Returns 0 on padding.
    """
    if scores.shape[-1] == 0:  # no window to unfold
        return scores.float()
    pad = kernel // 2
    fill = float("-inf") if pooling == "max" else 0.0
    # Windows as a strided view rather than F.max_pool1d: the pooling kernels start a
    # parallel region even for a handful of streams, which costs milliseconds on a busy
    # host; element-wise reductions stay on the calling thread for small inputs.
    padded = F.pad(scores.float().masked_fill(~valid, fill), (pad, pad), value=fill)
    windows = padded.unfold(-1, kernel, 1)  # (L, KVH, n, kernel)
    if pooling == "max":
        pooled = windows.amax(-1)  # (L, KVH, n)
    else:
        counts = F.pad(valid.float(), (pad, pad)).unfold(-1, kernel, 1).sum(-1)  # (L, KVH, n)
        pooled = windows.sum(-1) / counts.clamp_min(1)
    return pooled.masked_fill(~valid, 0)


# --- the policies -------------------------------------------------------------------------


@register_compaction_policy
@dataclass(frozen=True)
class StreamingLlmPolicy(CompactionPolicy):
    """StreamingLLM: the attention sinks plus the most recent tokens.

    Candidates at positions below `sinks` are kept first (the first tokens of a sequence
    draw attention whatever they say; after a prefix-cache hit they usually lie outside
    the candidates), earliest first and at most keep[l, h] of them; the newest candidates
    fill the rest.
    """

    name: ClassVar[str] = "streaming_llm"
    needs: ClassVar[frozenset[str]] = frozenset()

    sinks: int = 4  # the StreamingLLM paper's choice: four sinks recover the full model

    def __post_init__(self) -> None:
        if not (is_int(self.sinks) and self.sinks >= 0):
            raise ValueError(f"streaming_llm sinks must be an int >= 0, got {self.sinks!r}")

    def select(self, candidates: Candidates, keep: torch.Tensor) -> torch.Tensor:
        keep, n_valid = _check_inputs(candidates, keep, self.needs)
        valid = candidates.valid
        count = torch.minimum(keep, n_valid)  # (L, KVH)
        # Positions ascend, so a stream's sinks are its first entries and its newest
        # candidates its last valid ones: no sort needed.
        sinks = torch.minimum((valid & (candidates.positions < self.sinks)).sum(-1), count)
        index = torch.arange(valid.shape[-1])  # (n,)
        first = (n_valid - (count - sinks))[..., None]  # (L, KVH, 1): first newest kept
        return (index < sinks[..., None]) | ((index >= first) & valid)


@dataclass(frozen=True, kw_only=True)
class _ScoredPolicy(CompactionPolicy):
    """A policy that forces some candidates and ranks the rest by a score.

    Subclasses say which candidates are forced and what the score is; this class keeps
    forced candidates first (newest first), then the highest scores, uniformly per stream
    or, with `adaptive`, per layer.
    """

    adaptive: bool = False  # AdaKV: share each layer's budget among its heads by score

    def __post_init__(self) -> None:
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"{self.name} adaptive must be a bool, got {self.adaptive!r}")

    @abstractmethod
    def _forced_and_scores(
        self, candidates: Candidates, keep: torch.Tensor, n_valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(L, KVH, n) bool forced candidates (within valid) and (L, KVH, n) float scores."""

    def select(self, candidates: Candidates, keep: torch.Tensor) -> torch.Tensor:
        keep, n_valid = _check_inputs(candidates, keep, self.needs)
        forced, score = self._forced_and_scores(candidates, keep, n_valid)
        if self.adaptive:
            return _select_adaptive(candidates, keep, n_valid, forced, score)
        key = _sort_key(score, candidates.positions, candidates.valid, forced)
        return _keep_best(key, torch.minimum(keep, n_valid))


@register_compaction_policy
@dataclass(frozen=True, kw_only=True)
class H2oPolicy(_ScoredPolicy):
    """H2O (heavy hitters): the most recent tokens plus those with the most attention.

    round(keep * recent) of each stream's budget (half to even, as Python's `round`) goes
    to its newest candidates, the rest to the highest accumulated scores.
    """

    name: ClassVar[str] = "h2o"
    needs: ClassVar[frozenset[str]] = frozenset({"accumulated"})

    recent: float = 0.5  # the H2O paper splits the budget evenly between recent and heavy

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.recent, bool) or not isinstance(self.recent, int | float):
            raise ValueError(f"h2o recent must be a number in [0, 1], got {self.recent!r}")
        if not 0 <= self.recent <= 1:
            raise ValueError(f"h2o recent must be in [0, 1], got {self.recent!r}")

    def _forced_and_scores(
        self, candidates: Candidates, keep: torch.Tensor, n_valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        count = torch.minimum(keep, n_valid)
        recent = torch.round(count.double() * self.recent).long()  # (L, KVH)
        # Positions ascend, so the newest candidates are the last valid entries.
        first = (n_valid - recent)[..., None]  # (L, KVH, 1)
        forced = candidates.valid & (torch.arange(candidates.valid.shape[-1]) >= first)
        return forced, candidates.accumulated


@register_compaction_policy
@dataclass(frozen=True, kw_only=True)
class SnapKvPolicy(_ScoredPolicy):
    """SnapKV: the observation window plus the tokens it attended to most, in clusters.

    The candidates inside the observation window (the last `window_queries` positions)
    are kept first, newest first; the rest of the budget goes to the highest window
    scores after pooling along the stream, which keeps the neighbours of a strong token
    so that the kept context stays readable. `select` raises ValueError when the
    candidates carry no observation window (window_queries == 0).
    """

    name: ClassVar[str] = "snapkv"
    needs: ClassVar[frozenset[str]] = frozenset({"window"})

    kernel: int = 7  # the SnapKV paper's pooling width
    pooling: str = "max"  # "max" or "avg"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (is_int(self.kernel) and self.kernel >= 1 and self.kernel % 2 == 1):
            raise ValueError(f"snapkv kernel must be an odd int >= 1, got {self.kernel!r}")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"snapkv pooling must be 'max' or 'avg', got {self.pooling!r}")

    def _forced_and_scores(
        self, candidates: Candidates, keep: torch.Tensor, n_valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if candidates.window_queries <= 0:
            raise ValueError(
                "snapkv needs an observation window, but the candidates have "
                f"window_queries={candidates.window_queries}"
            )
        start = candidates.next_position - candidates.window_queries
        forced = candidates.valid & (candidates.positions >= start)
        return forced, _pool(candidates.window, candidates.valid, self.kernel, self.pooling)
