"""A request as the worker's scheduler follows it: its tokens, pages, progress and result.

A sequence goes WAITING -> [COPYING ->] PREFILL -> DECODE -> FINISHED: COPYING while
pages its peers hold are copied into it, off the serving thread (the others keep running).
It can end in any phase: its deadline passed or its caller cancelled it (`end`), then
the scheduler fails it at its next step and releases what it held. Preempted (its pages taken for
older sequences), it goes back to WAITING with the tokens it generated so far, and its
prompt and those tokens are computed again when it is admitted next; what it reported
as reused at its first admission stays as it was (recomputed tokens are never hits).

    tokens      [ prompt ......................... ][ output[:-1] ][ output[-1] ]
    computed    |<-- KV in the pages ------------->|
    prefill     runs [computed, len(tokens)) in chunks, then samples output[0]
    decode      runs output[-1] (one token a step), then samples the next
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from cache_service.events import Namespace
from workers.errors import PHASES, DeadlineExceeded, RequestEnded
from workers.serving.sampling import Sampler

if TYPE_CHECKING:
    from workers.cache.prefix_cache import Allocation
    from workers.serving.compaction import KvState


class Phase(enum.Enum):
    WAITING = "waiting"  # queued, holding no pages
    COPYING = "copying"  # admitted, pages held, its peers' pages being copied in
    PREFILL = "prefill"  # admitted: pages held, tokens [computed, len(tokens)) to run
    DECODE = "decode"  # its last sampled token runs next
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request in the worker's scheduler.

    Attributes:
        seq_id: its number in arrival order (the newest has the highest).
        prompt: the prompt's token ids.
        namespace: where its pages are matched and published.
        max_new_tokens: tokens to sample at most.
        sampler: picks each token (greedy or seeded sampling).
        stops: tokens that end generation (returned, last).
        reuse: False: nothing is matched, copied or published (a baseline run).
        on_token: called with each sampled token as soon as it is sampled (streaming);
            it runs on the scheduler's thread and should only hand the token on.
        return_logits: keep the logits after the prompt's last token.
        timeout_s: its deadline, in seconds from its arrival (inf: none).
        request_id: its caller's name for it ("": none), to cancel it by.
        route_estimate_s: the router's estimate of its time to first token (0: none).
    """

    seq_id: int
    prompt: list[int]
    namespace: Namespace
    max_new_tokens: int
    sampler: Sampler
    stops: frozenset[int] = frozenset()
    reuse: bool = True
    on_token: Callable[[int], None] | None = None
    return_logits: bool = False
    timeout_s: float = math.inf
    request_id: str = ""
    route_estimate_s: float = 0.0
    arrived: float = field(default_factory=time.perf_counter)

    phase: Phase = Phase.WAITING
    allocation: Allocation | None = None
    kv: KvState | None = None  # its layout and scores, when the worker compacts
    computed: int = 0  # tokens of `tokens` whose KV is in the pages
    # Prefill waits until every sequence in `depends_on` has computed this far: they
    # compute the pages before it (a batch plan's shared prefix).
    ready_from: int = 0
    depends_on: list[Sequence] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    # Fixed at the first admission: (local hit, copied) tokens of the prompt.
    hits: tuple[int, int] | None = None
    # Of the copied, those loaded from the worker's own tiers below, by tier, top down.
    own_tokens: dict[str, int] = field(default_factory=dict)
    batch_shared: int = 0  # prompt tokens a sibling of its batch computed for it
    recomputed: int = 0  # tokens computed again after preemptions
    preemptions: int = 0
    compacted_pages_freed: int = 0
    admitted_at: float | None = None  # first admission
    first_token_at: float | None = None
    copy_s: float = 0.0
    copying: Future | None = None  # its copy-in, while in COPYING
    # Its copy's spot checks (`workers.transfer.spot_check.SpotCheck`), run in its first
    # prefill pass; until they are judged, the (local, copied-to) tokens of its admission.
    checks: list[Any] = field(default_factory=list)
    unjudged: tuple[int, int] | None = None
    # Set from any thread to end it early (a cancellation, or its caller gave up on its
    # deadline); the scheduler fails it with this at its next step.
    ending: RequestEnded | None = None
    prefill_s: float = 0.0  # wall time of the passes that ran its prefill chunks
    finish_reason: str | None = None
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def deadline(self) -> float:
        """When it must have ended (time.perf_counter's clock)."""
        return self.arrived + self.timeout_s

    def end(self, error: RequestEnded) -> None:
        """Ask the scheduler to end it with `error` at its next step (any thread)."""
        if self.ending is None:
            self.ending = error

    def overdue(self, now: float) -> DeadlineExceeded | None:
        """The error it ends with if its deadline passed by `now`, else None."""
        if now < self.deadline:
            return None
        return DeadlineExceeded(self.timeout_s, self.current_phase, self.spent(now))

    @property
    def current_phase(self) -> str:
        """Which of PHASES it is in now."""
        if self.phase is Phase.COPYING:
            return "copying"
        if self.admitted_at is None:
            return "queued"
        return "prefill" if self.first_token_at is None else "decode"

    def spent(self, now: float) -> dict[str, float]:
        """Seconds spent in each phase so far (those it reached)."""
        admitted = self.admitted_at if self.admitted_at is not None else now
        copied = admitted + (self.copy_s or (now - admitted if self.copying else 0.0))
        first = self.first_token_at if self.first_token_at is not None else now
        ends = {"queued": admitted, "copying": copied, "prefill": max(copied, first), "decode": now}
        spent, start = {}, self.arrived
        for name in PHASES[: PHASES.index(self.current_phase) + 1]:
            spent[name] = max(0.0, ends[name] - start)
            start = ends[name]
        return spent

    def own_hits(self) -> dict[str, int]:
        """Of its copied prompt tokens, those each of the worker's own tiers below gave,
        top down (the last page's tokens may have been cut: the prompt's last token is
        always computed)."""
        left = self.hits[1] if self.hits is not None else 0
        hits = {}
        for name, tokens in self.own_tokens.items():
            hits[name] = min(tokens, left)
            left -= hits[name]
        return hits

    @property
    def tokens(self) -> list[int]:
        """The tokens whose KV the sequence computes: the prompt, then every sampled
        token but the newest while it waits to run."""
        assert self.allocation is not None, "a waiting sequence holds no tokens"
        return self.allocation.tokens

    @property
    def to_compute(self) -> list[int]:
        """Where an admission starts: the prompt and the tokens sampled so far."""
        return self.prompt + self.output

    @property
    def prefill_left(self) -> int:
        return len(self.tokens) - self.computed

    @property
    def ready(self) -> bool:
        """Whether its next prefill chunk may run: its batch siblings computed its pages."""
        return all(dep.computed >= self.ready_from for dep in self.depends_on)

    def finish(self, reason: str) -> None:
        self.phase = Phase.FINISHED
        self.finish_reason = reason

    def result(self, timeout_s: float | None = None) -> Any:
        """Wait until finished; raises what the scheduler failed it with."""
        self.done.wait(timeout_s)
        if self.error is not None:
            raise self.error
        return self
