"""What fails where on a worker's serving thread: a pass, a sequence, a copy-in, the loop.

A worker on the tiny model, in process, with a real service. Faults are test doubles set
on the worker's own parts (its runner, scheduler, member) for the test, never switches in
the worker. A request that hangs is a failure: every call here runs under a deadline
(`call`), and the module under pytest-timeout's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.waiting import call, wait_until
from tests.workers.conftest import make_worker
from workers.api import ServingStopped
from workers.service.client import ServiceError
from workers.serving import loop
from workers.serving.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)

PROMPT = [(5 * i + 2) % 250 + 1 for i in range(21)]


def once(real: Callable[..., Any], fault: Callable[..., Any]) -> Callable[..., Any]:
    """`real`, except that its first call runs `fault` instead."""
    calls = []

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return fault(*args, **kwargs) if len(calls) == 1 else real(*args, **kwargs)

    return wrapped


def raise_(error: BaseException) -> Callable[..., Any]:
    def fault(*args: Any, **kwargs: Any) -> Any:
        raise error

    return fault


def test_a_failure_after_the_forward_fails_that_pass_only(worker):
    scheduler = worker.scheduler
    scheduler.after_forward = once(scheduler.after_forward, raise_(RuntimeError("bookkeeping")))
    with pytest.raises(RuntimeError, match="bookkeeping"):
        call(worker.generate, PROMPT, 4)
    out = call(worker.generate, PROMPT, 4)  # the loop goes on
    assert len(out.token_ids) == 4
    health = worker.health()
    assert health.serving and health.restarts == 0 and health.last_failure == ""


def test_nan_logits_fail_their_request_only(worker):
    runner = worker.batch_runner

    def nan_forward(chunks, *args, **kwargs):
        return torch.full_like(real_forward(chunks, *args, **kwargs), math.nan)

    real_forward = runner.forward
    runner.forward = once(real_forward, nan_forward)
    sampled = worker.request(PROMPT, 4, sampling=SamplingParams(temperature=0.8, seed=1))
    with pytest.raises(ValueError, match="NaN"):
        call(worker.generate_batch, [sampled])
    out = call(worker.generate, PROMPT, 4)
    assert len(out.token_ids) == 4 and out.stats.local_hit_tokens > 0  # its pages were kept
    assert worker.health().serving and worker.health().restarts == 0


def test_a_loop_that_dies_refuses_at_once_then_serves_again(worker, monkeypatch):
    monkeypatch.setattr(loop, "RESTART_DELAY_S", 3.0)
    scheduler = worker.scheduler
    scheduler.schedule = once(scheduler.schedule, raise_(RuntimeError("scheduling broke")))
    with pytest.raises(ServingStopped, match="scheduling broke"):
        call(worker.generate, PROMPT, 4)  # in flight when the loop died
    health = worker.health()
    assert not health.serving and "scheduling broke" in health.last_failure
    with pytest.raises(ServingStopped, match="restarts"):
        call(worker.generate, PROMPT, 4)  # refused at once, never queued
    wait_until(lambda: worker.health().serving, 10, "the loop to start again")
    out = call(worker.generate, PROMPT, 4)
    assert len(out.token_ids) == 4
    assert worker.health().restarts == 1
    assert worker.stats().serving["restarts"] == 1


def test_a_loop_that_keeps_dying_stays_down(worker, monkeypatch):
    monkeypatch.setattr(loop, "RESTART_DELAY_S", 0.01)
    worker.scheduler.wait_for_work = raise_(RuntimeError("always"))
    wait_until(lambda: not worker.serving._thread.is_alive(), 10, "the loop to give up")
    health = worker.health()
    assert not health.serving and health.restarts == loop.MAX_RESTARTS
    with pytest.raises(ServingStopped, match="stays down"):
        call(worker.generate, PROMPT, 4)


def test_a_copy_in_that_raises_is_a_recompute(service):
    holder, copier = make_worker(service, "h"), make_worker(service, "c")
    try:
        infos = [holder.info(), copier.info()]
        holder.set_peers(infos)
        copier.set_peers(infos)
        expected = call(holder.generate, PROMPT, 4)
        assert holder.flush()
        member = copier.member
        member.copy_in = once(member.copy_in, raise_(OSError("the peer's segment vanished")))
        out = call(copier.generate, PROMPT, 4)
        assert out.token_ids == expected.token_ids
        assert out.stats.remote_hit_tokens == 0 and out.stats.computed_tokens == len(PROMPT)
        assert copier.stats().copy["failures"] == 1
        other = [t + 1 for t in PROMPT]
        call(holder.generate, other, 4)
        assert holder.flush()
        again = call(copier.generate, other, 4)  # the next copy-in runs as before
        assert again.stats.remote_hit_tokens == 20
        assert copier.health().serving
    finally:
        for w in (holder, copier):
            w.check_integrity()
            w.shutdown()


def test_a_service_that_refuses_the_match_is_a_miss(worker):
    client = worker.member.client
    client.match = raise_(ServiceError("unknown_worker", "refused"))
    out = call(worker.generate, PROMPT, 4)
    assert len(out.token_ids) == 4 and out.stats.remote_hit_tokens == 0
    assert worker.health().serving
