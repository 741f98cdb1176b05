"""Fixtures shared by the worker tests: a real service, without Ray."""

from __future__ import annotations

import subprocess

import pytest

from cache_service.server import ServerConfig, make_server
from workers.cache.device_settings import DeviceSettings
from workers.cache.disk_settings import DiskSettings
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
    disk: DiskSettings | None = None,
    secret: bytes = b"",
    share: bool = True,
    device: DeviceSettings | None = None,
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
        disk=disk,
        mesh_secret=secret,
        share=share,
        device=device,
    )
    return Worker(settings, model=model if model is not None else tiny_llama(), tokenizer=None)


@pytest.fixture
def worker(service):
    """Worker "a" on `service` (the tiny model), checked and shut down after the test."""
    worker = make_worker(service, "a")
    yield worker
    worker.check_integrity()
    worker.shutdown()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 128 KiB tmpfs, mounted for the test: a disk that fills up (15 records of the
    disk tests' tiny layout after the lock and file header)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=128k,mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up (needs root): {done.stderr.decode()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)
