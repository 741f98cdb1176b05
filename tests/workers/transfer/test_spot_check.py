"""Which copies are spot-checked, whom a failure blames, and where copies came from."""

from __future__ import annotations

import pytest
import torch

from workers.transfer.spot_check import Provenance, Sample, SpotChecks, kv_error, tolerance


def test_a_holders_first_copy_is_checked_then_copies_at_the_rate():
    checks = SpotChecks(rate=0.0, seed=1)
    (sample,) = checks.pick([("h0", 2, 6)], page_tokens=16)
    assert sample.holder == "h0" and 2 <= sample.page < 6 and 0 <= sample.slot < 16
    assert sample.attributable and checks.judged(sample, 1e-6).passed
    assert checks.pick([("h0", 2, 6)], 16) == []  # trusted, and the rate is 0
    every = SpotChecks(rate=1.0, seed=1)
    every.judged(Sample("h0", 2, 0, True), 0.0)
    assert [s.holder for s in every.pick([("h0", 0, 4)], 16)] == ["h0"]
    assert checks.figures() == {"checks": 1, "failures": 0, "unattributed": 0, "trusted_holders": 1}
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        SpotChecks(rate=1.5)
    checks.check()


def test_a_failure_blames_a_holder_only_over_a_context_it_or_trusted_holders_gave():
    checks = SpotChecks(rate=0.0, seed=3)
    checks.judged(Sample("trusted", 0, 0, True), 0.0)
    samples = checks.pick([("new", 0, 2), ("trusted", 2, 4), ("other", 4, 6)], 16)
    assert [(s.holder, s.attributable) for s in samples] == [("new", True), ("other", False)]
    verdict = checks.judged(samples[1], 0.9)
    assert not verdict.passed and checks.unattributed == 1
    checks.distrust(["trusted"])  # checked again at its next copy
    assert [s.holder for s in checks.pick([("trusted", 0, 2)], 16)] == ["trusted"]
    checks.check()


def test_kv_error_is_relative_and_infinite_for_non_finite_pages():
    page = torch.ones(2, 2, 1, 4, 8)
    assert kv_error(page, page) == 0.0
    assert kv_error(page * 1.01, page) == pytest.approx(0.01, rel=1e-3)
    assert kv_error(page * float("nan"), page) == float("inf")
    assert tolerance("float32") < tolerance("bfloat16")
    with pytest.raises(ValueError, match="float8"):
        tolerance("float8")


def test_provenance_follows_pages_until_they_are_freed_or_rewritten():
    provenance = Provenance()
    d = [bytes([i]) * 16 for i in range(4)]
    provenance.record([10, 11], "h0", d[:2])
    provenance.record([12], "h1", d[2:3])
    assert provenance.from_holder("h0") == {10: d[0], 11: d[1]}
    assert provenance.with_digests({d[1], d[2]}) == {11: d[1], 12: d[2]}
    empty = bytes(16)
    provenance.prune({10: d[3], 11: empty, 12: d[2]})  # 10 rewritten; 11 not yet published
    assert provenance.from_holder("h0") == {11: d[1]} and len(provenance) == 2
    provenance.check(num_pages=16)
