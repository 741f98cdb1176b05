"""`kvmesh bench serve`'s parts that decide what is measured: the scaled trace and its
derivation, the workloads' jobs, the open loop's arrivals, each front door's share, and
the summary's ratios. (The benchmark itself runs the real model on fresh meshes: too
long for the suite; its figures are quoted from runs.)"""

from __future__ import annotations

import io
import json

import pytest

from benchmarks import serve
from benchmarks.replay import block_tokens
from benchmarks.serve_workload import jobs, requests_of, trace_jobs
from benchmarks.trace_scale import BLOCK_TOKENS, SCALED, conversations, infinite_hit_rate, scale

# A hand trace: block 0 shared by all; requests 0 -> 2 -> 4 are one conversation (each
# turn extends the one before), 1 -> 3 another, 5 alone.
HAND = [
    {"timestamp": 1000, "input_length": 1024, "output_length": 64, "hash_ids": [0, 1]},
    {"timestamp": 1100, "input_length": 900, "output_length": 1, "hash_ids": [0, 7]},
    {"timestamp": 1200, "input_length": 2000, "output_length": 300, "hash_ids": [0, 1, 2, 3]},
    {"timestamp": 1300, "input_length": 1500, "output_length": 33, "hash_ids": [0, 7, 8]},
    {"timestamp": 1400, "input_length": 2500, "output_length": 10, "hash_ids": [0, 1, 2, 3, 4]},
    {"timestamp": 1500, "input_length": 600, "output_length": 2, "hash_ids": [0, 9]},
]


def test_conversations_follow_turns_that_extend_earlier_ones():
    # Block 0 alone (the shared system block) joins no conversation.
    assert conversations(HAND) == {0: [0, 2, 4], 1: [1, 3], 5: [5]}


def test_scaling_keeps_whole_conversations_and_divides_every_length():
    # Two requests asked for: the first conversation drawn (with this seed, 1 -> 3) has
    # them; a conversation is never cut.
    assert scale(HAND, requests=2, seed=3) == [
        {"timestamp": 0, "input_length": 29, "output_length": 1, "hash_ids": [0, 1]},
        {"timestamp": 200, "input_length": 47, "output_length": 2, "hash_ids": [0, 1, 2]},
    ]
    three = scale(HAND, requests=3, seed=3)  # then the next drawn, 5 alone
    assert [len(v) for v in conversations(three).values()] == [2, 1]
    full = scale(HAND, requests=6, seed=3)
    assert [row["timestamp"] for row in full] == [0, 100, 200, 300, 400, 500]
    assert [row["input_length"] for row in full] == [32, 29, 63, 47, 79, 19]  # rounded up
    assert [row["output_length"] for row in full] == [2, 1, 10, 2, 1, 1]  # at least one
    # Hash ids renumbered in order of first use, the sharing kept.
    assert [row["hash_ids"] for row in full] == [[0, 1], [0, 2], [0, 1, 3, 4], [0, 2, 5]] + [
        [0, 1, 3, 4, 6],
        [0, 7],
    ]
    # Blocks hit: 0 + 1 + 2 + 2 + 4 + 1 of 18.
    assert infinite_hit_rate(full) == infinite_hit_rate(HAND) == pytest.approx(10 / 18)


def test_the_committed_scaled_trace_is_what_its_readme_says():
    rows = [json.loads(line) for line in SCALED.read_text().splitlines()]
    assert len(rows) == 64 and len(conversations(rows)) == 37
    assert infinite_hit_rate(rows) == pytest.approx(0.303, abs=0.001)
    seen = -1
    for row in rows:
        assert 0 < row["input_length"] <= len(row["hash_ids"]) * BLOCK_TOKENS
        assert row["output_length"] >= 1
        for h in row["hash_ids"]:  # renumbered: each new id is the next one
            assert h <= seen + 1
            seen = max(seen, h)


def test_trace_jobs_send_each_conversations_turns_in_order_as_the_blocks_tokens():
    chosen = jobs("trace")
    assert len(chosen) == 37 and requests_of(chosen) == 64
    first = chosen[0].turns[0]
    row = json.loads(SCALED.read_text().splitlines()[0])
    expected = [int(t) for h in row["hash_ids"] for t in block_tokens(h, BLOCK_TOKENS)]
    assert first.tokens == tuple(expected[: row["input_length"]])
    assert first.new_tokens == row["output_length"]
    assert chosen[0].system == ""
    # Every request starts with block 0's tokens: the prefix the whole trace shares.
    block0 = tuple(int(t) for t in block_tokens(0, BLOCK_TOKENS))
    assert all(turn.tokens[:BLOCK_TOKENS] == block0 for job in chosen for turn in job.turns)


