"""The global index across tiers: demotions, pages loaded back, per-page tiers in spans,
removals counted by tier and reason, and a reference model of who holds what where."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_service.events import (
    REMOVAL_REASONS,
    TIERS,
    AllCleared,
    Namespace,
    PagesDemoted,
    PagesRemoved,
    PagesStored,
)
from cache_service.index import ApplyResult, GlobalIndex, HolderSpan, PackedSpan
from cache_service.messages import RouteDecision
from cache_service.routing import WorkerLoad
from tests.cache_service import test_index as plain
from tests.cache_service.test_index import NS, make_index, make_tokens, unpacked

HOST, DISK = bytes((1,)), bytes((2,))


def stored(
    page_ids: tuple[int, ...],
    pages: tuple[int, ...],
    parent: int | None = None,
    generations: tuple[int, ...] | None = None,
    tier: str = "host",
) -> PagesStored:
    return plain.stored(page_ids, pages, parent, generations=generations)._replace(tier=tier)


def apply(index: GlobalIndex, worker: str, *events) -> ApplyResult:
    info = index.worker_info(worker)
    return index.apply_events(worker, info.epoch, info.last_seq + 1, list(events))


def apply_ok(index: GlobalIndex, worker: str, *events) -> None:
    result = apply(index, worker, *events)
    assert result.applied, result


def tier_counts(index: GlobalIndex) -> dict[str, int]:
    return index.stats()["tiers"]


# ---- demoted, loaded back ----------------------------------------------------------------


def test_a_page_demoted_to_disk_and_loaded_back_keeps_its_holder():
    index = make_index("a")
    apply_ok(index, "a", stored((0, 1, 2), (1, 2, 3), generations=(1, 2, 3)))
    prompt = make_tokens(1, 2, 3)

    # The two last pages go down to disk under new ids (leaf first, as an LRU evicts).
    apply_ok(index, "a", PagesDemoted((2, 1), (1002, 1001), (7, 6), "disk"))
    assert index.match(NS, prompt).spans == (
        HolderSpan("a", "host", (0, 1001, 1002), (1, 6, 7), HOST + DISK + DISK),
    )
    assert tier_counts(index) == {"device": 0, "host": 1, "disk": 2}
    assert index.worker_info("a").pages == 3
    index.check_integrity()

    # Page 2 of the prompt is loaded back into host memory: a stored page on a node the
    # worker holds on disk moves that holding, and the disk id is forgotten.
    apply_ok(index, "a", stored((5,), (2,), parent=0, generations=(8,)))
    assert index.match(NS, prompt).spans == (
        HolderSpan("a", "host", (0, 5, 1002), (1, 8, 7), HOST + HOST + DISK),
    )
    assert tier_counts(index) == {"device": 0, "host": 2, "disk": 1}
    apply_ok(index, "a", PagesRemoved((1001,), "evicted", "disk"))  # forgotten: no effect
    assert index.stats()["events"]["unknown_pages"] == 1
    assert index.worker_info("a").pages == 3

    # The last one too: every page is in host memory again, and the span says so once.
    apply_ok(index, "a", stored((6,), (3,), parent=5, generations=(9,)))
    assert index.match(NS, prompt).spans == (HolderSpan("a", "host", (0, 5, 6), (1, 8, 9)),)
    assert tier_counts(index) == {"device": 0, "host": 3, "disk": 0}
    assert index.stats()["demotions"] == {"disk": 2}
    assert index.stats()["removals"] == {}
    index.check_integrity()


def test_a_chain_stored_over_pages_held_on_disk_moves_them_and_extends():
    index = make_index("a")
    apply_ok(index, "a", stored((100, 101), (1, 2), generations=(4, 5), tier="disk"))
    # Loaded back from its first page, one more page computed below: one chain.
    apply_ok(index, "a", stored((0, 1, 2), (1, 2, 3), generations=(6, 7, 8)))
    result = index.match(NS, make_tokens(1, 2, 3))
    assert result.spans == (HolderSpan("a", "host", (0, 1, 2), (6, 7, 8)),)
    assert index.worker_info("a").pages == 3  # never a second holding of one node
    # The disk ids are gone: naming them removes nothing.
    apply_ok(index, "a", PagesRemoved((100, 101), "evicted", "disk"))
    assert index.worker_info("a").pages == 3
    assert index.stats()["events"]["unknown_pages"] == 2
    index.check_integrity()


def test_spans_of_side_dict_holders_carry_their_tiers():
    workers = [f"w{i}" for i in range(6)]  # four inline columns: w4 and w5 in the side dict
    index = make_index(*workers)
    for i, worker in enumerate(workers):
        apply_ok(index, worker, stored((10 * i, 10 * i + 1, 10 * i + 2), (1, 2, 3)))
    apply_ok(index, "w5", PagesDemoted((52,), (552,), (3,)))
    apply_ok(index, "w1", PagesDemoted((12, 11), (512, 511), (3, 2)))
    apply_ok(index, "w4", PagesDemoted((40, 41, 42), (540, 541, 542), (1, 2, 3)))
    result = index.match(NS, make_tokens(1, 2, 3), requester="w0")
    assert {span.worker_id: span for span in result.spans} == {
        "w0": HolderSpan("w0", "host", (0, 1, 2), (0, 0, 0)),
        "w1": HolderSpan("w1", "host", (10, 511, 512), (0, 2, 3), HOST + DISK + DISK),
        "w2": HolderSpan("w2", "host", (20, 21, 22), (0, 0, 0)),
        "w3": HolderSpan("w3", "host", (30, 31, 32), (0, 0, 0)),
        "w4": HolderSpan("w4", "disk", (540, 541, 542), (1, 2, 3)),  # all on disk: uniform
        "w5": HolderSpan("w5", "host", (50, 51, 552), (0, 0, 3), HOST + HOST + DISK),
    }
    packed = index.match_packed(NS, make_tokens(1, 2, 3), requester="w0")
    assert {span.worker_id: span for span in packed.spans}["w5"] == PackedSpan(
        "w5",
        "host",
        struct.pack("<3i", 50, 51, 552),
        struct.pack("<3q", 0, 0, 3),
        HOST + HOST + DISK,
    )
    assert unpacked(packed) == result
    # A span shorter than the worker's holding reads the tiers of its own pages only.
    assert index.match(NS, make_tokens(1, 2)).spans[1] == HolderSpan(
        "w1", "host", (10, 511), (0, 2), HOST + DISK
    )
    index.check_integrity()


def test_a_worker_with_every_page_on_disk_names_disk_once():
    index = make_index("a")
    # A restarted worker adopts its disk tier: its resync names every chain "disk".
    epoch = index.worker_info("a").epoch
    chains = [stored((100, 101), (1, 2), tier="disk"), stored((102,), (3,), 101, tier="disk")]
    assert index.resync("a", epoch, 0, chains) == ApplyResult(True, False, "resynced", 0)
    assert index.match(NS, make_tokens(1, 2, 3)).spans == (
        HolderSpan("a", "disk", (100, 101, 102), (0, 0, 0)),
    )
    assert tier_counts(index) == {"device": 0, "host": 0, "disk": 3}
    index.check_integrity()


def test_routing_costs_the_pages_a_holder_keeps_on_disk():
    index = make_index("a", "b")
    prompt = make_tokens(1, 2, 3)  # 12 tokens, 3 pages
    apply_ok(index, "a", stored((0, 1, 2), (1, 2, 3)))
    apply_ok(index, "a", PagesDemoted((2, 1), (1002, 1001), (7, 6), "disk"))
    apply_ok(index, "b", stored((0, 1), (1, 2)))
    loads = {"a": 0.0, "b": 0.0}
    # a reads its 8 disk tokens (1 ms each); b holds 8 in host memory and copies the last
    # 4 from a's disk: 10 us each to copy, 1 ms each to read.
    disk = {w: WorkerLoad(disk_s=1e-3) for w in loads}
    assert index.route(NS, prompt, loads, reported=disk) == RouteDecision(
        "b", 8, pytest.approx(4 * 1e-5 + 4 * 1e-3), "prefix"
    )
    # A disk with no measured rate costs nothing: a holds the most.
    assert index.route(NS, prompt, loads).worker_id == "a"
    index.check_integrity()


# ---- demotions: ids, counts, refusals ----------------------------------------------------


def test_unknown_ids_in_a_demotion_are_skipped_and_counted():
    index = make_index("a")
    apply_ok(index, "a", stored((0, 1), (1, 2)))
    apply_ok(index, "a", PagesDemoted((7, 1, 8), (1007, 1001, 1008), (1, 2, 3)))
    assert index.match(NS, make_tokens(1, 2)).spans == (
        HolderSpan("a", "host", (0, 1001), (0, 2), HOST + DISK),
    )
    assert index.stats()["events"]["unknown_pages"] == 2
    assert index.stats()["demotions"] == {"disk": 1}
    # The same demotion again (its pages are known by their new ids now): nothing moves.
    apply_ok(index, "a", PagesDemoted((1,), (1001,), (2,)))
    assert index.stats()["events"]["unknown_pages"] == 3
    assert index.worker_info("a").pages == 2
    index.check_integrity()


def test_a_demotion_to_an_id_held_elsewhere_drops_what_it_named_before():
    index = make_index("a")
    apply_ok(index, "a", stored((0, 1), (1, 2)), stored((5, 6), (3, 4)))
    # Page id 5 is reused for the demoted page 1: what 5 named (and 6 below it) is gone.
    apply_ok(index, "a", PagesDemoted((1,), (5,), (9,)))
    assert index.match(NS, make_tokens(1, 2)).spans == (
        HolderSpan("a", "host", (0, 5), (0, 9), HOST + DISK),
    )
    assert index.match(NS, make_tokens(3, 4)).matched_tokens == 0
    assert index.num_pages == 2
    index.check_integrity()


def test_a_demotion_to_the_id_of_an_ancestor_is_a_conflict():
    index = make_index("a")
    apply_ok(index, "a", stored((0, 1), (1, 2)))
    result = apply(index, "a", PagesDemoted((1,), (0,), (1,)))
    assert result == ApplyResult(False, True, "page_conflict", 1)
    assert index.match(NS, make_tokens(1, 2)).spans == (HolderSpan("a", "host", (0, 1), (0, 0)),)
    index.check_integrity()


@pytest.mark.parametrize(
    "event, message",
    [
        (stored((0,), (1,), tier="ssd"), r"tier 'ssd' not in \('device', 'host', 'disk'\)"),
        (PagesRemoved((0,), "evicted", "cpu"), "tier 'cpu' not in"),
        (PagesRemoved((0,), "lost"), "removal reason 'lost' not in"),
        (PagesDemoted((0,), (1000,), (1,), "tape"), "tier 'tape' not in"),
        (PagesDemoted((0, 1), (1000,), (1, 1)), "1 new page ids for 2 pages"),
        (PagesDemoted((0,), (1000,), ()), "0 generations for 1 pages"),
        (PagesDemoted((0, 0), (1000, 1001), (1, 1)), "a page id repeats"),
        (PagesDemoted((0, 1), (1000, 1000), (1, 1)), "a new page id repeats"),
        (PagesDemoted((0,), (-1,), (1,)), r"page ids must be ints in \[0, 2\*\*31\)"),
        (PagesDemoted((0,), (1000,), (-1,)), "generations must be ints"),
    ],
)
def test_malformed_tiered_events_raise_and_change_nothing(event, message):
    index = make_index("a")
    apply_ok(index, "a", stored((0, 1), (1, 2)))
    before = index.match(NS, make_tokens(1, 2))
    with pytest.raises(ValueError, match=message):
        apply(index, "a", PagesDemoted((1,), (1001,), (1,)), event)
    assert index.match(NS, make_tokens(1, 2)) == before
    assert index.worker_info("a").last_seq == 1
    index.check_integrity()


def test_removals_are_counted_by_tier_and_reason():
    index = make_index("a", "b")
    apply_ok(index, "a", stored((0, 1, 2), (1, 2, 3)))
    apply_ok(index, "a", PagesDemoted((2,), (1002,), (1,)))
    apply_ok(index, "a", PagesRemoved((1002,), "evicted", "disk"))
    apply_ok(index, "a", stored((3,), (4,), parent=1))
    apply_ok(index, "a", PagesDemoted((3,), (1003,), (1,)))
    # A removal of an inner page drops what the worker holds below it, each under its tier.
    apply_ok(index, "a", PagesRemoved((0,), "corrupt"))
    apply_ok(index, "b", stored((0, 1), (1, 2), tier="device"), AllCleared())
    stats = index.stats()
    assert stats["removals"] == {
        "device": {"cleared": 2},
        "host": {"corrupt": 2},
        "disk": {"corrupt": 1, "evicted": 1},
    }
    assert stats["demotions"] == {"disk": 2}
    assert stats["tiers"] == {"device": 0, "host": 0, "disk": 0}
    assert stats["pages"] == 0
    index.check_integrity()


def test_every_removal_reason_is_accepted_and_counted():
    index = make_index("a")
    apply_ok(index, "a", stored(tuple(range(7)), tuple(range(1, 8))))
    for leaf, reason in zip(range(6, -1, -1), REMOVAL_REASONS, strict=True):
        apply_ok(index, "a", PagesRemoved((leaf,), reason))
    assert index.stats()["removals"] == {"host": dict.fromkeys(sorted(REMOVAL_REASONS), 1)}
    index.check_integrity()


# ---- property: the index against a reference model of tiers ------------------------------

# Six workers: more than the four inline holder columns, so the side dict is exercised.
WORKERS = tuple(f"w{i}" for i in range(6))
NAMESPACES = (Namespace("m", "", "s0"), Namespace("m", "", "s1"))
# Page ids per tier, disjoint as a worker's are: its disk ids lie above its host store's.
IDS = {"device": range(50, 54), "host": range(0, 6), "disk": range(100, 108)}

op_strategy = st.tuples(
    st.sampled_from(
        ["store"] * 3 + ["copy"] * 3 + ["demote"] * 3 + ["load"] * 3 + ["remove", "clear"]
    ),
    st.integers(0, len(WORKERS) - 1),
    st.integers(0, 50),
    st.integers(0, 50),
    st.lists(st.integers(0, 1), min_size=0, max_size=3 * 2),  # pages of 2 tokens, 0/1 only
)


class TierModel:
    """What each worker holds: page id -> (namespace, path of page token tuples, generation,
    tier); and what the events removed (tier, reason) and demoted (tier), in pages."""

    def __init__(self, index: GlobalIndex):
        for worker in WORKERS:
            index.register(worker, node_id="node0", now=0.0)
        self.index = index
        self.held: dict[str, dict[int, tuple[Namespace, tuple, int, str]]] = {
            worker: {} for worker in WORKERS
        }
        self.removed: dict[str, dict[str, int]] = {}
        self.demoted: dict[str, int] = {}
        self.unknown = 0
        self.seq = dict.fromkeys(WORKERS, 0)
        self.generation = 0

    def send(self, worker: str, *events) -> None:
        self.seq[worker] += 1
        epoch = self.index.worker_info(worker).epoch
        result = self.index.apply_events(worker, epoch, self.seq[worker], list(events))
        assert result == ApplyResult(True, False, "applied", self.seq[worker])

    def free_ids(self, worker: str, tier: str) -> list[int]:
        return [page for page in IDS[tier] if page not in self.held[worker]]

    def next_generations(self, count: int) -> tuple[int, ...]:
        self.generation += count
        return tuple(range(self.generation - count, self.generation))

    def id_of(self, worker: str, namespace: Namespace, path: tuple) -> int | None:
        """The worker's page id for `path`; None for the root."""
        if not path:
            return None
        mine = self.held[worker]
        return next(p for p, held in mine.items() if held[:2] == (namespace, path))

    def store(
        self, worker: str, a: int, b: int, tokens: list[int], copied: Namespace | None = None
    ) -> None:
        """New pages below a held page (or a root), in host memory or on the device; with
        `copied`, pages copied from a peer: `tokens` from the root of that namespace."""
        tier = ("host", "host", "device")[a % 3]
        namespace = NAMESPACES[b % 2] if copied is None else copied
        mine = self.held[worker]
        paths = sorted(held[1] for held in mine.values() if held[0] == namespace)
        path = ([()] + paths)[a % (len(paths) + 1)] if copied is None else ()
        parent = self.id_of(worker, namespace, path)
        held_paths = set(paths)
        pages = [tuple(tokens[i : i + 2]) for i in range(0, len(tokens) - 1, 2)]
        while pages and path + (pages[0],) in held_paths:  # already held: extend below it
            path += (pages.pop(0),)
            parent = self.id_of(worker, namespace, path)
        ids = self.free_ids(worker, tier)[: len(pages)]
        pages = pages[: len(ids)]
        if not pages:
            return
        generations = self.next_generations(len(pages))
        for page_id, page_tokens, generation in zip(ids, pages, generations, strict=True):
            path += (page_tokens,)
            mine[page_id] = (namespace, path, generation, tier)
        flat = tuple(t for p in pages for t in p)
        self.send(worker, PagesStored(namespace, parent, tuple(ids), generations, flat, tier))

    def copy(self, worker: str, a: int, b: int, _: list[int]) -> None:
        """The worker copies in a prefix a peer holds (in any tier) and publishes it: many
        holders of one node, past the inline columns."""
        peer = self.held[WORKERS[a % len(WORKERS)]]
        if not peer:
            return
        namespace, path, _, _ = sorted(peer.values())[b % len(peer)]
        self.store(worker, a, b, [t for p in path for t in p], copied=namespace)

    def demote(self, worker: str, a: int, b: int, tokens: list[int]) -> None:
        """Up to two pages above disk go down to disk under new ids; every third demotion
        names an id the worker does not hold, too. With nothing above disk: a store."""
        mine = self.held[worker]
        above = sorted(p for p, held in mine.items() if held[3] != "disk")
        free = self.free_ids(worker, "disk")
        if not above:
            self.store(worker, a, b, tokens)
            return
        if not free:
            return
        count = min(1 + b % 2, len(above), len(free))
        olds = [above[(a + i) % len(above)] for i in range(count)]
        olds = list(dict.fromkeys(olds))
        news = free[: len(olds)]
        generations = self.next_generations(len(olds))
        for old, new, generation in zip(olds, news, generations, strict=True):
            namespace, path, _, _ = mine.pop(old)
            mine[new] = (namespace, path, generation, "disk")
            self.demoted["disk"] = self.demoted.get("disk", 0) + 1
        if a % 3 == 0:  # an id in no tier's range: never held
            olds, news = [200, *olds], [300, *news]
            generations = (0, *generations)
            self.unknown += 1
        self.send(worker, PagesDemoted(tuple(olds), tuple(news), tuple(generations), "disk"))

    def load(self, worker: str, a: int, b: int, tokens: list[int]) -> None:
        """A page held on disk and the next ones down its path held on disk too (up to
        three) are loaded back into host memory or onto the device, with a new page
        computed below them when `tokens` says so: one stored chain. With nothing on
        disk: a demotion."""
        tier = ("host", "device")[b % 2]
        mine = self.held[worker]
        on_disk = sorted(p for p, held in mine.items() if held[3] == "disk")
        if not on_disk:
            self.demote(worker, a, b, tokens)
            return
        namespace, path, _, _ = mine[on_disk[a % len(on_disk)]]
        parent = self.id_of(worker, namespace, path[:-1])
        chain = [path]
        while len(chain) < 3:
            below = sorted(
                held[1]
                for held in mine.values()
                if held[0] == namespace and held[1][:-1] == chain[-1] and held[3] == "disk"
            )
            if not below:
                break
            chain.append(below[b % len(below)])
        pages = [p[-1] for p in chain]
        if len(tokens) >= 2:
            new_path = chain[-1] + (tuple(tokens[:2]),)
            if not any(held[:2] == (namespace, new_path) for held in mine.values()):
                chain.append(new_path)
                pages.append(tuple(tokens[:2]))
        ids = self.free_ids(worker, tier)[: len(chain)]
        chain, pages = chain[: len(ids)], pages[: len(ids)]
        if not chain:
            return
        generations = self.next_generations(len(chain))
        for page_id, chain_path, generation in zip(ids, chain, generations, strict=True):
            old = next((p for p, held in mine.items() if held[:2] == (namespace, chain_path)), None)
            if old is not None:
                del mine[old]
            mine[page_id] = (namespace, chain_path, generation, tier)
        flat = tuple(t for p in pages for t in p)
        self.send(worker, PagesStored(namespace, parent, tuple(ids), generations, flat, tier))

    def remove(self, worker: str, a: int, b: int, _: list[int]) -> None:
        mine = self.held[worker]
        if not mine:
            return
        victim = sorted(mine)[a % len(mine)]
        reason = REMOVAL_REASONS[b % len(REMOVAL_REASONS)]
        namespace, path, _, tier = mine[victim]
        for page_id, (ns, other, _, other_tier) in list(mine.items()):
            if ns == namespace and other[: len(path)] == path:
                del mine[page_id]
                by_reason = self.removed.setdefault(other_tier, {})
                by_reason[reason] = by_reason.get(reason, 0) + 1
        self.send(worker, PagesRemoved((victim,), reason, tier))

    def clear(self, worker: str, *_) -> None:
        for _, _, _, tier in self.held[worker].values():
            by_reason = self.removed.setdefault(tier, {})
            by_reason["cleared"] = by_reason.get("cleared", 0) + 1
        self.held[worker].clear()
        self.send(worker, AllCleared())

    def check(self) -> None:
        index = self.index
        index.check_integrity()
        expected: dict[tuple[Namespace, tuple], set[tuple[str, int, int, str]]] = {}
        counts = dict.fromkeys(TIERS, 0)
        for worker, mine in self.held.items():
            assert index.worker_info(worker).pages == len(mine)
            for page_id, (namespace, path, generation, tier) in mine.items():
                expected.setdefault((namespace, path), set()).add(
                    (worker, page_id, generation, tier)
                )
                counts[tier] += 1
        stats = index.stats()
        assert stats["tiers"] == counts
        assert stats["removals"] == self.removed
        assert stats["demotions"] == self.demoted
        assert stats["events"]["unknown_pages"] == self.unknown
        assert index.num_pages == len(expected)
        for namespace, path in expected:
            prompt = [t for p in path for t in p] + [5, 5, 5]  # a page never stored, a partial
            result = index.match(namespace, prompt)
            assert result.matched_tokens == 2 * len(path)
            for span in result.spans:
                tiers = [span.tier_of(i) for i in range(len(span.page_ids))]
                assert span.tier == tiers[0]
                # Per-page tiers are sent only when the span mixes tiers.
                assert (span.tiers == b"") == (len(set(tiers)) == 1)
            for depth in range(1, len(path) + 1):
                got = {
                    (
                        span.worker_id,
                        span.page_ids[depth - 1],
                        span.generations[depth - 1],
                        span.tier_of(depth - 1),
                    )
                    for span in result.spans
                    if len(span.page_ids) >= depth
                }
                assert got == expected[(namespace, path[:depth])]
            assert unpacked(index.match_packed(namespace, prompt)) == result


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op_strategy, max_size=60))
def test_index_matches_a_reference_model_of_tiers(ops):
    model = TierModel(GlobalIndex(page_tokens=2))
    for kind, w, a, b, tokens in ops:
        getattr(model, kind)(WORKERS[w], a, b, tokens)
        model.check()
    model.index.check_integrity()
