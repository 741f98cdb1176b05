"""`kvmesh bench chaos`, short: under killed workers, service restarts, lost event batches,
malformed frames, failing passes and loops, NaN logits, slow peers and a slow service, no
request fails without an injected fault, a deadline or a cancellation explaining it, none
hangs or is answered wrong, abandoned streams free their pages, nothing leaks, and reuse
comes back after recovery.

The benchmark runs in a process of its own: it starts its own simulated Ray cluster, and
this test process may already hold a Ray connection from other modules' fixtures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SECONDS = 20  # of workload; the start, every kind of fault once, recovery and shutdown
# add about a minute and a half
TIMEOUT_S = 300
STOP_TIMEOUT_S = 60
KEYS = (
    "requests",
    "failed_requests",
    "hung_requests",
    "deadline_exceeded",
    "explained_failures",
    "wrong_outputs",
    "faults_injected",
    "faults",
    "loop_failures_injected",
    "cancelled_requests",
    "pages_held_by_cancelled",
    "malformed_frames",
    "leaked_pages",
    "leaked_shm_segments",
    "hit_rate_before",
    "hit_rate_after_recovery",
    "outage_slowdown",
)


@pytest.fixture(scope="module")
def figures() -> dict:
    env = {**os.environ, "KVMESH_CHAOS_SECONDS": str(SECONDS)}
    command = [sys.executable, "-m", "cluster.cli", "bench", "chaos", "--json"]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        out, err = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGINT, not SIGKILL: the benchmark's cleanup stops the Ray cluster it started.
        process.send_signal(signal.SIGINT)
        try:
            _, err = process.communicate(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
        pytest.fail(f"the benchmark ran over {TIMEOUT_S}s:\n{err[-4000:]}")
    assert process.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def test_it_reports_every_figure(figures):
    assert set(KEYS) <= set(figures)
    assert list(figures)[: len(KEYS)] == list(KEYS)
    assert figures["requests"] > 0


def test_no_request_fails_unexplained_hangs_or_is_answered_wrong(figures):
    assert figures["failed_requests"] == 0, figures["errors"]
    assert figures["hung_requests"] == 0
    assert figures["wrong_outputs"] == 0


def test_no_request_with_the_default_deadline_passes_it(figures):
    assert figures["deadline_exceeded"] == 0, figures["explained_failures"]


def test_every_kind_of_fault_was_injected(figures):
    faults = figures["faults"]
    assert figures["faults_injected"] >= 12
    kinds = (
        "worker_kill",
        "service_restart",
        "event_drop",
        "worker_forgotten",
        "malformed",
        "pass_failure",
        "loop_failure",
        "nan_logits",
        "slow_peer",
        "slow_service",
        "abandoned_streams",
        "short_deadline",
    )
    assert [kind for kind in kinds if faults.get(kind, 0) < 1] == []
    assert figures["loop_failures_injected"] >= 1


def test_abandoned_streams_are_cancelled_and_hold_no_pages(figures):
    assert figures["cancelled_requests"] >= 1
    assert figures["abandoned_not_cancelled"] == 0
    assert figures["pages_held_by_cancelled"] == 0


def test_malformed_frames_are_answered_or_dropped_and_the_service_keeps_serving(figures):
    assert figures["malformed_frames"] > 0
    assert figures["malformed_unexpected"] == 0, figures["unexpected_replies"]
    assert figures["malformed_answered"] > 0
    assert figures["unresponsive_after_malformed"] == 0


def test_nothing_leaks(figures):
    assert figures["leaked_pages"] == 0
    assert figures["pages_in_use_at_end"] == 0
    assert figures["leaked_shm_segments"] == 0
    assert figures["integrity_errors"] == []
    assert figures["index_mismatched_workers"] == []


def test_reuse_comes_back_after_recovery(figures):
    assert figures["workers_live_at_end"] == 3
    assert figures["hit_rate_before"] > 0.5
    assert figures["hit_rate_after_recovery"] >= 0.9 * figures["hit_rate_before"]


def test_a_service_restart_costs_a_request_little(figures):
    # Loose: a restart costs the first request of each client one timeout, then requests
    # skip the service; the median is that of the fast ones.
    assert figures["restart_requests"] > 0
    assert figures["restart_slowdown"] <= 3.0


def test_a_stopped_service_costs_a_request_little(figures):
    # Request-path clients skip a silent service after one missed reply and never probe
    # it themselves (the heartbeat and the watchdog do): requests run on local caches.
    assert figures["outage_requests"] > 0
    assert figures["outage_slowdown"] <= 1.5