def test_hand_trace_jobs(tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in scale(HAND, requests=6)))
    chosen = trace_jobs(path)
    assert [len(job.turns) for job in chosen] == [3, 2, 1]
    assert [len(turn.tokens) for turn in chosen[0].turns] == [32, 63, 79]


def test_the_demo_workload_is_the_demos_64_requests():
    chosen = jobs("demo")
    assert requests_of(chosen) == 64 and len(chosen) == 24 + 8
    assert sorted(len(job.turns) for job in chosen) == [1] * 24 + [5] * 8
    with pytest.raises(ValueError, match="known: demo, trace"):
        jobs("nope")


def test_open_loop_arrivals_are_a_seeded_poisson_process_at_the_request_rate():
    slow = serve._arrivals("trace", 1.0)
    assert slow == serve._arrivals("trace", 1.0)  # the same for every policy and repeat
    assert slow[0] == 0.0 and slow == sorted(slow) and len(slow) == 37
    fast = serve._arrivals("trace", 2.0)  # twice the rate: every gap halved
    assert fast == pytest.approx([at / 2 for at in slow], abs=1e-4)


def test_each_front_door_sends_every_other_job_with_half_the_clients():
    one = serve._plans(serve.Setup("demo", 1, 8, []))
    assert [(p.jobs, p.clients) for p in one] == [(list(range(32)), 8)]
    offsets = [float(i) for i in range(37)]
    two = serve._plans(serve.Setup("trace", 2, 0, offsets))
    assert two[0].jobs == list(range(0, 37, 2)) and two[1].jobs == list(range(1, 37, 2))
    assert two[1].offsets == [float(i) for i in range(1, 37, 2)] and two[1].clients == 0


def run_figures(key: str, rate: float, p99: float) -> dict:
    return {
        f"requests_per_s_{key}": rate,
        f"ttft_p50_{key}_s": p99 / 2,
        f"ttft_p99_{key}_s": p99,
        f"hit_rate_{key}": 0.5,
        f"requests_{key}": 64,
    }


def test_the_summary_weighs_kvmesh_against_the_best_other_and_the_best_without_the_mesh():
    runs = {
        "kvmesh_2fd": [(2.0, 1.0), (2.2, 1.2), (1.8, 0.8)],
        "rr_2fd": [(1.5, 2.0), (1.6, 1.5), (1.7, 2.5)],
        "ll_2fd": [(1.9, 3.0), (1.9, 3.0), (1.9, 3.0)],
        "kvmesh_solo_2fd": [(1.0, 4.0)] * 3,
        "rr_solo_2fd": [(1.25, 4.0)] * 3,
    }
    results = {k: [run_figures(k, r, p) for r, p in v] for k, v in runs.items()}
    figures = serve._summary(results, 3, serve.Setup("demo", 2, 8, []), "_2fd")
    assert figures["requests_per_s_kvmesh_2fd"] == 2.0  # medians
    assert figures["requests_per_s_kvmesh_2fd_runs"] == [2.0, 2.2, 1.8]
    assert figures["throughput_vs_best_2fd"] == round(2.0 / 1.9, 3)  # ll's rate
    assert figures["p99_vs_best_2fd"] == 0.5  # against rr's p99 of 2.0
    assert figures["mesh_gain_2fd"] == 1.6
    # Each repeat against the others' runs of the same repeat.
    assert figures["throughput_vs_best_2fd_runs"] == [round(2.0 / 1.9, 3), 1.158, 0.947]
    assert figures["p99_vs_best_2fd_runs"] == [0.5, 0.8, 0.32]
    assert figures["mesh_gain_2fd_runs"] == [1.6, 1.76, 1.44]
    assert figures["front_doors"] == 2 and figures["requests"] == 64


def test_the_second_front_doors_output_goes_to_the_log_only_when_it_is_a_file(tmp_path):
    assert serve._file_of(io.StringIO()) is None  # no descriptor: the child's own stderr
    with open(tmp_path / "log", "w") as log:
        assert serve._file_of(log) is log
