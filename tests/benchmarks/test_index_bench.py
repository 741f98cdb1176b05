"""`kvmesh bench index` at a small scale: the trace, the plan's ground truth, and the real
index replaying it, so that a change to the index cannot break the benchmark unnoticed."""

from __future__ import annotations

import io
import os

import pytest

from benchmarks import index

pytestmark = pytest.mark.slow


def test_the_plan_follows_who_holds_what():
    steps = index.plan([[1, 2, 3], [1, 2, 4], [1, 2, 3, 5], [1, 2, 3, 5]])
    assert [s.worker for s in steps] == [0, 1, 2, 3]
    assert steps[1].depths == {0: 2}  # worker 0 holds 1, 2, 3; the prompt is 1, 2, 4
    assert steps[1].event[0] is None and len(steps[1].event[1]) == 3  # worker 1 had nothing
    assert steps[3].depths == {0: 3, 1: 2, 2: 4}
    with pytest.raises(ValueError, match="two parents"):
        index.plan([[1, 2], [3, 2]])


def test_a_small_replay_reports_every_figure_with_exact_depths():
    before = os.sched_getaffinity(0)
    log = io.StringIO()
    figures = index.run(log=log, repeats=2, limit=400)
    assert os.sched_getaffinity(0) == before  # pinned for the run only
    assert figures["requests"] == 400 and 0 < figures["events"] <= 400
    assert figures["wrong_depths"] == 0
    assert figures["pages"] > 0 and figures["holdings"] >= figures["pages"]
    assert figures["queries_per_s"] > 0 and figures["events_per_s"] > 0
    assert 0 < figures["query_p50_us"] <= figures["query_p99_us"]
    assert 0 < figures["event_p50_us"] <= figures["event_p99_us"]
    assert "replay 1" in log.getvalue()
