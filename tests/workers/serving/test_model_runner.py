"""Tests for workers/serving/model_runner.py: prefill of only the uncached suffix with the prefix
read from pages gives the logits, tokens and KV of a plain full forward.

The tiny random model runs in milliseconds; the SmolLM2 tests (marked slow) load the real
model once per module (the first load on a machine dequantises its GGUF, about 30 s).
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

import workers.serving.model_runner as model_runner
from tests.workers.model_fixtures import (
    NS,
    compute,
    held_kv,
    make_prompt,
    make_rig,
    max_diff,
    reference_greedy,
    reference_kv,
)
from workers.serving.model_runner import (
    LayoutMismatchError,
    ModelRunner,
    ModelSpec,
    default_cache_dir,
    eos_token_ids,
    load_model,
    load_smollm2,
    store_layout_for,
    tiny_llama,
)
from workers.serving.sampling import SamplingParams
from workers.store.page_store import SharedPageStore, StoreLayout

TOL = 1e-4  # max abs logit difference allowed against a full prefill (fp32)
PAGE = 4
N = 22  # prompt length: 5 full pages and a partial one
FILLER = make_prompt(8, seed=99, low=200, high=256)  # never equal to a prompt token


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=0)


def donor_for(prompt: list[int], shared: int) -> list[int]:
    """A prompt that shares exactly its first `shared` tokens with `prompt`."""
    return prompt[:shared] + FILLER


# ---------------------------------------------------------------------------- tiny model


@pytest.mark.parametrize(
    "split",
    [0, 6, 8, N - 1],
    ids=["nothing-cached", "inside-a-page", "page-boundary", "all-but-last"],
)
def test_prefill_reusing_pages_matches_full_prefill(tiny, split):
    prompt = make_prompt(N)
    with make_rig(tiny) as rig:
        if split:
            compute(rig, donor_for(prompt, split))
        allocation, result = compute(rig, prompt, release=False)
        assert allocation.cached_tokens == split
        assert result.computed_tokens == N - split
        assert max_diff(result.logits, rig.runner.full_prefill_logits(prompt)) < TOL
        # every slot, reused or computed, holds what a plain forward computes
        held = held_kv(rig.store, allocation.pages, N)
        assert max_diff(held, reference_kv(tiny, prompt)) < 1e-5
        allocation.release()
        rig.check_integrity()


def test_copy_on_write_partial_page(tiny):
    prompt = make_prompt(N)
    with make_rig(tiny) as rig:
        donor, _ = compute(rig, donor_for(prompt, 6))
        donor_page = rig.store.read_pages([donor.pages[1]])
        allocation, result = compute(rig, prompt, release=False)
        # one full page shared, two tokens of the second copied into a private page
        assert allocation.cached_tokens == 6
        assert allocation.pages[0] == donor.pages[0]
        assert allocation.pages[1] != donor.pages[1]
        assert max_diff(result.logits, rig.runner.full_prefill_logits(prompt)) < TOL
        # the suffix went into the copy, never into the shared source page
        assert torch.equal(rig.store.read_pages([donor.pages[1]]), donor_page)
        allocation.release()
        rig.check_integrity()


def test_generate_matches_uncached_greedy(tiny):
    prompt = make_prompt(N, seed=1)
    with make_rig(tiny) as rig:
        compute(rig, donor_for(prompt, 13))
        allocation = rig.cache.acquire(prompt, NS)
        assert allocation.cached_tokens == 13
        result = rig.runner.generate(allocation, max_new_tokens=8)
        assert result.token_ids == reference_greedy(rig.runner, prompt, 8)
        assert result.finish_reason == "length"
        assert result.prefill.computed_tokens == N - 13
        # all but the last new token were appended and computed into the pages
        assert allocation.tokens == prompt + result.token_ids[:-1]
        held = held_kv(rig.store, allocation.pages, allocation.num_tokens)
        assert max_diff(held, reference_kv(tiny, allocation.tokens)) < 1e-5
        allocation.publish(allocation.num_tokens)
        allocation.release()
        # a follow-up turn reuses the answer's pages
        follow_up = compute(rig, allocation.tokens + FILLER[:3])[0]
        assert follow_up.cached_tokens == (N + 7) // PAGE * PAGE
        rig.check_integrity()


def test_decode_step_reads_prefix_from_pages(tiny):
    prompt = make_prompt(N, seed=2)
    with make_rig(tiny) as rig:
        allocation, result = compute(rig, prompt, release=False)
        tokens, logits = list(prompt), result.logits
        for _ in range(6):  # crosses from the partial page into a new one
            tokens.append(int(torch.argmax(logits)))
            assert allocation.extend(tokens[-1:])
            logits = rig.runner.decode_step(allocation.pages, tokens, len(tokens) - 1)
            assert max_diff(logits, rig.runner.full_prefill_logits(tokens)) < TOL
        assert (
            max_diff(held_kv(rig.store, allocation.pages, len(tokens)), reference_kv(tiny, tokens))
            < 1e-5
        )
        allocation.release()
        rig.check_integrity()


def test_generate_stops_on_stop_token(tiny):
    prompt = make_prompt(N, seed=3)
    with make_rig(tiny) as rig:
        first = reference_greedy(rig.runner, prompt, 1)[0]
        allocation = rig.cache.acquire(prompt, NS)
        result = rig.runner.generate(allocation, max_new_tokens=8, stop_token_ids={first})
        assert result.token_ids == [first] and result.finish_reason == "stop"
        assert allocation.tokens == prompt
        allocation.release()
        rig.check_integrity()


def test_generate_out_of_pages_is_an_ordinary_result(tiny):
    prompt = make_prompt(8, seed=4)  # exactly two pages, and the store has only two
    with make_rig(tiny, num_pages=2) as rig:
        allocation = rig.cache.acquire(prompt, NS)
        result = rig.runner.generate(allocation, max_new_tokens=4)
        assert result.finish_reason == "out_of_pages"
        assert result.token_ids == reference_greedy(rig.runner, prompt, 1)
        assert allocation.tokens == prompt
        allocation.release()
        rig.check_integrity()


def hf_greedy(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """HF's own greedy `generate` (its DynamicCache, no pages): the new tokens."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("seed", "finish"), [(1, "stop"), (3, "length"), (16, "stop"), (12, "length")]
)
def test_greedy_generate_matches_hf_generate(tiny, seed, finish):
    prompt = make_prompt(N, seed=seed)
    with make_rig(tiny) as rig:
        compute(rig, donor_for(prompt, 9))
        allocation = rig.cache.acquire(prompt, NS)
        assert allocation.cached_tokens == 9
        # HF stops at the model's EOS (the tiny config's default, id 2), so the runner is
        # told the same stop tokens.
        stops = eos_token_ids(tiny)
        result = rig.runner.generate(allocation, max_new_tokens=12, stop_token_ids=stops)
        expected = hf_greedy(tiny, prompt, 12)
        assert result.token_ids == expected
        assert result.finish_reason == finish
        assert (expected[-1] in stops) == (finish == "stop")
        assert result.seed is None
        allocation.release()
        rig.check_integrity()


