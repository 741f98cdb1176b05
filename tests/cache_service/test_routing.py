"""Routing policies (`cache_service.routing`): kvmesh's estimate (what each worker would
compute, copy and wait for, against one another), round-robin, least-loaded and prefix
affinity, with exact decisions pinned; and the registry."""

from __future__ import annotations

import pytest

from cache_service.messages import RouteDecision
from cache_service.routing import (
    POLICIES,
    Candidate,
    EstimatedTtft,
    LeastLoaded,
    PrefixAffinity,
    RoundRobin,
    RouteInputs,
    WorkerLoad,
    candidates_of,
    make_policy,
)

# A CPU worker's proportions: a prompt token costs 2 ms, a copied one 10 us (same node)
# or 50 us (page server).
LOAD = WorkerLoad(prefill_s=2e-3, copy_s_same_node=1e-5, copy_s_remote=5e-5)


def candidates(*rows: tuple[str, str, float, int]) -> list[Candidate]:
    """Candidates from (worker id, node, queued tokens, running) rows."""
    return [
        Candidate(worker_id, node, queue, LOAD._replace(running=running))
        for worker_id, node, queue, running in rows
    ]


def route(cands, held=None, prompt=1000, pending=None, nodes=None, load_weight=1.0):
    inputs = RouteInputs(cands, prompt, held or {}, nodes or {}, pending or {}, load_weight)
    return EstimatedTtft().choose(inputs)


def test_with_nothing_cached_the_least_loaded_worker_computes_it():
    both = candidates(("a", "n1", 300, 0), ("b", "n1", 100, 0))
    assert route(both) == RouteDecision("b", 0, pytest.approx(2e-3 * 1100), "least_loaded")
    idle = candidates(("a", "n1", 0, 0), ("b", "n1", 0, 0))
    assert route(idle).worker_id == "a"  # a tie: the smallest id


def test_the_holder_wins_while_its_queue_is_shorter_than_copying_would_take():
    both = candidates(("a", "n1", 0, 0), ("b", "n1", 0, 0))
    held = {"a": 960}  # a holds 960 of the 1,000 tokens; b can copy them in 9.6 ms
    assert route(both, held, nodes={"a": "n1"}) == RouteDecision(
        "a", 960, pytest.approx(2e-3 * 40), "prefix"
    )
    # a has 10 prompt tokens queued (20 ms of work): copying (9.6 ms) is now cheaper.
    busy = candidates(("a", "n1", 10, 0), ("b", "n1", 0, 0))
    decision = route(busy, held, nodes={"a": "n1"})
    assert decision == RouteDecision("b", 0, pytest.approx(2e-3 * 40 + 1e-5 * 960), "copy")
    # 5 queued tokens (10 ms): within 5% of b's estimate, a tie: the holder keeps it.
    close = candidates(("a", "n1", 5, 0), ("b", "n1", 0, 0))
    assert route(close, held, nodes={"a": "n1"}).worker_id == "a"


def test_copying_across_nodes_costs_the_page_servers_rate():
    held = {"a": 960}
    nodes = {"a": "n1"}
    # b on another node would copy at 50 us a token (48 ms): a's 20 ms queue still wins.
    far = candidates(("a", "n1", 10, 0), ("b", "n2", 0, 0))
    assert route(far, held, nodes=nodes).worker_id == "a"
    near = candidates(("a", "n1", 10, 0), ("b", "n1", 0, 0))
    assert route(near, held, nodes=nodes).worker_id == "b"


def test_a_holder_that_is_not_a_candidate_can_still_be_copied_from():
    # x (not among the candidates: dead to this front door, or busy) holds the prefix.
    both = candidates(("a", "n1", 0, 0), ("b", "n2", 0, 0))
    decision = route(both, {"x": 800}, nodes={"x": "n2"})
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
    assert route(both, {"a": 960}, nodes={"a": "n1"}).worker_id == "b"


