"""Copy or recompute: the prefill profile, link rates, the decision, and the worker's choice
timed against both paths for real."""

from __future__ import annotations

import json

import pytest

from tests.workers.conftest import SERVICE_PAGE_TOKENS, make_worker
from tests.workers.transfer.slow_link import slow_down
from workers.serving.model_loader import tiny_llama
from workers.transfer import costs
from workers.transfer.costs import (
    MAX_CORRECTION,
    CopyCosts,
    Link,
    LinkRates,
    PrefillPoint,
    PrefillProfile,
    Share,
    decide,
)
from workers.worker import Worker

P = SERVICE_PAGE_TOKENS  # the `service` fixture's (tests/workers/conftest.py)


def make_profile() -> PrefillProfile:
    # Fixed cost 1 ms, then superlinear: 64 tokens 3 ms, 256 tokens 11 ms, 1024 tokens 91 ms.
    points = [(1, 0.001), (64, 0.003), (256, 0.011), (1024, 0.091)]
    return PrefillProfile([PrefillPoint(n, s) for n, s in points], key="k")


# ---------------------------------------------------------------------------- profile


def test_profile_interpolates_the_measured_curve():
    profile = make_profile()
    assert profile.full(0) == profile.full(1) == 0.001
    assert profile.full(160) == pytest.approx(0.007)  # halfway 64 -> 256
    assert profile.full(2048) == pytest.approx(0.091 + 0.08 / 768 * 1024)  # last slope
    # Whole prompt: its full prefill; a suffix: the fixed cost plus what it adds.
    assert profile.seconds(64, 0) == pytest.approx(0.003)
    assert profile.seconds(64, 192) == pytest.approx(0.001 + 0.011 - profile.full(192))
    assert profile.seconds(0, 100) == 0.0
    # The same 64 tokens cost more after a long context (attention over it).
    assert profile.seconds(64, 960) > 2 * profile.seconds(64, 0)
    profile.check_integrity()


def test_profile_rejects_bad_points_and_smooths_noise():
    with pytest.raises(ValueError, match="at least one"):
        PrefillProfile([])
    with pytest.raises(ValueError, match="measured twice"):
        PrefillProfile([PrefillPoint(4, 0.1), PrefillPoint(4, 0.2)])
    with pytest.raises(ValueError, match="bad profile point"):
        PrefillProfile([PrefillPoint(4, 0.0)])
    noisy = PrefillProfile([PrefillPoint(1, 0.002), PrefillPoint(64, 0.001)])
    assert noisy.points == (PrefillPoint(1, 0.002), PrefillPoint(64, 0.002))
    noisy.check_integrity()


def test_profile_measures_through_the_callable_capped():
    calls: list[int] = []

    def prefill(n: int) -> float:
        calls.append(n)
        return 0.001 + n * 1e-5

    profile = PrefillProfile.measure(prefill, lengths=(1, 64, 256, 1024), max_tokens=300)
    assert [p.tokens for p in profile.points] == [1, 64, 256, 300]
    assert calls == [1] + [1] * 2 + [64] * 2 + [256] * 2 + [300] * 2  # warm-up, then 2 each
    assert profile.points[3].seconds == pytest.approx(0.004)
    profile.check_integrity()


def test_profile_disk_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "_MEMO", {})
    path = tmp_path / "tiny" / costs.PROFILE_FILE
    calls: list[int] = []

    def prefill(n: int) -> float:
        calls.append(n)
        return 0.001 * n

    first = PrefillProfile.cached(path, "model|host", prefill, lengths=(1, 8))
    assert json.loads(path.read_text()) == {
        "format": 1,
        "key": "model|host",
        "points": [[1, 0.001], [8, 0.008]],
    }
    assert len(calls) == 5  # a warm-up, then two runs a length
    monkeypatch.setattr(costs, "_MEMO", {})  # a new process: read from disk, not measured
    again = PrefillProfile.cached(path, "model|host", prefill, lengths=(1, 8))
    assert again.points == first.points and len(calls) == 5
    assert PrefillProfile.load(path, "other|host") is None  # another machine measures anew
    path.write_text("{not json")
    assert PrefillProfile.load(path, "model|host") is None
    again.check_integrity()


