"""The routing estimate (`cache_service.index.routing`): what each worker would compute,
copy and wait for, against one another, with exact decisions pinned."""

from __future__ import annotations

import pytest

from cache_service.index.routing import Candidate, WorkerLoad, choose_worker
from cache_service.messages import RouteDecision

# A CPU worker's proportions: a prompt token costs 2 ms, a copied one 10 us (same node)
# or 50 us (page server).
LOAD = WorkerLoad(prefill_s=2e-3, copy_s_same_node=1e-5, copy_s_remote=5e-5)


def candidates(*rows: tuple[str, str, float, int]) -> dict[int, Candidate]:
    """slot -> Candidate from (worker id, node, queued tokens, running) rows."""
    return {
        slot: Candidate(worker_id, node, queue, LOAD._replace(running=running))
        for slot, (worker_id, node, queue, running) in enumerate(rows)
    }


def route(cands, held=None, prompt=1000, pending=None, nodes=None, load_weight=1.0):
    return choose_worker(cands, held or {}, prompt, load_weight, pending, nodes)


def test_with_nothing_cached_the_least_loaded_worker_computes_it():
    both = candidates(("a", "n1", 300, 0), ("b", "n1", 100, 0))
    assert route(both) == RouteDecision("b", 0, pytest.approx(2e-3 * 1100), "least_loaded")
    idle = candidates(("a", "n1", 0, 0), ("b", "n1", 0, 0))
    assert route(idle).worker_id == "a"  # a tie: the smallest id


def test_the_holder_wins_while_its_queue_is_shorter_than_copying_would_take():
    both = candidates(("a", "n1", 0, 0), ("b", "n1", 0, 0))
    held = {0: 960}  # a holds 960 of the 1,000 tokens; b can copy them in 9.6 ms
    assert route(both, held, nodes={0: "n1"}) == RouteDecision(
        "a", 960, pytest.approx(2e-3 * 40), "prefix"
    )
    # a has 10 prompt tokens queued (20 ms of work): copying (9.6 ms) is now cheaper.
    busy = candidates(("a", "n1", 10, 0), ("b", "n1", 0, 0))
    decision = route(busy, held, nodes={0: "n1"})
    assert decision == RouteDecision("b", 0, pytest.approx(2e-3 * 40 + 1e-5 * 960), "copy")
    # 5 queued tokens (10 ms): within 5% of b's estimate, a tie: the holder keeps it.
    close = candidates(("a", "n1", 5, 0), ("b", "n1", 0, 0))
    assert route(close, held, nodes={0: "n1"}).worker_id == "a"


def test_copying_across_nodes_costs_the_page_servers_rate():
    held = {0: 960}
    nodes = {0: "n1"}
    # b on another node would copy at 50 us a token (48 ms): a's 20 ms queue still wins.
    far = candidates(("a", "n1", 10, 0), ("b", "n2", 0, 0))
    assert route(far, held, nodes=nodes).worker_id == "a"
    near = candidates(("a", "n1", 10, 0), ("b", "n1", 0, 0))
    assert route(near, held, nodes=nodes).worker_id == "b"


def test_a_holder_that_is_not_a_candidate_can_still_be_copied_from():
    # Slot 5 (not among the candidates: dead to this front door, or busy) holds the prefix.
    both = candidates(("a", "n1", 0, 0), ("b", "n2", 0, 0))
    decision = route(both, {5: 800}, nodes={5: "n2"})
    assert decision == RouteDecision("b", 0, pytest.approx(2e-3 * 200 + 1e-5 * 800), "copy")


def test_a_prefix_being_computed_counts_for_the_worker_computing_it():
    both = candidates(("a", "n1", 200, 1), ("b", "n1", 0, 0))
    # Nothing is in the index yet, but a is computing 960 tokens of this prompt for a
    # request in flight: joining it there beats computing them again on b.
    decision = route(both, pending={"a": 960})
    assert decision.worker_id == "a" and decision.reason == "pending"
    assert route(both).worker_id == "b"  # without it, b


def test_running_sequences_slow_a_worker_down():
    # 40 sequences decoding on a: its prefill shares passes with 40 more tokens.
    both = candidates(("a", "n1", 0, 40), ("b", "n1", 0, 0))
    assert route(both, {0: 960}, nodes={0: "n1"}).worker_id == "b"


def test_the_costs_are_the_candidates_median_so_noise_does_not_decide():
    """Two workers of one kind measured their prefill 2 ms and 3 ms a token: the holder
    still wins (its situation, not the noise of its measurement, decides)."""
    both = {
        0: Candidate("a", "n1", 0, LOAD._replace(prefill_s=3e-3)),
        1: Candidate("b", "n1", 0, LOAD),
    }
    assert route(both, {0: 960}, nodes={0: "n1"}).worker_id == "a"


def test_the_queue_term_is_weighted_by_load_weight():
    both = candidates(("a", "n1", 50, 0), ("b", "n1", 0, 0))
    held = {0: 960}
    assert route(both, held, nodes={0: "n1"}, load_weight=1.0).worker_id == "b"
    assert route(both, held, nodes={0: "n1"}, load_weight=0.0).worker_id == "a"


def test_reports_become_the_loads_routing_weighs():
    from cache_service.messages import EMPTY_REPORT
    from cache_service.reports import WorkerReports

    reports = WorkerReports()
    reports.update("a", EMPTY_REPORT._replace(running=3, queued_tokens=120, prefill_ns=2_500_000))
    reports.update("b", EMPTY_REPORT)  # measured nothing yet: the defaults
    reports.update("gone", EMPTY_REPORT._replace(running=9))
    reports.departed("gone")
    loads = reports.loads()
    assert sorted(loads) == ["a", "b"]  # departed workers are no candidates
    assert loads["a"] == WorkerLoad(queued_tokens=120, running=3, prefill_s=pytest.approx(2.5e-3))
    assert loads["b"] == WorkerLoad()