def test_decodes_ahead_cost_a_step_for_each_pass_the_prompt_shares_with_them():
    # a holds 960 of the prompt but runs 4 sequences with 200 decode steps left, 50 ms a
    # pass of decodes; b is idle and must copy the 960 tokens (9.6 ms) and compute 40.
    busy = LOAD._replace(running=4, decode_steps=200, step_s=0.05, pass_tokens=4096)
    both = [Candidate("a", "n1", 0, busy), Candidate("b", "n1", 0, LOAD)]
    # a's prompt needs one pass (40 tokens), which carries one decode step: 80 + 50 ms.
    assert route(both, {"a": 960}, nodes={"a": "n1"}) == RouteDecision(
        "b", 0, pytest.approx(2e-3 * 40 + 1e-5 * 960), "copy"
    )
    # With a queue of 8,000 tokens ahead, the queue and the prompt take 3 passes (4,096
    # tokens a pass), each with a decode step; but never more steps than are left.
    queued = Candidate("a", "n1", 8000, busy)
    decision = route([queued, Candidate("b", "n1", 9000, LOAD)], prompt=1000)
    assert decision == RouteDecision("a", 0, pytest.approx(2e-3 * 9000 + 0.05 * 3), "least_loaded")
    short = queued._replace(load=busy._replace(decode_steps=1))
    assert route([short], prompt=1000).score == pytest.approx(2e-3 * 9000 + 0.05 * 1)
    # A prompt chunked 256 tokens a pass takes 4 passes for its 1,000 tokens.
    chunked = Candidate("a", "n1", 0, busy._replace(chunk_tokens=256))
    assert route([chunked], prompt=1000).score == pytest.approx(2e-3 * 1000 + 0.05 * 4)


def test_a_busy_worker_that_copies_waits_a_pass_more_for_its_copy_to_land():
    # a holds 960 tokens and decodes (100 ms a pass); b decodes too and must copy them.
    busy = LOAD._replace(running=2, decode_steps=10, step_s=0.1, pass_tokens=4096)
    both = [Candidate("a", "n1", 0, busy), Candidate("b", "n1", 0, busy)]
    decision = route(both, {"a": 960}, nodes={"a": "n1"})
    assert decision == RouteDecision("a", 960, pytest.approx(2e-3 * 40 + 0.1), "prefix")
    # b's estimate: the same 40 tokens and decode step, the copy, and the pass after it.
    alone = route([both[1]], {"a": 960}, nodes={"a": "n1"})
    assert alone == RouteDecision("b", 0, pytest.approx(2e-3 * 40 + 0.1 + 9.6e-3 + 0.1), "copy")
    # An idle b starts its pass as soon as the copy lands: no pass to wait for.
    idle = Candidate("b", "n1", 0, LOAD._replace(step_s=0.1, pass_tokens=4096))
    assert route([idle], {"a": 960}, nodes={"a": "n1"}).score == pytest.approx(0.08 + 9.6e-3)


def test_an_idle_holder_wins_and_equal_costs_split_by_queue_then_id():
    idle = LOAD._replace(step_s=0.05, pass_tokens=4096)  # measured, nothing decoding
    both = [Candidate("a", "n1", 0, idle), Candidate("b", "n1", 0, idle)]
    assert route(both, {"a": 960}, nodes={"a": "n1"}) == RouteDecision(
        "a", 960, pytest.approx(2e-3 * 40), "prefix"
    )
    # The same prompt on two equal, idle workers holding nothing: the smallest id; with
    # one of them a few tokens behind (within the tie): the shorter queue.
    assert route(both).worker_id == "a"
    tied = [Candidate("a", "n1", 3, idle), Candidate("b", "n1", 0, idle)]
    assert route(tied).worker_id == "b"


def test_a_worker_that_measured_no_decode_pass_counts_a_token_per_running_sequence():
    unmeasured = LOAD._replace(running=40, decode_steps=500)
    assert route([Candidate("a", "n1", 0, unmeasured)]).score == pytest.approx(2e-3 * 1040)