def test_profile_observe_refines_the_bucket_of_the_prefill():
    profile = make_profile()
    base = profile.seconds(100, 100)  # 100 tokens computed: bucket 64..256
    profile.observe(100, 100, 2 * base)  # the first observation sets the factor
    assert profile.seconds(100, 100) == pytest.approx(2 * base)
    profile.observe(100, 100, base)  # then an EWMA: 0.7 * 2 + 0.3 * 1
    assert profile.seconds(100, 100) == pytest.approx(1.7 * base)
    assert profile.seconds(200, 0) == pytest.approx(1.7 * make_profile().seconds(200, 0))
    assert profile.seconds(10, 0) == pytest.approx(make_profile().seconds(10, 0))  # untouched
    assert profile.seconds(10, 190) == pytest.approx(make_profile().seconds(10, 190))
    profile.observe(10, 0, 1e6)  # a wild outlier moves the factor at most 10x
    assert profile.corrections() == pytest.approx([1.0, 10.0, 1.7, 1.0])
    assert profile.observed == [0, 1, 2, 0]
    profile.check_integrity()


# ---------------------------------------------------------------------------- links


def test_link_rates_start_from_the_probe_then_follow_real_fetches():
    rates = LinkRates(shm_bytes_per_s=1e10, remote_bytes_per_s=1e9, remote_latency_s=0.001)
    assert rates.link("a", remote=True) == Link(True, 1e9, 0.001)
    assert rates.link("b", remote=False) == Link(False, 1e10, 0.0)
    rates.observe("a", True, 1_000_000, 0.001 + 0.01)  # 100 MB/s after the latency
    assert rates.link("a", True).bytes_per_s == pytest.approx(1e8)
    rates.observe("a", True, 1_000_000, 0.001 + 0.001)  # 1 GB/s: EWMA of s/byte
    assert 1 / rates.link("a", True).bytes_per_s == pytest.approx(0.7e-8 + 0.3e-9)
    assert rates.fetches == {"a": 2}
    assert set(rates.snapshot()) == {"probe:same_node", "probe:remote", "a"}
    rates.forget("a")
    assert rates.link("a", True) == Link(True, 1e9, 0.001) and rates.fetches == {}
    with pytest.raises(ValueError, match="bad link probe"):
        LinkRates(0, 1, 0)
    rates.check_integrity()


def test_the_link_reported_for_routing_is_the_median_of_the_measured_holders_of_its_kind():
    rates = LinkRates(shm_bytes_per_s=1e10, remote_bytes_per_s=1e9, remote_latency_s=0.001)
    assert rates.measured(True) == Link(True, 1e9, 0.001)  # no fetch yet: the probe
    assert rates.measured(False) == Link(False, 1e10, 0.0)
    for holder, seconds in (("a", 0.01), ("b", 0.02), ("c", 0.1)):  # 100, 50, 10 MB/s
        rates.observe(holder, True, 1_000_000, 0.001 + seconds)
    rates.observe("d", False, 1_000_000, 0.0005)  # a same-node holder: 2 GB/s
    assert rates.measured(True).bytes_per_s == pytest.approx(5e7)  # b's, the median
    assert rates.measured(True).latency_s == 0.001
    assert rates.measured(False).bytes_per_s == pytest.approx(2e9)
    rates.forget("d")
    assert rates.measured(False) == Link(False, 1e10, 0.0)
    rates.check_integrity()


# ---------------------------------------------------------------------------- deciding


def _costs(shares, links, prompt, local=0, page_bytes=1_000_000):
    return CopyCosts(tuple(shares), links, page_bytes, 16, prompt, local)


def test_the_decision_depends_on_the_page_count_and_the_prompt():
    profile = make_profile()
    link = {"a": Link(True, 1e9, 0.0005)}  # 1 ms a page of 1 MB
    # 4 pages = 64 tokens save 2 ms of prefill (3 ms - fixed 1 ms) but take 4.5 ms.
    few = decide(_costs([Share("a", 4)], link, 65), profile)
    assert (few.copy, few.reason) == (False, "recompute cheaper")
    assert few.copy_s == pytest.approx(0.0045 + profile.seconds(1, 64))
    assert few.recompute_s == pytest.approx(profile.seconds(65, 0))
    # The same link and 60 pages = 960 tokens: attention makes them worth copying.
    many = decide(_costs([Share("a", 60)], link, 961), profile)
    assert (many.copy, many.tasks, many.reason) == (True, 1, "copy cheaper")
    assert many.copy_s < many.recompute_s


