"""Fixtures shared by the worker tests: a real service, without Ray."""

from __future__ import annotations

import pytest

from cache_service.server import ServerConfig, make_server
from workers.cache.prefix_cache import PrefixCacheConfig
from workers.serving.model_loader import tiny_llama
from workers.worker import Worker, WorkerSettings

SERVICE_PAGE_TOKENS = 4  # the page size of the workers these tests build


@pytest.fixture
def service():
    """A running ServiceServer on loopback (no authentication), checked after the test."""
    server = make_server(ServerConfig(page_tokens=SERVICE_PAGE_TOKENS))
    server.start()
    yield server
    server.stop()
    server.index.check_integrity()


def make_worker(
    service,
    worker_id: str,
    node: str = "n1",
    pages: int = 64,
    copy_policy: str = "always",
    model=None,
) -> Worker:
    """A worker in this process on `service` (the tiny model unless `model` is given),
    publishing only when told (`flush`). Copies whatever is cached by default: the tests
    that use it check what a copy delivers, and the measured policy would rightly
    recompute some tiny-model prompts (tests/workers/transfer/test_costs.py checks it)."""
    settings = WorkerSettings(
        worker_id=worker_id,
        node_id=node,
        host="127.0.0.1",
        model="tiny",
        num_pages=pages,
        cache=PrefixCacheConfig(page_tokens=SERVICE_PAGE_TOKENS),
        service_address=service.address,
        publish_interval_s=60.0,
        copy_policy=copy_policy,
    )
    return Worker(settings, model=model if model is not None else tiny_llama(), tokenizer=None)


@pytest.fixture
def worker(service):
    """Worker "a" on `service` (the tiny model), checked and shut down after the test."""
    worker = make_worker(service, "a")
    yield worker
    worker.check_integrity()
    worker.shutdown()
