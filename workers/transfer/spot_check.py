"""Spot checks of copied pages: a sample recomputed, and where every copied page came from.

A copied page passes two checks as it lands (`copy_in`): its generation did not change
during the copy, and the digest its holder recorded equals the one the requester computes
for its own prompt. Both prove only what the holder *claims*: a member with its own key
can record the right digests over another prompt's KV. So a member also recomputes a
sample of what it copies and compares the KV (`SpotChecks`):

- every copy from a holder this member has not checked yet is checked, and any other
  copy with probability `rate`;
- a check recomputes one token's KV in a copied page j of the holder (a random slot),
  with the model, over everything before it as context, and compares it with that slot
  of the copied page within the tolerance of the pages' dtype (`TOLERANCES`). The token
  rides in the request's first prefill pass (`SpotCheck`: the scheduler adds it as one
  more chunk and judges it before anything of the pass is published or sampled); a copy
  that fails is dropped there and the request computes it all. One token in the pass,
  not a page in a pass of its own: on the CPU a 16-token page in a forward of its own
  cost a remote hit 42% more, one token in its own forward 24%, one token in the
  request's pass about 5% (SmolLM2, a 1,024-token prefix and a 64-token suffix); a
  holder serving another prompt's KV fails at any slot;
- a page that fails blames its holder only when every page of its context is this
  member's own or the same holder's, or comes from holders checked before: a poisoned
  earlier holder would otherwise make an honest later one fail. An unattributed failure
  makes every holder of the copy unchecked again, so its next copy is checked.

The tolerance: a token's KV recomputed alone against the same KV computed in a batch
differs by the order of summation only. Measured on SmolLM2-135M in float32
(tests/workers/serving/test_spot_check.py), as the largest difference over the slot's
largest magnitude: honest recomputations about 1e-6; the slot of a prompt one token
apart 10 to 45 tokens earlier 0.018 to 0.052; a whole page of an unrelated prompt 0.8 to
1.2. So float32 takes 1e-3 (a thousand times the honest error, 18x below the nearest
poison). Half precision
rounds each value at 2^-8 (bfloat16) or 2^-11 (float16) of its magnitude, and the
differences of summation order grow with it: their tolerances are 30x those roundings,
still below the prompt one token apart in bfloat16 only narrowly (a poisoner that close
to the right KV changes little).

`Provenance` remembers which copied page came from which holder, with its digest, so
when a holder is quarantined its pages are dropped here (and the digests reported, so
the copies others made of them go too).
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

SPOT_CHECK_RATE = 0.25  # of copies from holders checked before; see the module docstring
# Largest |copied - recomputed| over the page's largest |recomputed|, by the pages' dtype.
TOLERANCES = {"float32": 1e-3, "float16": 1.5e-2, "bfloat16": 3e-2}


def tolerance(dtype: str) -> float:
    """The spot checks' tolerance for pages of `dtype` (an unknown dtype raises: a guess
    would either pass poison or fail honest pages)."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        known = sorted(TOLERANCES)
        raise ValueError(f"no spot-check tolerance for {dtype!r}; known: {known}") from None


_MAX_TRUSTED = 4096  # holders remembered as checked (the oldest is checked again)
_EMPTY = bytes(16)  # the digest a page records before it is published (EMPTY_DIGEST)


class Sample(NamedTuple):
    """One copied token to recompute: slot `slot` of prompt page `page`, copied from
    `holder`; `attributable` when its context is the requester's own, the holder's, or
    from holders checked before."""

    holder: str
    page: int
    slot: int
    attributable: bool


class SpotCheck(NamedTuple):
    """A token of a copy to recompute, and what decides it: the caller runs prompt token
    `pos` through the model (its KV into its slot, over every token before it), then
    calls `judge`, True when the copy holds (False: the caller drops the whole copy and
    computes it; the holder was reported)."""

    pos: int
    judge: Callable[[], bool]


class Verdict(NamedTuple):
    """A check's outcome: the page, its error against the recomputation, and whether it
    passed."""

    sample: Sample
    error: float
    passed: bool


def kv_error(copied: torch.Tensor, recomputed: torch.Tensor) -> float:
    """The largest absolute difference over the recomputed page's largest magnitude
    (NaN or infinity in either: infinite)."""
    import torch  # here: the figures above are read where torch is not imported

    a, b = copied.float(), recomputed.float()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    scale = max(float(b.abs().max()), 1e-6)
    return float((a - b).abs().max()) / scale


