"""The batched forward pass (`workers.serving.batch_runner`): many sequences' chunks in one pass,
their KV in pages, against HF's own forward of each sequence alone."""

from __future__ import annotations

import pytest
import torch

from tests.workers.model_fixtures import (
    NS,
    held_kv,
    make_prompt,
    make_rig,
    max_diff,
    reference_kv,
)
from workers.serving.batch_runner import BatchRunner, Chunk
from workers.serving.model_runner import tiny_llama

P = 4  # tokens per page in these tests


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=3)


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1].float()


def test_one_cold_sequence_equals_hf(tiny):
    with make_rig(tiny, page_tokens=P) as rig:
        runner = BatchRunner(tiny, rig.store)
        tokens = make_prompt(23, seed=1)
        allocation = rig.cache.acquire(tokens, NS)
        logits = runner.forward([Chunk(allocation.pages, tokens, 0)])
        assert logits.shape == (1, tiny.config.vocab_size)
        assert max_diff(logits[0], full_logits(tiny, tokens)) < 1e-4
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
            assert max_diff(got, full_logits(tiny, tokens)) < 1e-4
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
            assert max_diff(got, full_logits(tiny, prefix + suffix)) < 1e-4
        # A decode step of each (one token): attended together, the prefix still once.
        steps = [9, 19, 29]
        for allocation, token in zip(allocations, steps, strict=True):
            assert allocation.extend([token])
        chunks = [Chunk(a.pages, [t], 21) for a, t in zip(allocations, steps, strict=True)]
        (group,) = runner._groups(chunks)
        assert group.members == [] and len(group.decoders.rows) == 3
        logits = runner.forward(chunks)
        for got, suffix, token in zip(logits, suffixes, steps, strict=True):
            assert max_diff(got, full_logits(tiny, prefix + suffix + [token])) < 1e-4
        for allocation in [first, *allocations]:
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
