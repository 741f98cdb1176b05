"""A worker with a device tier above host memory (tiny model, real service, no Ray): pages
the device evicts go down to host shared memory and come back with the outputs of a run
without any cache, the index follows every demotion, and peers copy its pages (device and host):
on its node through the CUDA IPC handle its segment carries, or, where that cannot be
opened (here: no CUDA), through its page server, as peers on other nodes do.

A CPU store in private memory stands in for the device: the same code as on a GPU, with
plain memory for staging (`workers.tier_setup`)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from cache_service.events import TIERS, Namespace
from tests.workers.conftest import SERVICE_PAGE_TOKENS, make_worker
from workers.cache.device_settings import DeviceSettings
from workers.cache.disk_settings import DiskSettings
from workers.serving.model_loader import full_prefill_logits
from workers.store.digests import page_digests
from workers.tier_setup import device_of

P = SERVICE_PAGE_TOKENS
NS = Namespace("tiny")
PROMPTS = [[(13 * s + 5 * i) % 240 + 3 for i in range(10 * P)] for s in range(5)]
DEVICE = DeviceSettings("cpu", pages=24)  # 2 prompts and a bit; host below: 64 pages


def _same_logits(out, worker, tokens) -> None:
    expected = full_prefill_logits(worker.batch_runner.model, tokens)
    got = torch.tensor(out.logits)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def _index_view(worker, tokens: list[int]) -> bytes:
    """The tiers the index names for the worker's pages of `tokens`, as codes."""
    _, spans = worker.member.client.match(NS, tokens)
    for span in spans:
        if span.worker_id == worker.worker_id:
            return bytes(span.tiers or bytes([TIERS.index(span.tier)]) * len(span.page_ids))
    return b""


def _local_view(worker, tokens: list[int]) -> bytes:
    """What the worker holds of `tokens` itself: device pages, then its tiers' records."""
    member = worker.member
    held = member.cache.match_length(tokens, NS) // P
    view = bytes([0]) * held
    digests = page_digests(NS, member.store.kv_format, tokens, P)
    for tier in member.below.chain():
        found = len(tier.records.chain(digests, held))
        view += bytes([TIERS.index(tier.name)]) * found
        held += found
    return view


@contextlib.contextmanager
def _trio(service, **gpu):
    """A worker "g" with a device tier (and `gpu`'s settings), a plain one on its node and
    one on another node, peers of each other; checked and shut down afterwards."""
    workers = [
        make_worker(service, "g", "n1", device=DEVICE, **gpu),
        make_worker(service, "b", "n1"),
        make_worker(service, "c", "n2"),
    ]
    try:
        infos = [w.info() for w in workers]
        for w in workers:
            w.set_peers(infos)
        yield workers
        for w in workers:
            w.check_integrity()
    finally:
        for w in workers:
            w.shutdown()


def test_device_settings_are_checked():
    with pytest.raises(ValueError, match="store.device 'tpu'"):
        DeviceSettings("tpu", 8)
    with pytest.raises(ValueError, match="device_pages must be a positive int"):
        DeviceSettings("cuda", 0)
    if not torch.cuda.is_available():
        assert device_of(DeviceSettings("auto", 8)) is None  # no GPU: no device tier
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            device_of(DeviceSettings("cuda", 8))
    assert device_of(None) is None and device_of(DEVICE) == torch.device("cpu")


def test_a_write_through_disk_under_a_device_tier_is_refused(service, tmp_path):
    disk = DiskSettings(str(tmp_path / "disk"), 16, "write_through")
    with pytest.raises(ValueError, match="write_through disk under a device tier"):
        make_worker(service, "a", disk=disk, device=DEVICE)