def test_the_costs_are_the_candidates_median_so_noise_does_not_decide():
    """Two workers of one kind measured their prefill 2 ms and 3 ms a token: the holder
    still wins (its situation, not the noise of its measurement, decides)."""
    both = [
        Candidate("a", "n1", 0, LOAD._replace(prefill_s=3e-3)),
        Candidate("b", "n1", 0, LOAD),
    ]
    assert route(both, {"a": 960}, nodes={"a": "n1"}).worker_id == "a"


def test_the_queue_term_is_weighted_by_load_weight():
    both = candidates(("a", "n1", 50, 0), ("b", "n1", 0, 0))
    held = {"a": 960}
    assert route(both, held, nodes={"a": "n1"}, load_weight=1.0).worker_id == "b"
    assert route(both, held, nodes={"a": "n1"}, load_weight=0.0).worker_id == "a"


def test_a_prefix_on_disk_costs_its_read_but_never_more_than_computing_it():
    # a holds 960 of the 1,000 tokens, all on its disk; b holds 640, in host memory.
    held, nodes, host = {"a": 960, "b": 640}, {"a": "n1", "b": "n1"}, {"a": 0}

    def route_with(disk_s: float, held_host=host) -> RouteDecision:
        both = candidates(("a", "n1", 0, 0), ("b", "n1", 0, 0))
        both = [c._replace(load=c.load._replace(disk_s=disk_s)) for c in both]
        return EstimatedTtft().choose(RouteInputs(both, 1000, held, nodes, {}, 1.0, held_host))

    # A disk read of 1 ms a token: a reads 960 (0.96 s); b copies a's 320 tokens past
    # its own from a's disk, at a's read cost (0.32 s), and computes the same 40.
    assert route_with(1e-3) == RouteDecision(
        "b", 640, pytest.approx(2e-3 * 40 + 1e-5 * 320 + 1e-3 * 320), "prefix"
    )
    # A disk as fast as a copy: a's own disk is as good as b's host memory (a tie within
    # 5%: the worker holding more keeps it).
    assert route_with(1e-5) == RouteDecision(
        "a", 960, pytest.approx(2e-3 * 40 + 1e-5 * 960), "prefix"
    )
    # A disk slower than computing costs what computing costs (a worker then computes).
    assert route_with(1.0).score == pytest.approx(2e-3 * 40 + 1e-5 * 320 + 2e-3 * 320)
    # Without held_host every held token is in host memory, as before tiers.
    assert route_with(1e-3, held_host={}) == RouteDecision(
        "a", 960, pytest.approx(2e-3 * 40), "prefix"
    )


def test_reports_become_the_loads_routing_weighs():
    from cache_service.messages import EMPTY_REPORT, Observed, TierFigures
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
    disk = TierFigures("disk", 9, 512, 0, 0, 0, {}, 0, Observed((), 0.0), 900, 1, 0, {})
    reports.update("b", EMPTY_REPORT._replace(tiers=(disk,)))
    assert reports.loads()["b"] == WorkerLoad(disk_s=pytest.approx(9e-7))
    decoding = EMPTY_REPORT._replace(decode_steps=12, step_ns=40_000_000, pass_tokens=4096)
    reports.update("b", decoding._replace(chunk_tokens=256))
    assert reports.loads()["b"] == WorkerLoad(
        decode_steps=12, step_s=pytest.approx(0.04), pass_tokens=4096, chunk_tokens=256
    )


# ---- the other policies and the registry -------------------------------------------------


def test_round_robin_takes_each_in_turn_by_id_whatever_they_hold():
    policy = RoundRobin()
    cands = candidates(("b", "n1", 0, 0), ("a", "n1", 900, 9))
    inputs = RouteInputs(cands, 1000, held={"b": 960}, holder_nodes={"b": "n1"})
    chosen = [policy.choose(inputs) for _ in range(3)]
    assert [(d.worker_id, d.matched_tokens, d.reason) for d in chosen] == [
        ("a", 0, "round_robin"),
        ("b", 960, "round_robin"),
        ("a", 0, "round_robin"),
    ]
    assert not policy.uses_holdings


