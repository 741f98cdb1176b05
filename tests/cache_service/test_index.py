"""The global prefix index: events, liveness, matching, statistics, routing, integrity,
and the thread that owns it."""

from __future__ import annotations

import struct
import threading
from typing import NamedTuple
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.events import AllCleared, Namespace, PagesRemoved, PagesStored
from cache_service.index import (
    ApplyResult,
    GlobalIndex,
    HolderSpan,
    MatchResult,
    OwnerError,
    PackedSpan,
    PeerAddress,
    PeerEntry,
    Registration,
    RegistryFull,
    RouteDecision,
    StaleEpoch,
    WorkerInfo,
)
from cache_service.index import global_index as global_index_module
from cache_service.index import keys as keys_module
from cache_service.index._compiled import ChainKeys, KeyTable
from cache_service.index.registry import DEFAULT_CAPACITY
from cache_service.routing import WorkerLoad
from cache_service.tokens import pack_tokens

P = 4  # tokens per page in these tests
NS = Namespace("smollm2-135m", "", "tenant-a")


def make_index(*workers: str, now: float = 0.0, **kwargs) -> GlobalIndex:
    index = GlobalIndex(page_tokens=P, **kwargs)
    for worker in workers:
        index.register(worker, node_id="node0", now=now)
    return index


def page(i: int) -> tuple[int, ...]:
    """The tokens of a distinct page, numbered i."""
    return tuple(range(100 * i, 100 * i + P))


def make_tokens(*pages: int, tail: int = 0) -> list[int]:
    """Pages back to back, then `tail` tokens of a partial page."""
    tokens = [t for i in pages for t in page(i)]
    return tokens + [9_999] * tail


def stored(
    page_ids: tuple[int, ...],
    pages: tuple[int, ...],
    parent: int | None = None,
    namespace: Namespace = NS,
    generations: tuple[int, ...] | None = None,
) -> PagesStored:
    generations = (0,) * len(page_ids) if generations is None else generations
    return PagesStored(namespace, parent, page_ids, generations, tuple(make_tokens(*pages)))


def spans(result: MatchResult) -> list[tuple[str, tuple[int, ...]]]:
    """The spans of a match as (worker, page ids), in their order."""
    return [(span.worker_id, span.page_ids) for span in result.spans]


def epoch(index: GlobalIndex, worker: str) -> int:
    """The epoch the index issued to the worker's current incarnation."""
    return index.worker_info(worker).epoch


def apply_ok(index: GlobalIndex, worker: str, seq: int, *events) -> None:
    result = index.apply_events(worker, epoch(index, worker), seq, list(events))
    assert result == ApplyResult(True, False, "applied", seq)


# ---- storing and matching ----------------------------------------------------------------


def test_match_returns_one_span_per_holder():
    index = make_index("a", "b")
    apply_ok(index, "b", 1, stored((3, 4), (1, 2)))
    apply_ok(index, "a", 1, stored((10, 11, 12), (1, 2, 3), generations=(5, 6, 7)))

    result = index.match(NS, make_tokens(1, 2, 3, 4, tail=2))

    # Longest first: a holds all three matched pages, b the first two.
    assert result == MatchResult(
        12,
        (
            HolderSpan("a", "host", (10, 11, 12), (5, 6, 7)),
            HolderSpan("b", "host", (3, 4), (0, 0)),
        ),
    )
    assert index.num_pages == 3
    index.check_integrity()


def test_a_packed_match_carries_the_wire_bytes():
    index = make_index("a", "b")
    apply_ok(index, "b", 1, stored((3, 4), (1, 2), generations=(2**40, 1)))
    apply_ok(index, "a", 1, stored((10, 11, 12), (1, 2, 3), generations=(5, 6, 7)))
    packed = index.match_packed(NS, make_tokens(1, 2, 3, 4), requester="b")
    assert packed == MatchResult(
        12,
        (
            PackedSpan("a", "host", struct.pack("<3i", 10, 11, 12), struct.pack("<3q", 5, 6, 7)),
            PackedSpan("b", "host", struct.pack("<2i", 3, 4), struct.pack("<2q", 2**40, 1)),
        ),
    )
    assert unpacked(packed) == index.match(NS, make_tokens(1, 2, 3, 4), requester="b")
    assert index.stats()["workers"]["b"]["local_hit_tokens"] == 2 * 2 * P  # both counted
    index.check_integrity()


def test_spans_of_equal_length_go_by_worker_id():
    index = make_index("b", "c", "a")
    for seq, worker in enumerate(("c", "a", "b"), start=1):
        apply_ok(index, worker, 1, stored((seq, 10 + seq), (1, 2)))
    assert spans(index.match(NS, make_tokens(1, 2))) == [
        ("a", (2, 12)),
        ("b", (3, 13)),
        ("c", (1, 11)),
    ]
    index.check_integrity()


def test_more_holders_than_inline_columns():
    workers = [f"w{i}" for i in range(7)]
    index = make_index(*workers)
    for i, worker in enumerate(workers):
        # w0 holds 1 page, w1 2 pages, ... w6 7 pages: spans of every length.
        pages = tuple(range(1, i + 2))
        apply_ok(index, worker, 1, stored(tuple(100 * i + p for p in pages), pages))
    result = index.match(NS, make_tokens(*range(1, 9)), requester="w2")
    assert result.matched_tokens == 7 * P
    assert spans(result) == [
        (f"w{i}", tuple(100 * i + p for p in range(1, i + 2))) for i in reversed(range(7))
    ]
    assert index.stats()["workers"]["w2"]["local_hit_tokens"] == 3 * P
    index.remove_worker("w6", "crashed")
    index.remove_worker("w1", "crashed")
    assert [worker for worker, _ in spans(index.match(NS, make_tokens(1)))] == [
        "w0",
        "w2",
        "w3",
        "w4",
        "w5",
    ]
    index.check_integrity()


def test_a_spans_tier_comes_from_its_pages_not_the_registration():
    index = GlobalIndex(page_tokens=P)
    index.register("g", node_id="node0", tier="gpu", now=0.0)
    apply_ok(index, "g", 1, stored((0,), (1,))._replace(tier="device"))
    assert index.match(NS, make_tokens(1)).spans == (HolderSpan("g", "device", (0,), (0,)),)
    assert index.worker_info("g").tier == "gpu"  # as registered: shown, never used
    index.check_integrity()


def test_match_compares_every_token():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0, 1), (1, 2)))
    tokens = make_tokens(1, 2)
    tokens[-1] += 1  # the last token of page 2 differs

    assert index.match(NS, tokens).matched_tokens == P
    assert index.match(NS, make_tokens(2, 1)).matched_tokens == 0
    assert index.match(NS, make_tokens(1, 2)[: 2 * P - 1]).matched_tokens == P  # partial page
    index.check_integrity()


def test_bytes_and_lists_match_alike():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0, 1), (1, 2)))
    tokens = make_tokens(1, 2, tail=3)
    as_bytes = struct.pack(f"<{len(tokens)}i", *tokens)

    assert pack_tokens(tokens) == as_bytes
    assert pack_tokens(np.array(tokens, dtype=np.int64)) == as_bytes
    expected = index.match(NS, tokens)
    assert expected.matched_tokens == 2 * P
    assert index.match(NS, as_bytes) == expected
    assert index.match(NS, np.array(tokens)) == expected
    index.check_integrity()


