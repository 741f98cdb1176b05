"""Fixed-bucket histograms: observed by the service's loop or a worker, summed over the
workers' reports, exposed by the metrics (`cache_service.metrics`) and the dashboard."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

from cache_service.messages import Observed


class HistogramCounts(NamedTuple):
    """A histogram's state: per-bucket counts (not cumulative; the last is +Inf), sum."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' form: (upper bound, observations <= it), ending with +Inf."""
        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class Histogram:
    """Fixed buckets, observed by one thread (the loop); `counts()` is a copy."""

    def __init__(self, bounds: Sequence[float]):
        assert list(bounds) == sorted(bounds) and len(set(bounds)) == len(bounds), bounds
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._total = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le).
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._total += value

    def counts(self) -> HistogramCounts:
        return HistogramCounts(self.bounds, tuple(self._counts), self._total)

    def observed(self) -> Observed:
        """The state as a worker report carries it (the bounds are the protocol's)."""
        return Observed(tuple(self._counts), self._total)


def summed(bounds: Sequence[float], observed: Sequence[Observed]) -> HistogramCounts:
    """The sum of several workers' observations of one histogram (its bounds given)."""
    counts = [0] * (len(bounds) + 1)
    total = 0.0
    for item in observed:
        for i, count in enumerate(item.counts):
            counts[i] += count
        total += item.total
    return HistogramCounts(tuple(bounds), tuple(counts), total)
