"""KV compaction (`workers.serving.compaction`): the tracked attention path and its scores, the
per-head packed layout, `free_and_reallocate`, and attention after compaction, all against
a reference forward written here that drops each (layer, KV head)'s keys by a mask."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tests.workers.model_fixtures import NS, make_prompt, make_rig, max_diff
from workers.serving.batch_runner import BatchRunner, Chunk
from workers.serving.compaction import CompactionConfig, Compactor
from workers.serving.compaction.kv_state import SCORES
from workers.serving.model_loader import tiny_llama

P = 4  # tokens per page: the tiny model's page holds 2 layers x 2 KV heads = 4 lanes


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=5)


def reference(model, tokens: list[int], hidden_from: torch.Tensor | None = None):
    """A plain forward over all of `tokens` with an explicit attention mask per layer and KV
    head: `hidden_from` `(L, KVH, T)` long gives, for each key, the first query position
    that no longer sees it (a key dropped by a compaction at that point), or None.

    Returns (logits `(T, vocab)`, attention weights per layer `(L, H, T, T)`)."""
    inner, cfg = model.model, model.config
    n = len(tokens)
    positions = torch.arange(n)
    causal = positions.unsqueeze(1) >= positions.unsqueeze(0)  # (q, k)
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    with torch.inference_mode():
        hidden = inner.embed_tokens(torch.tensor([tokens]))
        cos, sin = inner.rotary_emb(hidden, positions.unsqueeze(0))
        weights_all = []
        for index, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(1, n, -1, attn.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(1, n, -1, attn.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(1, n, -1, attn.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k = k.repeat_interleave(rep, dim=1)[0]  # (H, T, hd)
            v = v.repeat_interleave(rep, dim=1)[0]
            mask = causal.expand(cfg.num_attention_heads, n, n).clone()
            if hidden_from is not None:
                gone = positions.view(1, n, 1) >= hidden_from[index].view(-1, 1, n)  # (KVH,q,k)
                mask &= ~gone.repeat_interleave(rep, dim=0)
            scores = (q[0] @ k.transpose(1, 2)) * attn.scaling
            weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            weights_all.append(weights)
            out = (weights @ v).transpose(0, 1).reshape(1, n, -1)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = model.lm_head(inner.norm(hidden))[0].float()
    return logits, torch.stack(weights_all)


def prefill(runner, allocation, state, upto: int | None = None, chunk: int = 7):
    """Run the allocation's tokens [computed, upto) in chunks; logits of every token."""
    tokens = allocation.tokens[: upto or allocation.num_tokens]
    out, at = [], allocation.cached_tokens
    while at < len(tokens):
        part = tokens[at : at + chunk]
        (logits,) = runner.forward([Chunk(allocation.pages, part, at, state)], all_logits=True)
        out.append(logits)
        at += len(part)
    return torch.cat(out)


def tracked(rig, model, tokens: list[int], **config):
    """A runner and a compactor over the rig, and `tokens` acquired private and prefilled
    tracked: (runner, compactor, allocation, state, the prefill's logits)."""
    runner = BatchRunner(model, rig.store)
    compactor = Compactor(rig.store, CompactionConfig(**config))
    allocation = rig.cache.acquire(tokens, NS, private=True)
    state = compactor.track(allocation)
    return runner, compactor, allocation, state, prefill(runner, allocation, state)


def decode(runner, allocation, state, new: list[int]) -> torch.Tensor:
    """Feed `new` one token a step (as the scheduler's decode does); their logits."""
    out = []
    for token in new:
        start = allocation.num_tokens
        assert allocation.extend([token])
        out.append(runner.forward([Chunk(allocation.pages, [token], start, state)])[0])
    return torch.stack(out)


def dropped_from(state, length: int, at: int, before: torch.Tensor | None = None):
    """`hidden_from` for `reference`: keys of [dense, at) the state's segment no longer
    holds are hidden from position `at` on (`before`: earlier drops, kept)."""
    L, H = state.num_layers, state.num_kv_heads  # noqa: N806
    hidden = before.clone() if before is not None else torch.full((L, H, length), 10**9)
    if hidden.shape[2] < length:
        pad = torch.full((L, H, length - hidden.shape[2]), 10**9)
        hidden = torch.cat([hidden, pad], dim=2)
    for layer in range(L):
        for head in range(H):
            n = int(state.segment.lengths[layer, head])
            kept = set(state.segment.positions[layer, head, :n].tolist())
            for pos in range(state.dense_tokens, at):
                if pos not in kept:
                    hidden[layer, head, pos] = min(int(hidden[layer, head, pos]), at)
    return hidden