def test_bad_tokens_raise_and_change_nothing():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0,), (1,)))
    before = index.stats()

    with pytest.raises(ValueError, match="7 bytes, not a multiple of 4"):
        index.match(NS, b"\x00" * 7)
    with pytest.raises(ValueError, match="token id 2147483648 at index 1 is outside int32"):
        index.match(NS, [0, 2**31])
    with pytest.raises(ValueError, match="must be ints"):
        index.match(NS, [1.5])
    with pytest.raises(TypeError, match="Namespace"):
        index.match(("smollm2-135m", "", "tenant-a"), [1, 2])  # type: ignore[arg-type]
    assert index.stats() == before
    index.check_integrity()


def test_malformed_events_raise_and_change_nothing():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0,), (1,)))
    bad = [
        (PagesStored(NS, None, (1, 2), (0,), make_tokens(2, 3)), "1 generations for 2 pages"),
        (PagesStored(NS, None, (1,), (0,), (1, 2, 3)), "3 tokens for 1 pages of 4"),
        (PagesStored(NS, None, (1, 1), (0, 0), make_tokens(2, 3)), "repeats"),
        (PagesStored(NS, None, (-1,), (0,), make_tokens(2)), "page ids must be ints"),
        (PagesStored(NS, None, (2**31,), (0,), make_tokens(2)), r"\[0, 2\*\*31\)"),
        (PagesStored(NS, None, (1,), (0,), (0, 0, 0, 2**31)), "int32"),
        (PagesRemoved((0,), "bored"), "removal reason 'bored'"),
        ("not an event", "unknown event type str"),
    ]
    for event, message in bad:
        # A valid event first: a batch with a bad event applies none of its events.
        with pytest.raises(ValueError, match=message):
            index.apply_events("a", epoch(index, "a"), 2, [PagesRemoved((0,), "evicted"), event])
    assert index.match(NS, make_tokens(1)).matched_tokens == P
    apply_ok(index, "a", 2, stored((1,), (2,), parent=0))  # seq 2 was never consumed
    index.check_integrity()


# ---- idempotence, sequence numbers, resync ------------------------------------------------


def test_same_batch_twice_is_a_duplicate():
    index = make_index("a")
    batch = [stored((0, 1), (1, 2))]
    apply_ok(index, "a", 1, *batch)
    assert index.apply_events("a", epoch(index, "a"), 1, batch) == ApplyResult(
        False, False, "duplicate", 1
    )
    assert index.apply_events("a", epoch(index, "a"), 0, batch) == ApplyResult(
        False, False, "stale", 1
    )
    assert index.stats()["events"]["duplicates"] == 2
    assert spans(index.match(NS, make_tokens(1, 2))) == [("a", (0, 1))]
    index.check_integrity()


def test_same_event_twice_is_idempotent():
    index = make_index("a")
    event = stored((0, 1), (1, 2))
    apply_ok(index, "a", 1, event, event)
    apply_ok(index, "a", 2, event)
    assert index.num_pages == 2
    assert spans(index.match(NS, make_tokens(1, 2))) == [("a", (0, 1))]

    removal = PagesRemoved((1,), "evicted")
    apply_ok(index, "a", 3, removal, removal, PagesRemoved((77,), "evicted"))
    assert spans(index.match(NS, make_tokens(1, 2))) == [("a", (0,))]
    assert index.num_pages == 1
    index.check_integrity()


def test_restore_refreshes_the_generation():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0,), (1,), generations=(3,)))
    apply_ok(index, "a", 2, stored((0,), (1,), generations=(4,)))
    assert index.match(NS, make_tokens(1)).spans == (HolderSpan("a", "host", (0,), (4,)),)
    index.check_integrity()


def test_gap_needs_resync_and_resync_restores():
    index = make_index("a", "b")
    apply_ok(index, "a", 1, stored((0, 1), (1, 2)))
    apply_ok(index, "b", 1, stored((5,), (1,)))

    assert index.apply_events(
        "a", epoch(index, "a"), 3, [stored((2,), (3,), parent=1)]
    ) == ApplyResult(False, True, "gap", 1)
    # Until the resync, even the missing batch is refused: the worker's state is unknown.
    late = [PagesRemoved((1,), "evicted")]
    assert index.apply_events("a", epoch(index, "a"), 2, late) == ApplyResult(
        False, True, "awaiting_resync", 1
    )

    snapshot = [stored((0,), (1,)), stored((2, 3), (3, 4), parent=0)]
    assert index.resync("a", epoch(index, "a"), 3, snapshot) == ApplyResult(
        True, False, "resynced", 3
    )

    assert spans(index.match(NS, make_tokens(1, 2))) == [("a", (0,)), ("b", (5,))]
    assert spans(index.match(NS, make_tokens(1, 3, 4))) == [("a", (0, 2, 3)), ("b", (5,))]
    assert index.num_pages == 3
    apply_ok(index, "a", 4, PagesRemoved((3,), "evicted"))
    assert index.stats()["events"] == {
        "batches": 5,
        "duplicates": 0,
        "resyncs_requested": 1,
        "resyncs": 1,
        "over_capacity": 0,
        "unknown_pages": 0,
    }
    index.check_integrity()


def test_unknown_parent_needs_resync():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0,), (1,)))
    result = index.apply_events("a", epoch(index, "a"), 2, [stored((1,), (2,), parent=42)])
    assert result == ApplyResult(False, True, "unknown_parent", 1)
    assert index.num_pages == 1
    index.check_integrity()


def test_unknown_worker_and_epoch_need_resync():
    index = make_index("a")
    batch = [stored((0,), (1,))]
    assert index.apply_events("z", 1, 1, batch) == ApplyResult(False, True, "unknown_worker", 0)
    wrong = epoch(index, "a") + 1
    assert index.apply_events("a", wrong, 1, batch) == ApplyResult(False, True, "epoch_mismatch", 0)
    assert index.resync("z", 1, 1, batch) == ApplyResult(False, True, "unknown_worker", 0)
    assert index.num_pages == 0
    index.check_integrity()


def test_bad_resync_raises_and_changes_nothing():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0,), (1,)))
    with pytest.raises(ValueError, match="parent page 9 is not stored earlier"):
        index.resync("a", epoch(index, "a"), 5, [stored((1,), (2,), parent=9)])
    with pytest.raises(ValueError, match=r"pages \[1\] listed twice"):
        index.resync("a", epoch(index, "a"), 5, [stored((1,), (2,)), stored((1,), (3,))])
    with pytest.raises(ValueError, match="not PagesStored"):
        index.resync("a", epoch(index, "a"), 5, [AllCleared()])  # type: ignore[list-item]
    assert spans(index.match(NS, make_tokens(1))) == [("a", (0,))]
    apply_ok(index, "a", 2, AllCleared())
    index.check_integrity()


# ---- removals and page id reuse ---------------------------------------------------------


def test_removal_prunes_empty_chains_leaf_up():
    index = make_index("a", "b")
    apply_ok(index, "a", 1, stored((0, 1, 2), (1, 2, 3)))
    apply_ok(index, "b", 1, stored((0,), (1,)))
    apply_ok(index, "a", 2, PagesRemoved((2, 1), "evicted"))
    assert index.num_pages == 1
    apply_ok(index, "a", 3, PagesRemoved((0,), "evicted"))
    assert spans(index.match(NS, make_tokens(1, 2))) == [("b", (0,))]
    apply_ok(index, "b", 2, AllCleared())
    assert index.num_pages == 0
    assert index.match(NS, make_tokens(1)) == MatchResult(0, ())
    index.check_integrity()


