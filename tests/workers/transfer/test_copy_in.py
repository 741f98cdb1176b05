"""Copy-in: the planner's split of a match among holders, and the executor over real
stores (one holder attached as same node, one over a real page server at once)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from cache_service.events import Namespace
from cache_service.messages import HolderSpan
from tests.workers.transfer.slow_link import SlowLink
from workers.host_link import HostLink
from workers.store.host_tier import HostTier
from workers.store.page_store import SharedPageStore, StoreLayout
from workers.transfer import PageServer
from workers.transfer.copy_in import (
    CopyExecutor,
    CopyPlan,
    CopyTask,
    PageServerSource,
    PeerInfo,
    SharedMemorySource,
    Sources,
    plan_copy,
)
from workers.transfer.costs import Link
from workers.transfer.peer_disk import split_tiers


def span(worker_id: str, reach: int, base: int = 100) -> HolderSpan:
    """A holder of prompt pages 0 .. reach-1 at page ids base + i, generation 7."""
    return HolderSpan(worker_id, "cpu", tuple(base + i for i in range(reach)), (7,) * reach)


def task(holder: str, first: int, end: int, base: int = 100) -> CopyTask:
    return CopyTask(
        holder, tuple(base + i for i in range(first, end)), (7,) * (end - first), first, end
    )


# Page times that are exact in binary: 1024-byte pages, 0.25 s and 1 s a page.
FAST = Link(False, 4096.0, 0.0)
SLOW = Link(True, 1024.0, 0.0)


# ---------------------------------------------------------------------------- planning


def test_pages_a_same_node_holder_lacks_come_from_a_remote_one():
    links = {"near": Link(False, 1e10, 0.0), "far": Link(True, 1e9, 0.001)}
    spans = [span("far", 8, base=200), span("near", 3)]
    # far alone has [3, 8): 6 ms planned; then [0, 3) all to near (0.1 ms a page).
    assert plan_copy(spans, 0, 8, links, 1_000_000) == (
        task("near", 0, 3),
        task("far", 3, 8, base=200),
    )


def test_holders_of_the_same_range_share_it_by_rate_and_finish_together():
    spans = [span("a", 10), span("b", 10, base=200)]
    assert plan_copy(spans, 0, 10, {"a": FAST, "b": SLOW}, 1024) == (
        task("a", 0, 8),  # 8 pages at 0.25 s = 2 s
        task("b", 8, 10, base=200),  # 2 pages at 1 s = 2 s
    )
    # The faster holder takes the earlier pages whichever order the match lists them in.
    assert plan_copy(spans, 0, 10, {"a": SLOW, "b": FAST}, 1024) == (
        task("b", 0, 8, base=200),
        task("a", 8, 10),
    )
    # A holder so slow that even one page would finish last gets none.
    crawl = Link(True, 10.0, 0.0)
    assert plan_copy(spans, 0, 4, {"a": FAST, "b": crawl}, 1024) == (task("a", 0, 4),)


def test_a_holder_busy_deeper_in_the_prompt_takes_less_of_the_shared_range():
    spans = [span("a", 12), span("b", 4, base=200)]
    links = {"a": Link(False, 1024.0, 0.0), "b": Link(False, 1024.0, 0.0)}
    # a alone has [4, 12): 8 s planned, so b (idle) takes all of [0, 4).
    assert plan_copy(spans, 0, 12, links, 1024) == (task("b", 0, 4, base=200), task("a", 4, 12))


def test_unknown_holders_are_skipped_and_the_plan_starts_at_first():
    spans = [span("stranger", 10, base=300), span("a", 6)]
    assert plan_copy(spans, 2, 9, {"a": FAST}, 1024) == (task("a", 2, 6),)


def test_a_peers_disk_pages_are_a_holder_of_their_own_after_its_host_pages():
    """Host pages 0-2 of w, disk pages 3-5: w gives the host ones, "w/disk" the rest (even
    where a faster link would want more), and a second holder with host pages takes its
    share of the disk range by rate."""
    held = split_tiers(
        [HolderSpan("w", "host", (10, 11, 12, 90, 91, 92), (7,) * 6, b"\1" * 3 + b"\2" * 3)]
    )
    assert held.owners == {"w": "w", "w/disk": "w"} and held.disk == {"w/disk"}
    assert held.starts == {"w/disk": 3}
    host, disk = held.spans
    assert host == HolderSpan("w", "host", (10, 11, 12), (7,) * 3, b"\1" * 3)
    assert disk == HolderSpan("w/disk", "disk", (0, 0, 0, 90, 91, 92), (0, 0, 0, 7, 7, 7))
    links = {"w": SLOW, "w/disk": FAST}
    assert plan_copy(held.spans, 0, 6, links, 1024, held.starts) == (
        CopyTask("w", (10, 11, 12), (7,) * 3, 0, 3),
        CopyTask("w/disk", (90, 91, 92), (7,) * 3, 3, 6),
    )
    other = span("o", 6, base=200)
    plan = plan_copy([*held.spans, other], 1, 6, {**links, "o": SLOW}, 1024, held.starts)
    assert [(t.holder, t.first, t.end) for t in plan] == [
        ("o", 1, 2), ("w", 2, 3), ("w/disk", 3, 6)
    ]  # fmt: skip
    # Only on disk from page 0; a holder with a device tier gives its device pages and its
    # host pages after them (through its page server), as one source.
    only = split_tiers(
        [
            HolderSpan("d", "disk", (90, 91), (7, 7)),
            HolderSpan("x", "device", (1,), (7,)),
            HolderSpan("g", "device", (1, 2, 40), (7,) * 3, b"\0\0\1"),
        ]
    )
    assert [(s.worker_id, len(s.page_ids)) for s in only.spans] == [
        ("d", 0),
        ("d/disk", 2),
        ("x", 1),
        ("g", 3),
    ]


def test_a_holder_that_starts_late_leaves_no_gap_in_the_plan():
    starts = {"late": 4}
    spans = [span("early", 2), span("late", 8, base=200)]
    # Nobody gives pages 2 and 3: the plan ends at 2.
    assert plan_copy(spans, 0, 8, {"early": FAST, "late": FAST}, 1024, starts) == (
        task("early", 0, 2),
    )
    assert plan_copy(spans, 4, 8, {"early": FAST, "late": FAST}, 1024, starts) == (
        task("late", 4, 8, base=200),
    )


def test_nothing_to_copy():
    spans = [span("a", 3)]
    assert plan_copy(spans, 3, 8, {"a": FAST}, 1024) == ()  # nobody has page 3
    assert plan_copy(spans, 1, 1, {"a": FAST}, 1024) == ()  # an empty range
    assert plan_copy([], 0, 8, {"a": FAST}, 1024) == ()
    assert plan_copy(spans, 0, 3, {}, 1024) == ()  # no known holder


# ---------------------------------------------------------------------------- running

LAYOUT = StoreLayout(num_pages=64, num_layers=2, num_kv_heads=2, page_tokens=4, head_dim=8)
N = 40  # prompt pages, half from each holder


def digest(i: int) -> bytes:
    return bytes([i + 1]) * 16


@pytest.fixture
def holders():
    """Two holders of prompt pages 0..N-1 (page i holds the value i + 1 everywhere, at
    different page ids in each), and a requester with N pages allocated."""
    near = SharedPageStore.create(LAYOUT, tag="near")
    far = SharedPageStore.create(LAYOUT, tag="far")
    requester = SharedPageStore.create(LAYOUT, tag="requester")
    spans = []
    for name, store, skip in (("near", near, 3), ("far", far, 11)):
        store.allocate(skip)  # the holders' page ids differ from each other's
        pages = store.allocate(N)
        for i, page in enumerate(pages):
            store.write_page(page, torch.full(LAYOUT.page_shape, float(i + 1)))
            store.set_digest(page, digest(i))
        spans.append(HolderSpan(name, "cpu", tuple(pages), tuple(store.generations(pages))))
    targets = requester.allocate(N)
    yield near, far, requester, spans, targets
    for store in (requester, far, near):
        store.check_integrity()
        store.close()


def _plan(spans, links) -> CopyPlan:
    tasks = plan_copy(spans, 0, N, links, LAYOUT.page_bytes)
    return CopyPlan(tasks, 0, N, 0.0, 0.0)


def test_two_holders_copy_at_once_and_the_bytes_land_exactly(holders):
    near, far, requester, spans, targets = holders
    server = PageServer(far)
    shm = SlowLink(SharedMemorySource("near", "n1", near.name), 0.005)  # 20 pages: 100 ms
    remote = SlowLink(PageServerSource("far", "n2", server.address), 0.005)
    copier = CopyExecutor()
    try:
        same_rate = Link(False, 1e9, 0.0)
        plan = _plan(spans, {"near": same_rate, "far": same_rate._replace(remote=True)})
        assert [(t.holder, t.first, t.end) for t in plan.tasks] == [
            ("far", 0, 20),  # equal rates: ties go by name
            ("near", 20, 40),
        ]
        outcome = copier.run(
            plan, {"near": shm, "far": remote}, requester, targets, [digest(i) for i in range(N)]
        )
        assert outcome.end == N
        assert [r.valid for r in outcome.results] == [(True,) * 20, (True,) * 20]
        for i, page in enumerate(targets):
            assert torch.equal(requester.page(page), torch.full(LAYOUT.page_shape, float(i + 1)))
        assert server.pages_sent == 20 and shm.pages_copied == 20
        first, second = outcome.results
        assert first.seconds >= 0.1 and second.seconds >= 0.1
        assert max(first.start_s, second.start_s) < min(first.end_s, second.end_s)  # overlap
        server.check_integrity()
    finally:
        copier.close()
        shm.close()
        remote.close()
        server.stop()


def test_a_changed_page_ends_the_prefix_even_if_later_tasks_succeed(holders):
    near, far, requester, spans, targets = holders
    spans = [s for s in spans if s.worker_id == "near"]
    spans.append(spans[0]._replace(worker_id="near2"))  # the same store, as a second peer
    gens = list(spans[0].generations)
    gens[5] += 1  # page 5 changed since the index heard of it
    spans[0] = spans[0]._replace(generations=tuple(gens))
    sources = {
        "near": SharedMemorySource("near", "n1", near.name),
        "near2": SharedMemorySource("near2", "n1", near.name),
    }
    copier = CopyExecutor()
    try:
        plan = _plan(spans, {"near": FAST, "near2": FAST})
        assert [(t.holder, t.first, t.end) for t in plan.tasks] == [
            ("near", 0, 20),
            ("near2", 20, 40),
        ]
        outcome = copier.run(plan, sources, requester, targets, [digest(i) for i in range(N)])
        assert outcome.results[0].valid == (True,) * 5 + (False,) + (True,) * 14
        assert outcome.results[1].valid == (True,) * 20
        assert outcome.end == 5
    finally:
        copier.close()
        for source in sources.values():
            source.close()


def test_a_store_that_will_not_attach_is_all_misses(holders):
    _, _, requester, _, targets = holders
    gone = SharedMemorySource("gone", "n1", "kvmesh_no_such_store")
    assert gone.fetch([1, 2], [7, 7], [digest(0), digest(1)], targets[:2], requester) == [
        False,
        False,
    ]
    assert not gone.attached
    gone.close()


def test_sources_are_kept_per_peer_and_let_go(holders):
    near, far, _, _, _ = holders
    server = PageServer(far)
    sources = Sources("n1", auth=None)
    try:
        near_peer = PeerInfo("near", "n1", near.name, "tcp://127.0.0.1:1", None)
        far_peer = PeerInfo("far", "n2", far.name, server.address, None)
        shm = sources.get(near_peer)
        assert isinstance(shm, SharedMemorySource) and sources.get(near_peer) is shm
        assert isinstance(sources.get(far_peer), PageServerSource)
        assert sources.attached() == []  # attached on first fetch only
        shm.fetch([], [], [], [], near)
        assert sources.attached() == [near.name]
        assert sources.detach_dead() == []  # its owner (this process) lives
        sources.forget("near")
        assert sources.attached() == [] and not shm.attached
        again = sources.get(near_peer)
        assert again is not shm and isinstance(again, SharedMemorySource)
    finally:
        sources.close()
        server.stop()


def test_a_same_node_device_holder_is_read_where_each_page_is(monkeypatch):
    """A holder with a device tier (here a private CPU store standing in for it) and host
    memory below: its device pages come out of its pages opened through the handle in its
    segment (CUDA IPC; here the owner's tensor itself stands in for the opened handle),
    its host-tier pages through its page server; where the device pages cannot be opened,
    everything comes through the page server, with one log line."""
    layout = StoreLayout(num_pages=6, num_layers=1, num_kv_heads=1, page_tokens=4, head_dim=4)
    device = SharedPageStore.create(layout, pages_in_segment=False)
    host = SharedPageStore.create(layout)
    mine = SharedPageStore.create(layout)
    tier = HostTier(device, host)
    link = HostLink(tier, "holder/host")
    server = PageServer(device, disk=link)
    try:
        pages = device.allocate(4)
        digests = [bytes([i + 1]) * 16 for i in range(4)]
        for i, page in enumerate(pages):
            device.write_page(page, torch.full(layout.page_shape, float(i + 1)))
        device.set_digests(pages, digests)
        # Pages 2 and 3 go down to host memory, as the device's eviction sends them.
        parent = b"\0" * 16
        records = tier.write_many(
            [(pages[i], digests[i], parent, Namespace("t"), 1, b"") for i in (2, 3)]
        )
        ids = [pages[0], pages[1], *(link.id_base + r.slot for r in records)]
        gens = [*device.generations(pages[:2]), *(r.generation for r in records)]
        targets = mine.allocate(4)
        source = SharedMemorySource(
            "holder", "n1", device.name, partial(PageServerSource, "holder", "n1", server.address)
        )

        def opened(name):  # CUDA IPC stands in: the owner's pages, opened by a reader
            return SharedPageStore.attach(name, pages=device.page_range(0, layout.num_pages))

        with monkeypatch.context() as patched:
            patched.setattr(SharedPageStore, "open_peer", opened)
            assert source.fetch(ids, gens, digests, targets, mine) == [True] * 4
        assert server.pages_sent == 2 and source.pages_copied == 2 and not source.fallback
        for i, target in enumerate(targets):
            assert torch.equal(mine.page(target), torch.full(layout.page_shape, float(i + 1)))
        source.close()
        # No handle to open (pages on the CPU): every page by the page server.
        fallen = SharedMemorySource(
            "holder", "n1", device.name, partial(PageServerSource, "holder", "n1", server.address)
        )
        assert fallen.fetch(ids, gens, digests, targets, mine) == [True] * 4
        assert fallen.fallback and server.pages_sent == 6
        fallen.close()
        tier.check_integrity()
    finally:
        server.stop()
        for store in (mine, host, device):
            store.close()
