"""`kvmesh bench lookup` end to end at a small scale: the harness, the real server and
the echo, so that a change to the service or the codec cannot break the benchmark
unnoticed."""

from __future__ import annotations

import io

import pytest

from benchmarks import lookup

pytestmark = pytest.mark.slow


def test_a_small_run_reports_every_figure():
    log = io.StringIO()
    figures = lookup.run(log=log, prompts=200, phase_s=0.3)
    pages_per_prompt = (lookup.PROMPT_TOKENS - lookup.SYSTEM_TOKENS) // lookup.PAGE_TOKENS
    system_pages = lookup.SYSTEM_PROMPTS * lookup.SYSTEM_TOKENS // lookup.PAGE_TOKENS
    assert figures["pages_indexed"] == system_pages + 200 * pages_per_prompt
    assert figures["prompts"] == 200 and figures["clients"] == lookup.CLIENTS
    for setting in ("", "_plain"):  # CurveZMQ as deployed, then plain text
        lookups, echo = figures[f"lookups_per_s{setting}"], figures[f"echo_per_s{setting}"]
        assert lookups > 0 and echo > 0
        assert figures[f"ratio{setting}"] == round(lookups / echo, 3)
        assert 0 < figures[f"p50_us{setting}"] <= figures[f"p99_us{setting}"]
        assert 0 < figures[f"echo_p50_us{setting}"] <= figures[f"echo_p99_us{setting}"]
    assert figures["bytes_per_page"] > 0 and figures["inprocess_pages_per_s"] > 0
    assert "building an index of 200 prompts of 2048 tokens (plain)" in log.getvalue()
    assert "(authenticated (CurveZMQ))" in log.getvalue()
