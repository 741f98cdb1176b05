"""The worker's scheduler: which sequences run in the next forward pass, and how much of each.

Continuous batching, as in vLLM and nano-vllm: every step is one forward pass over

1. the newest sampled token of every sequence in decode (one token each), then
2. prefill chunks of admitted sequences, oldest first, then
3. the waiting sequences it can admit now, while the pass has room
   (`max_batch_tokens`) and fewer than `max_running` sequences run.

A prompt longer than `prefill_chunk_tokens` is prefilled a chunk a step, interleaved with
the decode steps of the others, so a long prompt never stalls them. Chunks end on
multiples of the chunk size, so with the cache's chunk alignment on (`chunk_tokens`)
every chunk starts where a cached one would.

Admission takes pages from the local prefix cache. Sequences that arrive together (one
`add`) under one namespace are admitted through one `acquire_batch` plan: a prefix they
share and nobody has cached is computed once, by the first of them, and the others
wait for it (`Sequence.ready`) and then compute only their own suffixes. Pages are
published as soon as a prefill chunk has written them, so a request arriving a step
later finds them cached instead of computing them again.

With compaction configured (`workers.serving.compaction`), every step first checks the store:
once the pages held by running sequences pass the high-water mark, the longest sequences
in decode are compacted by the configured policy (their private pages packed, the rest
freed) until the share is back under it, before anything would be preempted.

A newly admitted sequence whose prompt peers hold further than this worker does is copied
in on a copy thread (`copy_in`, `SchedulerConfig.copy_threads` at once) while the passes go
on without it: it sits in COPYING, holding its pages (never preempted meanwhile), and
joins the prefills at the first step after its copy landed.

Every step first ends the sequences whose deadline passed or whose caller cancelled them
(`Sequence.end`): they fail with their error and release their pages (those published
stay cached); one still copying is answered at once and releases its pages when its copy
returns.

Decode takes one more page whenever a sequence crosses a page boundary. When none is left
even after eviction, the newest running sequence is preempted: its pages are released
(private ones freed) and it waits to be admitted again, its prompt and the tokens it
generated then computed anew (counted as recomputed, never as hits). A sequence that
cannot grow with nothing else running finishes with "out_of_pages".
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from workers.cache.prefix_cache import PrefixCache
from workers.errors import RequestCancelled, RequestEnded, ServingStopped
from workers.serving.batch_runner import Chunk
from workers.serving.compaction import Compactor
from workers.serving.config import SchedulerConfig
from workers.serving.sequence import Phase, Sequence

log = logging.getLogger(__name__)


class CacheFull(RuntimeError):
    """The worker's page store cannot hold this request even after evicting everything
    unreferenced."""


class Step(NamedTuple):
    """One forward pass: a chunk per sequence, in the same order, then one chunk per spot
    check (`checks`, the sequence whose copy it checks and the check) after them."""

    sequences: list[Sequence]
    chunks: list[Chunk]
    checks: list[tuple[Sequence, Any]]

    def pairs(self) -> Iterable[tuple[Sequence, Chunk]]:
        """Each sequence with its own chunk (the spot checks' chunks left out)."""
        return zip(self.sequences, self.chunks[: len(self.sequences)], strict=True)


class Scheduler:
    """Decides each forward pass (see the module docstring).

    `add` may be called from any thread; everything else runs on the serving thread.

    Args:
        cache: the worker's local prefix cache (pages come from it).
        config: the pass's limits.
        copy_in: called for each newly admitted sequence that reuses, on a copy thread:
            copies what peers hold beyond the local prefix into its pages and returns
            where computing starts (None: nothing is copied). It must not raise (a copy
            that cannot be made is a miss); if it does, the sequence computes it all.
        on_admit: called with each sequence at its first admission, its hits known.
        on_finish: called with each sequence that finished or failed, after its pages
            were published and released.
        compactor: compacts running sequences under pressure (None, or one without a
            policy: never).
    """

    def __init__(
        self,
        cache: PrefixCache,
        config: SchedulerConfig | None = None,
        copy_in: Callable[[Sequence], int] | None = None,
        on_admit: Callable[[Sequence], None] | None = None,
        on_finish: Callable[[Sequence], None] | None = None,
        compactor: Compactor | None = None,
    ):
        self.cache = cache
        self.compactor = compactor if compactor is not None and compactor.enabled else None
        self._total_pages = cache.stats()["total_pages"]
        self.config = config or SchedulerConfig()
        self._copy_in = copy_in
        self._on_admit = on_admit
        self._on_finish = on_finish
        self.running: list[Sequence] = []  # admission order
        self._waiting: deque[list[Sequence]] = deque()  # arrival groups, oldest first
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._copies = ThreadPoolExecutor(self.config.copy_threads, "kvmesh-copy")
        self.preemptions = 0
        self.steps = 0
        # Sequences ended early, by why: "deadline" (passed it), "cancelled" (caller left).
        self.ended_by: Counter[str] = Counter()
        self.compactions = 0
        self.compacted_pages_freed = 0

    @property
    def ended(self) -> int:
        """Sequences ended early (a deadline passed, or their caller cancelled them)."""
        return sum(self.ended_by.values())

    # -- from any thread ---------------------------------------------------------------

    def add(self, sequences: Iterable[Sequence]) -> None:
        """Queue sequences that arrived together (one admission plan when they fit)."""
        group = list(sequences)
        if not group:
            return
        with self._lock:
            self._waiting.append(group)
            self._arrived.notify_all()

    def wait_for_work(self, timeout_s: float) -> bool:
        """Block until a sequence waits or runs (True) or `timeout_s` passed (False)."""
        with self._lock:
            if self.running or self._waiting:
                return True
            return self._arrived.wait(timeout_s)

    def wake(self) -> None:
        """Wake a `wait_for_work` (to stop the serving loop)."""
        with self._lock:
            self._arrived.notify_all()

    def load(self) -> dict[str, int]:
        """Sequences running and waiting now, the prompt tokens they have yet to compute,
        and the most decode steps any of them has left (its remaining `max_new_tokens`:
        a prompt arriving now shares its passes with those steps). Read from any thread:
        a moment's figures, not a locked snapshot."""
        with self._lock:
            waiting = [seq for group in self._waiting for seq in group]
        running = list(self.running)
        queued = sum(len(seq.to_compute) for seq in waiting)
        for seq in running:
            allocation = seq.allocation
            if seq.phase in (Phase.COPYING, Phase.PREFILL) and allocation is not None:
                queued += max(0, len(allocation.tokens) - seq.computed)
        decode_steps = max(
            (max(0, seq.max_new_tokens - len(seq.output)) for seq in running + waiting), default=0
        )
        return {
            "running": len(running),
            "waiting": len(waiting),
            "queued_tokens": queued,
            "decode_steps": decode_steps,
        }

    # -- on the serving thread ---------------------------------------------------------

    def wait_for_change(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for a sequence to arrive or a copy to land (nothing could
        run in the last step)."""
        with self._lock:
            self._arrived.wait(timeout_s)

    def schedule(self) -> Step:
        """The next forward pass (empty when nothing can run now)."""
        self.steps += 1
        self._end_overdue()
        self._land_copies()
        self._compact_under_pressure()
        step = Step([], [], [])
        budget = self.config.max_batch_tokens
        for seq in [s for s in self.running if s.phase is Phase.DECODE]:
            if seq.phase is Phase.DECODE and self._grow(seq, step):
                step.sequences.append(seq)
                step.chunks.append(
                    Chunk(seq.allocation.pages, seq.tokens[-1:], seq.computed, _kv(seq))
                )
                budget -= 1
        budget = self._prefill(step, budget)
        while budget > 0 and len(self.running) < self.config.max_running:
            admitted = self._admit_next()
            if not admitted:
                break
            budget = self._prefill(step, budget, admitted)
        # The spot checks' chunks go after every sequence's: a sequence's chunk and its
        # logits row are found by its index among the sequences.
        for seq in step.sequences:
            if seq.unjudged is not None:
                self._check(step, seq)
        return step

    def after_forward(self, step: Step) -> None:
        """A pass ran: every chunk's KV is in its pages. Judge the spot checks first: a
        sequence whose copy failed one computes its prompt after its local prefix again
        (nothing of this pass is published or sampled for it). Then publish the prefill
        chunks' full pages at once (a request arriving next step finds them cached)."""
        failed = {id(seq) for seq, check in step.checks if not check.judge()}
        for seq, chunk in step.pairs():
            if seq.unjudged is not None:
                local, copied_to = seq.unjudged
                seq.unjudged, seq.checks = None, []
                if id(seq) in failed:
                    seq.computed = local
                    self._admitted(seq, local, local)
                    continue
                self._admitted(seq, local, copied_to)
            seq.computed = chunk.end
            if seq.phase is Phase.PREFILL and seq.reuse:
                seq.allocation.publish(seq.computed)

    def finish(self, seq: Sequence, reason: str) -> None:
        """`seq` is done: publish what it computed, release its pages, wake its caller."""
        seq.finish(reason)
        self._retire(seq)

    def fail(self, seq: Sequence, error: BaseException) -> None:
        """`seq` cannot go on: release its pages and hand its caller `error`. A sequence
        still copying is answered now; its pages are released when its copy returns (the
        copy thread writes into them until then)."""
        seq.error = error
        if seq.copying is not None:  # `_land_copies` retires it
            seq.done.set()
            return
        seq.finish("error")
        self._retire(seq)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop copying (the serving loop stopped): wait up to `timeout_s` for the copies
        in flight, then release the pages of the sequences they were for."""
        self._copies.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout_s
        for seq in [s for s in self.running if s.copying is not None]:
            # A copy cancelled before it started never touched the pages.
            if not seq.copying.cancelled():
                try:
                    seq.copying.exception(max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    log.warning("sequence %d: its copy did not end; pages held", seq.seq_id)
                    continue
            seq.copying = None
            self.running.remove(seq)
            if seq.error is None:
                seq.error = ServingStopped("this worker stopped serving during the copy")
            seq.finish("error")
            seq.allocation, allocation = None, seq.allocation
            allocation.release()
            seq.done.set()

    def fail_all(self, error: BaseException) -> None:
        """Fail every running and waiting sequence (the serving loop stops)."""
        for seq in list(self.running):
            self.fail(seq, error)
        with self._lock:
            waiting, self._waiting = [s for g in self._waiting for s in g], deque()
        for seq in waiting:
            self.fail(seq, error)

    def check_integrity(self) -> None:
        for seq in self.running:
            assert seq.phase in (Phase.COPYING, Phase.PREFILL, Phase.DECODE), (
                f"{seq.seq_id} runs as {seq.phase}"
            )
            assert (seq.phase is Phase.COPYING) == (seq.copying is not None), seq.seq_id
            assert seq.allocation is not None and not seq.allocation.released
            assert 0 <= seq.computed <= len(seq.tokens), (seq.computed, len(seq.tokens))
            if seq.kv is not None:
                seq.kv.check_integrity(seq.allocation.pages, seq.allocation.num_tokens)
        with self._lock:
            for group in self._waiting:
                for seq in group:
                    assert seq.phase is Phase.WAITING and seq.allocation is None

    # -- internals ---------------------------------------------------------------------

    def _end_overdue(self) -> None:
        """Fail the sequences that were cancelled or whose deadline passed."""
        now = time.perf_counter()
        with self._lock:
            waiting = [seq for group in self._waiting for seq in group]
        for seq in [*self.running, *waiting]:
            if seq.phase is Phase.FINISHED or (seq.copying is not None and seq.done.is_set()):
                continue  # answered already (a copy still to return)
            error = seq.ending or seq.overdue(now)
            if error is None:
                continue
            self.ended_by["cancelled" if isinstance(error, RequestCancelled) else "deadline"] += 1
            if seq.phase is Phase.WAITING:
                with self._lock:
                    self._unqueue(seq)
            self.fail(seq, error)

    def _unqueue(self, seq: Sequence) -> None:
        """Take a waiting sequence out of its group (the lock held)."""
        for group in self._waiting:
            if seq in group:
                group.remove(seq)
                if not group:
                    self._waiting.remove(group)
                return

    def _land_copies(self) -> None:
        """Sequences whose copy returned join the prefills (or, answered meanwhile,
        release their pages)."""
        for seq in [s for s in self.running if s.copying is not None and s.copying.done()]:
            future, seq.copying = seq.copying, None
            if seq.done.is_set():  # ended while copying: its caller has its error
                seq.finish("error")
                self._retire(seq)
                continue
            try:
                copied_to = future.result()
            except Exception:
                log.exception("sequence %d: its copy-in raised; it computes it all", seq.seq_id)
                copied_to = seq.computed
            seq.phase = Phase.PREFILL
            if seq.checks and copied_to > seq.computed:
                # Its copy is used by its first pass, which also runs the checks; its hits
                # are known once they are judged (`after_forward`).
                seq.unjudged = (seq.allocation.cached_tokens, copied_to)
                seq.computed = copied_to
                continue
            seq.checks = []
            self._admitted(seq, seq.allocation.cached_tokens, copied_to)

    def _copy(self, seq: Sequence) -> int:
        """A sequence's copy-in, on a copy thread; wakes the serving thread when done."""
        start = time.perf_counter()
        try:
            return self._copy_in(seq)
        finally:
            seq.copy_s = time.perf_counter() - start
            self.wake()

    def _prefill(self, step: Step, budget: int, sequences: list[Sequence] | None = None) -> int:
        """Add prefill chunks of `sequences` (default: every running one in prefill)."""
        chunk_size = self.config.prefill_chunk_tokens
        for seq in self.running if sequences is None else sequences:
            if budget <= 0:
                break
            if seq.phase is not Phase.PREFILL or seq in step.sequences or not seq.ready:
                continue
            end = len(seq.tokens)
            if chunk_size:
                end = min(end, (seq.computed // chunk_size + 1) * chunk_size)
            end = min(end, seq.computed + budget)
            step.sequences.append(seq)
            step.chunks.append(
                Chunk(seq.allocation.pages, seq.tokens[seq.computed : end], seq.computed, _kv(seq))
            )
            budget -= end - seq.computed
        return budget

    def _check(self, step: Step, seq: Sequence) -> None:
        """Add `seq`'s spot checks to the pass: each copied token to recompute is one more
        chunk of one token, over the pages up to its own (its KV goes into its slot)."""
        p = self.cache.page_tokens
        for check in seq.checks:
            pages = seq.allocation.pages[: check.pos // p + 1]
            step.chunks.append(Chunk(pages, seq.tokens[check.pos : check.pos + 1], check.pos))
            step.checks.append((seq, check))

    def _compact_under_pressure(self) -> None:
        """Compact the longest sequences in decode while the pages running sequences hold
        are past the high-water mark (see the module docstring)."""
        compactor = self.compactor
        if compactor is None:
            return
        config = compactor.config
        limit = config.high_water * self._total_pages
        if self.cache.pages_referenced() <= limit:
            return
        candidates = [
            seq
            for seq in self.running
            if seq.phase is Phase.DECODE
            and seq.kv is not None
            and seq.computed == len(seq.tokens)
            and seq.computed - seq.kv.tail_start >= config.min_tokens
        ]
        for seq in sorted(candidates, key=lambda s: (-len(s.tokens), s.seq_id)):
            result = compactor.compact(seq.allocation, seq.kv)
            self.compactions += 1
            self.compacted_pages_freed += result.pages_freed
            seq.compacted_pages_freed += result.pages_freed
            log.info(
                "compacted sequence %d (%d tokens, %s): %d of %d pages freed",
                seq.seq_id, len(seq.tokens), config.policy, result.pages_freed,
                result.pages_before,
            )  # fmt: skip
            if self.cache.pages_referenced() <= limit:
                break

    def _grow(self, seq: Sequence, step: Step) -> bool:
        """A page slot for the sequence's newest token, preempting the newest running
        sequences if need be; False when `seq` itself was preempted or finished."""
        while not seq.allocation.extend(seq.output[-1:]):
            # A sequence being copied into keeps its pages until its copy returns.
            victim = max(
                (s for s in self.running if s.phase is not Phase.COPYING), key=lambda s: s.seq_id
            )
            if victim is seq and len(self.running) == 1:
                self.finish(seq, "out_of_pages")
                return False
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, step: Step | None = None) -> None:
        """Release a running sequence's pages (and drop its chunk from `step`); it waits
        to be admitted again, first."""
        for other in list(self.running):
            if seq in other.depends_on and other.phase is Phase.PREFILL and not other.ready:
                self._preempt(other, step)  # it was waiting for pages `seq` has not computed
        if step is not None and seq in step.sequences:
            n = len(step.sequences)
            mine = [n + i for i, (s, _) in enumerate(step.checks) if s is seq]
            for at in reversed(mine):  # its spot checks' chunks, after every sequence's
                del step.chunks[at], step.checks[at - n]
            at = step.sequences.index(seq)
            del step.sequences[at], step.chunks[at]
        seq.unjudged, seq.checks = None, []  # admitted again: copied (and checked) again
        self.running.remove(seq)
        seq.allocation.release()
        seq.allocation = None
        seq.kv = None  # compacted or not, it is computed anew, whole
        seq.phase = Phase.WAITING
        seq.depends_on = []
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        with self._lock:
            self._waiting.appendleft([seq])

    def _admit_next(self) -> list[Sequence]:
        """Admit the oldest waiting group, or as much of it as fits; [] when nothing can
        be admitted now. Groups waiting behind it that could share its batch plan join
        it: requests that arrived apart (other callers, other front doors) but are
        admitted in the same step compute a prefix they share once, as if they had
        arrived together."""
        room = self.config.max_running - len(self.running)
        with self._lock:
            if not self._waiting:
                return []
            group = self._waiting.popleft()
            while self._waiting and len(group) < room and self._plannable(group + self._waiting[0]):
                group = group + self._waiting.popleft()
        group, rest = group[:room], group[room:]
        admitted = self._acquire(group)
        if len(admitted) < len(group):
            rest = group[len(admitted) :] + rest
        if rest:
            with self._lock:
                self._waiting.appendleft(rest)
        if not admitted and not self.running:
            # Nothing runs whose pages could come free: the head cannot fit at all.
            head = rest[0]
            with self._lock:
                self._waiting[0].remove(head)
                if not self._waiting[0]:
                    self._waiting.popleft()
            self.fail(
                head,
                CacheFull(
                    f"{len(head.to_compute)} tokens do not fit in "
                    f"{self.cache.stats()['total_pages']} pages of {self.cache.page_tokens} "
                    f"tokens, even with nothing else held"
                ),
            )
        return admitted

    def _acquire(self, group: list[Sequence]) -> list[Sequence]:
        """Pages for a group: one batch plan for its new sequences of one namespace when
        sharing is on, else one acquire each; stops at the first that does not fit."""
        if len(group) > 1 and self._plannable(group):
            entries = self.cache.acquire_batch([s.to_compute for s in group], group[0].namespace)
            if entries is not None:
                for seq, entry in zip(group, entries, strict=True):
                    deps = [group[i] for i in entry.depends_on]
                    self._start(seq, entry.allocation, entry.compute_from, deps)
                return group
        admitted = []
        for seq in group:
            allocation = self.cache.acquire(seq.to_compute, seq.namespace)
            if allocation is None:
                break
            self._start(seq, allocation, allocation.cached_tokens, [])
            admitted.append(seq)
        return admitted

    def _plannable(self, group: list[Sequence]) -> bool:
        """Whether one batch plan can admit `group`: sharing is on, and they are new
        sequences that reuse, of one namespace."""
        return (
            self.config.batch_sharing
            and all(s.reuse and s.preemptions == 0 for s in group)
            and len({s.namespace for s in group}) == 1
        )

    def _start(self, seq: Sequence, allocation, compute_from: int, deps: list[Sequence]) -> None:
        seq.allocation = allocation
        if self.compactor is not None:
            seq.kv = self.compactor.track(allocation)
        seq.phase = Phase.PREFILL
        seq.depends_on = deps
        seq.ready_from = compute_from if deps else 0
        seq.computed = compute_from
        self.running.append(seq)
        if seq.hits is not None:  # admitted again after a preemption
            seq.recomputed += len(seq.tokens) - seq.computed
            return
        seq.admitted_at = time.perf_counter()
        local = allocation.cached_tokens
        if deps:
            # Pages a sibling computes are not hits: they are computed, once.
            local = min(local, min(dep_start(seq, dep) for dep in deps))
        if seq.reuse and self._copy_in is not None and not deps:
            seq.phase = Phase.COPYING
            seq.copying = self._copies.submit(self._copy, seq)
            return
        self._admitted(seq, local, local)

    def _admitted(self, seq: Sequence, local: int, copied_to: int) -> None:
        """The first admission is complete (copies landed): what it reused, once and for
        all."""
        seq.computed = max(seq.computed, copied_to)
        seq.hits = (local, copied_to - local)
        seq.batch_shared = seq.ready_from - local if seq.depends_on else 0
        if self._on_admit is not None:
            self._on_admit(seq)

    def _retire(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        for other in list(self.running):
            if seq in other.depends_on and not other.ready:
                self._preempt(other)  # the pages it waited for will never be computed
        allocation, seq.allocation = seq.allocation, None
        seq.kv = None
        if allocation is not None:
            try:
                # A request ended early computed right KV as far as it got: kept.
                if seq.reuse and (seq.error is None or isinstance(seq.error, RequestEnded)):
                    allocation.publish(seq.computed)
            finally:
                allocation.release()
        if self._on_finish is not None:
            self._on_finish(seq)
        seq.done.set()


def _kv(seq: Sequence):
    """The compaction state a chunk of `seq` carries: only when its attention needs it."""
    return seq.kv if seq.kv is not None and seq.kv.needs_own_path else None


def dep_start(seq: Sequence, dep: Sequence) -> int:
    """Where the pages `dep` computes for `seq` begin: what `dep` itself found cached."""
    return dep.allocation.cached_tokens if dep.allocation is not None else 0
