"""`kvmesh bench compaction`, short: one window of the real text, a 256-token prompt, the
real model, every policy at both budgets, cold and after a hit; the figures' shape, the
pages each run really freed, and the plot."""

from __future__ import annotations

import pytest

from benchmarks import compaction

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    plot = tmp_path_factory.mktemp("bench") / "compaction.png"
    return compaction.run(prompt_tokens=256, hit_tokens=128, eval_tokens=32, windows=1, plot=plot)


def test_every_policy_budget_and_case_is_measured(figures):
    assert figures["prompt_tokens"] == 256 and figures["text"].startswith("GPL-3")
    assert set(figures["policies"]) == set(compaction.POLICIES)
    for budgets in figures["policies"].values():
        assert set(budgets) == {"0.5", "0.25"}
        for cases in budgets.values():
            assert set(cases) == {"cold", "after_hit"}
            for leaf in cases.values():
                assert set(leaf) == {
                    "pages_before", "pages_freed", "pages_freed_ratio", "agreement", "ppl_ratio"
                }  # fmt: skip
                assert 0.0 <= leaf["agreement"] <= 1.0 and leaf["ppl_ratio"] > 0


def test_pages_freed_follow_the_budget_and_after_a_hit_only_the_suffix_counts(figures):
    policies = figures["policies"]
    # 256 tokens of 16 = 16 compactable pages cold; after the 128-token hit, 8. A uniform
    # policy keeps the budget in every head: exactly that share of pages comes back.
    for name in ("streaming_llm", "h2o", "snapkv"):
        for budget, cold_freed, hit_freed in (("0.5", 8, 4), ("0.25", 12, 6)):
            cold, hit = policies[name][budget]["cold"], policies[name][budget]["after_hit"]
            assert (cold["pages_before"], cold["pages_freed"]) == (16, cold_freed)
            assert (hit["pages_before"], hit["pages_freed"]) == (8, hit_freed)
    # Adaptive budgets differ per head; each head rounds up to whole lanes, so they return
    # at most what the uniform ones do, and never nothing.
    for name in ("h2o", "snapkv"):
        for budget in ("0.5", "0.25"):
            for case in ("cold", "after_hit"):
                adaptive = policies[f"{name}_adaptive"][budget][case]["pages_freed"]
                assert 0 < adaptive <= policies[name][budget][case]["pages_freed"]


def test_half_the_kv_keeps_most_predictions(figures):
    # Deterministic on this input (same model, same text): SnapKV at half the KV agreed
    # with the full cache on 30 of 32 predictions cold.
    assert figures["policies"]["snapkv"]["0.5"]["cold"]["agreement"] >= 0.75


def test_the_plot_is_a_png(figures):
    with open(figures["plot"], "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n"
