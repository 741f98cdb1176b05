"""`kvmesh bench copy` at a small scale: every path it measures moves the right bytes and
every figure is reported, so a change to the page server cannot break the benchmark
unnoticed."""

from __future__ import annotations

import io

import pytest

from benchmarks import copy

pytestmark = pytest.mark.slow


def test_a_small_run_reports_every_figure():
    log = io.StringIO()
    figures = copy.run(log=log, total_bytes=8 << 20, rounds=1)
    assert figures["pages"] == (8 << 20) // figures["page_bytes"]
    rates = [key for key in figures if key.endswith("_gbps")]
    assert sorted(rates) == [
        "raw_zmq_curve_gbps",
        "raw_zmq_gbps",
        "remote_copy_gbps",
        "remote_curve_gbps",
        "remote_signed_gbps",
        "shm_copy_gbps",
        "torch_copy_gbps",
    ]
    assert all(figures[key] > 0 for key in rates)
    for ratio in ("shm_ratio", "remote_ratio", "remote_signed_ratio", "remote_curve_ratio"):
        assert figures[ratio] > 0
    assert figures["curve_cost"] > 0
    assert list(figures)[-1] == "curve_cost"
    assert "across nodes" in log.getvalue()
