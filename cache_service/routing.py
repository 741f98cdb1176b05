"""Routing policies: which live worker takes a prompt. Pure: no Ray, no sockets, no index.

Every policy sees the same `RouteInputs`: the candidates (live workers, each with its
queue and its reported load and measured costs), what each holder holds of the prompt,
what each worker is computing of it right now for a request in flight (`pending`), and
the prompt's length; it returns a `RouteDecision`. The service's index builds the inputs
from what it holds (`GlobalIndex.route`) and runs the policy a ROUTE names; the front
door runs one itself when the service does not answer, and the benchmarks and `kvmesh
replay` name the same policies, so no policy is written twice.

    kvmesh           the worker whose first token comes soonest (estimate below)
    round-robin      each in turn, whatever they hold
    least-loaded     the shortest queue
    prefix-affinity  SGLang's cache-aware rule: the longest match while the loads are
                     balanced, the least loaded when they are not

kvmesh's estimate, for each candidate w, in seconds until the prompt's first token:

    est(w) = prefill_s * (load_weight * queue(w) + compute(w))   its queue, then its prefill
           + copy_s(w) * copied(w)                   what it copies in from holders
           + disk_s * read(w)                        what it, or a holder, reads from disk
           + decode(w)                               the decodes its passes carry meanwhile
           + landing(w)                              a copy joins the pass after it landed

    own(w)     = max(held(w), pending(w))   prompt tokens w holds as a prefix, or is
                                            computing right now for a request in flight
    reach(w)   = max(own(w), held anywhere) what w has once it copied the best holder's
    copied(w)  = reach(w) - own(w)
    compute(w) = prompt_tokens - reach(w)
    queue(w)   = prompt tokens w has yet to compute for the requests it queued or runs:
                 its last report's, and the front doors' requests sent since
    read(w)    = the tokens of own(w) and copied(w) on disk, not in host memory
    decode(w)  = step_s(w) * min(decode_steps(w), passes(w))
    passes(w)  = the forward passes until the prompt's first token: its queue and its
                 compute at pass_tokens(w) a pass, its compute at chunk_tokens(w) a pass

A copy runs beside the passes and the request joins the first pass after the copy
landed: on a worker with passes running (its sequences decode or its queue is not empty)
that is one pass later than a request that computes (`landing` = its step_s when it
copies or loads from disk; 0 when it does neither, or is idle).

Continuous batching runs the decodes of w's sequences in every pass beside the prefills,
so the prompt waits for a decode step in each of its passes while any of them still
decodes: `decode_steps` is the most steps one of them has left (its remaining
`max_new_tokens`), `step_s` the worker's measured time of a pass of decodes. A worker
that has not measured one yet counts a prompt token's time for each running sequence.

A holder's pages are in host memory up to its `held_host`, on its disk past it (a worker
demotes the leaves of its prefixes first, so a prefix's disk pages follow its host
pages). A token read from disk costs `disk_s`, the median of the candidates' measured
disk reads, but never more than computing it: a worker loads from disk only when that
is faster (`workers.transfer.costs`).

A prefix held only elsewhere counts for every worker (any of them can copy it), at the
measured cost of copying it: shared memory when the holder is on w's node, its page
server otherwise. So a worker holding the prompt wins it while its queue is shorter
than the time the others would take to copy it, and the requests of a popular prompt
spread over the workers instead of piling onto its holder. The costs are what the
workers measured and reported with their heartbeats (their prefill curves, their links);
one that has not reported yet gets the defaults below, in the same proportions as a CPU
worker's. The workers of a mesh run one model on one kind of machine, so the estimate
takes the median of the candidates' figures for all of them: what differs between two
such workers' measurements is noise, and it must not outweigh what differs between
their situations. Estimates within 5% of the best count as equal; among those the worker
holding (or computing) more of the prompt wins, then the one with the shorter queue,
then the smallest worker id, so the choice is deterministic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol

from cache_service.messages import RouteDecision

# Defaults for a worker that has not reported its measured costs yet: a CPU worker's
# proportions (SmolLM2-135M on two cores: a prompt token ~2 ms; a same-node page copy
# moves a token's KV in ~10 us, a page server in ~50 us).
DEFAULT_PREFILL_S = 2e-3
DEFAULT_COPY_S_SAME_NODE = 1e-5
DEFAULT_COPY_S_REMOTE = 5e-5
TIE_TOLERANCE = 0.05  # kvmesh: estimates this close (relative) to the best are ties
DEFAULT_POLICY = "kvmesh"


class WorkerLoad(NamedTuple):
    """A worker's load and measured costs, as its latest heartbeat reported them."""

    queued_tokens: int = 0  # prompt tokens of its queued and running requests, not computed
    running: int = 0  # sequences in prefill or decode
    prefill_s: float = DEFAULT_PREFILL_S  # seconds to compute one prompt token
    copy_s_same_node: float = DEFAULT_COPY_S_SAME_NODE  # seconds to copy one token's KV
    copy_s_remote: float = DEFAULT_COPY_S_REMOTE
    disk_s: float = 0.0  # seconds to read one token's KV from its disk (0: no disk, or unmeasured)
    decode_steps: int = 0  # the most decode steps one of its sequences has left
    step_s: float = 0.0  # seconds of one pass of decodes (0: not measured yet)
    pass_tokens: int = 0  # tokens one forward pass takes at most (0: unknown, no limit)
    chunk_tokens: int = 0  # a prompt's tokens per pass at most (0: no chunking)

    def passes(self, tokens: float, compute: int) -> int:
        """Forward passes until a prompt computing `compute` tokens behind `tokens` of
        queue and its own compute has its first token."""
        passes = math.ceil(tokens / self.pass_tokens) if self.pass_tokens else 1
        if self.chunk_tokens:
            passes = max(passes, math.ceil(compute / self.chunk_tokens))
        return max(1, passes)

    def landing_s(self, queue: float) -> float:
        """What copying adds: the pass a request waits for after its copy landed, when
        passes are running."""
        return self.step_s if (self.decode_steps or queue) else 0.0

    def decode_s(self, tokens: float, compute: int, prefill_s: float) -> float:
        """What the decodes of its sequences add to those passes."""
        if not self.step_s:
            return prefill_s * self.running
        return self.step_s * min(self.decode_steps, self.passes(tokens, compute))


