"""Fixtures of the serving tests: the real model, loaded once per module."""

from __future__ import annotations

import sys
import time

import pytest

from workers.serving.model_loader import load_smollm2


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct and its tokenizer (the first load on a machine dequantises
    its GGUF, about 30 s; later ones read the cache in about a second)."""
    start = time.perf_counter()
    model, tokenizer = load_smollm2()
    print(f"\nSmolLM2 load: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return model, tokenizer