def test_removing_an_inner_page_drops_the_workers_pages_below_it():
    index = make_index("a", "b")
    apply_ok(index, "a", 1, stored((0, 1, 2), (1, 2, 3)), stored((3,), (4,), parent=0))
    apply_ok(index, "b", 1, stored((7, 8), (1, 2)))
    apply_ok(index, "a", 2, PagesRemoved((1,), "evicted"))
    # a keeps page 0 and its other child; b still serves pages 1-2; page 3 of a is gone.
    assert spans(index.match(NS, make_tokens(1, 2, 3))) == [("b", (7, 8)), ("a", (0,))]
    assert spans(index.match(NS, make_tokens(1, 4))) == [("a", (0, 3)), ("b", (7,))]
    assert index.num_pages == 3
    index.check_integrity()


def test_a_reused_page_id_moves_to_its_new_node():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0, 1, 2), (1, 2, 3)))
    # Page 1 evicted (with page 2 below it) and re-stored under a new prefix.
    apply_ok(index, "a", 2, PagesRemoved((2, 1), "evicted"), stored((1,), (5,), parent=0))
    assert spans(index.match(NS, make_tokens(1, 5))) == [("a", (0, 1))]
    assert index.match(NS, make_tokens(1, 2)).matched_tokens == P
    # The removal never arrived: a store at a new place still moves the page.
    apply_ok(index, "a", 3, stored((1,), (6,)))
    assert spans(index.match(NS, make_tokens(6))) == [("a", (1,))]
    assert index.match(NS, make_tokens(1, 5)).matched_tokens == P
    assert index.num_pages == 2
    index.check_integrity()


def test_a_reused_page_id_as_its_only_root_child_keeps_the_root():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0,), (1,)))
    apply_ok(index, "a", 2, stored((0,), (2,)))  # page 0 rewritten without a removal
    assert index.match(NS, make_tokens(1)).matched_tokens == 0
    assert spans(index.match(NS, make_tokens(2))) == [("a", (0,))]
    index.check_integrity()


def test_a_page_id_on_its_own_path_is_a_conflict():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0, 1), (1, 2)))
    result = index.apply_events("a", epoch(index, "a"), 2, [stored((0,), (3,), parent=1)])
    assert result == ApplyResult(False, True, "page_conflict", 1)
    assert index.num_pages == 2
    index.check_integrity()


def test_same_prefix_under_a_new_page_id_replaces_the_old_one():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0,), (1,)))
    apply_ok(index, "a", 2, stored((4,), (1,)))
    assert spans(index.match(NS, make_tokens(1))) == [("a", (4,))]
    assert index.stats()["workers"]["a"]["pages"] == 1
    index.check_integrity()


# ---- workers: epochs and liveness --------------------------------------------------------


def test_each_registration_is_a_new_epoch_that_drops_the_old_ones_holdings():
    index = make_index("a", "b")
    first = epoch(index, "a")
    apply_ok(index, "a", 1, stored((0, 1), (1, 2)))
    apply_ok(index, "b", 1, stored((0,), (1,)))

    again = index.register("a", node_id="node1", now=2.0)
    assert again == Registration("a", again.epoch, 0, 2) and again.epoch > first
    assert again.epoch > epoch(index, "b") > first  # issued in order, never twice
    info = WorkerInfo("a", again.epoch, "node1", "cpu", 2.0, 0, 0, False, DEFAULT_CAPACITY)
    assert index.worker_info("a") == info
    assert spans(index.match(NS, make_tokens(1, 2))) == [("b", (0,))]
    assert index.apply_events("a", first, 2, []) == ApplyResult(False, True, "epoch_mismatch", 0)
    apply_ok(index, "a", 1, stored((3,), (1,)))
    assert spans(index.match(NS, make_tokens(1))) == [("a", (3,)), ("b", (0,))]
    with pytest.raises(StaleEpoch, match=f"at epoch {again.epoch}, not {first}: not removed"):
        index.remove_worker("a", "bye", epoch=first)
    assert index.remove_worker("a", "bye", epoch=again.epoch) == 1
    index.check_integrity()


KEY_A = b"A" * 40  # the shape of a z85 public key; the index does not decode it
PEER_A = PeerAddress("tcp://10.0.0.1:7001", "kvmesh-11-22-a", KEY_A)


def test_a_workers_entry_is_what_its_current_incarnation_registered():
    index = make_index("b", now=0.0)
    assert index.peer("a") is None
    first = index.register("a", node_id="node0", tier="gpu", now=1.0, peer=PEER_A)
    assert index.peer("a") == PeerEntry("a", first.epoch, "node0", "gpu", *PEER_A)
    assert index.peer("b") == PeerEntry("b", epoch(index, "b"), "node0", "cpu", "", "", None)
    moved = PeerAddress("tcp://10.0.0.2:7002", "kvmesh-33-44-a", None)
    again = index.register("a", node_id="node1", now=2.0, peer=moved)  # it restarted
    assert index.peer("a") == PeerEntry("a", again.epoch, "node1", "cpu", *moved)
    assert index.peers() == ([index.peer("a"), index.peer("b")], False)
    assert index.peers(after="a") == ([index.peer("b")], False)
    assert index.peers(limit=1) == ([index.peer("a")], True)
    index.check_integrity()


@pytest.mark.parametrize("reason", ["bye", "reported_dead", "expired", "evicted"])
def test_a_removed_worker_leaves_no_entry(reason):
    index = make_index(now=0.0, liveness_timeout_s=10.0, max_workers=2)
    index.register("a", node_id="node0", now=0.0, peer=PEER_A)
    index.register("b", node_id="node0", now=5.0)
    apply_ok(index, "b", 1, stored((0,), (1,)))
    if reason == "expired":
        assert index.expire(now=10.5) == ["a"]
    elif reason == "evicted":  # the registry is full: a, holding nothing, makes room
        index.register("c", node_id="node0", now=6.0)
    else:
        index.remove_worker("a", reason)
    assert index.peer("a") is None
    assert [entry.worker_id for entry in index.peers()[0]] == index.live_workers()
    assert "a" not in index.live_workers()
    assert index.stats()["removed_workers"] == {reason: 1}
    index.check_integrity()


def test_a_malformed_entry_is_refused_and_changes_nothing():
    index = make_index("a")
    before = index.peer("a")
    with pytest.raises(ValueError, match="40-char z85 key or None"):
        index.register("a", "node0", peer=PEER_A._replace(page_key=b"k" * 32))
    with pytest.raises(TypeError, match="address and store name are str"):
        index.register("a", "node0", peer=PEER_A._replace(shm_name=None))
    with pytest.raises(ValueError, match="limit must be positive"):
        index.peers(limit=0)
    assert index.peer("a") == before
    index.check_integrity()


def test_silent_workers_expire_with_all_their_pages():
    index = make_index("a", "b", now=0.0, liveness_timeout_s=10.0)
    apply_ok(index, "a", 1, stored((0, 1), (1, 2)))
    apply_ok(index, "b", 1, stored((0,), (1,)))

    a, b = epoch(index, "a"), epoch(index, "b")
    assert index.heartbeat("a", a, now=8.0)
    assert not index.heartbeat("a", a + 1, now=8.0)  # wrong epoch
    assert index.expire(now=10.0) == []  # b silent exactly the timeout: not past it
    assert index.expire(now=10.5) == ["b"]
    assert index.live_workers() == ["a"]
    assert index.worker_info("b") is None
    assert spans(index.match(NS, make_tokens(1, 2))) == [("a", (0, 1))]

    assert index.expire(now=18.5) == ["a"]
    assert index.match(NS, make_tokens(1, 2)) == MatchResult(0, ())
    assert index.num_pages == 0
    assert not index.heartbeat("a", a, now=19.0)
    assert index.apply_events("b", b, 2, []) == ApplyResult(False, True, "unknown_worker", 0)
    stats = index.stats()
    assert stats["workers_live"] == 0
    assert stats["removed_workers"] == {"expired": 2}
    index.check_integrity()


