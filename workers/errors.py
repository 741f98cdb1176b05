"""The errors a request can end with, as its caller gets them (torch-free: the front door,
`workers.api` and the engine read them without the model).

Every request ends with its result or one of these (docs/structure.md walks the path):

    ServingStopped      the worker's serving loop is not running: nothing of the request
                        ran there (the front door routes it elsewhere), or what ran was
                        lost with the loop
    DeadlineExceeded    the request passed its deadline; the error names the phase it was
                        in and where its time went
    RequestCancelled    its caller left (a stream closed, abandoned or collected)

The last two are `RequestEnded`: the request's pages were released, and those it had
already published stay cached for the requests after it.
"""

from __future__ import annotations

from collections.abc import Mapping

# The phases a request's time is spent in, in order (DeadlineExceeded.spent's keys).
PHASES = ("queued", "copying", "prefill", "decode")


class KvmeshError(RuntimeError):
    """Something asked of a mesh cannot be done; the message says why and what to do."""


class ServingStopped(KvmeshError):
    """The worker is not serving: its serving loop stopped or failed (the front door routes
    the request elsewhere when nothing of it was handed over yet)."""


class RequestEnded(KvmeshError):
    """The request was ended before its result: it holds nothing any more."""


class DeadlineExceeded(RequestEnded):
    """A request passed its deadline (`requests.timeout_s`, or the call's `timeout_s`).

    Attributes:
        timeout_s: the deadline, in seconds from the call.
        phase: where the request was when it passed it: one of PHASES, or "unanswered"
            when the front door gave up on a worker that did not answer in time.
        spent: seconds spent in each phase of PHASES, as far as it got.
    """

    def __init__(self, timeout_s: float, phase: str, spent: Mapping[str, float] | None = None):
        self.timeout_s = float(timeout_s)
        self.phase = phase
        self.spent = {name: round(float(s), 3) for name, s in (spent or {}).items()}
        where = ", ".join(f"{name} {s:.2f}s" for name, s in self.spent.items()) or "unknown"
        super().__init__(
            f"the request passed its deadline of {self.timeout_s:g}s while {phase} "
            f"(time spent: {where}); raise requests.timeout_s or the call's timeout_s if "
            f"it needs longer"
        )

    def __reduce__(self):  # Ray carries it back from the worker by its arguments
        return type(self), (self.timeout_s, self.phase, self.spent)


class RequestCancelled(RequestEnded):
    """Its caller cancelled the request (a stream closed or abandoned early)."""
