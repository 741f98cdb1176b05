"""Lost, repeated and reordered event batches are repaired (DESIGN guarantee 6).

Three workers run a seeded workload on small page pools (so pages are evicted and their
ids reused all the time) and publish through `tests.reliability.lossy_proxy`, which drops,
duplicates and reorders 10% of the event batches on their way to a real server. Once the
faults stop and every publisher has caught up, the index must hold for each worker exactly
the pages the worker holds, under the same prefixes and generations.

How the index is read: through `match` and a count. For the whole prefix of every leaf of
a worker's snapshot, a `match` must name that worker with the snapshot's page ids along it
(and their generations), so every page the worker holds is in the index where the worker
holds it; and the count of pages the index holds for the worker must equal the
snapshot's, so the index holds nothing else for it. At the end, `server.stop()` hands the
index back to the test's thread, which reads it through its public methods (`match`,
`worker_info`). During the run, each worker checks the same after every sync that
reports the service up to date, over a client of its own straight to the server (`match`,
and the per-worker `pages` of `stats`): the churn of small pools (page ids reused, pages
evicted, caches cleared) would otherwise paper over a lost batch long before the end.

What the faults turn into: a publisher sends one batch at a time and retries it with the
same seq, so a repeated or late frame reaches the index as a batch it has applied already
(ignored as a duplicate), or as one of an epoch its worker has left (refused); a batch lost
on both tries is repaired by the publisher itself, with a new registration and a full
resync. A gap within one epoch cannot come from the transport here; the index's gap
detection is the second line of defence, met when a publisher moves on past a lost batch
(tests/cache_service/test_server.py).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import pytest

from cache_service.events import Namespace
from cache_service.index import MatchResult
from cache_service.server import ServerConfig, make_server
from tests.reliability.lossy_proxy import FaultCounts, LossyProxy
from workers.cache.prefix_cache import Allocation, PrefixCache, PrefixCacheConfig
from workers.service.client import ServiceClient, ServiceEndpoint
from workers.service.publisher import EventPublisher
from workers.store.page_pool import PagePool

pytestmark = pytest.mark.slow

P = 4  # tokens per page: prompts of a few pages, many pages per operation
PAGES = 20  # per worker: two or three live prompts fill it, so acquires evict
WORKERS = ("w0", "w1", "w2")
NAMESPACES = (
    Namespace("m", salt="tenant-a"),
    Namespace("m", salt="tenant-b"),
    Namespace("m", adapter="lora-1", salt="tenant-a"),
)
PREFIXES_PER_NAMESPACE = 5
MAX_LIVE = 3  # allocations a worker holds at once
# A loopback round trip takes a millisecond; a try that meets a drop or a hold costs this.
TIMEOUT_S = 0.3
SEED = 11
RUN_TIMEOUT_S = 120.0  # a worker's workload not done by then is a hang


class Holding(NamedTuple):
    """A page a worker holds: where in which trie, and the generation it was stored with."""

    namespace: Namespace
    tokens: tuple[int, ...]  # the whole prefix, from the root through this page
    generation: int


@dataclass
class Outcome:
    """What one run of the mesh did and ended with."""

    counts: FaultCounts
    fault_log: dict[str, list[tuple[int, str]]]
    resyncs: dict[str, int]  # per worker, its publisher's (the first registration included)
    events: dict[str, int]  # the index's event figures
    holdings: dict[str, dict[int, Holding]]  # per worker, page id -> what it holds
    cache_stats: dict[str, dict]
    ops: dict[str, Counter]  # per worker, what its workload did
    seconds: float


class Worker:
    """One worker: its cache, its publisher (through the proxy) and its seeded workload."""

    def __init__(
        self,
        worker_id: str,
        proxy_address: str,
        server_address: str,
        prefixes: dict[Namespace, list],
        seed: int,
    ) -> None:
        self.worker_id = worker_id
        self.cache = PrefixCache(PagePool(PAGES), PrefixCacheConfig(page_tokens=P))
        # Short tries, one retry: a dropped or held batch costs one timeout, two in a row
        # cost the batch (the publisher then resyncs).
        self.client = ServiceClient(ServiceEndpoint(proxy_address), timeout_s=TIMEOUT_S, retries=1)
        self.publisher = EventPublisher(self.client, self.cache, worker_id, node_id="node-1")
        # The test's own view of the index, past the proxy: nothing lost, one try.
        self.monitor = ServiceClient(ServiceEndpoint(server_address), timeout_s=5.0, retries=0)
        self._prefixes = prefixes
        self._rng = random.Random(f"{seed}/workload/{worker_id}")
        self._live: list[Allocation] = []
        self.ops: Counter = Counter()
        self.error: BaseException | None = None

    def run(self, operations: int) -> None:
        """`operations` cache operations, syncing after each batch of 1 to 4."""
        try:
            done = 0
            while done < operations:
                batch = min(self._rng.randint(1, 4), operations - done)
                for _ in range(batch):
                    self._step()
                done += batch
                if self.publisher.sync():
                    self.ops["synced"] += 1
                    self.check_index(f"after operation {done}")
                else:
                    self.ops["sync_failed"] += 1
            for allocation in self._live:
                allocation.release()
            self._live.clear()
            self.publisher.sync()
        except BaseException as exc:  # handed to the test's thread
            self.error = exc

    def check_index(self, when: str) -> None:
        """The index holds what this worker holds: right after a sync that says so, every
        frame still on its way is one the index ignores (a repeat, a stale or an old
        epoch's batch), so this holds while the other workers go on."""
        held = worker_holdings(self.cache)
        seen = index_holdings(self.monitor.match, self.worker_id, leaf_prefixes(held))
        assert seen == held, f"{self.worker_id} {when}: the index differs from the worker:\n" + (
            _differences(held, seen)
        )
        pages = self.monitor.stats()["workers"].get(self.worker_id, {}).get("pages")
        assert pages == len(held), (
            f"{self.worker_id} {when}: the index holds {pages} pages for it, the worker {len(held)}"
        )
        self.ops["checked"] += 1

    def _step(self) -> None:
        rng, live = self._rng, self._live
        roll = rng.random()
        if not live or (roll < 0.40 and len(live) < MAX_LIVE):
            self._acquire()
        elif roll < 0.55:
            allocation = rng.choice(live)
            allocation.extend([rng.randrange(1000, 1008) for _ in range(rng.randint(1, 6))])
            self.ops["extend"] += 1
        elif roll < 0.80:
            allocation = rng.choice(live)
            n = allocation.num_tokens
            allocation.publish(n if rng.random() < 0.7 else rng.randint(0, n))
            self.ops["publish"] += 1
            if rng.random() < 0.7:
                self._release(allocation)
        elif roll < 0.97:
            self._release(rng.choice(live))  # what it never published leaves unannounced
        elif roll < 0.99:
            self.cache.evict(rng.randint(1, 4))
            self.ops["evict"] += 1
        else:
            self.cache.clear()
            self.ops["clear"] += 1

    def _acquire(self) -> None:
        rng = self._rng
        namespace = rng.choice(NAMESPACES)
        prefix = rng.choice(self._prefixes[namespace])
        cut = len(prefix) if rng.random() < 0.6 else rng.randint(1, len(prefix))
        # Suffixes from a small alphabet collide, so requests also share their tails
        # (and partly matching pages are copied on write).
        suffix = [rng.randrange(1000, 1004) for _ in range(rng.randint(0, 9))]
        allocation = self.cache.acquire(
            prefix[:cut] + suffix, namespace, extra_token_slots=rng.choice((0, 0, 2, 5))
        )
        if allocation is None:  # the live prompts pin too much: drop the oldest
            self.ops["acquire_failed"] += 1
            self._release(self._live[0])
            return
        self._live.append(allocation)
        self.ops["acquire"] += 1

    def _release(self, allocation: Allocation) -> None:
        allocation.release()
        self._live.remove(allocation)
        self.ops["release"] += 1


def shared_prefixes(seed: int) -> dict[Namespace, list[list[int]]]:
    """Per namespace, prompts of 1 to 6 pages that every worker draws from."""
    rng = random.Random(f"{seed}/prefixes")
    return {
        namespace: [
            [rng.randrange(1000) for _ in range(P * rng.randint(1, 6))]
            for _ in range(PREFIXES_PER_NAMESPACE)
        ]
        for namespace in NAMESPACES
    }


def worker_holdings(cache: PrefixCache) -> dict[int, Holding]:
    """What a worker would resync: its snapshot's chains, as page id -> Holding."""
    holdings: dict[int, Holding] = {}
    for chain in cache.snapshot():
        tokens = () if chain.parent_page is None else holdings[chain.parent_page].tokens
        for i, (page, generation) in enumerate(zip(chain.page_ids, chain.generations, strict=True)):
            tokens = tokens + tuple(chain.tokens[i * P : (i + 1) * P])
            holdings[page] = Holding(chain.namespace, tokens, generation)
    return holdings


def leaf_prefixes(holdings: dict[int, Holding]) -> list[tuple[Namespace, tuple[int, ...]]]:
    """The whole prefixes of the pages no other page hangs under: every page of
    `holdings` lies on one of them."""
    prefixes = {(h.namespace, h.tokens) for h in holdings.values()}
    inner = {(h.namespace, h.tokens[:-P]) for h in holdings.values()}
    return sorted(prefixes - inner)


def index_holdings(
    match: Callable[[Namespace, list[int]], MatchResult],
    worker_id: str,
    prefixes: list[tuple[Namespace, tuple[int, ...]]],
) -> dict[int, Holding]:
    """What the index says `worker_id` holds along each of `prefixes`, read by `match` (the
    index's own, or a client's): its span names the worker's pages along the prefix, from
    the root on."""
    holdings: dict[int, Holding] = {}
    for namespace, tokens in prefixes:
        spans = match(namespace, list(tokens)).spans
        span = next((s for s in spans if s.worker_id == worker_id), None)
        if span is None:
            continue
        for depth, (page, generation) in enumerate(
            zip(span.page_ids, span.generations, strict=True), start=1
        ):
            holdings[page] = Holding(namespace, tokens[: depth * P], generation)
    return holdings


def run_mesh(seed: int, operations: int) -> Outcome:
    """A server, the lossy proxy in front of it and three workers; run the workload with
    faults on, then without, and compare the index with the workers."""
    started = time.monotonic()
    # No HTTP port: nothing here scrapes metrics.
    server = make_server(ServerConfig(page_tokens=P, liveness_timeout_s=60, metrics_host=None))
    server.start()
    proxy = LossyProxy(server.address, seed)
    workers: list[Worker] = []
    try:
        proxy.start()
        prefixes = shared_prefixes(seed)
        workers = [Worker(w, proxy.address, server.address, prefixes, seed) for w in WORKERS]
        for worker in workers:  # registrations and resyncs pass the proxy untouched
            assert worker.publisher.sync(), f"{worker.worker_id} did not register"

        # The workers run at once, each on its own thread: the timeouts of lost frames
        # overlap. Each worker's frames are still one at a time (every call waits for its
        # reply), and the proxy draws faults per worker, so a seed replays the same run.
        threads = [
            threading.Thread(target=w.run, args=(operations,), name=f"lossy-{w.worker_id}")
            for w in workers
        ]
        for thread in threads:
            thread.daemon = True  # a hung workload must not hold the interpreter
            thread.start()
        for thread in threads:
            thread.join(RUN_TIMEOUT_S)
        hung = [thread.name for thread in threads if thread.is_alive()]
        assert not hung, f"workloads still running after {RUN_TIMEOUT_S}s: {hung}"
        for worker in workers:
            if worker.error is not None:
                raise worker.error

        # Faults off; the frames still held back go out now (stale by then: each is a
        # batch its worker already retried, or one of an epoch it has left).
        proxy.pass_through()
        for worker in workers:
            assert any(worker.publisher.sync() for _ in range(3)), (
                f"{worker.worker_id} could not catch up with faults off"
            )
        proxy.settle()  # nothing still on its way to the index
        counts, fault_log = proxy.counts, proxy.fault_log()
        server.check_integrity()
        events = server.stats()["events"]
    finally:
        for worker in workers:
            worker.client.close()
            worker.monitor.close()
        proxy.close()
        server.stop()

    index = server.index  # stopped: the test's thread may read it
    holdings = {}
    for worker in workers:
        worker.cache.check_integrity()
        held = worker_holdings(worker.cache)
        seen = index_holdings(index.match, worker.worker_id, leaf_prefixes(held))
        assert seen == held, f"{worker.worker_id}: the index differs from the worker:\n" + (
            _differences(held, seen)
        )
        info = index.worker_info(worker.worker_id)
        assert info is not None, f"{worker.worker_id} is not registered"
        assert info.pages == len(held), (
            f"{worker.worker_id}: the index holds {info.pages} pages for it, the worker {len(held)}"
        )
        publisher = worker.publisher
        assert (info.epoch, info.last_seq, info.needs_resync) == (
            publisher.epoch,
            publisher.seq,
            False,
        )
        holdings[worker.worker_id] = held
    index.check_integrity()
    assert index.stats()["holdings"] == sum(len(held) for held in holdings.values())
    return Outcome(
        counts=counts,
        fault_log=fault_log,
        resyncs={w.worker_id: w.publisher.resyncs for w in workers},
        events=events,
        holdings=holdings,
        cache_stats={w.worker_id: w.cache.stats() for w in workers},
        ops={w.worker_id: w.ops for w in workers},
        seconds=time.monotonic() - started,
    )


def _differences(held: dict[int, Holding], seen: dict[int, Holding]) -> str:
    lines = []
    for page in sorted(held.keys() | seen.keys()):
        if held.get(page) != seen.get(page):
            lines.append(f"  page {page}: worker {held.get(page)}, index {seen.get(page)}")
    return "\n".join(lines[:20])


def test_lost_duplicated_and_reordered_batches_are_repaired():
    outcome = run_mesh(SEED, operations=1000)

    counts = outcome.counts
    assert counts.dropped > 0 and counts.duplicated > 0 and counts.reordered > 0, counts
    faulted = counts.dropped + counts.duplicated + counts.reordered
    assert 0.05 < faulted / (faulted + counts.forwarded) < 0.15, counts  # about 10%
    # A batch lost twice over (both tries) costs the publisher a resync; this seed has some.
    assert any(resyncs > 1 for resyncs in outcome.resyncs.values()), outcome.resyncs
    assert outcome.events["resyncs"] == sum(outcome.resyncs.values()), outcome.events
    # Repeated frames reached the index and were ignored by their sequence numbers.
    assert outcome.events["duplicates"] > 0, outcome.events
    for worker_id, stats in outcome.cache_stats.items():
        assert stats["evictions"].get("evicted", 0) > 100, (worker_id, stats["evictions"])
        assert stats["published_pages"] > 500, (worker_id, stats)
        assert stats["live_allocations"] == 0
    assert all(outcome.holdings.values()), "a worker ended with nothing to compare"


def test_a_seed_replays_the_same_faults():
    first, second = run_mesh(SEED + 1, operations=250), run_mesh(SEED + 1, operations=250)
    assert first.fault_log == second.fault_log
    assert first.counts == second.counts
    assert first.resyncs == second.resyncs
    assert first.holdings == second.holdings
