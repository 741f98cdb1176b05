"""Cache-aware routing: which live worker gets a prompt's first token out soonest.

For each live candidate w, the seconds until the prompt's first token there:

    est(w) = prefill_s * (queue(w) + compute(w))     its queue, then its own prefill
           + copy_s(w) * copied(w)                   what it copies in from holders
           + prefill_s * running(w)                  a token's worth for each sequence
                                                     its prefill shares a pass with

    own(w)     = max(held(w), pending(w))   prompt tokens w holds as a prefix, or is
                                            computing right now for a request in flight
    reach(w)   = max(own(w), held anywhere) what w has once it copied the best holder's
    copied(w)  = reach(w) - own(w)
    compute(w) = prompt_tokens - reach(w)
    queue(w)   = prompt tokens w has yet to compute for the requests it queued or runs

A prefix held only elsewhere counts for every worker (any of them can copy it), at the
measured cost of copying it: shared memory when the holder is on w's node, its page
server otherwise. So a worker holding the prompt wins it while its queue is shorter
than the time the others would take to copy it, and the requests of a popular prompt
spread over the workers instead of piling onto its holder. A prefix being computed
right now (`pending`, which the front door knows from its requests in flight) counts
as held by the worker computing it, so concurrent requests for it join that worker's
batch rather than computing it again elsewhere.

The costs are what the workers measured and reported with their heartbeats (their
prefill curves, their links); one that has not reported yet gets the defaults below, in
the same proportions as a CPU worker's. The workers of a mesh run one model on one kind
of machine, so routing takes the median of the candidates' figures for all of them:
what differs between two such workers' measurements is noise, and it must not outweigh
what differs between their situations (what they hold, copy and have queued).
`load_weight` scales the queue term. Estimates within 5% of the best count as equal;
among those the worker holding (or computing) more of the prompt wins, then the one with
the shorter queue, then the smallest worker id, so the choice is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple

from cache_service.index.registry import Worker
from cache_service.messages import RouteDecision

# Defaults for a worker that has not reported its measured costs yet: a CPU worker's
# proportions (SmolLM2-135M on two cores: a prompt token ~2 ms; a same-node page copy
# moves a token's KV in ~10 us, a page server in ~50 us).
DEFAULT_PREFILL_S = 2e-3
DEFAULT_COPY_S_SAME_NODE = 1e-5
DEFAULT_COPY_S_REMOTE = 5e-5
TIE_TOLERANCE = 0.05  # estimates this close (relative) to the best are ties


class WorkerLoad(NamedTuple):
    """A worker's load and measured costs, as its latest heartbeat reported them."""

    queued_tokens: int = 0  # prompt tokens of its queued and running requests, not computed
    running: int = 0  # sequences in prefill or decode
    prefill_s: float = DEFAULT_PREFILL_S  # seconds to compute one prompt token
    copy_s_same_node: float = DEFAULT_COPY_S_SAME_NODE  # seconds to copy one token's KV
    copy_s_remote: float = DEFAULT_COPY_S_REMOTE


class Candidate(NamedTuple):
    """A live worker that may take the prompt."""

    worker_id: str
    node_id: str
    queue: float  # prompt tokens ahead of this one: the larger of the front door's count
    # and the worker's report
    load: WorkerLoad


def live_candidates(
    loads: Mapping[str, float],
    workers: Mapping[str, Worker],
    reported: Mapping[str, WorkerLoad] | None = None,
) -> dict[int, Candidate]:
    """slot -> Candidate for the registered workers among `loads`' keys.

    Args:
        loads: worker id -> prompt tokens the front door has in flight there.
        workers: the index's registered workers.
        reported: worker id -> its latest reported load and costs.

    Raises:
        ValueError: a load negative or not finite.
    """
    reported = reported or {}
    candidates: dict[int, Candidate] = {}
    for worker_id, load in loads.items():
        if not (math.isfinite(load) and load >= 0):
            raise ValueError(f"load of worker {worker_id!r} must be finite and >= 0: {load}")
        worker = workers.get(worker_id)
        if worker is not None:
            report = reported.get(worker_id, WorkerLoad())
            queue = max(float(load), float(report.queued_tokens))
            candidates[worker.slot] = Candidate(worker_id, worker.node_id, queue, report)
    return candidates


def choose_worker(
    candidates: Mapping[int, Candidate],
    held_tokens: Mapping[int, int],
    prompt_tokens: int,
    load_weight: float,
    pending: Mapping[str, int] | None = None,
    holder_nodes: Mapping[int, str] | None = None,
) -> RouteDecision:
    """The candidate with the soonest first token, by the estimate above.

    Args:
        candidates: slot -> Candidate of every live candidate; not empty.
        held_tokens: slot -> prompt tokens that worker holds as a prefix (absent: none);
            holders need not be candidates (they can still be copied from).
        prompt_tokens: the prompt's length.
        load_weight: the weight of the queue term.
        pending: worker id -> prompt tokens it is computing for a request in flight.
        holder_nodes: slot -> node of each holder in `held_tokens`.
    Returns:
        The decision; its score is the estimated seconds to the first token, and its
        reason "prefix" (the chosen worker holds part of the prompt), "pending" (it is
        computing part of it), "copy" (it copies part from a holder) or "least_loaded".
    """
    assert candidates, "no candidate to route to"
    pending = pending or {}
    holder_nodes = holder_nodes or {}
    loads = [c.load for c in candidates.values()]
    prefill_s = _median([load.prefill_s for load in loads])
    copy_same = _median([load.copy_s_same_node for load in loads])
    copy_remote = _median([load.copy_s_remote for load in loads])
    best = max(held_tokens.values(), default=0)
    # The nodes holding `best` tokens: copying from one of them on a candidate's node
    # goes through shared memory.
    best_nodes = {holder_nodes.get(slot) for slot, held in held_tokens.items() if held == best}

    def estimate(slot: int) -> tuple[float, int, int]:
        c = candidates[slot]
        held = held_tokens.get(slot, 0)
        own = max(held, min(int(pending.get(c.worker_id, 0)), prompt_tokens - 1))
        reach = max(own, best)
        copy_s = copy_same if c.node_id in best_nodes else copy_remote
        seconds = prefill_s * (load_weight * c.queue + prompt_tokens - reach + c.load.running)
        return seconds + copy_s * (reach - own), held, own

    figures = {slot: estimate(slot) for slot in candidates}
    soonest = min(seconds for seconds, _, _ in figures.values())
    tied = [s for s in candidates if figures[s][0] <= soonest * (1 + TIE_TOLERANCE)]
    chosen = min(tied, key=lambda s: (-figures[s][2], candidates[s].queue, candidates[s].worker_id))
    seconds, held, own = figures[chosen]
    if held and held >= own:
        reason = "prefix"
    elif own:
        reason = "pending"
    elif best:
        reason = "copy"
    else:
        reason = "least_loaded"
    return RouteDecision(candidates[chosen].worker_id, held, seconds, reason)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