def test_tracked_path_equals_hf_and_its_scores_are_the_attention_received(tiny):
    with make_rig(tiny, page_tokens=P, num_pages=32) as rig:
        runner = BatchRunner(tiny, rig.store)
        compactor = Compactor(rig.store, CompactionConfig(policy="h2o", window=5))
        tokens = make_prompt(23, seed=1)
        allocation = rig.cache.acquire(tokens, NS, private=True)
        state = compactor.track(allocation, SCORES)
        logits = prefill(runner, allocation, state)
        logits = torch.cat([logits, decode(runner, allocation, state, [3, 9])])
        ref_logits, weights = reference(tiny, allocation.tokens)
        assert max_diff(logits, ref_logits) < 1e-4
        # Every key's received weight, summed over queries and the query heads of its KV head.
        per_kv = weights.view(2, 2, 2, 25, 25).sum(dim=2)  # (L, KVH, q, k)
        accumulated, window = state.scores(25)
        assert max_diff(accumulated, per_kv.sum(dim=2)) < 1e-4
        # The window holds at least the last 5 queries, in whole chunks back to the one
        # that completes them: the third chunk's last 5 (16-20), the last chunk's 2 and
        # the two decode steps.
        assert state.window_queries() == 9
        assert max_diff(window, per_kv[:, :, 16:].sum(dim=2)) < 1e-4
        allocation.release()
        rig.check_integrity()


