"""The faults the benchmarks and the tests inject into a worker: one place, no switches.

A fault is a wrapper set on one of a worker's own parts, in the worker's process, around
the protocol that part already has (a page source's `fetch`, the batch runner's
`forward`, the scheduler's `schedule`, the service client's `match`); the worker's code
has no fault hooks and no setting that turns one on. In a Ray mesh a fault is installed
through the actor's `__ray_call__` (`install`), in process it is called on the worker.

    slow_peer(worker, s)        every page source the worker opens waits s per fetch
    slow_passes(worker, s)      every forward pass takes s more
    failing_passes(worker, n)   the next n forward passes raise
    nan_logits(worker, n)       the next n forward passes return NaN logits
    loop_failure(worker)        the scheduler raises once: the serving loop dies
    slow_service(worker, s)     the service answers each match s late (a slow service)
    poison(worker, salt, a, b)  its pages of prompt a hold prompt b's KV (a bad member;
                                not undone by heal: the store's bytes are changed)
    heal(worker)                every fault above removed

Each returns what the caller may watch (the slowed sources), and `heal` puts the parts
back as they were. One fault per part at a time: a second on the same part replaces the
first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

# Names of the fault installers `install` runs (in a worker's process).
FAULTS = ("slow_peer", "slow_passes", "failing_passes", "nan_logits", "loop_failure",
          "slow_service", "poison", "heal")  # fmt: skip


class InjectedFault(RuntimeError):
    """An error a fault raised on purpose (counted apart from real failures)."""


class SlowSource:
    """A page source (`workers.transfer.copy_in.PageSource`) whose fetches wait `seconds`
    first, as over a slow link; `in_flight` is set when a fetch starts, `returned` when
    one returns (at `returned_at`)."""

    def __init__(self, source: Any, seconds: float):
        self._source, self.seconds = source, seconds
        self.worker_id, self.node_id, self.remote = source.worker_id, source.node_id, source.remote
        self.in_flight, self.returned = threading.Event(), threading.Event()
        self.returned_at = 0.0  # time.perf_counter() when the last fetch returned

    def fetch(self, pages: Sequence[int], *args: Any) -> list[bool]:
        self.in_flight.set()
        time.sleep(self.seconds)
        try:
            return self._source.fetch(pages, *args)
        finally:
            self.returned_at = time.perf_counter()
            self.returned.set()

    def close(self) -> None:
        self._source.close()


def _replace(owner: Any, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]):
    """Set `owner.name` to `wrapper(original)`, remembering the original for `heal`."""
    originals = owner.__dict__.setdefault("_unfaulted", {})
    original = originals.setdefault(name, getattr(owner, name))
    setattr(owner, name, wrapper(original))


def _restore(owner: Any) -> None:
    for name, original in owner.__dict__.pop("_unfaulted", {}).items():
        setattr(owner, name, original)


def slow_peer(worker: Any, seconds: float) -> list[SlowSource]:
    """Every page source `worker` takes from now on waits `seconds` per fetch; returns
    the list the slowed sources are added to, as they are made."""
    made: list[SlowSource] = []

    def wrap(get: Callable[..., Any]) -> Callable[..., Any]:
        def slowed(peer: Any) -> SlowSource:
            made.append(SlowSource(get(peer), seconds))
            return made[-1]

        return slowed

    _replace(worker.member.sources, "get", wrap)
    return made


def slow_passes(worker: Any, seconds: float) -> None:
    """Every forward pass of `worker` takes `seconds` more."""

    def wrap(forward: Callable[..., Any]) -> Callable[..., Any]:
        def slowed(*args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return forward(*args, **kwargs)

        return slowed

    _replace(worker.batch_runner, "forward", wrap)


def failing_passes(worker: Any, count: int = 1) -> None:
    """The next `count` forward passes of `worker` raise InjectedFault (their sequences
    fail; the loop goes on)."""
    left = [count]

    def wrap(forward: Callable[..., Any]) -> Callable[..., Any]:
        def failing(*args: Any, **kwargs: Any) -> Any:
            if left[0] > 0:
                left[0] -= 1
                raise InjectedFault("injected: a forward pass failed")
            return forward(*args, **kwargs)

        return failing

    _replace(worker.batch_runner, "forward", wrap)


def nan_logits(worker: Any, count: int = 1) -> None:
    """The next `count` forward passes of `worker` return NaN logits (sampling fails
    their sequences, one by one)."""
    left = [count]

    def wrap(forward: Callable[..., Any]) -> Callable[..., Any]:
        def poisoned(*args: Any, **kwargs: Any) -> Any:
            logits = forward(*args, **kwargs)
            if left[0] > 0:
                left[0] -= 1
                logits = logits * float("nan")
            return logits

        return poisoned

    _replace(worker.batch_runner, "forward", wrap)


def loop_failure(worker: Any) -> None:
    """The scheduler raises InjectedFault once: the serving loop dies, fails what it held
    and restarts (workers.serving.loop)."""
    scheduler = worker.scheduler

    def wrap(schedule: Callable[..., Any]) -> Callable[..., Any]:
        def failing() -> Any:
            scheduler.schedule = schedule  # once
            raise InjectedFault("injected: the serving loop failed")

        return failing

    _replace(scheduler, "schedule", wrap)


def slow_service(worker: Any, seconds: float) -> None:
    """Each match `worker` asks the service answers `seconds` late (a service slow, not
    dead: the worker's copy-ins wait on it, its serving thread must not)."""

    def wrap(match: Callable[..., Any]) -> Callable[..., Any]:
        def slowed(*args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds)
            return match(*args, **kwargs)

        return slowed

    _replace(worker.member.client, "match", wrap)


def poison(worker: Any, salt: str, victim: list[int], source: list[int]) -> int:
    """The worker's cached pages of prompt `victim` (tenant salt `salt`) hold prompt
    `source`'s KV from now on, their generations and recorded digests untouched: a member
    serving pages that are not what it claims. Both prompts must be cached in full pages
    there; returns the pages poisoned."""
    from cache_service.events import Namespace

    namespace = Namespace(worker.model_name, "", salt)
    cache, store = worker.cache, worker.store
    held = [cache.acquire(list(tokens), namespace) for tokens in (victim, source)]
    try:
        n = min(a.cached_tokens for a in held) // cache.page_tokens
        for dst, src in zip(held[0].pages[:n], held[1].pages[:n], strict=True):
            store.page(dst).copy_(store.page(src))  # the bytes alone, behind the store's back
        return n
    finally:
        for allocation in held:
            allocation.release()


def heal(worker: Any) -> None:
    """Every fault removed: the parts are as they were."""
    for owner in (worker.member.sources, worker.batch_runner, worker.scheduler,
                  worker.member.client):  # fmt: skip
        _restore(owner)


def install(handle: Any, fault: str, *args: Any) -> Any:
    """Install `fault` (a name of FAULTS) in the worker actor `handle`'s process; returns
    the Ray reference of the call.

    Raises:
        ValueError: an unknown fault.
    """
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")
    return handle.__ray_call__.remote(_in_worker, fault, *args)


def _in_worker(worker: Any, fault: str, *args: Any) -> Any:
    return globals()[fault](worker, *args)
