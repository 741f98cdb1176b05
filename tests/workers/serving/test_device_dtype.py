"""Serving in the model's dtype and on its device (`workers.serving.batch_runner`,
`workers.serving.sampling`, `workers.serving.device`), checked on the CPU: the batch runner
in bfloat16 against HF's own bfloat16 forward, over a mixed batch (prefills, a continued
prompt, decode steps, shared pages); the combinations it refuses; the sampler on logits of
every float dtype; where a worker's device setting lands.

bfloat16 tolerance. bfloat16 keeps 8 significant bits, so the logits themselves, rounded at
the output layer, carry half a unit in the last place (ulp) of their magnitude each, and the
packed pass rounds its hidden states in another order than HF's forward does, which moves
them a few ulps more. The runner's logits are held to 4 ulps of the largest logit against
HF's bfloat16 forward, and, against the same weights run in float32, to no more than twice
HF's own bfloat16 error: it is as good as the plain forward, not merely close to it. A
greedy token is compared wherever HF's top two logits differ by more than twice the
tolerance (then no error within it can swap them).
"""

from __future__ import annotations

import copy

import pytest
import torch

from cache_service.events import Namespace
from tests.workers.model_fixtures import held_kv, make_prompt, make_rig, reference_kv
from workers.serving import models
from workers.serving.batch_runner import BatchRunner, Chunk
from workers.serving.compaction import CompactionConfig, Compactor
from workers.serving.model_loader import LayoutMismatchError, store_layout_for, tiny_llama
from workers.serving.sampling import Sampler, SamplingParams
from workers.store.page_store import SharedPageStore

NS = Namespace("tiny-llama-bf16")
P = 4  # tokens per page
BF16_BITS = 8  # significant bits of a bfloat16 (7 stored, one implied)


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 values around `x`."""
    return 2.0 ** (torch.tensor(abs(x)).log2().floor().item() - (BF16_BITS - 1))


@pytest.fixture(scope="module")
def pair():
    """A tiny Llama in bfloat16, and the same (rounded) weights in float32."""
    bf16 = tiny_llama(seed=5, dtype=torch.bfloat16)
    return bf16, copy.deepcopy(bf16).float()


def last_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1].float()


def decode(allocation, token: int) -> Chunk:
    """The decode step of `token` after `allocation`'s tokens (its pages grown for it)."""
    assert allocation.extend([token])
    return Chunk(allocation.pages, [token], allocation.num_tokens - 1)


class Checked:
    """Each row of the runner's logits held to HF's bfloat16 forward (see the docstring)."""

    def __init__(self, pair):
        self.bf16, self.fp32 = pair
        self.rows = 0
        self.greedy_compared = 0

    def check(self, got: torch.Tensor, tokens: list[int]) -> None:
        hf, truth = last_logits(self.bf16, tokens), last_logits(self.fp32, tokens)
        tol = 4 * bf16_ulp(truth.abs().max().item())
        assert got.dtype == torch.float32
        assert (got - hf).abs().max().item() <= tol, (len(tokens), tol)
        hf_error = (hf - truth).abs().max().item()
        assert (got - truth).abs().max().item() <= 2 * hf_error + 1e-6, (len(tokens), hf_error)
        top2 = hf.topk(2).values
        if (top2[0] - top2[1]).item() > 2 * tol:
            assert int(got.argmax()) == int(hf.argmax()), len(tokens)
            self.greedy_compared += 1
        self.rows += 1


