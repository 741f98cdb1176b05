"""The model table: names, shapes, dtypes, and the dtype reaching the worker's pages."""

from __future__ import annotations

import pytest
import torch

from workers.cache.prefix_cache import PrefixCacheConfig
from workers.serving import models
from workers.worker import Worker, WorkerSettings


def test_unknown_names_and_dtypes_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'gpt-9'; known: smollm2-135m, tiny"):
        models.model_shape("gpt-9")
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, got 'int8'"):
        models.load("tiny", "int8")


def test_the_tiny_model_loads_in_the_dtype_asked_for_with_the_shape_of_the_table():
    model, tokenizer = models.load("tiny", "bfloat16")
    assert tokenizer is None
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    shape = models.model_shape("tiny")
    assert (model.config.num_hidden_layers, model.config.num_key_value_heads) == shape[:2]


def test_the_configured_dtype_reaches_the_workers_pages(service):
    settings = WorkerSettings(
        worker_id="w",
        node_id="n",
        host="127.0.0.1",
        model="tiny",
        num_pages=16,
        cache=PrefixCacheConfig(page_tokens=4),
        service_address=service.address,
        publish_interval_s=60.0,
        dtype="bfloat16",
    )
    worker = Worker(settings)  # loads the model itself, as the Ray actor does
    try:
        assert worker.store.layout.dtype == "bfloat16"
        out = worker.generate(list(range(1, 11)), 3)
        assert len(out.token_ids) == 3
        worker.check_integrity()
    finally:
        worker.shutdown()
