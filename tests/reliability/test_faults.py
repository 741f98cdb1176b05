"""The faults the benchmarks and tests inject (`benchmarks.faults`): each does what it
says to a worker in process, and `heal` puts the worker's parts back as they were."""

from __future__ import annotations

import pytest

from benchmarks import faults
from tests.waiting import call, wait_until
from workers.api import ServingStopped

PROMPT = [(3 * i + 1) % 250 + 1 for i in range(13)]


def parts(worker) -> dict[str, object]:
    return {
        "forward": worker.batch_runner.forward,
        "schedule": worker.scheduler.schedule,
        "get": worker.member.sources.get,
        "match": worker.member.client.match,
    }


def test_each_fault_acts_and_heal_undoes_them_all(worker):
    before = parts(worker)
    reference = call(worker.generate, PROMPT, 4)
    faults.failing_passes(worker, 1)
    with pytest.raises(faults.InjectedFault, match="injected: a forward pass failed"):
        call(worker.generate, PROMPT, 4)
    faults.nan_logits(worker, 1)  # replaces the failing passes (one fault per part)
    with pytest.raises(ValueError, match="NaN"):
        call(worker.generate, [t + 1 for t in PROMPT], 4)
    assert call(worker.generate, PROMPT, 4).token_ids == reference.token_ids
    faults.loop_failure(worker)
    with pytest.raises(ServingStopped, match="injected: the serving loop failed"):
        call(worker.generate, PROMPT, 4)
    wait_until(lambda: worker.health().restarts == 1, 10, "the loop to restart")
    faults.slow_peer(worker, 0.5)
    faults.slow_service(worker, 0.01)
    assert parts(worker) != before
    faults.heal(worker)
    assert parts(worker) == before
    assert call(worker.generate, PROMPT, 4).token_ids == reference.token_ids


def test_an_unknown_fault_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown fault 'flood'; known: slow_peer"):
        faults.install(object(), "flood")
