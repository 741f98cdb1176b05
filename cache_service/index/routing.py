"""Cache-aware routing: which live worker should take a prompt.

For each live candidate w:

    score(w) = held(w) - load_weight * load(w) * prompt_tokens

held(w) is the number of prompt tokens w holds itself as a contiguous prefix from the
start of the prompt: what it reuses without copying anything in. The load term is in the
same unit: with load as a utilisation (0 idle .. 1 saturated), a saturated worker must
hold `load_weight` of the prompt more than an idle one to win it. Pages held only
elsewhere do not count: any chosen worker can copy those. Ties go to the least loaded,
then to the smallest worker id, so the choice is deterministic. With nothing cached
anywhere the score is load alone, which makes the least loaded worker the fallback
("least_loaded").
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from cache_service.index.registry import Worker
from cache_service.messages import RouteDecision


def live_candidates(
    loads: Mapping[str, float], workers: Mapping[str, Worker]
) -> dict[int, tuple[str, float]]:
    """slot -> (worker id, load) of the registered workers among `loads`' keys.

    Raises:
        ValueError: a load negative or not finite.
    """
    candidates: dict[int, tuple[str, float]] = {}
    for worker_id, load in loads.items():
        if not (math.isfinite(load) and load >= 0):
            raise ValueError(f"load of worker {worker_id!r} must be finite and >= 0: {load}")
        worker = workers.get(worker_id)
        if worker is not None:
            candidates[worker.slot] = (worker_id, float(load))
    return candidates


def choose_worker(
    candidates: Mapping[int, tuple[str, float]],
    held_tokens: Mapping[int, int],
    prompt_tokens: int,
    load_weight: float,
) -> RouteDecision:
    """The best candidate by the score above.

    Args:
        candidates: slot -> (worker id, load) of every live candidate; not empty.
        held_tokens: slot -> prompt tokens the worker holds as a prefix (absent: none).
        prompt_tokens: the prompt's length.
        load_weight: lambda in the score.
    """
    assert candidates, "no candidate to route to"

    def score(slot: int) -> float:
        return held_tokens.get(slot, 0) - load_weight * candidates[slot][1] * prompt_tokens

    def rank(slot: int) -> tuple[float, float, str]:
        worker_id, load = candidates[slot]
        return (-score(slot), load, worker_id)

    best = min(candidates, key=rank)
    matched = held_tokens.get(best, 0)
    reason = "prefix" if matched else "least_loaded"
    return RouteDecision(candidates[best][0], matched, score(best), reason)
