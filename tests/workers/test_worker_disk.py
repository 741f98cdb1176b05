"""A worker with a disk tier (tiny model, real service, real files, no Ray): prompts
evicted from shared memory come back from disk with the outputs of a run without any
cache, the index follows every demotion, a new incarnation adopts the files, corrupt
records are never served, and a slow disk is not read when recomputing is faster."""

from __future__ import annotations

import pytest
import torch

from cache_service.events import Namespace
from tests.workers.conftest import SERVICE_PAGE_TOKENS, make_worker
from workers.cache.device_settings import DeviceSettings
from workers.cache.disk_settings import DIR_ENV, DiskSettings
from workers.serving.model_loader import full_prefill_logits
from workers.store.digests import page_digests

P = SERVICE_PAGE_TOKENS
SECRET = b"k" * 32
PROMPTS = [[(11 * s + 5 * i) % 240 + 3 for i in range(10 * P)] for s in range(6)]


def _disk(tmp_path, policy: str = "write_back", pages: int = 256) -> DiskSettings:
    return DiskSettings(str(tmp_path / "disk"), pages, policy, keep=True)


def _same_logits(out, worker, tokens) -> None:
    expected = full_prefill_logits(worker.batch_runner.model, tokens)
    got = torch.tensor(out.logits)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def _index_view(worker, tokens: list[int]) -> tuple[int, bytes]:
    """(pages of `tokens` the index says the worker holds, their tiers as codes), asked
    over the service's socket as any client asks."""
    _, spans = worker.member.client.match(Namespace("tiny"), tokens)
    worker_id = worker.worker_id
    for span in spans:
        if span.worker_id == worker_id:
            tiers = span.tiers or bytes([("device", "host", "disk").index(span.tier)]) * len(
                span.page_ids
            )
            return len(span.page_ids), bytes(tiers)
    return 0, b""


def _local_view(worker, tokens: list[int]) -> tuple[int, bytes]:
    """What the worker itself holds of `tokens`: host pages, then disk records."""
    member = worker.member
    host = member.cache.match_length(tokens, Namespace("tiny")) // P
    digests = page_digests(Namespace("tiny"), member.store.kv_format, tokens, P)
    disk = len(member.disk.disk.chain(digests, host))
    return host + disk, bytes([1]) * host + bytes([2]) * disk


def test_an_evicted_prompt_comes_back_from_disk_and_the_index_follows(service, tmp_path):
    worker = make_worker(service, "a", pages=48, disk=_disk(tmp_path), secret=SECRET)
    try:
        for prompt in PROMPTS:  # 6 x 10 pages through 48: the early ones go down
            worker.generate(prompt + [1], 2)
            assert worker.flush()
            for other in PROMPTS:  # after each step: the index equals what it holds
                assert _index_view(worker, other) == _local_view(worker, other)
        assert worker.member.disk.demotions > 0
        first = PROMPTS[0] + [7, 7]
        assert worker.member.cache.match_length(first, Namespace("tiny")) < 10 * P
        out = worker.generate(first, 2, return_logits=True)
        assert out.stats.disk_hit_tokens > 0
        assert out.stats.local_hit_tokens >= out.stats.disk_hit_tokens
        assert out.stats.remote_hit_tokens == 0
        _same_logits(out, worker, first)
        (disk,) = worker.member._report().tiers  # what each heartbeat tells the service
        assert disk.tier == "disk" and disk.hit_tokens == out.stats.disk_hit_tokens
        assert disk.demotions == worker.member.disk.demotions and disk.bytes_read > 0
        assert worker.flush()
        assert _index_view(worker, first) == _local_view(worker, first)
        worker.check_integrity()
    finally:
        worker.shutdown()