def test_stop_token_ends_generation_as_hf_eos_does(tiny):
    prompt = make_prompt(N, seed=1)
    greedy = hf_greedy(tiny, prompt, 12, eos_token_id=None)
    assert len(greedy) == 12
    # the first token not seen before step k = 5, so it first appears there
    k = next(i for i in range(5, 12) if greedy[i] not in greedy[:i])
    stop = greedy[k]
    with make_rig(tiny) as rig:
        allocation = rig.cache.acquire(prompt, NS)
        result = rig.runner.generate(allocation, max_new_tokens=12, stop_token_ids=[stop])
        assert result.finish_reason == "stop"
        assert result.token_ids == greedy[: k + 1]
        assert result.token_ids == hf_greedy(tiny, prompt, 12, eos_token_id=stop)
        # the stop token is returned but never run: its KV is not in the pages
        assert allocation.tokens == prompt + greedy[:k]
        allocation.release()
        rig.check_integrity()


SAMPLING = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)


def test_seeded_sampling_is_the_same_cold_and_over_cached_pages(tiny):
    """The cached run's logits come from gathered pages, not a full prefill: equal to
    ~1e-5, not bit for bit (about 4e-6 apart here). The seeded tokens must not care."""
    prompt = make_prompt(N, seed=5)
    with make_rig(tiny) as rig:
        runs = []
        for expect_cached in (0, N - 2):  # the second run finds the first's prompt pages
            allocation = rig.cache.acquire(prompt, NS)
            assert allocation.cached_tokens == expect_cached
            result = rig.runner.generate(allocation, 12, sampling=SAMPLING)
            assert result.finish_reason == "length" and result.seed == SAMPLING.seed
            runs.append(result)
            allocation.publish(len(prompt))
            allocation.release()
        cold, cached = runs
        assert max_diff(cold.prefill.logits, cached.prefill.logits) < TOL
        assert cold.token_ids == cached.token_ids and len(cold.token_ids) == 12
        other_seed = SamplingParams.from_dict(SAMPLING.to_dict() | {"seed": 4321})
        allocation = rig.cache.acquire(prompt, NS)
        other = rig.runner.generate(allocation, 12, sampling=other_seed)
        assert other.token_ids != cold.token_ids
        allocation.release()
        rig.check_integrity()