def test_evicted_device_pages_come_back_from_host_memory_and_the_index_follows(service):
    worker = make_worker(service, "a", pages=64, device=DEVICE)
    try:
        member = worker.member
        assert member.store.num_pages == 24 and not member.store.pages_in_segment
        assert member.info().shm_name == member.store.name  # its segment: metadata only
        for prompt in PROMPTS:  # 5 x 10 pages through 24 on the device: the early go down
            worker.generate(prompt + [1], 2)
            assert worker.flush()
            for other in PROMPTS:  # after each step: the index says what it holds, and where
                assert _index_view(worker, other) == _local_view(worker, other)
        assert member.below.demotions > 0
        first = PROMPTS[0] + [7, 7]
        assert member.cache.match_length(first, NS) < 10 * P  # not on the device any more
        out = worker.generate(first, 2, return_logits=True)
        assert out.stats.local_hit_tokens == 10 * P and out.stats.remote_hit_tokens == 0
        assert out.stats.disk_hit_tokens == 0
        _same_logits(out, worker, first)
        device, host = member._report().tiers  # what each heartbeat tells the service
        assert (device.tier, device.capacity) == ("device", 24) and device.pages > 0
        assert host.tier == "host" and host.hit_tokens > 0 and host.bytes_read > 0
        assert host.capacity == 64 and host.pages == member.below.records.stats()["pages"]
        assert host.demotions == member.below.demotions
        assert member.stats()["host_tier"]["pages_loaded"] > 0
        assert worker.flush()
        assert _index_view(worker, first) == _local_view(worker, first)
        # The service files the worker's pages under its tiers, and its hits by tier.
        tiers = service.reports.tiers()
        assert tiers["device"]["capacity"] == 24 and tiers["host"]["capacity"] == 64
        assert tiers["host"]["hit_tokens"] == host.hit_tokens
        assert service.reports.hits_by_tier()["host"] == host.hit_tokens
        worker.check_integrity()
    finally:
        worker.shutdown()


def test_peers_copy_device_and_host_pages_through_its_page_server(service):
    with _trio(service, pages=64) as (gpu, near, far):
        for prompt in PROMPTS[:3]:  # the first prompt's last pages go down to host memory
            gpu.generate(prompt + [1], 2)
        assert gpu.flush()
        view = _index_view(gpu, PROMPTS[0])
        assert len(view) == 10 and view[-1] == TIERS.index("host"), view
        assert _index_view(gpu, PROMPTS[2]) == bytes(10)  # all on the device
        for peer, prompt in ((near, PROMPTS[0]), (far, PROMPTS[2]), (near, PROMPTS[1])):
            tokens = prompt + [5, 5]
            out = peer.generate(tokens, 2, return_logits=True)
            assert out.stats.remote_hit_tokens == 10 * P, out.stats
            _same_logits(out, peer, tokens)
        assert gpu.member.page_server.pages_sent == 30
        # No CUDA here: nothing of g's opens on its node, so b reads g's page server.
        assert near.member.sources.attached() == []
        assert near.member.stats()["through_page_servers"] == ["g"]
        # And the other way: the device worker copies a plain worker's pages into its own.
        prompt = PROMPTS[4] + [3]
        near.generate(prompt, 2)
        assert near.flush()
        out = gpu.generate(prompt + [4], 2, return_logits=True)
        assert out.stats.remote_hit_tokens == 10 * P
        _same_logits(out, gpu, prompt + [4])


def test_a_device_worker_with_a_disk_keeps_three_tiers_and_peers_read_them_all(service, tmp_path):
    """Device (24 pages) -> host memory (24) -> disk: five prompts of 10 pages push the
    first ones down to the disk through host memory; the index follows every move; the
    first prompt comes back from host memory and the disk with the logits of a run without
    any cache, and peers on its node and another copy prompts from wherever its pages are
    (through its page server: no CUDA here)."""
    disk = DiskSettings(str(tmp_path / "disk"), 128)
    with _trio(service, pages=24, disk=disk) as (gpu, near, far):
        for prompt in PROMPTS:
            gpu.generate(prompt + [1], 2)
            assert gpu.flush()
            for other in PROMPTS:
                assert _index_view(gpu, other) == _local_view(gpu, other)
        host, lowest = gpu.member.below.chain()
        assert host.demotions > 0 and lowest.demotions > 0
        view = _index_view(gpu, PROMPTS[0])
        assert len(view) == 10 and view[-1] == TIERS.index("disk"), view
        first = PROMPTS[0] + [7, 7]
        out = gpu.generate(first, 2, return_logits=True)
        assert out.stats.local_hit_tokens == 10 * P and out.stats.remote_hit_tokens == 0
        assert out.stats.disk_hit_tokens > 0
        _same_logits(out, gpu, first)
        device, host_figures, disk_figures = gpu.member._report().tiers
        assert [t.tier for t in (device, host_figures, disk_figures)] == list(TIERS)
        assert disk_figures.hit_tokens == out.stats.disk_hit_tokens
        assert gpu.flush()
        assert _index_view(gpu, first) == _local_view(gpu, first)
        for peer, prompt in ((near, PROMPTS[1]), (far, PROMPTS[2])):
            tokens = prompt + [5, 5]
            out = peer.generate(tokens, 2, return_logits=True)
            assert out.stats.remote_hit_tokens == 10 * P, out.stats
            _same_logits(out, peer, tokens)