@pytest.mark.parametrize("policy", ["streaming_llm", "h2o", "snapkv"])
def test_compacted_sequence_attends_as_if_its_dropped_keys_were_masked(tiny, policy):
    """Cold prompt, compacted to half per head, decoded, compacted again, decoded: every
    logit equals a plain forward whose attention hides each head's dropped keys from the
    compaction on."""
    with make_rig(tiny, page_tokens=P, num_pages=40) as rig:
        params = {"adaptive": True} if policy != "streaming_llm" else {}
        runner, compactor, allocation, state, prefilled = tracked(
            rig, tiny, make_prompt(30, seed=2), policy=policy, params=params, window=4
        )
        logits = [prefilled]
        free = rig.store.num_free
        first = compactor.compact(allocation, state, budget=0.5)
        # 30 tokens on 8 pages; half of each stream is 15 tokens = 4 lanes, or with
        # adaptive budgets different lanes per head, 16 lanes in all on 4-lane pages.
        assert first.pages_before == 8 and first.tokens_before == 30
        assert first.kept.sum(dim=1).tolist() == [30, 30]  # per layer: 2 heads x 15
        assert rig.store.num_free - free == first.pages_freed == 8 - first.pages_after
        assert first.pages_after == -(-int((-(-first.kept // P)).sum()) // 4)
        state.check_integrity(allocation.pages, allocation.num_tokens)
        hidden = dropped_from(state, 30, 30)
        logits.append(decode(runner, allocation, state, make_prompt(9, seed=3)))
        second = compactor.compact(allocation, state, budget=8)
        if policy == "streaming_llm":
            assert second.kept.tolist() == [[8, 8], [8, 8]]
        assert int(second.kept.sum()) == 32
        state.check_integrity(allocation.pages, allocation.num_tokens)
        hidden = dropped_from(state, 39, 39, hidden)
        logits.append(decode(runner, allocation, state, make_prompt(4, seed=4)))
        ref_logits, _ = reference(tiny, allocation.tokens, dropped_from(state, 43, 39, hidden))
        assert max_diff(torch.cat(logits), ref_logits) < 1e-4
        rig.cache.check_integrity()
        allocation.release()
        rig.check_integrity()


def test_keeping_everything_moves_every_token_into_lanes_and_changes_nothing(tiny):
    with make_rig(tiny, page_tokens=P, num_pages=32) as rig:
        runner, compactor, allocation, state, prefilled = tracked(
            rig, tiny, make_prompt(17, seed=6), policy="streaming_llm"
        )
        logits = [prefilled]
        result = compactor.compact(allocation, state, budget=1.0)
        # 17 tokens: 5 lanes per stream, 20 lanes = 5 pages: nothing to free.
        assert (result.pages_before, result.pages_after, result.pages_freed) == (5, 5, 0)
        logits.append(decode(runner, allocation, state, [1, 2, 3, 4, 5]))
        ref_logits, _ = reference(tiny, allocation.tokens)
        assert max_diff(torch.cat(logits), ref_logits) < 1e-4
        allocation.release()
        rig.check_integrity()


def test_after_a_hit_only_what_follows_the_shared_prefix_is_compacted(tiny):
    with make_rig(tiny, page_tokens=P, num_pages=48) as rig:
        runner = BatchRunner(tiny, rig.store)
        compactor = Compactor(rig.store, CompactionConfig(policy="h2o"))
        prefix = make_prompt(16, seed=7)
        owner = rig.cache.acquire(prefix, NS)
        runner.forward([Chunk(owner.pages, prefix, 0)])
        owner.publish(16)
        owner.release()
        shared = list(owner.pages[:4])
        before = rig.store.read_pages(shared).clone()
        generations = rig.store.generations(shared)

        tokens = prefix + make_prompt(22, seed=8)
        allocation = rig.cache.acquire(tokens, NS, private=True)
        assert allocation.cached_tokens == 16 and allocation.pages[:4] == shared
        state = compactor.track(allocation)
        assert state.dense_pages == 4 and state.dense_tokens == 16
        logits = [prefill(runner, allocation, state)]
        free = rig.store.num_free
        result = compactor.compact(allocation, state, budget=0.25)
        # 38 - 16 = 22 compactable tokens on 6 pages; a quarter is 6 tokens = 2 lanes a
        # stream, 8 lanes = 2 pages.
        assert (result.pages_before, result.pages_after, result.pages_freed) == (6, 2, 4)
        assert rig.store.num_free - free == 4
        assert allocation.pages[:4] == shared
        state.check_integrity(allocation.pages, allocation.num_tokens)
        rig.cache.check_integrity()
        hidden = dropped_from(state, 38, 38)
        logits.append(decode(runner, allocation, state, [11, 12, 13]))
        ref_logits, _ = reference(tiny, allocation.tokens, dropped_from(state, 41, 38, hidden))
        assert max_diff(torch.cat(logits), ref_logits[16:]) < 1e-4
        # The shared pages are whole and unchanged, and nothing compacted is ever shared.
        assert torch.equal(rig.store.read_pages(shared), before)
        assert rig.store.generations(shared) == generations
        assert allocation.publish(allocation.num_tokens) == 0
        allocation.release()
        assert rig.cache.match_length(tokens, NS) == 16
        rig.check_integrity()


def test_free_and_reallocate_refuses_bad_arguments_and_changes_nothing(tiny):
    with make_rig(tiny, page_tokens=P, num_pages=16) as rig:
        allocation = rig.cache.acquire(make_prompt(10, seed=9), NS, private=True)
        pages = list(allocation.pages)
        with pytest.raises(ValueError, match="cannot keep 4 of an allocation's 3"):
            allocation.free_and_reallocate(4, 10)
        with pytest.raises(ValueError, match="tail_start 11 outside"):
            allocation.free_and_reallocate(1, 11)
        assert allocation.pages == pages and allocation.compacted is None
        freed = allocation.free_and_reallocate(1, 10)
        assert freed == pages[1:] and allocation.pages == pages[:1]
        assert allocation.capacity == 10 and allocation.extend([1]) and len(allocation.pages) == 2
        allocation.release()
        rig.check_integrity()


def test_compaction_config_is_checked():
    with pytest.raises(ValueError, match="unknown compaction policy 'lru'; known: none, h2o"):
        CompactionConfig(policy="lru")
    with pytest.raises(ValueError, match="high_water"):
        CompactionConfig(policy="h2o", high_water=0.0)
    with pytest.raises(ValueError, match="without a policy"):
        CompactionConfig(params={"sinks": 2})
    with pytest.raises(ValueError):
        CompactionConfig(policy="streaming_llm", params={"sink": 2})
    with pytest.raises(ValueError):
        CompactionConfig(policy="h2o", budget=0)