class SpotChecks:
    """Which copies to check, and what the checks found. Thread-safe.

    Args:
        rate: the probability a copy from a holder checked before is checked (0: only
            the first copy from each holder; 1: every copy).
        limit: the largest error a page passes with (`tolerance(dtype)`).
        seed: the sampler's seed (None: random).

    Raises:
        ValueError: a rate outside [0, 1].
    """

    def __init__(
        self,
        rate: float = SPOT_CHECK_RATE,
        limit: float = TOLERANCES["float32"],
        seed: int | None = None,
    ):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"spot check rate must be in [0, 1], got {rate}")
        self.rate = rate
        self.limit = limit
        self._rng = random.Random(seed)
        self._trusted: OrderedDict[str, None] = OrderedDict()  # holders checked, passing
        self._lock = threading.Lock()
        self.checks = 0  # pages recomputed and compared
        self.failures = 0  # of them, pages that did not hold what they claimed
        self.unattributed = 0  # failures whose context came from unchecked holders

    def pick(self, ranges: Sequence[tuple[str, int, int]], page_tokens: int) -> list[Sample]:
        """The tokens to check of a copy whose holders gave prompt pages [lo, hi) each
        (`(holder, lo, hi)` in prompt order, pages of `page_tokens`): one token of each
        holder not checked yet, or one of the copy with probability `rate`."""
        with self._lock:
            fresh = [r for r in ranges if r[0] not in self._trusted]
            if not fresh and ranges and self._rng.random() < self.rate:
                fresh = [self._rng.choices(ranges, [hi - lo for _, lo, hi in ranges])[0]]
            samples = []
            for holder, lo, hi in fresh:
                before = {h for h, _, end in ranges if end <= lo}
                attributable = all(h == holder or h in self._trusted for h in before)
                page, slot = self._rng.randrange(lo, hi), self._rng.randrange(page_tokens)
                samples.append(Sample(holder, page, slot, attributable))
            return samples

    def judged(self, sample: Sample, error: float) -> Verdict:
        """Record a check's outcome; a passing one trusts its holder, a failing
        unattributed one makes every holder before it unchecked again."""
        verdict = Verdict(sample, error, error <= self.limit)
        with self._lock:
            self.checks += 1
            if verdict.passed:
                self._trusted[sample.holder] = None
                self._trusted.move_to_end(sample.holder)
                while len(self._trusted) > _MAX_TRUSTED:
                    self._trusted.popitem(last=False)
                return verdict
            self.failures += 1
            self._trusted.pop(sample.holder, None)
            if not sample.attributable:
                self.unattributed += 1
        return verdict

    def distrust(self, holders: Iterable[str]) -> None:
        """Check `holders` again at their next copy (an unattributed failure involved
        them)."""
        with self._lock:
            for holder in holders:
                self._trusted.pop(holder, None)

    def check(self) -> None:
        """Raise AssertionError unless the counts and the trusted holders are in bounds."""
        with self._lock:
            assert len(self._trusted) <= _MAX_TRUSTED, f"{len(self._trusted)} trusted holders"
            assert 0 <= self.unattributed <= self.failures <= self.checks, (
                f"{self.unattributed} unattributed, {self.failures} failed, {self.checks} checks"
            )

    def figures(self) -> dict[str, int]:
        with self._lock:
            return {
                "checks": self.checks,
                "failures": self.failures,
                "unattributed": self.unattributed,
                "trusted_holders": len(self._trusted),
            }


class Provenance:
    """Which of a member's pages were copied from which holder, with the digest each held
    when it landed: a page freed or rewritten since records another digest, and its entry
    no longer counts. Thread-safe; at most one entry per page of the store."""

    def __init__(self) -> None:
        self._origin: dict[int, tuple[str, bytes]] = {}  # page -> (holder, digest)
        self._lock = threading.Lock()

    def record(self, pages: Sequence[int], holder: str, digests: Sequence[bytes]) -> None:
        with self._lock:
            for page, digest in zip(pages, digests, strict=True):
                self._origin[page] = (holder, digest)

    def from_holder(self, holder: str) -> dict[int, bytes]:
        """Pages recorded as copied from `holder`: page -> digest."""
        with self._lock:
            return {p: d for p, (h, d) in self._origin.items() if h == holder}

    def forget(self, pages: Iterable[int]) -> None:
        """The copies into `pages` were dropped (their request computes them)."""
        with self._lock:
            for page in pages:
                self._origin.pop(page, None)

    def with_digests(self, digests: set[bytes]) -> dict[int, bytes]:
        """Pages recorded as copied (from anyone) whose digest is one of `digests`."""
        with self._lock:
            return {p: d for p, (_, d) in self._origin.items() if d in digests}

    def prune(self, current: dict[int, bytes]) -> None:
        """Forget pages whose digest now (`current`: page -> digest) is another one than
        they landed with (rewritten since). An empty digest is a page not published yet
        (its request still runs) or freed: kept, since a freed page that is reused is
        rewritten and a published one records its digest."""
        with self._lock:
            for page, digest in current.items():
                entry = self._origin.get(page)
                if entry is not None and digest != _EMPTY and entry[1] != digest:
                    del self._origin[page]

    def __len__(self) -> int:
        return len(self._origin)

    def check(self, num_pages: int) -> None:
        with self._lock:
            assert all(0 <= p < num_pages for p in self._origin), "provenance of no page"