def test_a_new_incarnation_adopts_the_disk_and_never_serves_a_corrupt_record(service, tmp_path):
    settings = _disk(tmp_path, "write_through")
    worker = make_worker(service, "a", pages=64, disk=settings, secret=SECRET)
    outputs = [worker.generate(p + [1], 3).token_ids for p in PROMPTS[:3]]
    disk = worker.member.disk.disk
    digests = page_digests(Namespace("tiny"), worker.member.store.kv_format, PROMPTS[2], P)
    flip = disk.body_offset(disk.lookup(digests[3]).slot) + 5  # prompt 2's 4th page
    path = disk.data_path
    worker.check_integrity()
    worker.shutdown()  # keep=True: the files stay, as a killed worker's do
    with open(path, "r+b") as f:
        f.seek(flip)
        byte = f.read(1)
        f.seek(flip)
        f.write(bytes([byte[0] ^ 0x5A]))

    again = make_worker(service, "a", pages=64, disk=settings, secret=SECRET)
    try:
        adopted = again.member.disk.disk
        assert adopted.dropped["corrupt"] == 1 and adopted.dropped["orphan"] >= 1
        assert again.flush()
        for prompt in PROMPTS[:3]:
            assert _index_view(again, prompt) == _local_view(again, prompt)
        for i, prompt in enumerate(PROMPTS[:3]):
            out = again.generate(prompt + [1], 3, return_logits=True)
            assert out.token_ids == outputs[i]
            _same_logits(out, again, prompt + [1])
            # Prompts 0 and 1 come back whole from disk; prompt 2 only up to the flip.
            assert out.stats.disk_hit_tokens == (3 * P if i == 2 else 10 * P)
        again.check_integrity()
    finally:
        again.shutdown()


def test_another_meshs_records_are_dropped(service, tmp_path):
    settings = _disk(tmp_path, "write_through")
    worker = make_worker(service, "a", pages=64, disk=settings, secret=SECRET)
    worker.generate(PROMPTS[0] + [1], 1)
    worker.shutdown()
    other = make_worker(service, "a", pages=64, disk=settings, secret=b"o" * 32)
    try:
        assert other.member.disk.disk.dropped["foreign"] == 10
        out = other.generate(PROMPTS[0] + [1], 1)
        assert out.stats.disk_hit_tokens == 0
        other.check_integrity()
    finally:
        other.shutdown()


def test_a_slow_disk_is_not_read_when_recomputing_is_faster(service, tmp_path):
    """The disk turns slow: its reads' real times show it, and within a few requests the
    worker recomputes instead of loading (the answer stays the same)."""
    worker = make_worker(
        service, "a", pages=64, disk=_disk(tmp_path), secret=SECRET, copy_policy="measured"
    )
    try:
        worker.generate(PROMPTS[0] + [1], 1)
        worker.member.cache.evict(1000)
        first = worker.generate(PROMPTS[0] + [2], 1)
        decision = worker.member.last_decision  # a healthy disk: loaded if it is cheaper
        loaded = decision.copy_s < decision.recompute_s
        assert first.stats.disk_hit_tokens == (40 if loaded else 0), decision
        worker.member.disk.disk.throttle(100_000.0)  # a dying disk: 100 kB/s
        for round_ in range(10):
            worker.member.cache.evict(1000)
            tokens = PROMPTS[0] + [3 + round_]
            out = worker.generate(tokens, 1, return_logits=True)
            _same_logits(out, worker, tokens)
            if out.stats.disk_hit_tokens == 0:
                break
        assert out.stats.disk_hit_tokens == 0, "the slow disk was still read"
        assert worker.member.last_decision.reason == "recompute cheaper"
        worker.check_integrity()
    finally:
        worker.shutdown()


def _mesh_disk(tmp_path, monkeypatch) -> DiskSettings:
    """A disk tier in the mesh's default directory (under tmp_path): where same-node peers
    find its data file."""
    monkeypatch.setenv(DIR_ENV, str(tmp_path / "mesh"))
    return DiskSettings("", 256, "write_back", keep=False)


def _flip(disk, digest: bytes) -> None:
    """Flip one byte of the body of `digest`'s record in the data file."""
    at = disk.body_offset(disk.lookup(digest).slot) + 5
    with open(disk.data_path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x5A]))


# A peer whose pages are in host memory, or on a device (a private store standing in): it
# lands what it reads from a holder's disk in host rows and writes them up.
PEER_TIERS = pytest.mark.parametrize(
    "peer_device", [None, DeviceSettings("cpu", 32)], ids=["host-peer", "device-peer"]
)