def test_removed_worker_loses_everything_and_its_slot_is_reused():
    index = make_index("a", "b")
    apply_ok(index, "a", 1, stored((0, 1), (1, 2)))
    apply_ok(index, "b", 1, stored((0, 1), (1, 2)))
    assert index.remove_worker("a", "crashed") == 2
    assert index.remove_worker("a", "crashed") == 0
    assert spans(index.match(NS, make_tokens(1, 2))) == [("b", (0, 1))]

    index.register("c", node_id="node0", now=0.0)  # takes a's slot
    apply_ok(index, "c", 1, stored((4,), (1,)))
    assert spans(index.match(NS, make_tokens(1))) == [("b", (0,)), ("c", (4,))]
    assert index.stats()["removed_workers"] == {"crashed": 1}
    index.check_integrity()


# ---- tenants and statistics -------------------------------------------------------------


def test_tenants_never_share_pages():
    other = Namespace(NS.model, NS.adapter, "tenant-b")
    index = make_index("a", "b")
    # Named first, as the front door does: a salt has figures of its own once named.
    index.name_tenant(NS.salt, "acme")
    index.name_tenant("tenant-b", "globex")
    apply_ok(index, "a", 1, stored((0, 1), (1, 2)))

    assert index.match(other, make_tokens(1, 2), requester="b") == MatchResult(0, ())
    apply_ok(index, "b", 1, stored((0,), (1,), namespace=other))
    assert spans(index.match(other, make_tokens(1, 2))) == [("b", (0,))]
    assert spans(index.match(NS, make_tokens(1, 2))) == [("a", (0, 1))]
    assert index.match(Namespace(NS.model, "lora-1", NS.salt), make_tokens(1)).matched_tokens == 0

    tenants = index.stats()["tenants"]
    assert tenants["acme"]["hit_tokens"] == 2 * P
    assert tenants["globex"]["hit_tokens"] == P
    assert tenants["globex"]["miss_tokens"] == 2 * P + P
    assert set(tenants) == {"acme", "globex"}  # names, never salts
    index.check_integrity()


def test_statistics_stay_bounded_and_show_no_salts():
    index = make_index("a", "b", max_tenants=2)
    apply_ok(index, "a", 1, stored((0,), (1,)))
    index.name_tenant("s0", "zero")
    index.name_tenant("s1", "one")
    index.name_tenant("s2", "two")  # a third name does not fit
    for salt in ("s0", "s1", "s2", "s3"):  # s2 has no name, s3 was never named
        index.match(Namespace("m", "", salt), make_tokens(1), requester="a")
    index.match(NS, make_tokens(1), requester="nobody")  # not a worker
    index.match(NS, make_tokens(1), requester="b")
    index.remove_worker("b", "bye")
    stats = index.stats()
    # Unnamed salts share one tally and take no place of a name.
    assert {name: c["queries"] for name, c in stats["tenants"].items()} == {
        "zero": 1,
        "one": 1,
        "(unnamed)": 4,
    }
    assert {w: c["queries"] for w, c in stats["workers"].items()} == {
        "a": 4,
        "(unregistered)": 1,
        "(removed)": 1,
    }
    assert stats["cluster"]["queries"] == 6
    index.check_integrity()


def test_a_full_registry_makes_room_only_by_registrations_without_pages():
    index = make_index("a", now=0.0, max_workers=2)
    apply_ok(index, "a", 1, stored((0,), (1,)))
    index.register("b", node_id="node0", now=1.0)
    index.register("c", node_id="node0", now=2.0)  # b held nothing: it makes room
    assert index.live_workers() == ["a", "c"]
    apply_ok(index, "c", 1, stored((0,), (2,)))
    with pytest.raises(RegistryFull, match="2 workers registered, each holding pages"):
        index.register("d", node_id="node0", tier="new-tier", now=3.0)
    assert index.live_workers() == ["a", "c"]
    assert index.stats()["tiers"] == {"device": 0, "host": 2, "disk": 0}
    assert index.stats()["removed_workers"] == {"evicted": 1}
    index.check_integrity()


def test_a_registered_tier_name_is_kept_with_its_registration_only():
    index = make_index()
    for i in range(300):
        index.register("a", node_id="node0", tier=f"tier-{i}", now=0.0)
    assert index.worker_info("a").tier == index.peer("a").tier == "tier-299"
    assert index.stats()["tiers"] == {"device": 0, "host": 0, "disk": 0}
    index.remove_worker("a", "bye")
    assert index.worker_info("a") is None and index.peer("a") is None
    index.check_integrity()


def test_a_match_names_at_most_max_spans_holders():
    index = make_index(*(f"w{i}" for i in range(6)), max_spans=3)
    for i in range(6):
        apply_ok(index, f"w{i}", 1, stored((i,), (1,)))
    result = index.match(NS, make_tokens(1), requester="w5")
    assert [span.worker_id for span in result.spans] == ["w0", "w1", "w2"]
    assert index.stats()["workers"]["w5"]["local_hit_tokens"] == P  # still its own hit
    index.check_integrity()


def test_local_and_remote_hits_are_counted_per_requester():
    index = make_index("a", "b")
    apply_ok(index, "a", 1, stored((0, 1, 2), (1, 2, 3)))
    apply_ok(index, "b", 1, stored((5,), (1,)))

    index.match(NS, make_tokens(1, 2, 3, 4, tail=2), requester="b")  # 18 tokens
    index.match(NS, make_tokens(1, 2), requester="a")
    index.match(NS, make_tokens(7))

    stats = index.stats()
    assert stats["workers"]["b"] == {
        "queries": 1,
        "queried_tokens": 18,
        "hit_tokens": 12,
        "local_hit_tokens": 4,
        "remote_hit_tokens": 8,
        "miss_tokens": 4,
        "alignment_lost_tokens": 2,
        "pages": 1,
        "live": True,
        "node": "node0",
    }
    assert stats["workers"]["a"]["local_hit_tokens"] == 8
    assert stats["workers"]["a"]["remote_hit_tokens"] == 0
    assert stats["cluster"] == {
        "queries": 3,
        "queried_tokens": 30,
        "hit_tokens": 20,
        "local_hit_tokens": 12,
        "remote_hit_tokens": 8,
        "miss_tokens": 8,
        "alignment_lost_tokens": 2,
    }
    assert (stats["pages"], stats["holdings"], stats["workers_live"]) == (3, 4, 2)
    index.check_integrity()


def test_alignment_loss_is_the_trailing_partial_page():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0,), (1,)))
    index.match(NS, make_tokens(1, tail=3))  # 1 page hit, 3 tokens lost
    index.match(NS, [1, 2])  # shorter than a page: all lost
    cluster = index.stats()["cluster"]
    assert (cluster["hit_tokens"], cluster["miss_tokens"], cluster["alignment_lost_tokens"]) == (
        4,
        0,
        5,
    )
    index.check_integrity()


