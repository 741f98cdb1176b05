"""Tests for workers/serving/model_loader.py: the weights cache (built once, atomically,
rebuilt when stale), the model's end-of-turn ids, the plain full forward, and the real
model's cached folder.

The SmolLM2 tests (marked slow) load the real model (the first load on a machine
dequantises its GGUF, about 30 s)."""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

import workers.serving.model_loader as model_loader
from tests.workers.model_fixtures import make_prompt, max_diff
from workers.serving.model_loader import (
    ModelSpec,
    default_cache_dir,
    eos_token_ids,
    full_prefill_logits,
    load_model,
    load_smollm2,
    load_tokenizer,
    rope_theta,
    smollm2_shaped,
    tiny_llama,
)
from workers.serving.models import KNOWN_MODELS


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=0)


@pytest.mark.slow
def test_smollm2_eos_is_im_end(smollm2):
    model, tokenizer = smollm2
    assert eos_token_ids(model, tokenizer) == {2}
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


def test_smollm2_shaped_is_the_known_shape_seeded_tied_in_any_dtype():
    shape, expected = model_loader.SMOLLM2_135M_SHAPE, KNOWN_MODELS["smollm2-135m"]
    kv = (shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"])
    assert kv == expected[:3]
    assert (shape["max_position_embeddings"], shape["vocab_size"]) == expected[3:]
    # Fewer layers and tokens than the real shape: the same code, built in a blink.
    small = {"num_hidden_layers": 1, "vocab_size": 1024}
    model = smollm2_shaped(seed=4, dtype=torch.bfloat16, **small)
    config = model.config
    sizes = (config.hidden_size, config.intermediate_size, config.num_attention_heads)
    assert sizes == (576, 1536, 9)
    assert (config.num_key_value_heads, config.head_dim, rope_theta(config)) == (3, 64, 1e5)
    assert model.dtype == torch.bfloat16 and not model.training
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    again = smollm2_shaped(seed=4, **small)  # float32: the same draws, unrounded
    assert torch.equal(again.model.embed_tokens.weight.bfloat16(), model.model.embed_tokens.weight)


@pytest.mark.slow
def test_smollm2_shaped_has_the_real_models_config(smollm2):
    real = smollm2[0].config
    for field, value in model_loader.SMOLLM2_135M_SHAPE.items():
        if field == "rope_theta":
            assert rope_theta(real) == value
        else:
            assert getattr(real, field) == pytest.approx(value, rel=1e-6), field


def test_eos_token_ids_unions_every_source():
    # stand-ins holding only the attributes read: an id, a list of ids, or None in each
    obj = SimpleNamespace
    model = obj(generation_config=obj(eos_token_id=[2, 7]), config=obj(eos_token_id=0))
    assert eos_token_ids(model, obj(eos_token_id=9)) == {0, 2, 7, 9}
    assert eos_token_ids(obj(generation_config=None, config=obj(eos_token_id=None))) == set()
    assert eos_token_ids(obj(config=obj(eos_token_id=(3, None))), obj(eos_token_id=None)) == {3}


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


@pytest.mark.slow
def test_the_tokenizer_alone_loads_from_the_cache_or_the_gguf_without_weights(
    smollm2, tmp_path, monkeypatch
):
    # What an attached front door loads: never the weights (a front door's threads once
    # all loaded the model at the same time on first use, and some failed).
    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    _, tokenizer = smollm2
    text = "<|im_start|>user\nhello there<|im_end|>"
    cached = load_tokenizer()  # from the cache the fixture's load left
    from_gguf = load_tokenizer(cache_dir=tmp_path / "no-cache-here")
    assert cached.encode(text) == from_gguf.encode(text) == tokenizer.encode(text)
    assert not (tmp_path / "no-cache-here").exists()  # reading it writes nothing


def test_model_cache_is_built_once_atomically_and_rebuilt_when_stale(tmp_path, monkeypatch, tiny):
    """`load_model` over a stand-in GGUF whose "dequantisation" returns the tiny model."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"v1")
    builds = []

    def load_gguf(path):
        builds.append(path)
        return tiny, word_tokenizer()

    monkeypatch.setattr(model_loader, "gguf_path", lambda spec: gguf)
    monkeypatch.setattr(model_loader, "_load_gguf", load_gguf)
    spec = ModelSpec("tiny", "no_such_package", gguf.name)
    cache_dir = tmp_path / "cache" / "tiny"

    def load():
        model, _ = load_model(spec, cache_dir)
        for name, tensor in tiny.state_dict().items():
            assert torch.equal(model.state_dict()[name], tensor), name

    def crash(*args, **kwargs):
        raise RuntimeError("killed mid-write")

    with monkeypatch.context() as patch:
        patch.setattr(model_loader, "_save_weights", crash)
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
    monkeypatch.setattr(model_loader.tempfile, "tempdir", str(tmp_path / "tmp"))
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


def test_full_prefill_logits_are_the_last_position_of_a_plain_forward(tiny):
    tokens = make_prompt(13, seed=4)
    logits = full_prefill_logits(tiny, tokens)
    assert logits.shape == (tiny.config.vocab_size,) and logits.dtype == torch.float32
    with torch.inference_mode():
        every = tiny(input_ids=torch.tensor([tokens])).logits[0]  # (13, vocab)
    assert max_diff(logits, every[-1]) < 1e-5
    assert max_diff(logits, every[-2]) > 1e-2  # not some other position's
