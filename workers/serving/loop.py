"""The worker's serving thread: schedule a pass, run it, sample, finish, and again.

    submit(sequences) --> Scheduler.add          (any thread: a request's own)
    serving thread:   Scheduler.schedule -> BatchRunner.forward -> after_forward
                      -> sample each sequence whose chunk ended its tokens
                      -> finish on a stop token or max_new_tokens
    the request's thread waits on its sequence (`Sequence.result`)

One thread runs the model, so requests never contend for it: they queue in the scheduler,
which batches them (see `workers.serving.scheduler`).

What fails where:

- a pass that raises (the forward, its bookkeeping) fails the sequences of that pass; a
  sequence whose sampling or token callback raises fails alone. The loop goes on.
- the loop itself raising (scheduling, admission) fails everything queued or running and
  stops serving: `submit` refuses at once (ServingStopped), `health` says so, and after
  RESTART_DELAY_S the loop starts again in the same thread, at most MAX_RESTARTS times a
  RESTART_WINDOW_S; past that it stays down, refusing every request, until the worker is
  replaced. The front door routes around a worker that is not serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from workers.serving.batch_runner import BatchRunner
from workers.serving.health import ServingHealth, ServingStopped
from workers.serving.scheduler import Scheduler, Step
from workers.serving.sequence import Phase, Sequence

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.2  # how long the thread sleeps on an empty queue before looking again
# With work held but none runnable (copies in flight, pages short), how long before looking
# again without being woken (an arrival or a landed copy wakes it at once).
_NOTHING_TO_RUN_WAIT_S = 0.01
# A loop that fails is started again after a pause (a failure it hit again at once would
# otherwise spin), at most MAX_RESTARTS times within RESTART_WINDOW_S: a loop that keeps
# failing has a cause a restart does not cure, and a worker refusing at once is better
# than one failing every request after accepting it.
RESTART_DELAY_S = 1.0
MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0

__all__ = ["ServingLoop", "ServingStopped"]


class ServingLoop:
    """Runs `scheduler`'s passes on `runner` in a thread of its own.

    Args:
        runner: the batched forward pass.
        scheduler: which sequences run in each pass.
        name: the thread's name.
        on_pass: called after each pass with the step and its wall time (for figures).
    """

    def __init__(
        self,
        runner: BatchRunner,
        scheduler: Scheduler,
        name: str = "kvmesh-serving",
        on_pass: Callable[[Step, float], None] | None = None,
    ):
        self.runner = runner
        self.scheduler = scheduler
        self._on_pass = on_pass
        self._stop = threading.Event()
        # Held while a request is queued and while serving stops, so that no request is
        # queued after the loop failed everything it held (it would wait forever).
        self._gate = threading.Lock()
        self._serving = True
        self._failures: deque[float] = deque()  # when the loop failed, within the window
        self.restarts = 0
        self.last_failure = ""
        self._progress_at = time.monotonic()  # the last pass, or the last moment idle
        self._thread = threading.Thread(target=self._supervise, name=name, daemon=True)
        self._thread.start()

    def submit(self, sequences: Iterable[Sequence]) -> None:
        """Queue sequences that arrived together (see `Scheduler.add`).

        Raises:
            ServingStopped: the loop was stopped, or failed and has not started again.
        """
        with self._gate:
            if self._stop.is_set() or not self._serving:
                raise ServingStopped(self._why_not())
            self.scheduler.add(sequences)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the current pass; sequences still queued or running fail."""
        self._stop.set()
        self.scheduler.wake()
        self._thread.join(timeout_s)
        self.scheduler.close()

    @property
    def alive(self) -> bool:
        """Whether the loop serves now (False while it waits to restart, or for good)."""
        return self._serving and self._thread.is_alive()

    def health(self) -> ServingHealth:
        """Whether the loop serves, how often it failed, and how long queued work has
        waited for a pass (what the front door's watchdog checks)."""
        load = self.scheduler.load()
        busy = load["running"] or load["waiting"]
        return ServingHealth(
            serving=self.alive,
            restarts=self.restarts,
            last_failure=self.last_failure,
            stalled_s=time.monotonic() - self._progress_at if busy else 0.0,
        )

    def _why_not(self) -> str:
        if self._stop.is_set():
            return "this worker has stopped serving"
        if self._thread.is_alive():
            return f"this worker's serving loop failed and restarts ({self.last_failure})"
        return (
            f"this worker's serving loop failed {len(self._failures)} times within "
            f"{RESTART_WINDOW_S:g}s and stays down (last: {self.last_failure})"
        )

    def _supervise(self) -> None:
        """Serve; when the loop fails, fail what it held, and start it again unless it
        failed too often."""
        try:
            while not self._stop.is_set():
                try:
                    self._serve()
                except Exception as exc:
                    log.exception("the serving loop failed")
                    if not self._failed(exc):
                        return
                    if self._stop.wait(RESTART_DELAY_S):
                        return
                    with self._gate:
                        self._serving = True
                        self.restarts += 1
                    log.warning("the serving loop started again (restart %d)", self.restarts)
        finally:
            with self._gate:
                self._serving = False
                self.scheduler.fail_all(ServingStopped(self._why_not()))

    def _failed(self, exc: Exception) -> bool:
        """Stop serving after the loop raised `exc`: everything it held fails. Whether it
        may start again."""
        now = time.monotonic()
        with self._gate:
            self._serving = False
            self.last_failure = repr(exc)
            self._failures.append(now)
            while now - self._failures[0] > RESTART_WINDOW_S:
                self._failures.popleft()
            self.scheduler.fail_all(ServingStopped(f"the serving loop failed: {exc!r}"))
        return len(self._failures) <= MAX_RESTARTS

    def _serve(self) -> None:
        self._progress_at = time.monotonic()
        while not self._stop.is_set():
            if not self.scheduler.wait_for_work(_IDLE_WAIT_S):
                self._progress_at = time.monotonic()
                continue
            step = self.scheduler.schedule()
            if not step.chunks:
                # Everything waits on pages, copies or siblings: until one arrives or lands.
                self.scheduler.wait_for_change(_NOTHING_TO_RUN_WAIT_S)
                continue
            self._pass(step)

    def _pass(self, step: Step) -> None:
        start = time.perf_counter()
        try:
            logits = self.runner.forward(step.chunks)
            self.scheduler.after_forward(step)
        except Exception as exc:  # a bad pass fails its sequences, not the worker
            log.exception("a forward pass of %d sequences failed", len(step.sequences))
            for seq in step.sequences:
                if seq.phase is not Phase.FINISHED:
                    self.scheduler.fail(seq, exc)
            return
        self._progress_at = time.monotonic()
        if self._on_pass is not None:
            try:
                self._on_pass(step, time.perf_counter() - start)
            except Exception:  # figures only: never a request's failure
                log.exception("the pass callback failed")
        for seq, row in zip(step.sequences, logits[: len(step.sequences)], strict=True):
            if seq.phase is Phase.FINISHED or seq.computed < len(seq.tokens):
                continue  # a prefill chunk short of the end: nothing to sample yet
            try:
                if seq.phase is Phase.PREFILL:
                    if seq.return_logits and seq.logits is None:
                        seq.logits = row.clone()
                    seq.phase = Phase.DECODE
                self._sample(seq, row)
            except Exception as exc:  # NaN logits, a sampler's error: this sequence only
                log.exception("sampling sequence %d failed", seq.seq_id)
                if seq.phase is not Phase.FINISHED:
                    self.scheduler.fail(seq, exc)

    def _sample(self, seq: Sequence, logits) -> None:
        token = seq.sampler(logits)
        seq.output.append(token)
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        if seq.on_token is not None:
            try:
                seq.on_token(token)
            except Exception as exc:  # the consumer's error ends its request only
                self.scheduler.fail(seq, exc)
                return
        if token in seq.stops:
            self.scheduler.finish(seq, "stop")
        elif len(seq.output) >= seq.max_new_tokens:
            self.scheduler.finish(seq, "length")