def test_stats_are_plain_data():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0,), (1,)))
    index.match(NS, make_tokens(1), requester="ghost")

    def plain(value) -> bool:
        if isinstance(value, dict):
            return all(isinstance(k, str) and plain(v) for k, v in value.items())
        if isinstance(value, list):
            return all(isinstance(item, str) for item in value)
        return type(value) in (int, bool, str)

    stats = index.stats()
    assert plain(stats)
    assert stats["workers"]["(unregistered)"]["live"] is False
    index.check_integrity()


# ---- routing ----------------------------------------------------------------------------


def make_routing_index() -> GlobalIndex:
    """a holds 3 pages of the prompt, b 1, c and d none (c holds an unrelated page)."""
    index = make_index("a", "b", "c", "d", load_weight=0.5)
    apply_ok(index, "a", 1, stored((0, 1, 2), (1, 2, 3)))
    apply_ok(index, "b", 1, stored((0,), (1,)))
    apply_ok(index, "c", 1, stored((0,), (9,)))
    return index


PROMPT = make_tokens(1, 2, 3, 4)  # 16 tokens


def test_route_prefers_the_worker_holding_most():
    index = make_routing_index()
    # a computes 4 tokens (2 ms each by default); b copies 8 from a on its node first
    # (10 us each), c copies 12: a is soonest.
    decision = index.route(NS, PROMPT, {"a": 0.0, "b": 0.0, "c": 0.0})
    assert decision == RouteDecision("a", 12, pytest.approx(2e-3 * 4), "prefix")
    index.check_integrity()


def test_route_weighs_the_queue_against_copying():
    index = make_routing_index()
    # a has a queued token (weighted 0.5): 2e-3 * 4.5 > b's copy of 8 tokens + its 4.
    assert index.route(NS, PROMPT, {"a": 1.0, "b": 0.0}) == RouteDecision(
        "b", 4, pytest.approx(8e-5 + 2e-3 * 4), "prefix"
    )
    # The queue a reported with its heartbeat counts beside the requests sent since.
    reported = {"a": WorkerLoad(queued_tokens=2)}
    assert index.route(NS, PROMPT, {"a": 0.0, "b": 0.0}, reported=reported).worker_id == "b"
    assert index.route(NS, PROMPT, {"a": 0.0, "b": 0.0}).worker_id == "a"
    # d holds nothing: it copies 12 tokens from a, and wins against a busy a and b.
    assert index.route(NS, PROMPT, {"a": 20.0, "b": 20.0, "d": 0.0}) == RouteDecision(
        "d", 0, pytest.approx(1.2e-4 + 2e-3 * 4), "copy"
    )
    index.check_integrity()


def test_route_counts_a_prefix_pending_on_a_worker():
    index = make_routing_index()
    uncached = make_tokens(7, 8, 6)  # 12 tokens nobody has published
    # d is computing its first 8 tokens for a request in flight.
    decision = index.route(NS, uncached, {"c": 0.0, "d": 2.0}, pending={"d": 8.0})
    assert decision == RouteDecision("d", 0, pytest.approx(2e-3 * (0.5 * 2 + 4)), "pending")
    assert index.route(NS, uncached, {"c": 0.0, "d": 2.0}).worker_id == "c"
    index.check_integrity()


def test_route_falls_back_to_the_least_loaded():
    index = make_routing_index()
    uncached = make_tokens(7, 8)
    assert index.route(NS, uncached, {"a": 30, "b": 20, "c": 90}) == RouteDecision(
        "b", 0, pytest.approx(2e-3 * (0.5 * 20 + 8)), "least_loaded"
    )
    # Equal load: the smallest worker id.
    assert index.route(NS, uncached, {"d": 0.0, "c": 0.0}).worker_id == "c"
    # Unregistered ids are skipped; none live at all is an ordinary answer.
    assert index.route(NS, uncached, {"ghost": 0.0, "d": 0.5}).worker_id == "d"
    assert index.route(NS, uncached, {"ghost": 0.0}) == RouteDecision(
        None, 0, 0.0, "no_live_worker"
    )
    with pytest.raises(ValueError, match="load of worker 'a' must be finite and >= 0: -1"):
        index.route(NS, uncached, {"a": -1})
    assert index.stats()["cluster"]["queries"] == 0  # routing is a read
    index.check_integrity()


# ---- paths of many runs, the key table ---------------------------------------------------


def make_fragmented_index() -> GlobalIndex:
    """a's pages 1, 2, 3 published one at a time, interleaved with c's: node ids 1, 3, 5."""
    index = make_index("a", "c")
    for seq, (mine, theirs) in enumerate([(1, 9), (2, 8), (3, 7)], start=1):
        parent = None if seq == 1 else seq - 2
        apply_ok(index, "a", seq, stored((seq - 1,), (mine,), parent=parent))
        apply_ok(index, "c", seq, stored((seq - 1,), (theirs,), parent=parent))
    return index


@pytest.mark.parametrize("runs", [4, 1, 0])
def test_a_path_of_many_runs(runs):
    index = make_fragmented_index()
    with mock.patch.object(global_index_module, "MAX_RUNS", runs):
        assert path_of(index, make_tokens(1, 2, 3)).node_ids() == [1, 3, 5]
        assert spans(index.match(NS, make_tokens(1, 2, 3, 4))) == [("a", (0, 1, 2))]
        assert spans(index.match(NS, make_tokens(9, 8, 5))) == [("c", (0, 1))]
        assert index.route(NS, make_tokens(1, 2, 3), {"a": 0.0, "c": 0.0}).matched_tokens == 3 * P
    index.check_integrity()


def test_a_chain_published_at_once_is_one_run():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((5, 6, 7), (1, 2, 3)))
    path = path_of(index, make_tokens(1, 2, 3, 4))
    assert (path.length, path.runs, path.nodes) == (3, ((1, 3),), None)  # node 0: the root
    assert path_of(index, make_tokens(1, 2, 4)).length == 2
    index.check_integrity()


def test_a_remembered_branch_is_checked_before_use():
    """The walk remembers the child it found below each branch; once that node is released
    and its id reused for another page, the entry is stale and no match comes of it."""
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0, 1), (1, 2)))
    assert spans(index.match(NS, make_tokens(1, 2))) == [("a", (0, 1))]
    apply_ok(index, "a", 2, AllCleared())
    apply_ok(index, "a", 3, stored((5, 6), (3, 2)))  # the same node ids, other tokens
    assert index.match(NS, make_tokens(1, 2)).matched_tokens == 0
    assert spans(index.match(NS, make_tokens(3, 2))) == [("a", (5, 6))]
    apply_ok(index, "a", 4, AllCleared())
    apply_ok(index, "a", 5, stored((7, 8), (1, 2)))
    assert spans(index.match(NS, make_tokens(1, 2))) == [("a", (7, 8))]
    index.check_integrity()


class Path(NamedTuple):
    length: int
    runs: tuple[tuple[int, int], ...]
    nodes: tuple[int, ...] | None

    def node_ids(self) -> list[int]:
        if self.nodes is not None:
            return list(self.nodes)
        return [node for first, pages in self.runs for node in range(first, first + pages)]


def path_of(index: GlobalIndex, tokens: list[int]) -> Path:
    """The nodes the match walk finds for `tokens` in namespace NS."""
    nodes = index._nodes
    root = nodes.roots.get(NS)
    return Path(*nodes.trie.walk(root, pack_tokens(tokens), global_index_module.MAX_RUNS))