class Candidate(NamedTuple):
    """A live worker that may take the prompt."""

    worker_id: str
    node_id: str
    # Prompt tokens ahead of this one: the worker's own report (what it has yet to compute)
    # and the callers' requests sent there since, which the report does not count yet.
    queue: float
    load: WorkerLoad = WorkerLoad()


class RouteInputs(NamedTuple):
    """What a policy weighs.

    Attributes:
        candidates: the live workers that may take the prompt; not empty.
        prompt_tokens: the prompt's length.
        held: worker id -> prompt tokens it holds as a prefix (absent: none); holders
            need not be candidates (they can still be copied from).
        holder_nodes: worker id -> node, of each holder in `held`.
        pending: worker id -> prompt tokens it is computing for a request in flight.
        load_weight: the weight of the queue term (kvmesh's estimate).
        held_host: worker id -> the tokens of its `held` prefix in host memory, the rest
            being on its disk (absent: all of it in host memory).
    """

    candidates: Sequence[Candidate]
    prompt_tokens: int
    held: Mapping[str, int] = {}
    holder_nodes: Mapping[str, str] = {}
    pending: Mapping[str, int] = {}
    load_weight: float = 1.0
    held_host: Mapping[str, int] = {}


class RoutingPolicy(Protocol):
    """Chooses a worker for a prompt. `uses_holdings`: whether it reads `held` (a policy
    that does not spares the index the walk of the prompt)."""

    name: str
    uses_holdings: bool

    def choose(self, inputs: RouteInputs) -> RouteDecision: ...


def candidates_of(
    loads: Mapping[str, float],
    nodes: Mapping[str, str],
    reported: Mapping[str, WorkerLoad] | None = None,
) -> list[Candidate]:
    """Candidates for the workers among `loads`' keys that `nodes` knows, in id order.

    Args:
        loads: worker id -> prompt tokens of the callers' requests there that its report
            does not count yet (those sent since; for a worker that reports no queue,
            every request in flight there).
        nodes: worker id -> node, of every registered worker.
        reported: worker id -> its latest reported load and costs.

    Raises:
        ValueError: a load negative or not finite.
    """
    reported = reported or {}
    out = []
    for worker_id in sorted(loads):
        load = loads[worker_id]
        if not (math.isfinite(load) and load >= 0):
            raise ValueError(f"load of worker {worker_id!r} must be finite and >= 0: {load}")
        node = nodes.get(worker_id)
        if node is not None:
            report = reported.get(worker_id, WorkerLoad())
            queue = float(load) + float(report.queued_tokens)
            out.append(Candidate(worker_id, node, queue, report))
    return out


# ---------------------------------------------------------------------------- policies