def test_holders_run_concurrently_and_a_slow_tail_is_dropped():
    profile = make_profile()
    links = {"fast": Link(False, 1e10, 0.0), "slow": Link(True, 1e7, 0.001)}
    shares = [Share("fast", 50), Share("slow", 10)]
    costs_ = _costs(shares, links, 961)
    assert costs_.copy_seconds(1) == pytest.approx(0.005)
    assert costs_.copy_seconds(2) == pytest.approx(1.001)  # the slow holder sets the time
    part = decide(costs_, profile)
    assert (part.copy, part.tasks, part.reason) == (True, 1, "copy part cheaper")
    forced = decide(costs_, profile, "always")
    assert (forced.copy, forced.tasks, forced.reason) == (True, 2, "policy always")
    never = decide(costs_, profile, "never")
    assert (never.copy, never.tasks, never.reason) == (False, 0, "policy never")
    with pytest.raises(ValueError, match="unknown copy policy 'sometimes'; known: measured"):
        decide(costs_, profile, "sometimes")


# ---------------------------------------------------------------------------- the worker

PROMPT = [(7 * i + 3) % 250 for i in range(1001)]  # 250 full pages, then 1 token


def bigger_llama():
    """A random Llama big enough that prefilling 1000 tokens clearly costs more than the
    copy-in's fixed costs (the match, the digests), still under a second on a CPU."""
    return tiny_llama(hidden_size=256, intermediate_size=512, num_hidden_layers=4, head_dim=64)


def _worker(service, worker_id: str) -> Worker:
    return make_worker(service, worker_id, pages=300, copy_policy="measured", model=bigger_llama())


def _path_s(out) -> float:
    """What the request's prompt cost: the copy-in and the prefill after it."""
    return out.stats.copy_s + out.stats.prefill_forward_s


def test_the_worker_recomputes_over_a_slow_link_and_copies_over_a_fast_one(service, monkeypatch):
    monkeypatch.setattr(costs, "_MEMO", {})  # not the "tiny" profile of other tests' model
    a, b, c = (_worker(service, w) for w in "abc")
    try:
        infos = [w.info() for w in (a, b, c)]
        for w in (a, b, c):
            w.set_peers(infos)
        a.generate(PROMPT, 2)
        assert a.flush()

        # b's link to a is slowed to 4 ms a page: a second for the prefix, against a
        # prefill of 1001 tokens of ~100-300 ms (a busy 2-core machine). The first copy
        # trusts the memcpy probe and copies; its real time teaches b the link is slow.
        slow_down(monkeypatch, b.member.sources, "a", 0.004)
        slow_copy = b.generate(PROMPT, 2)
        assert slow_copy.stats.remote_hit_tokens == 1000
        assert b.stats().copy["decisions"] == {"copy cheaper": 1}
        b.clear_cache()
        recomputed = b.generate(PROMPT, 2)
        assert recomputed.stats.remote_hit_tokens == 0
        assert b.stats().copy["decisions"] == {"copy cheaper": 1, "recompute cheaper": 1}
        last = b.stats().copy["last"]
        assert last["copy_s"] > 2 * last["recompute_s"]
        # Both paths for real: recomputing beat the slow copy.
        assert _path_s(recomputed) < _path_s(slow_copy) / 2

        # c's link to a is the plain memcpy: copying 250 pages beats prefilling 1000 tokens.
        fast_copy = c.generate(PROMPT, 2)
        assert fast_copy.stats.remote_hit_tokens == 1000
        assert c.stats().copy["decisions"] == {"copy cheaper": 1}
        full = c.generate(PROMPT, 2, reuse=False)  # the recompute path, for real
        assert _path_s(fast_copy) < _path_s(full) / 2
        for w in (a, b, c):
            w.check_integrity()
    finally:
        for w in (a, b, c):
            w.shutdown()


def test_corrections_held_at_their_bound_stay_within_it():
    """Prefills far faster than the curve clamp its correction at 1 / MAX_CORRECTION; the
    blend of clamped values must not round past the bound (it once gave
    0.09999999999999999 and failed check_integrity on a loaded machine)."""
    profile = make_profile()
    bucket_cost = profile.seconds(16, 0)
    profile.observe(16, 0, bucket_cost)  # the bucket's correction: 1.0
    for _ in range(200):  # then only fast ones: the blend converges on the bound from above
        profile.observe(16, 0, 1e-9)
    assert min(profile.corrections()) >= 1.0 / MAX_CORRECTION
    profile.check_integrity()