def test_unseeded_sampling_reports_its_seed_for_a_replay(tiny):
    prompt = make_prompt(N, seed=5)
    with make_rig(tiny) as rig:
        allocation = rig.cache.acquire(prompt, NS)
        first = rig.runner.generate(allocation, 8, sampling=SamplingParams(temperature=1.0))
        allocation.release()
        allocation = rig.cache.acquire(prompt, NS)
        replay = SamplingParams(temperature=1.0, seed=first.seed)
        assert rig.runner.generate(allocation, 8, sampling=replay).token_ids == first.token_ids
        allocation.release()
        rig.check_integrity()


@pytest.mark.parametrize("stop", [False, True], ids=["length", "stop"])
def test_on_token_streams_each_token_before_the_next_forward(tiny, stop):
    prompt = make_prompt(N, seed=6)
    with make_rig(tiny) as rig:
        greedy = reference_greedy(rig.runner, prompt, 8)
        k = next(i for i in range(2, 8) if greedy[i] not in greedy[:i])
        stops = {greedy[k]} if stop else set()
        allocation = rig.cache.acquire(prompt, NS)
        seen: list[int] = []

        def on_token(token: int) -> None:
            # called before the token is appended and computed
            assert allocation.tokens == prompt + seen
            seen.append(token)

        result = rig.runner.generate(allocation, 8, stop_token_ids=stops, on_token=on_token)
        assert seen == result.token_ids
        assert seen == (greedy[: k + 1] if stop else greedy)
        allocation.release()
        rig.check_integrity()


def test_an_on_token_error_ends_generation_with_the_pages_consistent(tiny):
    prompt = make_prompt(N, seed=7)

    def on_token(token: int) -> None:
        raise RuntimeError(f"client gone at {token}")

    with make_rig(tiny) as rig:
        allocation = rig.cache.acquire(prompt, NS)
        with pytest.raises(RuntimeError, match="client gone"):
            rig.runner.generate(allocation, 8, on_token=on_token)
        assert allocation.tokens == prompt
        held = held_kv(rig.store, allocation.pages, allocation.num_tokens)
        assert max_diff(held, reference_kv(tiny, prompt)) < 1e-5
        allocation.release()
        rig.check_integrity()


def test_wrong_kv_in_a_page_is_detected(tiny):
    """The tolerance means something: one page holding another prompt's KV (what a
    hash-only match would serve) moves the logits far beyond it."""
    prompt, other = make_prompt(N, seed=6), make_prompt(N, seed=60)
    with make_rig(tiny) as rig:
        allocation, _ = compute(rig, prompt, release=False)
        stranger, _ = compute(rig, other, release=False)
        pages = list(allocation.pages)
        pages[2] = stranger.pages[2]  # same positions 8..11, other tokens
        result = rig.runner.prefill(pages, prompt, 20)
        assert max_diff(result.logits, rig.runner.full_prefill_logits(prompt)) > 100 * TOL
        for held in (allocation, stranger):
            held.release()
        rig.check_integrity()


@pytest.mark.parametrize(
    ("field", "value", "model_value"),
    [
        ("num_layers", 3, 2),
        ("num_kv_heads", 4, 2),
        ("head_dim", 8, 16),
        ("dtype", "float16", "float32"),
    ],
)
def test_layout_mismatch_names_both_values(tiny, field, value, model_value):
    fields = store_layout_for(tiny, 4, PAGE).__dict__ | {field: value}
    with SharedPageStore.create(StoreLayout(**fields), tag="mismatch") as store:
        with pytest.raises(
            LayoutMismatchError, match=rf"{field}.* is {value}.* model's is {model_value}"
        ):
            ModelRunner(tiny, store)
        store.check_integrity()


def test_sliding_window_model_is_refused():
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
    with SharedPageStore.create(store_layout_for(model, 2, PAGE), tag="mistral") as store:
        with pytest.raises(ValueError, match="full attention in every layer"):
            ModelRunner(model, store)
        store.check_integrity()


