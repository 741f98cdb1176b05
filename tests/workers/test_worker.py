"""The worker on a tiny model, without Ray: local hits, same-node and cross-node copies."""

from __future__ import annotations

import pytest
import torch

from tests.workers.conftest import SERVICE_PAGE_TOKENS, make_worker
from workers.serving.model_loader import full_prefill_logits
from workers.serving.sampling import SamplingParams
from workers.worker import CacheFull, Worker

P = SERVICE_PAGE_TOKENS  # the `service` fixture's (tests/workers/conftest.py)


def _worker(
    service, worker_id: str, node: str, pages: int = 64, copy_policy: str = "always"
) -> Worker:
    return make_worker(service, worker_id, node, pages, copy_policy)


@pytest.fixture
def trio(service):
    workers = [
        _worker(service, "a", "n1"),
        _worker(service, "b", "n1"),
        _worker(service, "c", "n2"),
    ]
    infos = [w.info() for w in workers]
    for w in workers:
        w.set_peers(infos)
    yield workers
    for w in workers:
        w.check_integrity()
        w.shutdown()


PREFIX = [(7 * i + 3) % 250 for i in range(37)]


def _expected(worker: Worker, tokens: list[int]) -> torch.Tensor:
    return full_prefill_logits(worker.batch_runner.model, tokens)


def _check(out, expected: torch.Tensor) -> None:
    got = torch.tensor(out.logits)
    assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()


def test_prefix_served_locally_then_from_peers(trio):
    a, b, c = trio
    cold = a.generate(PREFIX + [1, 2, 3], 6, return_logits=True)
    assert cold.stats.local_hit_tokens == 0 and cold.stats.remote_hit_tokens == 0

    prompt = PREFIX + [9, 9, 9, 9, 9]
    expected = _expected(a, prompt)
    again = a.generate(prompt, 6, return_logits=True)  # own cache: 36 of 37 prefix tokens
    assert again.stats.local_hit_tokens == 37
    _check(again, expected)
    assert a.flush()  # a's pages reach the index (they would a moment later anyway)

    same_node = b.generate(prompt, 6, return_logits=True)  # copied out of a's shm
    assert same_node.stats.local_hit_tokens == 0
    assert same_node.stats.remote_hit_tokens == 40  # all full pages of the prompt
    assert same_node.token_ids == again.token_ids
    _check(same_node, expected)

    other_node = c.generate(prompt + [5], 6, return_logits=True)  # over a's page server
    assert other_node.stats.remote_hit_tokens == 40
    assert c.stats().copy["decisions"] == {"policy always": 1}
    _check(other_node, _expected(c, prompt + [5]))
    assert a.member.page_server.pages_sent > 0

    # b and c hold copies of a's ten prompt pages now (and b, which answered as a did,
    # the same first decode page): a's next heartbeat marks a's eleven, b's the ten that
    # c copied later, to go first when their caches make room.
    assert b.flush() and c.flush()
    for worker in (a, b, c):
        assert worker.member.publisher.heartbeat()
    marked = [w.member.stats()["cache"]["held_elsewhere_marked_pages"] for w in trio]
    assert marked == [11, 10, 0]
    assert a.member.stats()["publisher"]["held_elsewhere"] == 11


def test_a_worker_without_the_mesh_never_looks_up_nor_copies_but_keeps_its_own(service):
    a = make_worker(service, "a", "n1")
    alone = make_worker(service, "b", "n1", share=False)
    try:
        for worker in (a, alone):
            worker.set_peers([a.info(), alone.info()])
        prompt = PREFIX + [9, 9, 9, 9, 9]
        a.generate(prompt, 6)
        assert a.flush()  # the index knows a holds the prompt
        cold = alone.generate(prompt, 6)
        assert (cold.stats.local_hit_tokens, cold.stats.remote_hit_tokens) == (0, 0)
        again = alone.generate(prompt, 6)
        assert (again.stats.local_hit_tokens, again.stats.remote_hit_tokens) == (len(prompt) - 1, 0)
        assert again.token_ids == cold.token_ids
        assert alone.flush()  # it still publishes: routing knows what it holds
        stats = alone.stats()
        assert stats.copy_bytes == {"same_node": 0, "remote": 0}
        assert stats.copy["decisions"] == {}
        index = service.stats()
        assert index["workers"]["b"]["queries"] == 0 and index["workers"]["b"]["pages"] > 0
        assert index["workers"]["a"]["queries"] > 0
        # a computes the prompt anew, after alone: the index tells alone its pages are held
        # elsewhere, and alone keeps them first all the same (it cannot copy them back).
        a.clear_cache()
        assert a.flush()
        a.generate(prompt, 6)
        assert a.flush() and alone.flush()
        assert alone.stats().publisher["held_elsewhere"] == 0
        assert alone.stats().cache["held_elsewhere_marked_pages"] == 0
        assert service.stats()["superseded"]["issued"] > 0  # the notices were sent
    finally:
        for worker in (a, alone):
            worker.check_integrity()
            worker.shutdown()


def test_tenants_never_share(trio):
    a, b, _ = trio
    a.generate(PREFIX + [1], 4, salt="tenant-a")
    assert a.flush()
    out = b.generate(PREFIX + [2], 4, salt="tenant-b")
    assert out.stats.remote_hit_tokens == 0 and out.stats.local_hit_tokens == 0
    assert b.flush()
    again = a.generate(PREFIX + [3], 4, salt="tenant-b")
    assert again.stats.local_hit_tokens == 0
    assert again.stats.remote_hit_tokens == 36  # tenant-b's pages on b


