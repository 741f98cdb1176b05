"""The worker's serving thread: schedule a pass, run it, sample, finish, and again.

    submit(sequences) --> Scheduler.add          (any thread: a request's own)
    serving thread:   Scheduler.schedule -> BatchRunner.forward -> after_forward
                      -> sample each sequence whose chunk ended its tokens
                      -> finish on a stop token or max_new_tokens
    the request's thread waits on its sequence (`Sequence.result`)

One thread runs the model, so requests never contend for it: they queue in the scheduler,
which batches them (see `workers.serving.scheduler`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from workers.serving.batch_runner import BatchRunner
from workers.serving.scheduler import Scheduler, Step
from workers.serving.sequence import Phase, Sequence

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.2  # how long the thread sleeps on an empty queue before looking again


class ServingStopped(RuntimeError):
    """The worker stopped serving before the request finished."""


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
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, sequences: Iterable[Sequence]) -> None:
        """Queue sequences that arrived together (see `Scheduler.add`).

        Raises:
            ServingStopped: the loop was stopped.
        """
        if self._stop.is_set():
            raise ServingStopped("this worker has stopped serving")
        self.scheduler.add(sequences)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop after the current pass; sequences still queued or running fail."""
        self._stop.set()
        self.scheduler.wake()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.scheduler.wait_for_work(_IDLE_WAIT_S):
                    continue
                step = self.scheduler.schedule()
                if not step.chunks:
                    time.sleep(0.001)  # everything waits on pages or siblings: let them come
                    continue
                self._pass(step)
        except BaseException as exc:  # the thread must not die silently: fail the callers
            log.exception("the serving loop stopped")
            self.scheduler.fail_all(ServingStopped(f"the serving loop failed: {exc!r}"))
            raise
        self.scheduler.fail_all(ServingStopped("this worker has stopped serving"))

    def _pass(self, step: Step) -> None:
        start = time.perf_counter()
        try:
            logits = self.runner.forward(step.chunks)
        except Exception as exc:  # a bad pass fails its sequences, not the worker
            log.exception("a forward pass of %d sequences failed", len(step.sequences))
            for seq in step.sequences:
                self.scheduler.fail(seq, exc)
            return
        self.scheduler.after_forward(step)
        if self._on_pass is not None:
            self._on_pass(step, time.perf_counter() - start)
        for seq, row in zip(step.sequences, logits, strict=True):
            if seq.phase is Phase.FINISHED or seq.computed < len(seq.tokens):
                continue  # a prefill chunk short of the end: nothing to sample yet
            if seq.phase is Phase.PREFILL:
                if seq.return_logits and seq.logits is None:
                    seq.logits = row.clone()
                seq.phase = Phase.DECODE
            self._sample(seq, row)

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