def test_workspace_reuse_leaks_nothing_between_sequences(tiny):
    long_prompt, prompt = make_prompt(300, seed=10), make_prompt(N, seed=11)
    with make_rig(tiny, num_pages=100) as rig:
        compute(rig, long_prompt)  # leaves the workspace full of another sequence's KV
        compute(rig, donor_for(prompt, 6))
        _, result = compute(rig, prompt)
        assert result.computed_tokens == N - 6
        assert max_diff(result.logits, rig.runner.full_prefill_logits(prompt)) < TOL
        rig.check_integrity()


def test_attached_store_is_refused(tiny):
    with make_rig(tiny) as rig, SharedPageStore.attach(rig.store.name) as reader:
        with pytest.raises(LayoutMismatchError, match="read-only"):
            ModelRunner(tiny, reader)
        rig.check_integrity()


def test_bad_requests_raise_and_change_nothing(tiny):
    prompt = make_prompt(N, seed=7)
    with make_rig(tiny) as rig:
        allocation, _ = compute(rig, prompt, release=False)
        before = rig.store.read_pages(allocation.pages)
        runner, pages = rig.runner, allocation.pages
        with pytest.raises(ValueError, match=r"cached_tokens 22 outside \[0, 22\)"):
            runner.prefill(pages, prompt, N)
        with pytest.raises(ValueError, match="22 tokens need 6 pages of 4 tokens, got 5"):
            runner.prefill(pages[:5], prompt, 0)
        with pytest.raises(ValueError, match=r"token id 256 outside the model's vocab \[0, 256\)"):
            runner.prefill(pages, [*prompt[:-1], 256], 4)
        with pytest.raises(ValueError, match="max_new_tokens"):
            runner.generate(allocation, -1)
        assert torch.equal(rig.store.read_pages(allocation.pages), before)
        assert allocation.tokens == prompt
        allocation.release()
        rig.check_integrity()


# ---------------------------------------------------------------------------- SmolLM2

CHAT = [
    {
        "role": "system",
        "content": "You are a careful assistant for a team that runs LLM inference services. "
        "Answer in plain English, in short paragraphs, and say when you are unsure. "
        "The team cares about latency, memory, and correctness above all else.",
    },
    {
        "role": "user",
        "content": "Our service keeps the attention keys and values of every prompt in fixed "
        "size pages of shared memory. When a new prompt starts with the same tokens as an "
        "earlier one, a worker copies those pages instead of computing them again, and only "
        "runs the model on the rest of the prompt. Pages are indexed in a trie keyed by the "
        "exact token ids, so two prompts share a page only when every token in it matches. "
        "Workers on other machines can fetch pages over the network from the worker that "
        "holds them, and a central service tracks which worker holds which prefix. "
        "Each page carries a generation counter that changes when the page is freed or "
        "rewritten, so a reader can tell a stale copy from a good one. Explain in three "
        "sentences why reusing cached pages reduces the time to the first token, and what "
        "could go wrong if the page index matched prompts by hash alone without comparing "
        "the tokens. Then list two ways a worker could check that a copied page is still "
        "valid after the copy, and say which one you would choose for a cluster where "
        "workers come and go every few minutes and the network sometimes drops messages. "
        "Keep the whole answer under two hundred words.",
    },
]


@pytest.fixture(scope="module")
def smollm2():
    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    print(f"\nSmolLM2 load: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return model, tokenizer


def chat_prompt(tokenizer, n: int) -> list[int]:
    tokens = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert len(tokens) >= n, f"chat prompt has {len(tokens)} tokens, {n} wanted"
    return list(tokens)


@pytest.mark.slow
def test_smollm2_reuses_a_250_token_prefix(smollm2):
    model, tokenizer = smollm2
    prompt = chat_prompt(tokenizer, 290)
    n = len(prompt)
    with make_rig(model, num_pages=48, page_tokens=16, tag="smollm2") as rig:
        other_ending = tokenizer.encode(" Please answer in French instead.")
        compute(rig, prompt[:250] + other_ending)
        allocation = rig.cache.acquire(prompt, NS)
        assert allocation.cached_tokens == 250  # 15 full pages and 10 tokens copied
        result = rig.runner.generate(allocation, max_new_tokens=8)
        full = rig.runner.full_prefill_logits(prompt)
        assert max_diff(result.prefill.logits, full) < TOL
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            expected = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False
            )[0, n:].tolist()
        assert result.token_ids == expected
        print(
            f"\nSmolLM2 {n}-token chat prompt, 250 cached: {result.prefill}; 8 tokens "
            f"{tokenizer.decode(result.token_ids)!r}",
            file=sys.stderr,
        )
        allocation.release()
        rig.check_integrity()