def test_bf16_mixed_batches_match_hf_bf16(pair):
    """Prefills, a prompt continued in a second chunk, shared pages read by a group, and
    decode steps (in a group and alone) in the same passes, all in bfloat16."""
    bf16, _ = pair
    checked = Checked(pair)
    with make_rig(bf16, num_pages=64, page_tokens=P, tag="bf16") as rig:
        assert rig.store.layout.dtype == "bfloat16"  # store_layout_for takes the model's
        prefix = make_prompt(16, seed=1)
        first = rig.cache.acquire(prefix + [1, 2, 3], NS, extra_token_slots=3)
        (row,) = rig.runner.forward([Chunk(first.pages, first.tokens, 0)])
        checked.check(row, first.tokens)
        first.publish(19)
        shared = [rig.cache.acquire(prefix + make_prompt(6, seed=10 + i), NS, 3) for i in (0, 1)]
        assert [a.cached_tokens for a in shared] == [16, 16]
        lone_prompt = make_prompt(11, seed=30)
        lone = rig.cache.acquire(lone_prompt, NS, extra_token_slots=3)
        chunks = [Chunk(a.pages, a.tokens[16:], 16) for a in shared]
        chunks.append(Chunk(lone.pages, lone_prompt[:7], 0))
        (group, alone) = rig.runner._groups(chunks)
        assert group.shared is not None and alone.shared is None
        logits = rig.runner.forward(chunks)
        for got, tokens in zip(logits, [a.tokens for a in shared] + [lone_prompt[:7]], strict=True):
            checked.check(got, tokens)
        # The lone prompt's second chunk beside three sequences decoding, then four decoding.
        greedy = Sampler(None)
        decoding = [first, *shared]
        chunks = [
            decode(a, greedy(row)) for a, row in zip(decoding, [row, *logits[:2]], strict=True)
        ]
        chunks.append(Chunk(lone.pages, lone_prompt[7:], 7))
        decoding.append(lone)
        for _ in range(2):
            # Three decode steps over the shared pages together (the cascade's decoders).
            assert len(rig.runner._groups(chunks)[0].decoders.rows) == 3
            logits = rig.runner.forward(chunks)
            for got, allocation in zip(logits, decoding, strict=True):
                checked.check(got, allocation.tokens)
            chunks = [decode(a, greedy(row)) for a, row in zip(decoding, logits, strict=True)]
        assert checked.rows == 1 + 3 + 4 + 4 and checked.greedy_compared >= checked.rows // 2
        # The KV in the pages is HF's, to a bfloat16 ulp of its magnitude (the last token
        # is the next step's: not run yet).
        computed = first.num_tokens - 1
        expected = reference_kv(bf16, first.tokens[:computed]).float()
        held = held_kv(rig.store, first.pages, computed)
        assert held.dtype == torch.bfloat16
        kv_tol = 2 * bf16_ulp(expected.abs().max().item())
        assert (held.float() - expected).abs().max().item() <= kv_tol
        for allocation in [first, *shared, lone]:
            allocation.release()
        rig.check_integrity()


def test_a_store_of_another_dtype_is_refused_naming_both(pair):
    bf16, fp32 = pair
    with SharedPageStore.create(store_layout_for(fp32, 4, P), tag="dtype") as store:
        with pytest.raises(LayoutMismatchError, match=r"dtype is float32.* model's is bfloat16"):
            BatchRunner(bf16, store)
        store.check_integrity()


class PagesElsewhere:
    """A store whose page tensor reports another device (what a device store gives), the
    rest of it the wrapped store's."""

    def __init__(self, store: SharedPageStore, device: str):
        self._store, self._device = store, device

    def page_range(self, start: int, stop: int) -> torch.Tensor:
        return self._store.page_range(start, stop).to(self._device)

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def test_a_store_on_another_device_than_the_model_is_refused_naming_both(pair):
    bf16, _ = pair
    with SharedPageStore.create(store_layout_for(bf16, 4, P), tag="device") as store:
        with pytest.raises(ValueError, match=r"weights are on cpu .* pages on meta"):
            BatchRunner(bf16, PagesElsewhere(store, "meta"))
        on_meta = tiny_llama(seed=5, dtype=torch.bfloat16, device="meta")
        with pytest.raises(ValueError, match=r"weights are on meta .* pages on cpu"):
            BatchRunner(on_meta, store)
        store.check_integrity()


def test_compaction_refuses_a_store_off_the_cpu_at_construction(pair):
    bf16, _ = pair
    with SharedPageStore.create(store_layout_for(bf16, 4, P), tag="compact") as store:
        elsewhere = PagesElsewhere(store, "meta")
        with pytest.raises(ValueError, match=r"'h2o' needs a page store on the CPU.* on meta"):
            Compactor(elsewhere, CompactionConfig(policy="h2o", budget=0.5))
        assert not Compactor(elsewhere).enabled  # compaction off: nothing to refuse
        assert Compactor(store, CompactionConfig(policy="h2o", budget=0.5)).enabled
        store.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_sampler_takes_logits_of_every_float_dtype(dtype):
    # Multiples of 1/8 up to 4: exact in every one of these dtypes, so each sees the same.
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randint(-32, 33, (64,), generator=gen) / 8).to(dtype)
    exact = logits.double()
    assert Sampler(None)(logits) == int(exact.argmax())
    params = SamplingParams(temperature=0.8, top_k=20, seed=11)
    reference, sampler = Sampler(params), Sampler(params)
    assert [sampler(logits) for _ in range(8)] == [reference(exact) for _ in range(8)]
    broken = logits.clone()
    broken[5] = float("nan")
    for params in (None, SamplingParams(temperature=1.0, seed=1)):
        with pytest.raises(ValueError, match="NaN"):
            Sampler(params)(broken)


def test_rotary_frequencies_stay_float32_in_bf16():
    model, _ = models.load("tiny", "bfloat16", device="cpu")
    assert model.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.model.rotary_emb.inv_freq, tiny_llama().model.rotary_emb.inv_freq)