class EstimatedTtft:
    """kvmesh's own: the soonest first token, by the estimate in the module docstring."""

    name = "kvmesh"
    uses_holdings = True

    def choose(self, inputs: RouteInputs) -> RouteDecision:
        candidates, prompt_tokens = inputs.candidates, inputs.prompt_tokens
        assert candidates, "no candidate to route to"
        loads = [c.load for c in candidates]
        prefill_s = _median([load.prefill_s for load in loads])
        copy_same = _median([load.copy_s_same_node for load in loads])
        copy_remote = _median([load.copy_s_remote for load in loads])
        disk_s = min(
            _median([load.disk_s for load in loads if load.disk_s > 0] or [0.0]), prefill_s
        )
        held_host = inputs.held_host
        best = max(inputs.held.values(), default=0)
        # The holders of `best` tokens: copying from one on a candidate's node goes through
        # shared memory; the one with the most of them in host memory is copied from.
        best_holders = [w for w, held in inputs.held.items() if held == best]
        best_nodes = {inputs.holder_nodes.get(w) for w in best_holders}
        best_host = max((held_host.get(w, best) for w in best_holders), default=0)

        def estimate(c: Candidate) -> tuple[float, int, int]:
            held = inputs.held.get(c.worker_id, 0)
            own = max(held, min(int(inputs.pending.get(c.worker_id, 0)), prompt_tokens - 1))
            reach = max(own, best)
            copy_s = copy_same if c.node_id in best_nodes else copy_remote
            queue = inputs.load_weight * c.queue
            read = held - min(held, held_host.get(c.worker_id, held))  # its own, on disk
            read += max(0, reach - max(own, best_host))  # the holder's, past its host pages
            compute = prompt_tokens - reach
            seconds = prefill_s * (queue + compute) + c.load.decode_s(
                queue + compute, compute, prefill_s
            )
            seconds += copy_s * (reach - own) + disk_s * read
            if reach > own or read:  # loads from its disk go through a copy too
                seconds += c.load.landing_s(queue)
            return seconds, held, own

        figures = {c.worker_id: estimate(c) for c in candidates}
        soonest = min(seconds for seconds, _, _ in figures.values())
        tied = [c for c in candidates if figures[c.worker_id][0] <= soonest * (1 + TIE_TOLERANCE)]
        chosen = min(tied, key=lambda c: (-figures[c.worker_id][2], c.queue, c.worker_id))
        seconds, held, own = figures[chosen.worker_id]
        if held and held >= own:
            reason = "prefix"
        elif own:
            reason = "pending"
        elif best:
            reason = "copy"
        else:
            reason = "least_loaded"
        return RouteDecision(chosen.worker_id, held, seconds, reason)


class RoundRobin:
    """Each candidate in turn (by id), whatever it holds: the baseline with no cache
    awareness. Keeps its place between calls."""

    name = "round-robin"
    uses_holdings = False

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, inputs: RouteInputs) -> RouteDecision:
        candidates = sorted(inputs.candidates, key=lambda c: c.worker_id)
        chosen = candidates[next(self._turn) % len(candidates)]
        return RouteDecision(
            chosen.worker_id, inputs.held.get(chosen.worker_id, 0), 0.0, "round_robin"
        )


class LeastLoaded:
    """The candidate with the fewest prompt tokens queued (then the fewest running
    sequences, then the smallest id)."""

    name = "least-loaded"
    uses_holdings = False

    def choose(self, inputs: RouteInputs) -> RouteDecision:
        chosen = _least_loaded(inputs.candidates)
        return RouteDecision(
            chosen.worker_id, inputs.held.get(chosen.worker_id, 0), chosen.queue, "least_loaded"
        )


class PrefixAffinity:
    """SGLang's cache-aware rule. While the loads are balanced, the candidate holding the
    longest prefix of the prompt (held, or being computed for a request in flight) takes
    it, if that prefix is at least `cache_threshold` of the prompt; otherwise, or when
    the loads are imbalanced, the least loaded does. Loads are the candidates' queues in
    prompt tokens; they are imbalanced when the largest exceeds the smallest by more than
    `balance_abs_tokens` and by a factor of more than `balance_rel`.

    Args:
        cache_threshold: the share of the prompt a match must reach to win.
        balance_abs_tokens: the absolute gap that can make loads imbalanced.
        balance_rel: the relative gap that can make loads imbalanced.
    """

    name = "prefix-affinity"
    uses_holdings = True

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_tokens: float = 4096.0,
        balance_rel: float = 1.5,
    ):
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_tokens < 0 or balance_rel < 1.0:
            raise ValueError(
                f"balance thresholds must be >= 0 tokens and >= 1.0 times, got "
                f"{balance_abs_tokens} and {balance_rel}"
            )
        self.cache_threshold = cache_threshold
        self.balance_abs_tokens = balance_abs_tokens
        self.balance_rel = balance_rel

    def choose(self, inputs: RouteInputs) -> RouteDecision:
        candidates = inputs.candidates
        queues = [c.queue for c in candidates]
        low, high = min(queues), max(queues)
        if high - low > self.balance_abs_tokens and high > self.balance_rel * low:
            chosen = _least_loaded(candidates)
            return RouteDecision(
                chosen.worker_id, inputs.held.get(chosen.worker_id, 0), 0.0, "balance"
            )

        def matched(c: Candidate) -> int:
            pending = min(int(inputs.pending.get(c.worker_id, 0)), inputs.prompt_tokens - 1)
            return max(inputs.held.get(c.worker_id, 0), pending)

        best = min(candidates, key=lambda c: (-matched(c), c.queue, c.worker_id))
        share = matched(best) / max(1, inputs.prompt_tokens)
        if matched(best) and share >= self.cache_threshold:
            return RouteDecision(
                best.worker_id, inputs.held.get(best.worker_id, 0), share, "prefix"
            )
        chosen = _least_loaded(candidates)
        return RouteDecision(
            chosen.worker_id, inputs.held.get(chosen.worker_id, 0), share, "least_loaded"
        )


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    EstimatedTtft.name: EstimatedTtft,
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
    PrefixAffinity.name: PrefixAffinity,
}


def make_policy(name: str) -> RoutingPolicy:
    """A new instance of the policy called `name` (round-robin's place is its own).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}") from None


def _least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    return min(candidates, key=lambda c: (c.queue, c.load.running, c.worker_id))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
