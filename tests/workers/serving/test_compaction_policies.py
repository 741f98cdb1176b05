"""Compaction policies (`workers.serving.compaction.policies`): exact kept sets on hand-built
streams for StreamingLLM, H2O and SnapKV, AdaKV's per-layer budgets, Budget parsing, the
registry, and a randomized check of the uniform policies against a plain-Python model."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator

import pytest
import torch

from workers.serving.compaction.config import Budget
from workers.serving.compaction.policies import (
    COMPACTION_POLICIES,
    Candidates,
    CompactionPolicy,
    H2oPolicy,
    SnapKvPolicy,
    StreamingLlmPolicy,
    make_compaction_policy,
    register_compaction_policy,
)

BUILTIN = {"streaming_llm", "h2o", "snapkv"}
PAD_POSITION = 10**6  # what padding holds: a policy that kept it would show it at once

Streams = list[list[list[float]]]  # [layer][head] -> one value per candidate


def make_candidates(
    positions: list[list[list[int]]],
    accumulated: Streams | None = None,
    window: Streams | None = None,
    *,
    n: int | None = None,
    window_queries: int = 0,
    next_position: int | None = None,
    pad_score: float = 0.0,
) -> Candidates:
    """Candidates from per-stream lists, padded at the end to n (default: the longest)."""
    layers, heads = len(positions), len(positions[0])
    n = n if n is not None else max(len(s) for layer in positions for s in layer)

    def fill(streams: Streams | None, pad: float, dtype: torch.dtype) -> torch.Tensor:
        out = torch.full((layers, heads, n), pad, dtype=dtype)
        for l_, layer in enumerate(streams or []):
            for h, stream in enumerate(layer):
                out[l_, h, : len(stream)] = torch.tensor(stream, dtype=dtype)
        return out

    pos = fill(positions, PAD_POSITION, torch.long)
    valid = fill([[[1] * len(s) for s in layer] for layer in positions], 0, torch.bool)
    if next_position is None:
        next_position = max((max(s) for layer in positions for s in layer if s), default=-1) + 1
    return Candidates(
        positions=pos,
        valid=valid,
        accumulated=fill(accumulated, pad_score, torch.float32).masked_fill(~valid, pad_score),
        window=fill(window, pad_score, torch.float32).masked_fill(~valid, pad_score),
        window_queries=window_queries,
        next_position=next_position,
    )


def kept_positions(candidates: Candidates, kept: torch.Tensor) -> list[list[list[int]]]:
    """The kept positions of each stream, ascending."""
    assert kept.dtype == torch.bool and kept.shape == candidates.positions.shape
    assert not (kept & ~candidates.valid).any(), "kept padding"
    layers, heads, _ = kept.shape
    return [
        [sorted(candidates.positions[l_, h][kept[l_, h]].tolist()) for h in range(heads)]
        for l_ in range(layers)
    ]


def select(
    policy: CompactionPolicy, candidates: Candidates, keep: list[list[int]]
) -> list[list[list[int]]]:
    return kept_positions(candidates, policy.select(candidates, torch.tensor(keep)))


# --- StreamingLLM -------------------------------------------------------------------------


def test_streaming_llm_sinks_outside_candidates_keeps_the_newest():
    # After a prefix-cache hit the candidates start at position 10: no sinks among them.
    c = make_candidates([[list(range(10, 18)), list(range(10, 15))]])
    assert select(StreamingLlmPolicy(), c, [[3, 2]]) == [[[15, 16, 17], [13, 14]]]
    assert select(StreamingLlmPolicy(), c, [[0, 5]]) == [[[], [10, 11, 12, 13, 14]]]


def test_streaming_llm_sinks_inside_candidates_come_first():
    c = make_candidates([[[0, 1, 2, 3, 8, 9, 10, 11], [2, 3, 4, 5, 6, 7, 8, 9]]])
    assert select(StreamingLlmPolicy(sinks=2), c, [[5, 4]]) == [[[0, 1, 9, 10, 11], [6, 7, 8, 9]]]
    # Default 4 sinks: the second stream holds sinks 2 and 3 only.
    assert select(StreamingLlmPolicy(), c, [[5, 4]]) == [[[0, 1, 2, 3, 11], [2, 3, 8, 9]]]
    # More sinks than budget: the earliest sinks win.
    assert select(StreamingLlmPolicy(sinks=4), c, [[3, 1]]) == [[[0, 1, 2], [2]]]
    assert select(StreamingLlmPolicy(sinks=0), c, [[2, 2]]) == [[[10, 11], [8, 9]]]


# --- H2O ----------------------------------------------------------------------------------

HEAVY = [5.0, 0.1, 3.0, 0.2, 4.0, 0.3, 0.5, 0.4]  # heavy hitters at positions 0, 4, 2


def test_h2o_splits_recent_and_heavy_hitters():
    c = make_candidates([[list(range(8))]], [[HEAVY]])
    assert select(H2oPolicy(), c, [[4]]) == [[[0, 4, 6, 7]]]
    assert select(H2oPolicy(recent=0.0), c, [[3]]) == [[[0, 2, 4]]]
    assert select(H2oPolicy(recent=1.0), c, [[3]]) == [[[5, 6, 7]]]
    assert select(H2oPolicy(recent=0.25), c, [[4]]) == [[[0, 2, 4, 7]]]


def test_h2o_recent_count_rounds_half_to_even():
    c = make_candidates([[list(range(8))]], [[HEAVY]])
    assert select(H2oPolicy(), c, [[5]]) == [[[0, 2, 4, 6, 7]]]  # round(2.5) = 2 recent
    assert select(H2oPolicy(), c, [[3]]) == [[[0, 6, 7]]]  # round(1.5) = 2 recent


def test_h2o_with_padding_and_layers():
    c = make_candidates(
        [[[3, 5, 6, 9, 12], list(range(8))], [[1, 2], [0, 4, 7]]],
        [[[9, 1, 8, 1, 1], HEAVY], [[1, 2], [3, 2, 1]]],
        n=8,
        pad_score=100.0,  # padding's scores must not count
    )
    kept = select(H2oPolicy(), c, [[3, 2], [2, 1]])
    assert kept == [[[3, 9, 12], [0, 7]], [[1, 2], [0]]]


def test_ties_go_to_the_more_recent_candidate():
    c = make_candidates([[list(range(8)), [1, 3, 5, 7, 9]]], [[[2, 1, 2, 1, 2, 0, 0, 0], [1] * 5]])
    assert select(H2oPolicy(recent=0.0), c, [[2, 3]]) == [[[2, 4], [5, 7, 9]]]
    assert select(H2oPolicy(recent=0.0, adaptive=True), c, [[2, 3]]) == [[[0, 2, 4], [7, 9]]]
    snap = make_candidates(
        [[list(range(8))]], window=[[[1] * 8]], window_queries=1, next_position=20
    )
    assert select(SnapKvPolicy(), snap, [[3]]) == [[[5, 6, 7]]]


# --- SnapKV -------------------------------------------------------------------------------

# Window scores for positions 0..7; with next_position 8 and 2 window queries, positions 6
# and 7 are the observation window. Pooled over 3 (valid neighbours only):
#   max: [4, 9, 9, 9, 3, 3, 3, 2]    avg: [2, 4.33, 3, 3, 1, 1.33, 2, 1.5]
WINDOW = [4.0, 0.0, 9.0, 0.0, 0.0, 3.0, 1.0, 2.0]


def test_snapkv_max_and_avg_pooling():
    c = make_candidates([[list(range(8))]], window=[[WINDOW]], window_queries=2)
    assert select(SnapKvPolicy(kernel=3), c, [[4]]) == [[[2, 3, 6, 7]]]
    assert select(SnapKvPolicy(kernel=3, pooling="avg"), c, [[4]]) == [[[1, 3, 6, 7]]]
    assert select(SnapKvPolicy(kernel=1), c, [[4]]) == [[[0, 2, 6, 7]]]
    assert select(SnapKvPolicy(kernel=3), c, [[6]]) == [[[0, 1, 2, 3, 6, 7]]]


def test_snapkv_keeps_the_window_newest_first():
    c = make_candidates([[list(range(8))]], window=[[WINDOW]], window_queries=4)
    assert select(SnapKvPolicy(kernel=3), c, [[2]]) == [[[6, 7]]]
    assert select(SnapKvPolicy(kernel=3), c, [[5]]) == [[[3, 4, 5, 6, 7]]]
    # The window lies past the candidates (they end well before the last queries).
    far = make_candidates([[list(range(8))]], window=[[WINDOW]], window_queries=4, next_position=50)
    assert select(SnapKvPolicy(kernel=1), far, [[2]]) == [[[0, 2]]]


def test_snapkv_pooling_ignores_padding():
    # Positions 0..4 valid, 3 padding entries holding 100 (if they leaked, position 3's
    # pooled score would win). Position 4 is the window.
    for pad in (0.0, 100.0):
        c = make_candidates(
            [[list(range(5))]],
            window=[[[1.0, 0.0, 0.0, 0.0, 0.0]]],
            n=8,
            window_queries=1,
            pad_score=pad,
        )
        # max over 5: [1, 1, 1, 0]: the newest of the tied 1s.
        assert select(SnapKvPolicy(kernel=5), c, [[2]]) == [[[2, 4]]]
    c = make_candidates(
        [[list(range(5))]], window=[[[1.0, 0.0, 0.0, 0.0, 5.0]]], n=8, window_queries=1
    )
    # avg over the valid entries under a kernel of 5: position 2: 6/5, position 3: 5/4
    # (counting padding as zeros would make it 5/5 and lose to position 2).
    assert select(SnapKvPolicy(kernel=5, pooling="avg"), c, [[2]]) == [[[3, 4]]]


def test_snapkv_without_a_window_is_refused():
    c = make_candidates([[list(range(8))]], window=[[WINDOW]], window_queries=0)
    with pytest.raises(ValueError, match="observation window"):
        SnapKvPolicy().select(c, torch.tensor([[4]]))


def test_policies_read_only_the_scores_they_need():
    c = make_candidates([[list(range(8))]], [[HEAVY]], [[WINDOW]], window_queries=2)
    empty = torch.empty(0)
    assert select(H2oPolicy(), c._replace(window=empty), [[4]]) == [[[0, 4, 6, 7]]]
    assert select(SnapKvPolicy(kernel=3), c._replace(accumulated=empty), [[4]]) == [[[2, 3, 6, 7]]]
    assert select(StreamingLlmPolicy(), c._replace(accumulated=empty, window=empty), [[2]]) == [
        [[0, 1]]
    ]
    with pytest.raises(ValueError, match="accumulated"):
        H2oPolicy().select(c._replace(accumulated=empty), torch.tensor([[4]]))
    assert StreamingLlmPolicy.needs == frozenset()
    assert H2oPolicy.needs == frozenset({"accumulated"})
    assert SnapKvPolicy.needs == frozenset({"window"})


@pytest.mark.parametrize("n", [0, 3])
def test_streams_without_valid_candidates_keep_nothing(n):
    c = make_candidates([[[], []]], n=n, window_queries=2, next_position=5)
    keep = Budget(fraction=0.5).counts(c.valid)
    for policy in (
        StreamingLlmPolicy(),
        H2oPolicy(),
        H2oPolicy(adaptive=True),
        SnapKvPolicy(),
        SnapKvPolicy(pooling="avg", adaptive=True),
    ):
        assert select(policy, c, keep.tolist()) == [[[], []]]


def test_bad_inputs_are_refused():
    c = make_candidates([[list(range(8))]], [[HEAVY]])
    with pytest.raises(ValueError, match="keep must be"):
        H2oPolicy().select(c, torch.tensor([4]))
    with pytest.raises(ValueError, match=">= 0"):
        H2oPolicy().select(c, torch.tensor([[-1]]))
    shuffled = c._replace(positions=c.positions.flip(-1))
    with pytest.raises(ValueError, match="ascending"):
        H2oPolicy().select(shuffled, torch.tensor([[4]]))
    gap = c._replace(valid=torch.tensor([[[True, False] * 4]]))
    with pytest.raises(ValueError, match="first"):
        StreamingLlmPolicy().select(gap, torch.tensor([[1]]))


# --- adaptive (AdaKV) ---------------------------------------------------------------------


def test_adaptive_moves_budget_from_a_concentrated_head():
    # Head 0 attends to position 0 only, head 1 spreads its attention evenly.
    c = make_candidates([[list(range(8)), list(range(8))]], [[[8.0] + [0.0] * 7, [1.0] * 8]])
    # Each head forces its 2 newest (recent 0.5 of 4, no floor at 4 // 5 = 0); the other 4
    # go to normalised scores: head 0's position 0 (1.0), then head 1's at 1/8 each.
    kept = select(H2oPolicy(adaptive=True), c, [[4, 4]])
    assert kept == [[[0, 6, 7], [3, 4, 5, 6, 7]]]
    assert select(H2oPolicy(), c, [[4, 4]]) == [[[0, 5, 6, 7], [4, 5, 6, 7]]]


def test_adaptive_floor_keeps_a_starved_head_alive():
    c = make_candidates([[list(range(10)), list(range(10))]], [[[10.0] + [0.01] * 9, [1.0] * 10]])
    # Budget 5 each, no recent share: each head's floor is 5 // 5 = 1 (head 0: position 0,
    # head 1: its newest of equal scores); head 1 wins all 8 others.
    kept = select(H2oPolicy(recent=0.0, adaptive=True), c, [[5, 5]])
    assert kept == [[[0], list(range(1, 10))]]
    # SnapKV: same shape of scores in the window, the window itself forced per head.
    snap = make_candidates(
        [[list(range(10)), list(range(10))]],
        window=[[[10.0] + [0.01] * 9, [1.0] * 10]],
        window_queries=1,
    )
    kept = select(SnapKvPolicy(kernel=1, adaptive=True), snap, [[5, 5]])
    assert kept == [[[0, 9], [2, 3, 4, 5, 6, 7, 8, 9]]]


def test_adaptive_layer_totals_and_valid_caps():
    c = make_candidates(
        [[list(range(8)), [0, 1, 2]], [list(range(8)), list(range(8))]],
        [[[1.0] * 8, [5.0, 5.0, 5.0]], [[1.0] * 8, [9.0] + [0.0] * 7]],
        n=8,
    )
    policy = H2oPolicy(adaptive=True)
    # keep above a stream's valid count: head 1 of layer 0 holds only 3.
    kept = policy.select(c, torch.tensor([[2, 7], [3, 3]]))
    counts = kept.sum(-1)
    assert counts.sum(-1).tolist() == [9, 6]
    assert counts[0, 1] == 3 and (counts <= c.valid.sum(-1)).all()
    # A layer asking for more than it holds keeps everything it holds.
    kept = policy.select(c, torch.tensor([[8, 7], [8, 8]]))
    assert torch.equal(kept, c.valid)


# --- randomized check against a plain-Python model ----------------------------------------


def reference_h2o(stream: list[tuple[int, float]], keep: int, recent: float) -> set[int]:
    """stream: (position, score) ascending by position."""
    keep = min(keep, len(stream))
    n_recent = round(keep * recent)
    newest = [p for p, _ in stream[len(stream) - n_recent :]]
    rest = sorted(stream[: len(stream) - n_recent], key=lambda ps: (ps[1], ps[0]), reverse=True)
    return set(newest) | {p for p, _ in rest[: keep - n_recent]}


def reference_streaming_llm(positions: list[int], keep: int, sinks: int) -> set[int]:
    keep = min(keep, len(positions))
    sink = [p for p in positions if p < sinks][:keep]
    others = [p for p in positions if p >= sinks]
    return set(sink) | set(others[len(others) - (keep - len(sink)) :])


def random_case(rng: random.Random) -> tuple[Candidates, torch.Tensor]:
    layers, heads, n = rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 12)
    positions, scores, windows = [], [], []
    for _ in range(layers):
        positions.append([sorted(rng.sample(range(30), rng.randint(0, n))) for _ in range(heads)])
        # Small integer scores, so that ties are common.
        scores.append([[float(rng.randint(0, 3)) for _ in s] for s in positions[-1]])
        windows.append([[rng.random() for _ in s] for s in positions[-1]])
    c = make_candidates(
        positions, scores, windows, n=n, window_queries=rng.randint(1, 8), next_position=30
    )
    keep = torch.tensor([[rng.randint(0, len(s)) for s in layer] for layer in positions])
    return c, keep


def test_uniform_policies_match_the_reference_model():
    rng = random.Random(0)
    for _ in range(150):
        c, keep = random_case(rng)
        recent, sinks = rng.choice([0.0, 0.25, 0.5, 0.7, 1.0]), rng.randint(0, 6)
        h2o = kept_positions(c, H2oPolicy(recent=recent).select(c, keep))
        streaming = kept_positions(c, StreamingLlmPolicy(sinks=sinks).select(c, keep))
        for l_, h in torch.cartesian_prod(
            torch.arange(keep.shape[0]), torch.arange(keep.shape[1])
        ).tolist():
            valid = c.valid[l_, h]
            positions = c.positions[l_, h][valid].tolist()
            scored = list(zip(positions, c.accumulated[l_, h][valid].tolist(), strict=True))
            k = int(keep[l_, h])
            assert set(h2o[l_][h]) == reference_h2o(scored, k, recent)
            assert set(streaming[l_][h]) == reference_streaming_llm(positions, k, sinks)


def test_every_policy_keeps_exact_counts_within_valid():
    rng = random.Random(1)
    for _ in range(150):
        c, keep = random_case(rng)
        n_valid = c.valid.sum(-1)
        for policy in (
            SnapKvPolicy(kernel=rng.choice([1, 3, 5]), pooling=rng.choice(["max", "avg"])),
            H2oPolicy(recent=rng.random()),
        ):
            kept = policy.select(c, keep)
            assert not (kept & ~c.valid).any()
            assert torch.equal(kept.sum(-1), keep)
            adaptive = dataclasses.replace(policy, adaptive=True).select(c, keep)
            counts = adaptive.sum(-1)
            assert not (adaptive & ~c.valid).any()
            assert torch.equal(counts.sum(-1), keep.sum(-1))
            assert (counts <= n_valid).all()
            # Each head keeps its forced candidates and floor: min(keep, forced + keep // 5).
            if isinstance(policy, H2oPolicy):
                forced = torch.round(keep.double() * policy.recent).long()
            else:
                forced = (c.valid & (c.positions >= c.next_position - c.window_queries)).sum(-1)
            assert (counts >= torch.minimum(keep, forced + keep // 5)).all()


# --- Budget -------------------------------------------------------------------------------


def test_budget_parse():
    assert Budget.parse(8) == Budget(tokens=8)
    assert Budget.parse(0.5) == Budget(fraction=0.5)
    assert Budget.parse(1.0) == Budget(fraction=1.0)
    assert Budget.parse([0.5, 1.0]) == Budget(per_layer=(0.5, 1.0))
    assert Budget.parse((0.25,)) == Budget(per_layer=(0.25,))


@pytest.mark.parametrize(
    "value", [0, -1, True, False, 1.5, 0.0, -0.5, "8", None, [], [0.5, 0.0], [0.5, True]]
)
def test_budget_parse_refuses(value):
    with pytest.raises(ValueError):
        Budget.parse(value)


def test_budget_fields_exactly_one():
    with pytest.raises(ValueError, match="exactly one"):
        Budget()
    with pytest.raises(ValueError, match="tokens=4, fraction=0.5"):
        Budget(tokens=4, fraction=0.5)


def test_budget_counts():
    valid = torch.arange(10) < torch.tensor([[10, 5, 0], [3, 1, 2]])[..., None]  # (2, 3, 10)
    assert Budget(tokens=4).counts(valid).tolist() == [[4, 4, 0], [3, 1, 2]]
    assert Budget(fraction=0.5).counts(valid).tolist() == [[5, 3, 0], [2, 1, 1]]
    assert Budget(fraction=0.3).counts(valid).tolist() == [[3, 2, 0], [1, 1, 1]]  # 0.3 * 10
    assert Budget(per_layer=(0.2, 1.0)).counts(valid).tolist() == [[2, 1, 0], [3, 1, 2]]
    with pytest.raises(ValueError, match="3 fractions for 2 layers"):
        Budget(per_layer=(0.2, 0.5, 1.0)).counts(valid)


# --- registry -----------------------------------------------------------------------------


@pytest.fixture
def registry() -> Iterator[dict[str, type[CompactionPolicy]]]:
    saved = dict(COMPACTION_POLICIES)
    yield COMPACTION_POLICIES
    COMPACTION_POLICIES.clear()
    COMPACTION_POLICIES.update(saved)


def test_make_builds_the_registered_policies():
    assert make_compaction_policy("streaming_llm", sinks=2) == StreamingLlmPolicy(sinks=2)
    assert make_compaction_policy("h2o", recent=0.3, adaptive=True) == H2oPolicy(
        recent=0.3, adaptive=True
    )
    assert make_compaction_policy("snapkv") == SnapKvPolicy(kernel=7, pooling="max")


def test_unknown_name_lists_the_known_ones():
    known = ", ".join(sorted(COMPACTION_POLICIES))  # h2o, snapkv, streaming_llm and any others
    with pytest.raises(ValueError, match=f"'lru'; known: {known}$") as raised:
        make_compaction_policy("lru")
    assert all(name in str(raised.value) for name in BUILTIN)


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("h2o", {"window": 3}, "no parameter window"),
        ("streaming_llm", {"adaptive": True}, "no parameter adaptive"),
        ("h2o", {"recent": 1.5}, "recent"),
        ("h2o", {"adaptive": 1}, "adaptive"),
        ("snapkv", {"kernel": 4}, "kernel"),
        ("snapkv", {"pooling": "min"}, "pooling"),
        ("streaming_llm", {"sinks": -1}, "sinks"),
    ],
)
def test_bad_params_are_refused(name, params, match):
    with pytest.raises(ValueError, match=match):
        make_compaction_policy(name, **params)


def test_user_policy_registers_and_duplicates_are_refused(registry):
    @register_compaction_policy
    class OldestPolicy(CompactionPolicy):
        """Keeps the oldest candidates."""

        name = "oldest"
        needs = frozenset()

        def __init__(self, skip: int = 0) -> None:
            self.skip = skip

        def select(self, candidates: Candidates, keep: torch.Tensor) -> torch.Tensor:
            index = torch.arange(candidates.positions.shape[-1])
            return candidates.valid & (index < keep[..., None])

    policy = make_compaction_policy("oldest", skip=1)
    assert isinstance(policy, OldestPolicy) and policy.skip == 1
    c = make_candidates([[list(range(8))]])
    assert select(policy, c, [[2]]) == [[[0, 1]]]
    with pytest.raises(ValueError, match="no parameter limit"):
        make_compaction_policy("oldest", limit=1)
    with pytest.raises(ValueError, match="'oldest' is already registered"):
        register_compaction_policy(OldestPolicy)
    with pytest.raises(ValueError, match="'h2o' is already registered"):
        register_compaction_policy(type("Other", (OldestPolicy,), {"name": "h2o"}))
    with pytest.raises(ValueError, match="needs"):
        register_compaction_policy(
            type("Keys", (OldestPolicy,), {"name": "keys", "needs": frozenset({"keys"})})
        )
    assert "oldest" in registry and set(registry) >= BUILTIN


def test_registry_is_restored_after_user_policies():
    assert "oldest" not in COMPACTION_POLICIES and set(COMPACTION_POLICIES) >= BUILTIN
