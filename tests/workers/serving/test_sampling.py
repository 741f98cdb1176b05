"""Tests for workers/serving/sampling.py: params validation and serialisation, greedy and filtered
sampling, seeded determinism that survives float noise in the logits, and the
one-draw-per-token contract."""

from __future__ import annotations

import json
import math

import pytest
import torch

from workers.serving.sampling import Sampler, SamplingParams, filtered_probs

VOCAB = 256


def make_logits(seed: int, n: int = VOCAB, scale: float = 2.0) -> torch.Tensor:
    """`(n,)` float32 logits, spread enough that a few tokens dominate."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


def draws(params: SamplingParams, logits: list[torch.Tensor]) -> list[int]:
    """One sampler's tokens over a sequence of logits."""
    sampler = Sampler(params)
    return [sampler(step) for step in logits]


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float):
    """The filtered distribution, computed the plain way: a dict token -> probability."""
    scaled = [x / temperature for x in logits]
    ranked = sorted(range(len(scaled)), key=lambda t: -scaled[t])
    if top_k > 0:
        kth = scaled[ranked[top_k - 1]]
        ranked = [t for t in ranked if scaled[t] >= kth]
    z = sum(math.exp(scaled[t]) for t in ranked)
    kept, total = [], 0.0
    for t in ranked:  # most probable first, until their sum reaches top_p
        kept.append(t)
        total += math.exp(scaled[t]) / z
        if total >= top_p:
            break
    mass = sum(math.exp(scaled[t]) for t in kept)
    return {t: math.exp(scaled[t]) / mass for t in kept}


# ---------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.5, "temperature must be >= 0"),
        ("temperature", float("nan"), "temperature must be finite, got nan"),
        ("temperature", float("inf"), "temperature must be finite, got inf"),
        ("temperature", True, "temperature must be a real number, got bool True"),
        ("temperature", "0.7", "temperature must be a real number, got str '0.7'"),
        ("temperature", None, "temperature must be a real number, got NoneType None"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\], got 1.5"),
        ("top_p", -0.1, r"top_p must be in \(0, 1\], got -0.1"),
        ("top_p", float("nan"), "top_p must be finite, got nan"),
        ("top_p", False, "top_p must be a real number, got bool False"),
        ("top_k", -2, "top_k must be >= 1, or 0 or -1 for no filter, got -2"),
        ("top_k", 1.5, "top_k must be an int, got float 1.5"),
        ("top_k", 5.0, "top_k must be an int, got float 5.0"),
        ("top_k", True, "top_k must be an int, got bool True"),
        ("top_k", "3", "top_k must be an int, got str '3'"),
        ("seed", -1, r"seed must be None or in \[0, 2\*\*63\), got -1"),
        ("seed", 2**63, rf"seed must be None or in \[0, 2\*\*63\), got {2**63}"),
        ("seed", True, "seed must be an int, got bool True"),
        ("seed", 7.0, "seed must be an int, got float 7.0"),
        ("seed", "7", "seed must be an int, got str '7'"),
    ],
)
def test_bad_params_raise_naming_field_and_value(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=message):  # the wire path checks the same
        SamplingParams.from_dict({field: value})


def test_params_defaults_edges_and_normalisation():
    default = SamplingParams()
    assert default.greedy and (default.top_p, default.top_k, default.seed) == (1.0, 0, None)
    assert not SamplingParams(temperature=1e-3).greedy
    edges = SamplingParams(temperature=2, top_p=1, top_k=-1, seed=2**63 - 1)
    assert edges.temperature == 2.0 and type(edges.temperature) is float
    assert edges.top_p == 1.0 and type(edges.top_p) is float
    assert edges.top_k == 0  # -1 and 0 both mean no filter, stored as 0
    assert edges == SamplingParams(temperature=2.0, top_k=0, seed=2**63 - 1)
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(top_k=1).top_k == 1
    with pytest.raises(AttributeError):
        default.temperature = 1.0  # frozen


def test_params_round_trip_through_json():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=12345)
    d = params.to_dict()
    assert d == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 12345}
    assert SamplingParams.from_dict(json.loads(json.dumps(d))) == params
    assert SamplingParams.from_dict({}) == SamplingParams()
    assert SamplingParams.from_dict({"temperature": 1.0}).to_dict()["seed"] is None


def test_from_dict_rejects_unknown_keys_and_non_mappings():
    with pytest.raises(ValueError, match=r"unknown sampling params \['max_tokens', 'topp'\]"):
        SamplingParams.from_dict({"temperature": 1.0, "topp": 0.5, "max_tokens": 3})
    with pytest.raises(ValueError, match="must be a mapping, got list"):
        SamplingParams.from_dict([("temperature", 1.0)])


def test_sampler_refuses_bad_inputs():
    with pytest.raises(ValueError, match="params must be SamplingParams, got dict"):
        Sampler({"temperature": 1.0})
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    with pytest.raises(ValueError, match=r"logits must be \(vocab,\), got shape \(1, 256\)"):
        sampler(make_logits(0).unsqueeze(0))
    with pytest.raises(ValueError, match=r"got shape \(0,\)"):
        sampler(torch.empty(0))
    with pytest.raises(ValueError, match="logits hold NaN"):
        sampler(torch.tensor([0.0, float("nan")]))
    with pytest.raises(ValueError, match="no finite entry"):
        sampler(torch.full((4,), -math.inf))