def test_least_loaded_takes_the_shortest_queue_then_fewest_running_then_id():
    policy = LeastLoaded()
    pick = lambda *rows: policy.choose(RouteInputs(candidates(*rows), 100)).worker_id  # noqa: E731
    assert pick(("a", "n1", 300, 0), ("b", "n1", 100, 5)) == "b"
    assert pick(("a", "n1", 100, 2), ("b", "n1", 100, 1)) == "b"
    assert pick(("b", "n1", 100, 1), ("a", "n1", 100, 1)) == "a"


def test_prefix_affinity_keeps_a_prefix_on_its_holder_while_loads_are_balanced():
    policy = PrefixAffinity(cache_threshold=0.5, balance_abs_tokens=1000, balance_rel=1.5)
    held = {"a": 640}
    # Balanced (a gap of 500 tokens): the longest match wins, though a is busier.
    balanced = candidates(("a", "n1", 600, 0), ("b", "n1", 100, 0))
    decision = policy.choose(RouteInputs(balanced, 1000, held))
    assert (decision.worker_id, decision.matched_tokens, decision.reason) == ("a", 640, "prefix")
    # Imbalanced (1,900 tokens apart, 20 times as much): the least loaded.
    imbalanced = candidates(("a", "n1", 2000, 0), ("b", "n1", 100, 0))
    decision = policy.choose(RouteInputs(imbalanced, 1000, held))
    assert (decision.worker_id, decision.reason) == ("b", "balance")
    # A match under the threshold (30% of the prompt) does not count: the least loaded.
    decision = policy.choose(RouteInputs(balanced, 1000, {"a": 300}))
    assert (decision.worker_id, decision.reason) == ("b", "least_loaded")
    # A prefix being computed for a request in flight counts as held (as SGLang's tree
    # counts a prompt from the moment it is routed).
    decision = policy.choose(RouteInputs(balanced, 1000, pending={"b": 800}))
    assert (decision.worker_id, decision.reason) == ("b", "prefix")


def test_prefix_affinity_refuses_thresholds_out_of_range():
    with pytest.raises(ValueError, match="cache_threshold"):
        PrefixAffinity(cache_threshold=1.5)
    with pytest.raises(ValueError, match="balance thresholds"):
        PrefixAffinity(balance_rel=0.5)


def test_the_registry_makes_each_policy_and_names_the_known_ones():
    assert sorted(POLICIES) == ["kvmesh", "least-loaded", "prefix-affinity", "round-robin"]
    for name in POLICIES:
        assert make_policy(name).name == name
    assert make_policy("round-robin") is not make_policy("round-robin")  # a place of its own
    with pytest.raises(ValueError, match="unknown routing policy 'random'; known: kvmesh, "):
        make_policy("random")


def test_candidates_are_the_registered_workers_their_reports_and_requests_sent_since():
    # A queue is what the worker reported and what the callers sent there since (the
    # report does not count those yet); one that reported nothing has only the latter.
    reported = {"a": WorkerLoad(queued_tokens=500), "b": WorkerLoad(queued_tokens=10)}
    nodes = {"a": "n1", "b": "n2", "c": "n1"}
    cands = candidates_of({"b": 100.0, "a": 100.0, "c": 30.0, "zz": 0.0}, nodes, reported)
    assert [(c.worker_id, c.node_id, c.queue) for c in cands] == [
        ("a", "n1", 600.0),
        ("b", "n2", 110.0),
        ("c", "n1", 30.0),
    ]  # zz is not registered: no candidate
    with pytest.raises(ValueError, match="load of worker 'a' must be finite"):
        candidates_of({"a": float("nan")}, nodes)