def test_vanished_peer_pages_are_recomputed(trio):
    a, b, _ = trio
    a.generate(PREFIX + [1], 4)
    assert a.flush()
    a.member.publisher.stop(bye=False)  # from here on a's events never reach the service
    a.cache.clear()  # a evicts everything; the index still says a holds the prefix
    prompt = PREFIX + [2]
    out = b.generate(prompt, 4, return_logits=True)
    assert out.stats.remote_hit_tokens == 0  # every copied page failed validation
    _check(out, _expected(b, prompt))
    # What b reports: the refused copy's tokens were computed, never hits; its bytes moved.
    report = b.member.figures.report(b.cache.stats())
    assert [(t.requests, t.local_hit, t.remote_hit, t.computed) for t in report.tenants] == [
        (1, 0, 0, len(prompt))
    ]
    assert report.copy_bytes_same_node > 0 and report.copy_bytes_remote == 0
    assert sum(report.ttft_miss.counts) == 1 and sum(report.ttft_hit.counts) == 0


def test_without_reuse_the_whole_prompt_is_computed_and_nothing_is_shared(trio):
    a, _, _ = trio
    prompt = PREFIX + [1]
    a.generate(prompt, 4)
    cached = a.cache.stats()["cached_pages"]
    out = a.generate(prompt, 4, return_logits=True, reuse=False)
    assert (out.stats.local_hit_tokens, out.stats.remote_hit_tokens) == (0, 0)
    assert out.stats.computed_tokens == len(prompt)
    _check(out, _expected(a, prompt))
    stats = a.cache.stats()
    assert stats["cached_pages"] == cached and stats["in_use_pages"] == 0  # nothing kept
    assert a.generate(prompt, 4).stats.local_hit_tokens == 37  # the cache is intact


def test_request_too_big_is_cache_full(service):
    w = _worker(service, "small", "n1", pages=4)
    try:
        with pytest.raises(CacheFull, match="do not fit in 4 pages"):
            w.generate(list(range(40)), 4)
        with pytest.raises(ValueError, match="empty prompt"):
            w.generate([], 4)
        w.check_integrity()
    finally:
        w.shutdown()


def test_a_holder_nobody_named_is_found_in_the_services_registry(service):
    """Peers were never told of each other (as for a worker that joins, or a holder that
    restarted, after connect): the requester finds the holder the match names in the
    service's registry, with what its REGISTER carried, and copies from it."""
    holder = _worker(service, "h", "n1")
    asker = _worker(service, "q", "n2")  # another node: the page server path
    try:
        assert holder.member.peers.known() == asker.member.peers.known() == []
        prompt = PREFIX + [4, 4, 4]
        holder.generate(prompt, 2)
        assert holder.flush()
        out = asker.generate(prompt, 2)
        assert out.stats.remote_hit_tokens == 36  # every full page but the last token's
        found = asker.member.peers.get("h")
        assert asker.member.peers.known() == ["h"]
        assert (found.node_id, found.shm_name, found.page_address) == (
            "n1",
            holder.store.name,
            holder.member.page_server.address,
        )
        assert holder.member.page_server.pages_sent > 0
        holder.check_integrity()
        asker.check_integrity()
    finally:
        holder.shutdown()
        asker.shutdown()


def test_bad_arguments_are_refused_before_anything_is_held(service):
    w = _worker(service, "v", "n1")
    try:
        for prompt, n, message in [
            ([1, 2, 3], 2.0, "max_new_tokens must be an int, got 2.0"),
            ([1, 2, 3], 0, "max_new_tokens must be >= 1"),
            ([1, 2, 256], 2, r"token id 256 \(position 2\) outside the model's vocabulary"),
            ([1, 2, 3], 1022, "exceed the model's context window of 1024 tokens"),
            ("text", 2, "no tokenizer"),
        ]:
            with pytest.raises(ValueError, match=message):
                w.generate(prompt, n)
        with pytest.raises(ValueError, match="temperature"):
            w.generate([1, 2, 3], 2, sampling=SamplingParams(temperature=-1.0))
        with pytest.raises(ValueError, match="sampling must be SamplingParams"):
            w.generate([1, 2, 3], 2, sampling={"temperature": 1.0})
        with pytest.raises(TypeError, match="temperature"):
            w.generate([1, 2, 3], 2, temperature=1.0)  # not a field of GenerateRequest
        with pytest.raises(ValueError, match="ignore_eos must be a bool"):
            w.generate([1, 2, 3], 2, ignore_eos=1)
        with pytest.raises(ValueError, match="stop token 999"):
            w.generate([1, 2, 3], 2, stop_token_ids=[999])
        assert w.cache.stats()["queries"] == 0 and w.requests == 0
        w.check_integrity()
    finally:
        w.shutdown()


def test_stream_yields_each_token_then_the_result(service):
    w = _worker(service, "s", "n1")
    try:
        whole = w.generate(PREFIX, 8, ignore_eos=True)
        items = list(w.stream(w.request(PREFIX, 8, ignore_eos=True)))
        assert tuple(i.token_id for i in items[:-1]) == whole.token_ids
        assert [i.last for i in items] == [False] * 8 + [True]
        assert items[-1].output.token_ids == whole.token_ids
        assert items[-1].output.finish_reason == "length"
        assert items[-1].output.stats.local_hit_tokens == 36
        with pytest.raises(ValueError, match="max_new_tokens"):
            next(iter(w.stream(w.request(PREFIX, -1))))
        w.check_integrity()
    finally:
        w.shutdown()