# ---------------------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_draws_nothing():
    sampler = Sampler(SamplingParams(seed=3))
    before = sampler.generator.get_state()
    for seed in range(20):
        logits = make_logits(seed)
        assert sampler(logits) == int(torch.argmax(logits))
    assert torch.equal(sampler.generator.get_state(), before)
    assert Sampler()(torch.tensor([0.0, 5.0, 1.0], dtype=torch.bfloat16)) == 1


@pytest.mark.parametrize("temperature", [0.05, 1.0, 10.0, 1000.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    logits = [make_logits(seed) for seed in range(50)]
    params = SamplingParams(temperature=temperature, top_k=1, seed=11)
    assert draws(params, logits) == [int(torch.argmax(step)) for step in logits]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 100.0])
def test_tiny_top_p_is_greedy(temperature):
    logits = [make_logits(seed) for seed in range(50)]
    params = SamplingParams(temperature=temperature, top_p=1e-9, seed=11)
    assert draws(params, logits) == [int(torch.argmax(step)) for step in logits]


def test_masked_tokens_are_never_drawn():
    logits = make_logits(1, n=16, scale=0.1)
    logits[::2] = -math.inf
    tokens = set(draws(SamplingParams(temperature=5.0, seed=2), [logits] * 500))
    assert tokens and all(t % 2 == 1 for t in tokens)


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([1.0, 3.0, 1.0, 1.0, 0.0])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert probs.nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert probs.dtype == torch.float64 and math.isclose(float(probs.sum()), 1.0)


# ---------------------------------------------------------------------------- determinism


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=5),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=5),
    ],
    ids=["plain", "filtered"],
)
def test_same_seed_same_tokens_other_seed_other_tokens(params):
    logits = [make_logits(seed, scale=1.0) for seed in range(200)]
    first = draws(params, logits)
    assert draws(params, logits) == first
    other = draws(SamplingParams(**params.to_dict() | {"seed": 6}), logits)
    assert sum(a != b for a, b in zip(first, other, strict=True)) > 50


def test_unseeded_samplers_pick_their_own_seed():
    a, b = Sampler(SamplingParams(temperature=1.0)), Sampler(SamplingParams(temperature=1.0))
    assert 0 <= a.seed < 2**63 and a.seed != b.seed
    # the seed it reports replays it
    logits = [make_logits(seed) for seed in range(30)]
    tokens = [a(step) for step in logits]
    assert draws(SamplingParams(temperature=1.0, seed=a.seed), logits) == tokens


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=21),
        SamplingParams(temperature=0.7, seed=21),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=21),
    ],
    ids=["t1", "t0.7", "filtered"],
)
def test_float_noise_in_the_logits_changes_no_token(params):
    """What two cache paths feed the sampler: logits equal to ~1e-6, not bit for bit."""
    gen = torch.Generator().manual_seed(0)
    logits = [make_logits(seed, scale=1.0) for seed in range(200)]
    noisy = [step + 1e-6 * torch.randn(VOCAB, generator=gen) for step in logits]
    assert any(not torch.equal(a, b) for a, b in zip(logits, noisy, strict=True))
    assert draws(params, noisy) == draws(params, logits)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=0),
        SamplingParams(temperature=0.5, top_k=1, seed=0),
        SamplingParams(temperature=2.0, top_p=1e-6, seed=0),
        SamplingParams(temperature=0.9, top_k=7, top_p=0.5, seed=0),
    ],
    ids=["plain", "top_k=1", "tiny-top_p", "both"],
)
def test_exactly_one_draw_per_sampled_token(params):
    sampler = Sampler(params)
    reference = torch.Generator().manual_seed(0)
    for n in range(1, 40):
        sampler(make_logits(n))
        torch.rand((), generator=reference, dtype=torch.float64)
        assert torch.equal(sampler.generator.get_state(), reference.get_state()), n


# ---------------------------------------------------------------------------- distribution


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 6, 1.0), (1.3, 0, 0.8), (0.9, 8, 0.75)],
)
def test_empirical_distribution_matches_filtered_softmax(temperature, top_k, top_p):
    logits = make_logits(4, n=12, scale=1.0)
    expected = reference_probs(logits.tolist(), temperature, top_k, top_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=99)
    probs = filtered_probs(logits, params)
    assert {t: pytest.approx(p) for t, p in expected.items()} == {
        t: float(probs[t]) for t in range(12) if probs[t] > 0
    }
    n = 6000
    tokens = draws(params, [logits] * n)
    assert set(tokens) <= set(expected)  # nothing outside the filters, ever
    counts = {t: tokens.count(t) for t in expected}
    chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in expected.items())
    df = len(expected) - 1
    # Loose: the chi-square's mean is df and its sd sqrt(2 df); 5 sd above is far in the
    # tail for a correct sampler and far below what a wrong distribution gives at n=6000.
    assert chi2 < df + 5 * math.sqrt(2 * df) + 5, (chi2, counts, expected)