def crowded_key(home: int, variant: int) -> int:
    """An odd int64 key whose top ten bits are `home`: its home slot in a fresh table."""
    key = home << 54 | (2 * variant + 1)
    return key - 2**64 if key >= 2**63 else key


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.sampled_from([0, 1, 2, 1000, 1023]), st.integers(0, 5)),
        max_size=400,
    )
)
def test_the_key_table_is_a_multimap(ops):
    """Keys crowded onto a few home slots (the last ones too) and repeated: long probe runs,
    equal keys, backward-shift deletion."""
    table = KeyTable()
    model: dict[int, list[int]] = {}
    for node, (insert, home, variant) in enumerate(ops):
        key = crowded_key(home, variant)
        if insert or not model.get(key):
            table.insert(key, node)
            model.setdefault(key, []).append(node)
        else:
            table.remove(key, model[key].pop(len(model[key]) // 2))
        for probe, nodes in model.items():
            assert sorted(table.candidates(probe)) == sorted(nodes)
    check_table(table, model)


def test_the_key_table_grows_and_shrinks():
    table = KeyTable()
    keys = [crowded_key((0, 1, 2, 500, 1021, 1022, 1023)[home % 7], home) for home in range(3000)]
    for node, key in enumerate(keys):
        table.insert(key, node)
    assert table.bits == 13  # at most half full
    check_table(table, {key: [node] for node, key in enumerate(keys)})
    for node, key in enumerate(keys[:2900]):
        table.remove(key, node)
    assert table.bits == 10
    check_table(table, {key: [node + 2900] for node, key in enumerate(keys[2900:])})


def test_the_key_table_refuses_what_is_not_its_own_and_changes_nothing():
    table = KeyTable()
    table.insert(crowded_key(3, 1), 7)
    with pytest.raises(ValueError, match="must be odd"):
        table.insert(2, 8)
    with pytest.raises(ValueError, match="node id"):
        table.insert(crowded_key(3, 2), -1)
    with pytest.raises(OverflowError):
        table.insert(2**64 + 1, 8)
    with pytest.raises(KeyError, match="not in the key table"):
        table.remove(crowded_key(3, 1), 8)  # the key, another node
    with pytest.raises(TypeError, match="int64 keys"):
        table.find_run(np.array([1, 3], np.int32))
    assert table.size == 1
    check_table(table, {crowded_key(3, 1): [7]})


@settings(max_examples=60, deadline=None)
@given(
    st.integers(-(2**63), 2**63 - 1),
    st.integers(0, 40),
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=5 * P + 3),
)
def test_chain_keys_are_the_running_sums_of_their_terms(start, depth, tokens):
    """Against the formula in plain Python ints (keys.py): key(page i) = start + the sum of
    coefficient * token over the token positions from depth * P to the end of page i."""
    keys = ChainKeys(P, 12345)
    data = struct.pack(f"<{len(tokens)}i", *tokens)
    pages = len(tokens) // P
    coefficients = keys.coefficients((depth + pages) * P).tolist()
    assert all(c % 2 == 0 for c in coefficients)
    expected, key = [], start
    for i in range(pages * P):
        key += coefficients[depth * P + i] * tokens[i]
        if i % P == P - 1:
            expected.append((key + 2**63) % 2**64 - 2**63)
    assert keys.chain_keys(start, depth, data).tolist() == expected
    prompt = bytes(4 * P * depth) + data  # the same pages, at page depth `depth` of a prompt
    for page in range(pages):
        parent = start if page == 0 else expected[page - 1]
        assert keys.page_key(parent, depth + page, prompt) == expected[page]


def test_chain_keys_refuse_what_they_cannot_key():
    keys = ChainKeys(P, 7)
    data = struct.pack(f"<{2 * P}i", *range(2 * P))
    with pytest.raises(ValueError, match="no such page"):
        keys.page_key(1, 2, data)
    with pytest.raises(ValueError, match="depth must be >= 0"):
        keys.chain_keys(1, -1, data)
    with pytest.raises(ValueError, match="longest key"):
        keys.chain_keys(1, 2**26, data)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        keys.chain_keys(1, 0)
    with pytest.raises(ValueError, match="positive"):
        ChainKeys(0, 7)
    assert keys.chain_keys(1, 0, data[:-1]).tolist() == keys.chain_keys(1, 0, data)[:1].tolist()
    assert all(k & 1 for k in keys.chain_keys(1, 3, data).tolist())  # odd from an odd root


def columns(nodes, **changed):
    """The 14 columns the trie attaches, in order, some replaced."""
    holders = nodes._holders
    named = {
        "tokens": nodes.tokens_arr,
        "parent": nodes.parent_arr,
        "first_child": nodes.first_child_arr,
        "next_sibling": nodes.next_sibling_arr,
        "prev_sibling": nodes.prev_sibling_arr,
        "key": nodes.key_arr,
        "depth": nodes.depth_arr,
        "last_access": nodes.last_access_arr,
        "chained": nodes.chained_arr,
        "count": holders.count_arr,
        "slot": holders.slot_arr,
        "page": holders.page_arr,
        "generation": holders.generation_arr,
        "tier": holders.tier_arr,
    }
    return [*{**named, **changed}.values()]


def test_the_compiled_trie_reads_only_columns_that_agree_and_nodes_inside_them():
    index = GlobalIndex(page_tokens=P)
    index.register("a", "n1", now=0.0)
    apply_ok(index, "a", 1, stored((0, 1, 2), (1, 2, 3)))
    nodes = index._nodes
    trie = nodes.trie
    data = pack_tokens(make_tokens(1, 2, 3))
    assert trie.walk(nodes.roots[NS], data, 4)[0] == 3
    for root in (nodes.capacity, 2**40, -5):  # no such node: nothing is read, nothing found
        assert trie.walk(root, data, 4)[0] == 0
    with pytest.raises(ValueError, match="negative"):
        trie.walk(nodes.roots[NS], data, -1)
    with pytest.raises(ValueError, match="column key has 63 nodes, the others 64"):
        trie.attach(*columns(nodes, key=nodes.key_arr[:-1]))
    with pytest.raises(TypeError, match="chained has 8-byte items"):
        trie.attach(*columns(nodes, chained=nodes.key_arr))
    with pytest.raises(ValueError, match="columns shrank"):
        trie.attach(*columns(nodes, **{name: column[:2] for name, column in zip(
            ("tokens", "parent", "first_child", "next_sibling", "prev_sibling", "key", "depth",
             "last_access", "chained", "count", "slot", "page", "generation", "tier"),
            columns(nodes), strict=True)}))  # fmt: skip
    pages = index._registry.workers["a"].pages
    slot = index._registry.workers["a"].slot
    before = index.stats()
    # Nodes outside those handed out, page ids outside int32, tiers outside TIERS: refused
    # before anything is written.
    for bad_parent in (nodes.allocated, 2**40, -1):
        with pytest.raises(ValueError, match="node id outside"):
            trie.store(pages, slot, bad_parent, data[: 4 * P], [9], [1], 1, 0)
    with pytest.raises(ValueError, match="page id must be in"):
        trie.store(pages, slot, nodes.roots[NS], data[: 4 * P], [2**31], [1], 1, 0)
    with pytest.raises(ValueError, match="tier outside"):
        trie.store(pages, slot, nodes.roots[NS], data[: 4 * P], [9], [1], 7, 0)
    with pytest.raises(ValueError, match="tokens for another count"):
        trie.store(pages, slot, nodes.roots[NS], data, [9], [1], 1, 0)
    with pytest.raises(ValueError, match="node id outside"):
        trie.drop_subtree(pages, slot, 2**31 - 1, True)
    with pytest.raises(TypeError, match="expected a PageMap"):
        trie.drop_all({}, slot, True)
    assert index.stats() == before
    index.check_integrity()


def check_table(table, model: dict[int, list[int]]) -> None:
    stored_keys, nodes = table.check()
    assert sorted(zip(stored_keys.tolist(), nodes.tolist(), strict=True)) == sorted(
        (key, node) for key, held in model.items() for node in held
    )
    present = [key for key, held in model.items() if held]
    found = table.find_run(np.array(present, np.int64)).tolist()
    assert len(found) == len(present)
    assert all(node in model[key] for key, node in zip(present, found, strict=True))
    absent = crowded_key(1000, 99)
    assert table.find_run(np.array([absent, *present[:1]], np.int64)).size == 0


# ---- the owner thread --------------------------------------------------------------------


def in_thread(call):
    """What `call()` returns or raises when run in a thread of its own."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed back to the test
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="intruder")
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    return outcome


CALLS = {
    "register": lambda index: index.register("b", node_id="node0", now=0.0),
    "heartbeat": lambda index: index.heartbeat("a", 1, now=1.0),
    "expire": lambda index: index.expire(now=100.0),
    "remove_worker": lambda index: index.remove_worker("a", "bye"),
    "live_workers": lambda index: index.live_workers(),
    "worker_info": lambda index: index.worker_info("a"),
    "apply_events": lambda index: index.apply_events("a", 1, 2, [AllCleared()]),
    "resync": lambda index: index.resync("a", 1, 2, []),
    "name_tenant": lambda index: index.name_tenant("salt", "acme"),
    "match": lambda index: index.match(NS, make_tokens(1)),
    "match_packed": lambda index: index.match_packed(NS, make_tokens(1)),
    "route": lambda index: index.route(NS, make_tokens(1), {"a": 0.0}),
    "num_pages": lambda index: index.num_pages,
    "stats": lambda index: index.stats(),
    "check_integrity": lambda index: index.check_integrity(),
    "hand_off": lambda index: index.hand_off(),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_call_from_another_thread_is_refused_and_changes_nothing(name):
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0,), (1,)))
    before = index.stats()
    outcome = in_thread(lambda: CALLS[name](index))
    assert isinstance(outcome.get("error"), OwnerError), outcome
    assert "owned by thread 'MainThread'" in str(outcome["error"])
    assert "'intruder' may not call it" in str(outcome["error"])
    assert index.stats() == before
    assert index.match(NS, make_tokens(1)).matched_tokens == P
    index.check_integrity()


def test_a_handed_off_index_belongs_to_the_next_thread_that_calls_it():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0,), (1,)))
    index.hand_off()
    outcome = in_thread(lambda: index.match(NS, make_tokens(1)).matched_tokens)
    assert outcome == {"value": P}
    with pytest.raises(OwnerError, match="owned by thread 'intruder'"):
        index.match(NS, make_tokens(1))  # the creator gave it away


# ---- integrity ---------------------------------------------------------------------------


def test_check_integrity_catches_a_broken_reverse_map():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0, 1), (1, 2)))
    index._registry.workers["a"].pages.pop(1)  # corrupt on purpose
    with pytest.raises(AssertionError, match="2 holders on nodes, 1 in reverse maps"):
        index.check_integrity()


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda index: index._nodes.key_arr.__setitem__(2, index._nodes.key[2] + 2), "wrong key"),
        (lambda index: index._nodes.chained_arr.__setitem__(2, 0), "chained flag"),
        (lambda index: index._holders.count_arr.__setitem__(2, 2), "holder count"),
        (lambda index: index._nodes.depth_arr.__setitem__(2, 5), "depth"),
        (lambda index: index._nodes.tokens_arr.__setitem__((2, 0), 7), "does not match its page"),
        (lambda index: index._holders.tier_arr.__setitem__((2, 0), 3), "in no tier of TIERS"),
        (lambda index: index._holders.tier_arr.__setitem__((2, 0), 2), r"\[0, 1, 1\] pages per"),
        (lambda index: index._registry.workers["a"].tier_pages.__setitem__(1, 3), "per tier"),
    ],
)
def test_check_integrity_catches_corruption(corrupt, message):
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0, 1), (1, 2)))
    index.check_integrity()
    corrupt(index)
    with pytest.raises(AssertionError, match=message):
        index.check_integrity()


@pytest.mark.parametrize(
    "peer, message",
    [
        (PeerAddress("", "", b"short"), "is not a 40-char z85 key"),
        (PeerAddress(None, "", None), "a: PeerAddress"),
        (("", "", None), "a: peer entry"),
    ],
)
def test_check_integrity_covers_peer_entries(peer, message):
    index = make_index("a")
    index.check_integrity()
    index._registry.workers["a"].peer = peer  # corrupt on purpose
    with pytest.raises(AssertionError, match=message):
        index.check_integrity()


def test_check_integrity_catches_a_worker_changing_columns():
    index = make_index("a", "b")
    apply_ok(index, "a", 1, stored((0, 1), (1, 2)))
    apply_ok(index, "b", 1, stored((0, 1), (1, 2)))
    slots = index._holders.slot_arr
    slots[2, [0, 1]] = slots[2, [1, 0]]  # node 2: a and b swap columns, node 1 does not
    with pytest.raises(AssertionError, match="same column"):
        index.check_integrity()


def test_node_ids_are_reused_after_pruning():
    index = make_index("a")
    apply_ok(index, "a", 1, stored((0, 1), (1, 2)))
    apply_ok(index, "a", 2, AllCleared())
    allocated = index._nodes.allocated
    apply_ok(index, "a", 3, stored((0, 1), (3, 4)))
    assert index._nodes.allocated == allocated == 3  # a root and two pages
    index.check_integrity()


# ---- property: the index against a reference model ---------------------------------------

# Six workers: more than the four inline holder columns, so the side dict is exercised.
WORKERS = tuple(f"w{i}" for i in range(6))
NAMESPACES = (Namespace("m", "", "s0"), Namespace("m", "", "s1"))
POOL = 6  # page ids per worker: small, so ids are reused after evictions

op_strategy = st.tuples(
    st.sampled_from(
        [
            "store",
            "store",
            "store",
            "overwrite",
            "overwrite_late",
            "remove",
            "clear",
            "redeliver",
            "restart",
        ]
    ),
    st.integers(0, len(WORKERS) - 1),
    st.integers(0, 50),
    st.integers(0, 50),
    st.lists(st.integers(0, 1), min_size=0, max_size=3 * 2),  # pages of 2 tokens, 0/1 only
)


class Model:
    """Each worker's published pages: page id -> (namespace, path of page token tuples)."""

    def __init__(self, index: GlobalIndex):
        self.index = index
        self.held: dict[str, dict[int, tuple[Namespace, tuple, int]]] = {w: {} for w in WORKERS}
        self.seq = dict.fromkeys(WORKERS, 0)
        self.epoch = {worker: index.worker_info(worker).epoch for worker in WORKERS}
        self.last_batch: dict[str, list] = {w: [] for w in WORKERS}
        self.generation = 0

    def send(self, worker: str, batch: list) -> None:
        self.seq[worker] += 1
        result = self.index.apply_events(worker, self.epoch[worker], self.seq[worker], batch)
        assert result == ApplyResult(True, False, "applied", self.seq[worker])
        self.last_batch[worker] = batch

    def store(
        self,
        worker: str,
        a: int,
        b: int,
        tokens: list[int],
        overwrite: bool = False,
        late: bool = False,
    ) -> None:
        """Publish new pages; with `overwrite`, reuse a held page id in the new chain without
        a removal event, as a worker whose removal got folded into the store would: as the
        chain's first page, or with `late` as its second."""
        namespace = NAMESPACES[a % 2]
        mine = self.held[worker]
        reused = sorted(mine)[b % len(mine)] if overwrite and mine else None
        reused_was = None if reused is None else mine[reused][:2]
        if reused is not None:
            self.drop(worker, reused)
        parents = sorted(p for p, (ns, _, _) in mine.items() if ns == namespace)
        choice = b % (len(parents) + 1)
        parent = None if choice == 0 else parents[choice - 1]
        path = () if parent is None else mine[parent][1]
        by_path = {held[1]: p for p, held in mine.items() if held[0] == namespace}
        pages = [tuple(tokens[i : i + 2]) for i in range(0, len(tokens) - 1, 2)]
        while pages and path + (pages[0],) in by_path:  # already published: extend below it
            path += (pages.pop(0),)
            parent = by_path[path]
        others = [p for p in range(POOL) if p not in mine and p != reused]
        if reused is None:
            ids = others
        elif late and others:
            ids = [others[0], reused, *others[1:]]
        else:
            ids = [reused, *others]
        pages = pages[: len(ids)]
        ids = ids[: len(pages)]
        batch: list = []
        if pages:
            generations = tuple(range(self.generation, self.generation + len(pages)))
            self.generation += len(pages)
            for page_id, page_tokens, generation in zip(ids, pages, generations, strict=True):
                path += (page_tokens,)
                mine[page_id] = (namespace, path, generation)
            flat = tuple(t for p in pages for t in p)
            batch.append(PagesStored(namespace, parent, tuple(ids), generations, flat))
        if reused is not None and (
            reused not in ids or reused_was in {mine[page_id][:2] for page_id in ids}
        ):
            # The index sees the reused page's old pages go only when the id lands somewhere
            # new; re-stored at its old place (or not at all), only a removal tells it.
            batch.insert(0, PagesRemoved((reused,), "evicted"))
        if batch:
            self.send(worker, batch)

    def drop(self, worker: str, victim: int) -> None:
        """Forget a page and the worker's pages below it."""
        mine = self.held[worker]
        namespace, path, _ = mine[victim]
        for page_id, (ns, other, _) in list(mine.items()):
            if ns == namespace and other[: len(path)] == path:
                del mine[page_id]

    def remove(self, worker: str, a: int) -> None:
        mine = self.held[worker]
        if not mine:
            return
        victim = sorted(mine)[a % len(mine)]
        self.drop(worker, victim)
        self.send(worker, [PagesRemoved((victim,), "evicted")])

    def clear(self, worker: str) -> None:
        self.held[worker].clear()
        self.send(worker, [AllCleared()])

    def redeliver(self, worker: str) -> None:
        seq = self.seq[worker]
        result = self.index.apply_events(worker, self.epoch[worker], seq, self.last_batch[worker])
        assert result == ApplyResult(False, False, "duplicate", seq)  # seq 0 too: nothing yet

    def restart(self, worker: str) -> None:
        self.held[worker].clear()
        self.seq[worker] = 0
        self.last_batch[worker] = []
        self.epoch[worker] = self.index.register(worker, "node0", now=0.0).epoch

    def check(self) -> None:
        self.index.check_integrity()
        expected: dict[tuple[Namespace, tuple], set[tuple[str, int, int]]] = {}
        for worker, mine in self.held.items():
            for page_id, (namespace, path, generation) in mine.items():
                expected.setdefault((namespace, path), set()).add((worker, page_id, generation))
        assert self.index.num_pages == len(expected)
        for namespace, path in expected:
            prompt = [t for p in path for t in p] + [5, 5, 5]  # a page never stored, a partial
            result = self.index.match(namespace, prompt)
            assert result.matched_tokens == 2 * len(path)
            held = {span.worker_id: len(span.page_ids) for span in result.spans}
            assert len(held) == len(result.spans), "a worker has two spans"
            assert list(result.spans) == sorted(
                result.spans, key=lambda span: (-len(span.page_ids), span.worker_id)
            )
            assert max(held.values()) == len(path)
            for span in result.spans:
                assert len(span.generations) == len(span.page_ids) and span.tier == "host"
                assert span.tiers == b""
            for depth in range(1, len(path) + 1):
                got = {
                    (span.worker_id, span.page_ids[depth - 1], span.generations[depth - 1])
                    for span in result.spans
                    if len(span.page_ids) >= depth
                }
                assert got == expected[(namespace, path[:depth])]
            for worker in WORKERS:
                routed = self.index.route(namespace, prompt, {worker: 0.0})
                assert routed.matched_tokens == 2 * held.get(worker, 0)
            assert unpacked(self.index.match_packed(namespace, prompt)) == result


def unpacked(packed: MatchResult) -> MatchResult:
    """A packed match with its page ids and generations as tuples again."""
    spans = []
    for span in packed.spans:
        count = len(span.page_ids) // 4
        assert len(span.generations) == 8 * count
        page_ids = struct.unpack(f"<{count}i", span.page_ids)
        generations = struct.unpack(f"<{count}q", span.generations)
        spans.append(HolderSpan(span.worker_id, span.tier, page_ids, generations, span.tiers))
    return MatchResult(packed.matched_tokens, tuple(spans))


def run_model(ops: list) -> None:
    index = GlobalIndex(page_tokens=2)
    for worker in WORKERS:
        index.register(worker, node_id="node0", now=0.0)
    model = Model(index)
    for kind, w, a, b, tokens in ops:
        worker = WORKERS[w]
        if kind in ("store", "overwrite", "overwrite_late"):
            model.store(
                worker, a, b, tokens, overwrite=kind != "store", late=kind == "overwrite_late"
            )
        elif kind == "remove":
            model.remove(worker, a)
        elif kind == "clear":
            model.clear(worker)
        elif kind == "redeliver":
            model.redeliver(worker)
        else:
            model.restart(worker)
        model.check()
    index.check_integrity()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op_strategy, max_size=40))
def test_index_matches_a_reference_model(ops):
    run_model(ops)


@pytest.mark.parametrize("runs", [0, 1])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_strategy, max_size=40))
def test_the_vectorised_lookup_matches_the_model(runs, ops):
    """Paths walked as at most `runs` runs of node ids, the rest by all keys at once."""
    with mock.patch.object(global_index_module, "MAX_RUNS", runs):
        run_model(ops)


@pytest.mark.parametrize("runs", [0, 4])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_strategy, max_size=40))
def test_index_matches_the_model_when_every_key_collides(runs, ops):
    """Zero coefficients and one root key for all namespaces: every node of the index has
    the same prefix key, so every lookup meets collisions and only the exact comparison of
    tokens and parents tells the nodes apart."""
    with (
        mock.patch.object(keys_module, "_chain_keys", colliding_keys),
        mock.patch.object(keys_module, "_root_key", lambda secret, namespace: 1),
        mock.patch.object(global_index_module, "MAX_RUNS", runs),
    ):
        run_model(ops)


def colliding_keys(page_tokens: int, secret: int) -> ChainKeys:
    return ChainKeys(page_tokens, secret, collide=True)
