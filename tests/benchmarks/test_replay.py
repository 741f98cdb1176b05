"""`kvmesh replay`: trace parsing, synthetic tokens, hit accounting, the CLI entry point."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import index as index_bench
from benchmarks import replay as rp
from benchmarks.replay import (
    TRACE_BLOCK_TOKENS,
    VOCAB,
    ReplayProgress,
    TraceRequest,
    add_arguments,
    block_tokens,
    load_trace,
    main,
    replay,
    request_tokens,
)

REAL_TRACE = Path(index_bench.TRACE)  # the Mooncake conversation trace, gzipped, in the repo
B = TRACE_BLOCK_TOKENS


def make_request(hash_ids: list[int], input_length: int | None = None) -> TraceRequest:
    length = len(hash_ids) * B if input_length is None else input_length
    return TraceRequest(0, length, 10, tuple(hash_ids))


def write_trace(path: Path, rows: list[dict | str]) -> Path:
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def row(hash_ids: list[int], input_length: int | None = None, timestamp: int = 0) -> dict:
    length = len(hash_ids) * B if input_length is None else input_length
    return {
        "timestamp": timestamp,
        "input_length": length,
        "output_length": 7,
        "hash_ids": hash_ids,
    }


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmesh replay")
    add_arguments(parser)
    return parser


# Three requests, two workers, 512-token pages:
#   r0  [1, 2]      1024 tokens
#   r1  [1, 2, 3]   1536 tokens   shares blocks 1, 2 with r0
#   r2  [1, 4, 5]   1500 tokens   shares block 1 (its last block is partial)
# round-robin: r0 -> w0, r1 -> w1 (cold: misses r0's 1024), r2 -> w0 (reuses block 1).
# prefix: r0 -> w0 (nothing cached, all idle: smallest id); r1 -> w0 (holds 1024 tokens,
# score 1024 - 0.5 * 1.0 * 1536 = 256 beats idle w1's 0); r2: w0 holds 512 but did all
# the recent work (512 - 0.5 * 1.0 * 1500 < 0), so idle w1 takes it and copies block 1 in.
HAND_TRACE = [make_request([1, 2]), make_request([1, 2, 3]), make_request([1, 4, 5], 1500)]
HAND_INPUT = 1024 + 1536 + 1500


# ---------------------------------------------------------------------------- tokens


def test_block_tokens_are_deterministic_and_distinct():
    first = block_tokens(7)
    assert first.dtype == np.int32 and first.shape == (B,)
    assert np.array_equal(first, block_tokens(7))
    assert not np.array_equal(first, block_tokens(8))
    assert first.min() >= 0 and first.max() < VOCAB
    # Pinned: a change of generator would silently change every replay figure.
    assert block_tokens(0)[:4].tolist() == [28704, 47238, 43278, 22486]
    assert block_tokens(1)[:4].tolist() == [19927, 13312, 26324, 25626]
    assert block_tokens(2**63 - 1, block_tokens=3).tolist() == [28850, 8037, 4962]


def test_block_tokens_spread_over_the_vocabulary():
    tokens = np.concatenate([block_tokens(h) for h in range(64)])
    assert len(np.unique(tokens)) > 0.45 * VOCAB  # 32k draws cover ~48% of 49k ids


def test_request_tokens_concatenate_blocks_and_truncate():
    tokens = request_tokens(make_request([3, 9, 4], 1100))
    assert tokens.shape == (1100,)
    assert np.array_equal(tokens[:B], block_tokens(3))
    assert np.array_equal(tokens[B : 2 * B], block_tokens(9))
    assert np.array_equal(tokens[2 * B :], block_tokens(4)[: 1100 - 2 * B])


@pytest.mark.parametrize("bad", [-1, 2**63, 1.5, True])
def test_block_tokens_rejects_bad_hash_ids(bad):
    with pytest.raises(ValueError, match="hash_id must be an integer"):
        block_tokens(bad)


# ---------------------------------------------------------------------------- trace


def test_load_trace_reads_lines_and_limit(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [row([1, 2], 1000, 5), "", row([1], 3, 9)])
    assert load_trace(path) == [
        TraceRequest(5, 1000, 7, (1, 2)),
        TraceRequest(9, 3, 7, (1,)),
    ]
    assert load_trace(path, limit=1) == [TraceRequest(5, 1000, 7, (1, 2))]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field 'hash_ids'"),
        (row([1], 0), "field 'input_length' must be an integer >= 1"),
        (row([1], True), "field 'input_length' must be an integer >= 1"),
        (row([1], 5, timestamp=-1), "field 'timestamp' must be a number >= 0"),
        ({**row([1], 5), "output_length": "3"}, "field 'output_length'"),
        (row([1, "2"], 600), "field 'hash_ids' must be a list of integers"),
        (row([1, -2], 600), "field 'hash_ids' must be a list of integers"),
        (row([1, 2], 513 * 2 + 1), "'hash_ids' has 2 blocks but input_length 1027 needs 3"),
        (row([1, 2, 3], 1024), "'hash_ids' has 3 blocks but input_length 1024 needs 2"),
    ],
)
def test_bad_trace_lines_name_line_and_field(tmp_path, line, message):
    path = write_trace(tmp_path / "t.jsonl", [row([1, 2]), line])
    with pytest.raises(ValueError, match=r"t\.jsonl:2: ") as error:
        load_trace(path)
    assert message in str(error.value)


def test_load_trace_rejects_bad_limit_and_missing_file(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [row([1])])
    with pytest.raises(ValueError, match="limit must be a positive integer"):
        load_trace(path, limit=0)
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.jsonl")


# ---------------------------------------------------------------------------- replay


def test_hand_trace_round_robin_misses_what_prefix_routing_hits():
    rr = replay(HAND_TRACE, workers=2, pages_per_worker=8, routing="round-robin")
    assert rr["hit_tokens"] == rr["local_hit_tokens"] == 512
    assert rr["remote_hit_tokens"] == 0
    assert rr["requests_per_worker"] == {"w0": 2, "w1": 1}
    assert rr["hit_rate"] == pytest.approx(512 / HAND_INPUT, abs=1e-6)

    prefix = replay(HAND_TRACE, workers=2, pages_per_worker=8, routing="prefix")
    # r0 computes blocks 1, 2 on w0. r1 finds w0 still busy with them (512 tokens over
    # the mean, in the replay's queue model): w1 copies blocks 1, 2 from w0 (a page copy
    # is ~200 times cheaper than computing it) and computes block 3. r2 goes to w1, which
    # now holds block 1 itself.
    assert prefix["remote_hit_tokens"] == 1024  # r1 on w1, blocks 1 and 2 copied
    assert prefix["local_hit_tokens"] == 512  # r2 on w1, block 1 its own
    assert prefix["hit_tokens"] == 1536
    assert prefix["computed_tokens"] == HAND_INPUT - 1536
    assert prefix["requests_per_worker"] == {"w0": 1, "w1": 2}
    assert prefix["computed_tokens_per_worker"] == {"w0": 1024, "w1": 512 + 1500 - 512}
    assert prefix["hit_rate"] == pytest.approx(1536 / HAND_INPUT, abs=1e-6)
    assert prefix["local_hit_rate"] == pytest.approx(512 / HAND_INPUT, abs=1e-6)
    assert prefix["remote_hit_rate"] == pytest.approx(1024 / HAND_INPUT, abs=1e-6)
    # Pages of blocks 1, 2 on w0; 1, 2 (copied in), 3 and 4 on w1; r2's partial last
    # page stays private.
    assert (prefix["index_pages"], prefix["index_holdings"]) == (4, 6)
    assert prefix["evicted_pages"] == 0

    for figures in (rr, prefix):
        assert figures["requests"] == 3
        assert figures["input_tokens"] == HAND_INPUT
        assert figures["infinite_hit_tokens"] == 1536  # one cache keeping everything
        assert figures["infinite_hit_rate"] >= figures["hit_rate"]
        assert figures["infinite_block_hit_rate"] == pytest.approx(3 / 8)
        assert figures["seconds"] >= figures["replay_seconds"] > 0
    assert prefix["vs_infinite"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "routing, per_worker, local, remote",
    [
        ("kvmesh", {"w0": 1, "w1": 2}, 512, 1024),  # as "prefix" above
        # Per-worker caches, nothing copied: only r1's blocks 1 and 2 hit, on w0.
        ("round-robin", {"w0": 2, "w1": 1}, 512, 0),
        # r1 to the idle w1, which copies blocks 1 and 2; r2 to w1, which holds block 1.
        ("least-loaded", {"w0": 1, "w1": 2}, 512, 1024),
        # r1 stays on w0, the holder, while loads are balanced (blocks 1 and 2 its own);
        # r2 goes to w1 once w0 is the busier, copying block 1.
        ("prefix-affinity", {"w0": 2, "w1": 1}, 1024, 512),
    ],
)
def test_every_registry_policy_replays_the_hand_trace(routing, per_worker, local, remote):
    figures = replay(HAND_TRACE, workers=2, pages_per_worker=8, routing=routing)
    assert figures["routing"] == routing
    assert figures["requests_per_worker"] == per_worker
    assert (figures["local_hit_tokens"], figures["remote_hit_tokens"]) == (local, remote)
    assert figures["computed_tokens"] == HAND_INPUT - local - remote


def test_small_pools_evict_least_recently_used_pages():
    # One worker of 3 pages: r2 needs 2 new pages, so the LRU leaves (blocks 3, 2) go.
    figures = replay(HAND_TRACE, workers=1, pages_per_worker=3, routing="round-robin")
    assert figures["evicted_pages"] == 2
    assert figures["hit_tokens"] == 1024 + 512
    assert figures["index_pages"] == 2  # blocks 1 and 4: the index saw the removals


def test_repeated_prompt_reuses_all_but_its_last_token():
    # The second [1, 2] reuses 1023 tokens (the last page by copy-on-write); the third,
    # cut to 700 tokens, reuses 699 through a partial copy of block 2's page.
    trace = [make_request([1, 2]), make_request([1, 2]), make_request([1, 2], 700)]
    for routing in ("round-robin", "prefix"):
        figures = replay(trace, workers=1, pages_per_worker=4, routing=routing)
        assert figures["hit_tokens"] == 1023 + 699
        assert figures["infinite_hit_tokens"] == 1023 + 699
        assert figures["remote_hit_tokens"] == 0


def test_remote_copy_leaves_the_last_token_to_compute():
    cluster = rp._Cluster(workers=2, pages_per_worker=4, page_tokens=B, load_window=8)
    tokens = request_tokens(make_request([1, 2]))
    packed = tokens.astype("<i4").tobytes()
    assert cluster.serve("w0", tokens, packed, copy_remote=True) == ("w0", 0, 0)
    # w1 holds nothing: all 1024 tokens are on w0, but the last one is computed anyway.
    assert cluster.serve("w1", tokens, packed, copy_remote=True) == ("w1", 0, 1023)
    # ... and now w1 holds the pages itself.
    assert cluster.serve("w1", tokens, packed, copy_remote=True) == ("w1", 1023, 0)
    # Computed: w0 1024 tokens, w1 1 + 1: w0's queue is what it did beyond the mean.
    assert cluster.loads() == {"w0": 1024 - 513, "w1": 0.0}
    cluster.check_integrity()


def test_smaller_pages_count_the_same_hits():
    figures = replay(HAND_TRACE, workers=2, pages_per_worker=200, routing="prefix", page_tokens=16)
    assert figures["infinite_hit_tokens"] == 1536
    assert figures["hit_tokens"] == 1536


def test_progress_callback_sees_both_phases_to_the_end():
    seen: list[ReplayProgress] = []
    replay(HAND_TRACE, workers=2, pages_per_worker=8, routing="prefix", progress=seen.append)
    finals = [p for p in seen if p.done == p.total]
    assert [(p.phase, p.done, p.total) for p in finals] == [("replay", 3, 3), ("infinite", 3, 3)]
    assert finals[0].hit_rate == pytest.approx(1536 / HAND_INPUT)


def test_progress_bar_writes_carriage_returns_to_stderr(capsys):
    replay(HAND_TRACE, workers=2, pages_per_worker=8, routing="prefix", progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "\rreplay" in captured.err and "3/3" in captured.err and "hit 0.378" in captured.err
    assert captured.err.endswith("\n")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"workers": 0}, "workers must be a positive integer, got 0"),
        ({"pages_per_worker": -3}, "pages_per_worker must be a positive integer"),
        ({"page_tokens": 0}, "page_tokens must be a positive integer"),
        ({"routing": "random"}, "unknown routing 'random'; known: prefix, kvmesh, round-robin"),
        (
            {"pages_per_worker": 2},
            "a request of the trace needs 3 pages of 512 tokens but a worker has only 2",
        ),
    ],
)
def test_bad_replay_arguments_raise(kwargs, message):
    args = {"workers": 2, "pages_per_worker": 8, "routing": "prefix"} | kwargs
    with pytest.raises(ValueError) as error:
        replay(HAND_TRACE, **args)
    assert message in str(error.value)


def test_empty_trace_is_an_error():
    with pytest.raises(ValueError, match="no requests"):
        replay([], workers=1, pages_per_worker=1, routing="prefix")


def test_real_trace_head_prefix_beats_round_robin():
    requests = load_trace(REAL_TRACE, limit=300)
    assert len(requests) == 300
    rr = replay(requests, workers=4, pages_per_worker=1000, routing="round-robin")
    prefix = replay(requests, workers=4, pages_per_worker=1000, routing="prefix")
    assert prefix["evicted_pages"] > 0 and rr["evicted_pages"] > 0
    assert prefix["hit_rate"] > 1.15 * rr["hit_rate"]
    assert prefix["infinite_hit_rate"] == rr["infinite_hit_rate"]
    for figures in (rr, prefix):
        assert figures["infinite_hit_rate"] >= figures["hit_rate"]
        assert figures["hit_tokens"] + figures["computed_tokens"] == figures["input_tokens"]
    # With room for everything, prefix routing loses nothing against one infinite cache.
    roomy = replay(requests, workers=4, pages_per_worker=4000, routing="prefix")
    assert roomy["evicted_pages"] == 0
    assert roomy["hit_rate"] >= 0.97 * roomy["infinite_hit_rate"]


def test_cluster_eviction_keeps_fewer_duplicates_on_the_real_trace():
    """Workers that evict first what a peer stored since (the index's notices) hold fewer
    copies of one page between them, and lose no hits for it."""
    requests = load_trace(REAL_TRACE, limit=3000)
    kw = dict(workers=4, pages_per_worker=600, routing="prefix")
    cluster = replay(requests, **kw)
    local = replay(requests, **kw, cluster_eviction=False)
    assert cluster["cluster_eviction"] and not local["cluster_eviction"]
    assert cluster["evicted_pages"] > 0
    duplicates = {
        f["cluster_eviction"]: f["index_holdings"] - f["index_pages"] for f in (cluster, local)
    }
    assert duplicates[True] * 4 < duplicates[False], duplicates
    assert cluster["hit_rate"] >= local["hit_rate"]


# ---------------------------------------------------------------------------- CLI


def test_main_prints_one_json_line_last(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", [row([1, 2]), row([1, 2, 3]), row([1, 4, 5], 1500)])
    args = make_parser().parse_args(
        [str(path), "--workers", "2", "--pages-per-worker", "8", "--routing", "prefix"]
    )
    assert main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("kvmesh replay: t.jsonl, 2 workers, prefix routing")
    assert len(lines) > 2
    figures = json.loads(lines[-1])
    assert figures["trace"] == str(path)
    assert figures["hit_tokens"] == 1536 and figures["requests"] == 3
    for key in ("hit_rate", "infinite_hit_rate", "local_hit_rate", "remote_hit_rate", "seconds"):
        assert key in figures


def test_main_json_and_limit(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", [row([1, 2]), row([1, 2, 3]), row([1, 4, 5], 1500)])
    argv = [str(path), "--workers", "1", "--pages-per-worker", "8", "--routing", "round-robin"]
    assert main(make_parser().parse_args([*argv, "--limit", "2", "--json"])) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 1
    figures = json.loads(lines[0])
    assert (figures["requests"], figures["hit_tokens"]) == (2, 1024)
    assert captured.err == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "0"], "argument --workers: expected a positive integer, got 0"),
        (["--pages-per-worker", "x"], "expected a positive integer, got 'x'"),
        (["--routing", "random"], "argument --routing: invalid choice: 'random'"),
        (["--page-tokens", "-16"], "argument --page-tokens: expected a positive integer"),
        (["--limit", "0"], "argument --limit: expected a positive integer, got 0"),
    ],
)
def test_bad_cli_arguments_are_usage_errors(capsys, argv, message):
    valid = ["trace.jsonl", "--workers", "2", "--pages-per-worker", "8", "--routing", "prefix"]
    with pytest.raises(SystemExit) as exit_info:
        make_parser().parse_args([*valid, *argv])  # the later value of an option wins
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_main_reports_missing_file_and_bad_trace(tmp_path, capsys):
    argv = ["--workers", "2", "--pages-per-worker", "8", "--routing", "prefix"]
    missing = tmp_path / "missing.jsonl"
    assert main(make_parser().parse_args([str(missing), *argv])) == 2
    assert f"trace file not found: {missing}" in capsys.readouterr().err

    bad = write_trace(tmp_path / "bad.jsonl", [row([1]), row([1, 2], 100)])
    assert main(make_parser().parse_args([str(bad), *argv])) == 2
    captured = capsys.readouterr()
    assert "bad.jsonl:2: field 'hash_ids' has 2 blocks" in captured.err
    assert captured.out == ""

    small = write_trace(tmp_path / "small.jsonl", [row([1, 2, 3])])
    assert main(make_parser().parse_args([str(small), *argv[:3], "2", *argv[4:]])) == 2
    assert "needs 3 pages" in capsys.readouterr().err