@pytest.mark.slow
def test_smollm2_eos_is_im_end(smollm2):
    model, tokenizer = smollm2
    assert eos_token_ids(model, tokenizer) == {2}
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


def test_eos_token_ids_unions_every_source():
    # stand-ins holding only the attributes read: an id, a list of ids, or None in each
    obj = SimpleNamespace
    model = obj(generation_config=obj(eos_token_id=[2, 7]), config=obj(eos_token_id=0))
    assert eos_token_ids(model, obj(eos_token_id=9)) == {0, 2, 7, 9}
    assert eos_token_ids(obj(generation_config=None, config=obj(eos_token_id=None))) == set()
    assert eos_token_ids(obj(config=obj(eos_token_id=(3, None))), obj(eos_token_id=None)) == {3}


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
        runner = rig.runner
        runner.prefill(pages, tokens[:64], 0)  # warm-up: first-call allocations
        prefill_512 = runner.prefill(pages, tokens[:512], 0)
        full = runner.prefill(pages, tokens, 0)
        suffix = runner.prefill(pages, tokens, 1024)
        assert max_diff(suffix.logits, full.logits) < TOL
        print(
            f"\nSmolLM2, one thread: prefill 512 tokens: {prefill_512.total_s:.3f} s; 1088 tokens: "
            f"{full.total_s:.3f} s; 64-token suffix over a 1024-token prefix: "
            f"{suffix.total_s:.3f} s (gather {suffix.gather_s * 1e3:.1f} ms, forward "
            f"{suffix.forward_s * 1e3:.1f} ms, scatter {suffix.scatter_s * 1e3:.1f} ms)",
            file=sys.stderr,
        )
        # 64 of 1088 tokens: far under half the cost even on a noisy machine
        assert suffix.total_s < 0.5 * full.total_s
        rig.store.free(pages)
        rig.check_integrity()


@pytest.mark.slow
def test_smollm2_loads_from_its_cache(smollm2):
    model, _ = smollm2
    start = time.perf_counter()
    again, _ = load_smollm2()  # the module fixture's load left the cache in place
    elapsed = time.perf_counter() - start
    print(f"\nSmolLM2 cached load: {elapsed:.2f} s", file=sys.stderr)
    ids = torch.tensor([[1, 9690, 198, 2683, 359]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, again(ids).logits)
    # The folder is an HF checkpoint other engines load too (vLLM): the tied output layer
    # is stored once, under the embedding's name, and the config names the architecture.
    folder = default_cache_dir()
    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]


def test_model_cache_is_built_once_atomically_and_rebuilt_when_stale(tmp_path, monkeypatch, tiny):
    """`load_model` over a stand-in GGUF whose "dequantisation" returns the tiny model."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"v1")
    builds = []

    def load_gguf(path):
        builds.append(path)
        return tiny, word_tokenizer()

    monkeypatch.setattr(model_runner, "gguf_path", lambda spec: gguf)
    monkeypatch.setattr(model_runner, "_load_gguf", load_gguf)
    spec = ModelSpec("tiny", "no_such_package", gguf.name)
    cache_dir = tmp_path / "cache" / "tiny"

    def load():
        model, _ = load_model(spec, cache_dir)
        for name, tensor in tiny.state_dict().items():
            assert torch.equal(model.state_dict()[name], tensor), name

    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-write")

    with monkeypatch.context() as patch:
        patch.setattr(model_runner, "_save_weights", crash)
        with pytest.raises(RuntimeError, match="killed mid-write"):
            load()
    assert list(cache_dir.parent.iterdir()) == []  # no cache, no half-written temp dir

    load()
    load()
    assert len(builds) == 2  # the crashed build and one good one; the last load read the cache
    (cache_dir / "model.safetensors").write_bytes(b"damaged")
    load()
    assert len(builds) == 3
    gguf.write_bytes(b"v2 is longer")  # another package version: the cache is replaced whole
    load()
    assert len(builds) == 4
    assert [p.name for p in cache_dir.parent.iterdir()] == ["tiny"]

    # an unwritable cache directory degrades to a temporary one, removed after the load
    monkeypatch.setattr(model_runner.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cache_dir = tmp_path / "a-file" / "tiny"
    cache_dir.parent.write_text("not a directory")
    load()
    assert len(builds) == 5 and list((tmp_path / "tmp").iterdir()) == []


def word_tokenizer():
    """A tokenizer with no files: one word per id."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(256)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    return PreTrainedTokenizerFast(tokenizer_object=backend)
