"""The batched forward pass (`workers.serving.batch_runner`): many sequences' chunks in one pass,
their KV in pages, against HF's own forward of each sequence alone; a prompt over cached
pages (whole, or a page copied on write) against a full prefill; the store it accepts;
and, on the real model, what computing only the suffix saves."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from tests.workers.model_fixtures import (
    NS,
    compute,
    held_kv,
    make_prompt,
    make_rig,
    max_diff,
    reference_kv,
    reference_logits,
)
from workers.serving.batch_runner import BatchRunner, Chunk
from workers.serving.model_loader import LayoutMismatchError, store_layout_for, tiny_llama
from workers.store.page_store import SharedPageStore, StoreLayout

P = 4  # tokens per page in these tests
TOL = 1e-4  # max abs logit difference allowed against a full prefill (fp32)
N = 22  # prompt length: 5 full pages and a partial one
FILLER = make_prompt(8, seed=99, low=200, high=256)  # never equal to a prompt token


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=3)


def donor_for(prompt: list[int], shared: int) -> list[int]:
    """A prompt that shares exactly its first `shared` tokens with `prompt`."""
    return prompt[:shared] + FILLER


def test_one_cold_sequence_equals_hf(tiny):
    with make_rig(tiny, page_tokens=P) as rig:
        runner = BatchRunner(tiny, rig.store)
        tokens = make_prompt(23, seed=1)
        allocation = rig.cache.acquire(tokens, NS)
        logits = runner.forward([Chunk(allocation.pages, tokens, 0)])
        assert logits.shape == (1, tiny.config.vocab_size)
        assert max_diff(logits[0], reference_logits(tiny, tokens)) < 1e-4
        assert max_diff(held_kv(rig.store, allocation.pages, 23), reference_kv(tiny, tokens)) < 1e-4
        assert (runner.calls, runner.tokens_run) == (1, 23)
        allocation.release()
        rig.check_integrity()


def test_ragged_sequences_in_one_pass_each_equal_hf_alone(tiny):
    """A cold prompt, a prompt continuing in a second chunk, and two sequences decoding
    one token each, all in one forward pass."""
    with make_rig(tiny, page_tokens=P, num_pages=64) as rig:
        runner = BatchRunner(tiny, rig.store)
        prompts = [make_prompt(n, seed=s) for n, s in ((9, 10), (17, 11), (13, 12), (6, 13))]
        allocations = [rig.cache.acquire(p, NS, extra_token_slots=1) for p in prompts]
        # Prefill the first part of prompt 1 and all of prompts 2 and 3 beforehand.
        runner.forward(
            [
                Chunk(allocations[1].pages, prompts[1][:10], 0),
                Chunk(allocations[2].pages, prompts[2], 0),
                Chunk(allocations[3].pages, prompts[3], 0),
            ]
        )
        extra = [5, 7]  # the tokens sequences 2 and 3 decode next
        chunks = [
            Chunk(allocations[0].pages, prompts[0], 0),
            Chunk(allocations[1].pages, prompts[1][10:], 10),
            Chunk(allocations[2].pages, [extra[0]], 13),
            Chunk(allocations[3].pages, [extra[1]], 6),
        ]
        logits = runner.forward(chunks)
        expected = [prompts[0], prompts[1], prompts[2] + [extra[0]], prompts[3] + [extra[1]]]
        for got, tokens, allocation in zip(logits, expected, allocations, strict=True):
            assert max_diff(got, reference_logits(tiny, tokens)) < 1e-4
            kv = held_kv(rig.store, allocation.pages, len(tokens))
            assert max_diff(kv, reference_kv(tiny, tokens)) < 1e-4
        assert runner.calls == 2 and runner.tokens_run == 10 + 13 + 6 + 9 + 7 + 2
        for allocation in allocations:
            allocation.release()
        rig.check_integrity()


def test_sequences_sharing_a_prefix_read_its_pages_once_in_a_group(tiny):
    with make_rig(tiny, page_tokens=P, num_pages=64) as rig:
        runner = BatchRunner(tiny, rig.store)
        prefix = make_prompt(16, seed=20)
        first = rig.cache.acquire(prefix + [1, 2, 3], NS)
        runner.forward([Chunk(first.pages, first.tokens, 0)])
        first.publish(first.num_tokens)
        suffixes = [make_prompt(5, seed=21 + i) for i in range(3)]
        allocations = [rig.cache.acquire(prefix + s, NS) for s in suffixes]
        assert all(a.cached_tokens == 16 for a in allocations)
        chunks = [Chunk(a.pages, a.tokens[16:], 16) for a in allocations]
        (group,) = runner._groups(chunks)
        assert group.shared.tolist() == first.pages[:4]  # the prefix, gathered once
        assert [len(member.pages) for member in group.members] == [2, 2, 2]
        logits = runner.forward(chunks)
        for got, suffix in zip(logits, suffixes, strict=True):
            assert max_diff(got, reference_logits(tiny, prefix + suffix)) < 1e-4
        # A decode step of each (one token): attended together, the prefix still once.
        steps = [9, 19, 29]
        for allocation, token in zip(allocations, steps, strict=True):
            assert allocation.extend([token])
        chunks = [Chunk(a.pages, [t], 21) for a, t in zip(allocations, steps, strict=True)]
        (group,) = runner._groups(chunks)
        assert group.members == [] and len(group.decoders.rows) == 3
        logits = runner.forward(chunks)
        for got, suffix, token in zip(logits, suffixes, steps, strict=True):
            assert max_diff(got, reference_logits(tiny, prefix + suffix + [token])) < 1e-4
        for allocation in [first, *allocations]:
            allocation.release()
        rig.check_integrity()


def test_tokens_recomputed_inside_a_sequences_pages_ride_in_its_pass(tiny):
    """A spot check's shape: a sequence's chunk, and one-token chunks recomputing tokens
    in pages it reads (each over only the pages up to its own). Each runs as alone: the
    sequence's logits and the recomputed tokens' KV are what they are without the others."""
    with make_rig(tiny, page_tokens=P, num_pages=64) as rig:
        runner = BatchRunner(tiny, rig.store)
        prompt = make_prompt(40, seed=30)
        allocation = rig.cache.acquire(prompt, NS)
        runner.forward([Chunk(allocation.pages, prompt[:32], 0)])
        pages = allocation.pages
        held = {pos: rig.store.page(pages[pos // P])[:, :, :, pos % P].clone() for pos in (5, 22)}
        checks = [Chunk(pages[: pos // P + 1], prompt[pos : pos + 1], pos) for pos in held]
        logits = runner.forward([Chunk(pages, prompt[32:], 32), *checks])
        assert max_diff(logits[0], reference_logits(tiny, prompt)) < 1e-4
        for pos, before in held.items():
            assert max_diff(rig.store.page(pages[pos // P])[:, :, :, pos % P], before) < 1e-5
        allocation.release()
        rig.check_integrity()


def test_bad_chunks_are_refused_before_anything_runs(tiny):
    with make_rig(tiny, page_tokens=P) as rig:
        runner = BatchRunner(tiny, rig.store)
        allocation = rig.cache.acquire(make_prompt(8, seed=1), NS)
        with pytest.raises(ValueError, match="at least one chunk"):
            runner.forward([])
        with pytest.raises(ValueError, match="chunk 0 has no tokens"):
            runner.forward([Chunk(allocation.pages, [], 0)])
        with pytest.raises(ValueError, match="need 3 pages of 4, got 2"):
            runner.forward([Chunk(allocation.pages, list(range(9)), 0)])
        assert runner.calls == 0
        allocation.release()
        rig.check_integrity()


# ---------------------------------------------------------------------------- over cached pages


@pytest.mark.parametrize(
    "split",
    [0, 6, 8, N - 1],
    ids=["nothing-cached", "inside-a-page", "page-boundary", "all-but-last"],
)
def test_a_prompt_over_cached_pages_matches_a_full_prefill(tiny, split):
    prompt = make_prompt(N)
    with make_rig(tiny, page_tokens=P) as rig:
        if split:
            compute(rig, donor_for(prompt, split))
        before = rig.runner.tokens_run
        allocation, logits = compute(rig, prompt, release=False)
        assert allocation.cached_tokens == split
        assert rig.runner.tokens_run - before == N - split
        assert max_diff(logits, reference_logits(tiny, prompt)) < TOL
        # every slot, reused or computed, holds what a plain forward computes
        held = held_kv(rig.store, allocation.pages, N)
        assert max_diff(held, reference_kv(tiny, prompt)) < 1e-5
        allocation.release()
        rig.check_integrity()


def test_a_partly_matched_page_is_computed_in_its_copy_never_in_the_source(tiny):
    prompt = make_prompt(N)
    with make_rig(tiny, page_tokens=P) as rig:
        donor, _ = compute(rig, donor_for(prompt, 6))
        donor_page = rig.store.read_pages([donor.pages[1]])
        allocation, logits = compute(rig, prompt, release=False)
        # one full page shared, two tokens of the second copied into a private page
        assert allocation.cached_tokens == 6
        assert allocation.pages[0] == donor.pages[0]
        assert allocation.pages[1] != donor.pages[1]
        assert max_diff(logits, reference_logits(tiny, prompt)) < TOL
        # the suffix went into the copy, never into the shared source page
        assert torch.equal(rig.store.read_pages([donor.pages[1]]), donor_page)
        allocation.release()
        rig.check_integrity()


def test_wrong_kv_in_a_page_is_detected(tiny):
    """The tolerance means something: one page holding another prompt's KV (what a
    hash-only match would serve) moves the logits far beyond it."""
    prompt, other = make_prompt(N, seed=6), make_prompt(N, seed=60)
    with make_rig(tiny, page_tokens=P) as rig:
        allocation, _ = compute(rig, prompt, release=False)
        stranger, _ = compute(rig, other, release=False)
        pages = list(allocation.pages)
        pages[2] = stranger.pages[2]  # same positions 8..11, other tokens
        (logits,) = rig.runner.forward([Chunk(pages, prompt[20:], 20)])
        assert max_diff(logits, reference_logits(tiny, prompt)) > 100 * TOL
        # the same pass over the prompt's own pages is within it
        (logits,) = rig.runner.forward([Chunk(allocation.pages, prompt[20:], 20)])
        assert max_diff(logits, reference_logits(tiny, prompt)) < TOL
        for held in (allocation, stranger):
            held.release()
        rig.check_integrity()


# ---------------------------------------------------------------------------- the store it takes


@pytest.mark.parametrize(
    ("field", "value", "model_value"),
    [
        ("num_layers", 3, 2),
        ("num_kv_heads", 4, 2),
        ("head_dim", 8, 16),
        ("dtype", "float16", "float32"),
    ],
)
def test_a_store_that_does_not_fit_the_model_is_refused(tiny, field, value, model_value):
    fields = store_layout_for(tiny, 4, P).__dict__ | {field: value}
    with SharedPageStore.create(StoreLayout(**fields), tag="mismatch") as store:
        with pytest.raises(
            LayoutMismatchError, match=rf"{field}.* is {value}.* model's is {model_value}"
        ):
            BatchRunner(tiny, store)
        store.check_integrity()


def test_a_sliding_window_model_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=8,
    )
    model = MistralForCausalLM(config).eval()
    with SharedPageStore.create(store_layout_for(model, 2, P), tag="mistral") as store:
        with pytest.raises(ValueError, match="full attention in every layer"):
            BatchRunner(model, store)
        store.check_integrity()


def test_an_attached_store_is_refused(tiny):
    with make_rig(tiny, page_tokens=P) as rig, SharedPageStore.attach(rig.store.name) as reader:
        with pytest.raises(LayoutMismatchError, match="read-only"):
            BatchRunner(tiny, reader)
        rig.check_integrity()


# ---------------------------------------------------------------------------- SmolLM2


@pytest.fixture
def one_thread():
    # Timings on one thread: with two OpenMP threads on a shared two-core machine, a busy
    # neighbour process stalls every parallel op at its barrier and timings become noise.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_smollm2_suffix_costs_less_than_full_prefill(smollm2, one_thread):
    model, _ = smollm2
    tokens = make_prompt(1088, seed=8, low=100, high=40000)
    with make_rig(model, num_pages=72, page_tokens=16, tag="smollm2") as rig:
        pages = rig.store.allocate(1088 // 16)

        def prefill(start: int, end: int) -> tuple[torch.Tensor, float]:
            """Tokens [start, end) over the KV of [0, start) in the pages: logits, seconds."""
            began = time.perf_counter()
            (logits,) = rig.runner.forward([Chunk(pages, tokens[start:end], start)])
            return logits, time.perf_counter() - began

        prefill(0, 64)  # warm-up: first-call allocations
        _, prefill_512_s = prefill(0, 512)
        full, full_s = prefill(0, 1088)
        suffix, suffix_s = prefill(1024, 1088)
        assert max_diff(suffix, full) < TOL
        print(
            f"\nSmolLM2, one thread: prefill 512 tokens: {prefill_512_s:.3f} s; 1088 tokens: "
            f"{full_s:.3f} s; 64-token suffix over a 1024-token prefix: {suffix_s:.3f} s",
            file=sys.stderr,
        )
        # 64 of 1088 tokens: far under half the cost even on a noisy machine
        assert suffix_s < 0.5 * full_s
        rig.store.free(pages)
        rig.check_integrity()