@PEER_TIERS
def test_a_peer_copies_host_pages_from_memory_and_the_rest_from_the_holders_disk(
    service, tmp_path, monkeypatch, peer_device
):
    """The index names a holder's pages with their tiers: a same-node peer copies the
    holder's host pages out of its shared memory and the disk pages after them out of its
    data file, with the outputs of a run without any cache."""
    settings = _mesh_disk(tmp_path, monkeypatch)
    holder = make_worker(service, "a", pages=64, disk=settings, secret=SECRET)
    peer = make_worker(service, "b", pages=64, secret=SECRET, device=peer_device)
    try:
        for w in (holder, peer):
            w.set_peers([holder.info(), peer.info()])
        tokens = PROMPTS[1] + [4]
        reference = peer.generate(tokens, 3, reuse=False).token_ids
        holder.generate(tokens, 1)
        holder.member.cache.evict(3)  # its last 3 pages go down to its disk
        assert holder.flush()
        pages, tiers = _index_view(holder, tokens)
        assert pages == 10 and tiers == bytes([1]) * 7 + bytes([2]) * 3
        out = peer.generate(tokens, 3, return_logits=True)
        assert out.token_ids == reference
        assert out.stats.remote_hit_tokens == 10 * P and out.stats.disk_hit_tokens == 0
        _same_logits(out, peer, tokens)
        assert peer.member.sources.get_disk(holder.info()).pages_read == 3
        assert peer.member.copies_refused == 0
        for w in (holder, peer):
            w.check_integrity()
    finally:
        peer.shutdown()
        holder.shutdown()


@PEER_TIERS
@pytest.mark.parametrize("node", ["n1", "n2"], ids=["same-node-file", "page-server"])
def test_a_peer_copies_pages_held_only_on_disk_and_never_a_corrupt_record(
    service, tmp_path, monkeypatch, node, peer_device
):
    """A holder's prompt lives only on its disk: a peer on its node reads the data file, a
    peer on another node asks its page server, and both copy it whole; a record whose
    bytes are flipped on the holder's disk is never served: the peer copies up to it and
    computes the rest, with the outputs of a run without any cache."""
    settings = _mesh_disk(tmp_path, monkeypatch)
    holder = make_worker(service, "a", pages=64, disk=settings, secret=SECRET)
    peer = make_worker(service, "b", node=node, pages=64, secret=SECRET, device=peer_device)
    try:
        for w in (holder, peer):
            w.set_peers([holder.info(), peer.info()])
        whole, damaged = PROMPTS[2] + [5], PROMPTS[3] + [5]
        references = [peer.generate(t, 3, reuse=False).token_ids for t in (whole, damaged)]
        for tokens in (whole, damaged):
            holder.generate(tokens, 1)
        holder.member.cache.evict(1000)  # everything down to disk
        assert holder.flush()
        assert _index_view(holder, whole) == (10, bytes([2]) * 10)
        disk = holder.member.disk.disk
        kv_format = holder.member.store.kv_format
        _flip(disk, page_digests(Namespace("tiny"), kv_format, damaged, P)[4])

        out = peer.generate(whole, 3, return_logits=True)
        assert out.token_ids == references[0] and out.stats.remote_hit_tokens == 10 * P
        _same_logits(out, peer, whole)
        out = peer.generate(damaged, 3, return_logits=True)
        assert out.token_ids == references[1] and out.stats.remote_hit_tokens == 4 * P
        _same_logits(out, peer, damaged)
        assert peer.member.copies_refused >= 1
        copied = peer.member.figures.copy_bytes_now()
        assert (
            copied["remote" if node == "n2" else "same_node"]
            == 20 * holder.member.store.layout.page_bytes
        )
        if node == "n2":  # the holder read it, found it corrupt, and dropped it
            assert disk.stats()["evictions"].get("corrupt", 0) >= 1
        for w in (holder, peer):
            w.check_integrity()
    finally:
        peer.shutdown()
        holder.shutdown()


def test_a_full_disk_stops_taking_pages_and_no_request_fails(service, small_tmpfs):
    settings = DiskSettings(str(small_tmpfs / "disk"), 400, "write_back", keep=True)
    worker = make_worker(service, "a", pages=24, disk=settings, secret=SECRET)
    try:
        prompts = [[(13 * s + 3 * i) % 240 + 3 for i in range(5 * P)] for s in range(20)]
        for tokens in prompts:  # 20 x 5 pages through 24: most go down, or would
            out = worker.generate(tokens + [1], 1, return_logits=True)
            _same_logits(out, worker, tokens + [1])
            worker.check_integrity()
        stats = worker.member.disk.stats()
        assert stats["write_failures"] >= 1 and not stats["accepting"]
        assert 0 < stats["pages"] < 100
        assert worker.flush()
        assert worker.member._report().tiers[0].accepting == 0
    finally:
        worker.shutdown()
