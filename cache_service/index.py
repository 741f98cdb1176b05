"""The global prefix index: which full pages of which prompts are cached on which worker.

The service holds metadata only, never KV bytes. Workers stream `PagesStored` /
`PagesRemoved` / `AllCleared` events (see `events.py`); the index turns them into one
page-granular trie per `Namespace` and answers, for a prompt, the longest prefix of full
pages that some live worker holds, page by page with its holders:

    prompt tokens    |<- page 0 ->|<- page 1 ->|<- page 2 ->|<- page 3 ->|<-partial->|
    index holders    |  w1, w2    |  w1, w2    |  w2        |  (none)    |  no node  |
    match            |<------------ matched_tokens -------->|
    requester w1     |<-- local hit ---------->|<- remote ->|<-- miss -->|<- lost -->|

"lost" (alignment_lost_tokens) is the trailing partial page: page granularity cannot serve
it whatever is cached. For every query, queried = hit + miss + alignment_lost, and
hit = local + remote.

Storage is a struct of arrays rather than one object per node, because the index holds
about a million pages and a Python object per node (plus its dict of children) costs
several hundred bytes. A node is an int id. Its key is the bytes of its parent's id
(int32) followed by its page's tokens (int32 each, little-endian: the wire format), and
one dict maps key -> node id for the whole index. A lookup therefore compares the stored
tokens exactly (dict equality on the bytes), never a hash alone, and the parent id in the
key keeps namespaces (each rooted at its own node) apart. The first holder of a node
lives in arrays; further holders, rare in comparison, live in a side dict.

Invariant (checked by `check_integrity`): each worker's holdings are prefix-closed, i.e. a
worker that holds a node holds its parent too. A worker's events only ever hang pages
under its own pages, and dropping a page drops the worker's holdings beneath it, so a
node with no holders never has holders below it and is removed at once, leaf-up.
"""

from __future__ import annotations

import math
import struct
import sys
import time
import tracemalloc
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from cache_service.events import (
    REMOVAL_REASONS,
    AllCleared,
    KvEvent,
    Namespace,
    PagesRemoved,
    PagesStored,
)

TokenInput = Sequence[int] | bytes | bytearray | memoryview | np.ndarray

_NODE_ID = struct.Struct("<i")  # the parent-id prefix of every child key
_NONE = -1  # "no node" / "no holder" inside the int arrays, never outside this module
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MAX = 2**63 - 1
# Page stores hand out small dense page ids (0..pool size), so a worker's page -> node map
# is a flat int32 array up to this many pages (16 MiB at most) and a dict beyond it.
_DENSE_PAGE_LIMIT = 1 << 22
_BIG_ENDIAN = sys.byteorder == "big"
_new_tuple = tuple.__new__

assert array("i").itemsize == 4, "array('i') must be 32-bit to pack int32 tokens"


class Holder(NamedTuple):
    """One worker's copy of a page: where to fetch it and how to validate the copy."""

    worker_id: str
    page_id: int  # the page id in the worker's own page store
    generation: int  # the page's generation when it was published
    tier: str  # e.g. "cpu" or "gpu"


class PageMatch(NamedTuple):
    """One matched page: its holders, in the order they stored it."""

    holders: tuple[Holder, ...]


class MatchResult(NamedTuple):
    """The longest cached prefix of full pages; `pages[i]` covers tokens [i*P, (i+1)*P)."""

    matched_tokens: int
    pages: tuple[PageMatch, ...]


class ApplyResult(NamedTuple):
    """The outcome of `apply_events` / `resync`.

    `reason` is one of: "applied", "resynced", "duplicate" (seq == last applied: ignored),
    "stale" (seq < last applied: ignored), "gap" (a batch went missing), "unknown_worker"
    (not registered, or removed: register again, then resync), "epoch_mismatch",
    "unknown_parent" (a chain hangs under a page the index does not know), "page_conflict"
    (a page id reported twice on one path), "awaiting_resync" (an earlier batch failed).
    `last_seq` is the last seq the index applied for the worker (0 when unknown).
    """

    applied: bool
    needs_resync: bool
    reason: str
    last_seq: int


class Registration(NamedTuple):
    """The outcome of `register`."""

    worker_id: str
    epoch: int
    last_seq: int  # the next event batch must carry last_seq + 1
    dropped_pages: int  # holdings of an older epoch that the registration dropped


class WorkerInfo(NamedTuple):
    """A live worker as the index sees it."""

    worker_id: str
    epoch: int
    node_id: str
    tier: str
    last_seen: float
    last_seq: int
    pages: int  # pages it holds
    needs_resync: bool


class RouteDecision(NamedTuple):
    """Which worker should take a prompt; `worker_id` is None when no candidate is live.

    `reason` is "prefix" (the chosen worker holds a prefix of the prompt), "least_loaded"
    (it holds none: the fallback) or "no_live_worker".
    """

    worker_id: str | None
    matched_tokens: int  # tokens the chosen worker holds locally, as a contiguous prefix
    score: float
    reason: str


def pack_tokens(tokens: TokenInput) -> bytes:
    """Token ids in the wire format: little-endian int32, back to back.

    Args:
        tokens: packed bytes (returned as they are), a numpy integer array, or a sequence
            of ints.

    Returns:
        The packed bytes, 4 per token.

    Raises:
        ValueError: packed bytes not a multiple of 4 long, or a token outside int32.
    """
    if isinstance(tokens, bytes | bytearray | memoryview):
        data = bytes(tokens)
        if len(data) % 4:
            raise ValueError(f"packed tokens are {len(data)} bytes, not a multiple of 4")
        return data
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"token array must be 1-D integers, got {tokens.dtype} {tokens.shape}")
        if tokens.size and (tokens.min() < _INT32_MIN or tokens.max() > _INT32_MAX):
            raise ValueError(
                f"token ids must fit int32, got range [{tokens.min()}, {tokens.max()}]"
            )
        return tokens.astype("<i4", copy=False).tobytes()
    try:
        packed = array("i", tokens)
    except OverflowError:
        raise ValueError(
            f"token ids must fit int32 [{_INT32_MIN}, {_INT32_MAX}], "
            f"got range [{min(tokens)}, {max(tokens)}]"
        ) from None
    except TypeError as error:
        raise ValueError(f"token ids must be ints: {error}") from None
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


class _PageMap:
    """One worker's page id -> node id map (the index's reverse map for that worker)."""

    __slots__ = ("_dense", "_sparse", "size")

    def __init__(self) -> None:
        self._dense = array("i")  # page id -> node id, _NONE where the page is unknown
        self._sparse: dict[int, int] = {}  # page ids >= _DENSE_PAGE_LIMIT
        self.size = 0

    def get(self, page: int) -> int | None:
        if page < _DENSE_PAGE_LIMIT:
            if page < len(self._dense):
                node = self._dense[page]
                return None if node == _NONE else node
            return None
        return self._sparse.get(page)

    def set(self, page: int, node: int) -> None:
        if page >= _DENSE_PAGE_LIMIT:
            self.size += page not in self._sparse
            self._sparse[page] = node
            return
        dense = self._dense
        if page >= len(dense):
            grown = min(max(page + 1, len(dense) + len(dense) // 2, 64), _DENSE_PAGE_LIMIT)
            dense.extend(array("i", [_NONE]) * (grown - len(dense)))
        self.size += dense[page] == _NONE
        dense[page] = node

    def pop(self, page: int) -> int | None:
        node = self.get(page)
        if node is not None:
            self.size -= 1
            if page < _DENSE_PAGE_LIMIT:
                self._dense[page] = _NONE
            else:
                del self._sparse[page]
        return node

    def items(self) -> list[tuple[int, int]]:
        pairs = [(page, node) for page, node in enumerate(self._dense) if node != _NONE]
        return pairs + sorted(self._sparse.items())

    def clear(self) -> None:
        self._dense = array("i")
        self._sparse = {}
        self.size = 0


class _Worker:
    __slots__ = (
        "worker_id",
        "slot",
        "epoch",
        "node_id",
        "tier",
        "last_seen",
        "last_seq",
        "desynced",
        "pages",
    )

    def __init__(self, worker_id: str, slot: int, epoch: int, node_id: str, tier: int):
        self.worker_id = worker_id
        self.slot = slot  # the worker's number in the holder arrays
        self.epoch = epoch
        self.node_id = node_id
        self.tier = tier  # tier code of the pages it stores
        self.last_seen = 0.0
        self.last_seq = 0
        self.desynced = False  # an event batch failed: refuse batches until a resync
        self.pages = _PageMap()


_COUNTERS = (
    "queries",
    "queried_tokens",
    "hit_tokens",
    "local_hit_tokens",
    "remote_hit_tokens",
    "miss_tokens",
    "alignment_lost_tokens",
)


class _Counters:
    __slots__ = _COUNTERS

    def __init__(self) -> None:
        for name in _COUNTERS:
            setattr(self, name, 0)

    def add(self, queried: int, hit: int, local: int, lost: int) -> None:
        self.queries += 1
        self.queried_tokens += queried
        self.hit_tokens += hit
        self.local_hit_tokens += local
        self.remote_hit_tokens += hit - local
        self.miss_tokens += queried - hit - lost
        self.alignment_lost_tokens += lost

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _COUNTERS}


class GlobalIndex:
    """Cluster-wide prefix index: page-granular tries of token pages and their holders.

    Not thread-safe: the service calls it from one thread (its server loop), so nothing in
    here locks.

    Args:
        page_tokens: tokens per page, the same on every worker.
        liveness_timeout_s: a worker silent (no register/heartbeat) for longer than this
            is dropped by `expire`.
        load_weight: lambda in the routing score (see `route`).

    Raises:
        ValueError: a non-positive page_tokens or timeout, or a negative load_weight.
    """

    def __init__(
        self, page_tokens: int = 16, liveness_timeout_s: float = 10.0, load_weight: float = 0.5
    ):
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {page_tokens}")
        if not liveness_timeout_s > 0:
            raise ValueError(f"liveness_timeout_s must be positive, got {liveness_timeout_s}")
        if not load_weight >= 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        self.page_tokens = page_tokens
        self.liveness_timeout_s = liveness_timeout_s
        self.load_weight = load_weight
        self._page_bytes = 4 * page_tokens
        # Nodes, a struct of arrays indexed by node id.
        self._keys: list[bytes | None] = []  # parent id + page tokens; None: root or free
        self._parent = array("i")
        self._first_child = array("i")
        self._next_sibling = array("i")
        self._prev_sibling = array("i")
        self._holder_slot = array("i")  # first holder, inline; _NONE: no holder
        self._holder_page = array("q")
        self._holder_generation = array("q")
        self._holder_tier = array("B")
        self._last_access = array("q")  # logical clock, see self._clock
        # The second and later holders of a node: (slot, page, generation, tier).
        self._extra_holders: dict[int, list[tuple[int, int, int, int]]] = {}
        self._children: dict[bytes, int] = {}  # key -> node id, every non-root node
        self._roots: dict[Namespace, int] = {}
        self._root_namespace: dict[int, Namespace] = {}
        self._free_nodes: list[int] = []
        self._num_pages = 0
        self._clock = 0
        # Workers.
        self._workers: dict[str, _Worker] = {}
        self._slots: list[_Worker | None] = []
        self._free_slots: list[int] = []
        self._tiers: list[str] = []
        self._tier_codes: dict[str, int] = {}
        # Statistics.
        self._cluster = _Counters()
        self._by_worker: dict[str, _Counters] = {}
        self._by_tenant: dict[str, _Counters] = {}
        self._events = {"batches": 0, "duplicates": 0, "resyncs_requested": 0, "resyncs": 0}
        self._removed_workers: dict[str, int] = {}

    # ---- workers -------------------------------------------------------------------------

    def register(
        self,
        worker_id: str,
        epoch: int,
        node_id: str,
        tier: str = "cpu",
        now: float | None = None,
    ) -> Registration:
        """Register a worker (or a new incarnation of one) and mark it alive.

        A new epoch drops everything the old epoch held and restarts its sequence numbers;
        the same epoch again (a retried registration) keeps its holdings and seq.

        Args:
            worker_id: the worker's name, unique in the cluster.
            epoch: the incarnation, increasing on every worker restart.
            node_id: the cluster node the worker runs on.
            tier: the memory tier its pages live in (recorded on each holder).
            now: the current time in seconds (default: time.monotonic()).

        Returns:
            A Registration; the next event batch carries seq `last_seq + 1`.

        Raises:
            ValueError: epoch older than the registered one, or more than 256 tiers.
        """
        now = time.monotonic() if now is None else now
        tier_code = self._tier_code(tier)
        worker = self._workers.get(worker_id)
        dropped = 0
        if worker is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slots)
            worker = _Worker(worker_id, slot, epoch, node_id, tier_code)
            if slot == len(self._slots):
                self._slots.append(worker)
            else:
                self._slots[slot] = worker
            self._workers[worker_id] = worker
        elif epoch < worker.epoch:
            raise ValueError(
                f"worker {worker_id!r}: epoch {epoch} is older than the registered {worker.epoch}"
            )
        elif epoch > worker.epoch:
            dropped = self._drop_all(worker)
            worker.epoch, worker.last_seq, worker.desynced = epoch, 0, False
        worker.node_id, worker.tier, worker.last_seen = node_id, tier_code, now
        return Registration(worker_id, epoch, worker.last_seq, dropped)

    def heartbeat(self, worker_id: str, epoch: int, now: float | None = None) -> bool:
        """Mark a worker alive.

        Args:
            worker_id: the worker.
            epoch: its incarnation.
            now: the current time in seconds (default: time.monotonic()).

        Returns:
            False when the worker is unknown (expired or never registered) or the epoch is
            not the registered one: the worker must register again.
        """
        worker = self._workers.get(worker_id)
        if worker is None or worker.epoch != epoch:
            return False
        worker.last_seen = time.monotonic() if now is None else now
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Remove every worker silent for longer than `liveness_timeout_s`.

        Args:
            now: the current time in seconds (default: time.monotonic()).

        Returns:
            The removed worker ids, sorted.
        """
        now = time.monotonic() if now is None else now
        silent = sorted(
            worker_id
            for worker_id, worker in self._workers.items()
            if now - worker.last_seen > self.liveness_timeout_s
        )
        for worker_id in silent:
            self.remove_worker(worker_id, "expired")
        return silent

    def remove_worker(self, worker_id: str, reason: str) -> int:
        """Forget a worker (dead, drained) and all its holdings at once.

        Args:
            worker_id: the worker; an unknown one is a no-op.
            reason: why, counted in `stats()["removed_workers"]`.

        Returns:
            The number of holdings dropped.
        """
        worker = self._workers.pop(worker_id, None)
        if worker is None:
            return 0
        dropped = self._drop_all(worker)
        self._slots[worker.slot] = None
        self._free_slots.append(worker.slot)
        self._removed_workers[reason] = self._removed_workers.get(reason, 0) + 1
        return dropped

    def live_workers(self) -> list[str]:
        """The registered (live) worker ids, sorted."""
        return sorted(self._workers)

    def worker_info(self, worker_id: str) -> WorkerInfo | None:
        """A live worker's registration and state; None when it is not registered."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return None
        return WorkerInfo(
            worker_id,
            worker.epoch,
            worker.node_id,
            self._tiers[worker.tier],
            worker.last_seen,
            worker.last_seq,
            worker.pages.size,
            worker.desynced,
        )

    # ---- events --------------------------------------------------------------------------

    def apply_events(
        self, worker_id: str, epoch: int, seq: int, events: Sequence[KvEvent]
    ) -> ApplyResult:
        """Apply one batch of a worker's events, in order.

        Batches are numbered per worker from 1 after registration (or from a resync's seq
        + 1). A batch equal to or older than the last applied is ignored; a gap, an unknown
        worker or epoch, or an event that cannot be placed asks for a resync, and further
        batches are refused until it comes. Each event is idempotent on its own: storing a
        page already held (same node, same page id) only refreshes its generation, and
        removing an unknown page does nothing.

        Args:
            worker_id: the sender.
            epoch: its incarnation, as registered.
            seq: the batch's sequence number.
            events: PagesStored / PagesRemoved / AllCleared, in the order they happened.

        Returns:
            An ApplyResult; see its docstring for the reasons.

        Raises:
            ValueError: a malformed event (lengths, token range, page ids, removal reason);
                nothing is applied then.
        """
        self._events["batches"] += 1
        worker = self._workers.get(worker_id)
        refusal = self._refusal(worker, epoch)
        if refusal is not None:
            return refusal
        assert worker is not None
        if worker.desynced:
            return ApplyResult(False, True, "awaiting_resync", worker.last_seq)
        if seq <= worker.last_seq:
            self._events["duplicates"] += 1
            reason = "duplicate" if seq == worker.last_seq else "stale"
            return ApplyResult(False, False, reason, worker.last_seq)
        if seq > worker.last_seq + 1:
            return self._desync(worker, "gap")
        packed = [self._check_event(event) for event in events]
        self._clock += 1
        for event, data in zip(events, packed, strict=True):
            if isinstance(event, PagesStored):
                failure = self._store(worker, event, data)
                if failure is not None:
                    return self._desync(worker, failure)
            elif isinstance(event, PagesRemoved):
                for page in event.page_ids:
                    node = worker.pages.get(page)
                    if node is not None:
                        self._drop_subtree(worker, node)
            else:
                self._drop_all(worker)
        worker.last_seq = seq
        return ApplyResult(True, False, "applied", seq)

    def resync(
        self, worker_id: str, epoch: int, seq: int, chains: Sequence[PagesStored]
    ) -> ApplyResult:
        """Replace all of a worker's holdings with a full snapshot of its shareable pages.

        Args:
            worker_id: the sender.
            epoch: its incarnation, as registered.
            seq: the seq of the last batch the snapshot includes; the next batch is seq + 1.
            chains: every shareable page, parents before children; each chain's parent is
                None or a page of an earlier chain.

        Returns:
            ApplyResult(True, False, "resynced", seq), or a refusal for an unknown worker
            or epoch (register first).

        Raises:
            ValueError: a malformed chain, a parent page not stored earlier in the
                snapshot, or a page id listed twice; nothing changes then.
        """
        worker = self._workers.get(worker_id)
        refusal = self._refusal(worker, epoch)
        if refusal is not None:
            return refusal
        assert worker is not None
        packed = []
        seen: set[int] = set()
        for i, chain in enumerate(chains):
            if not isinstance(chain, PagesStored):
                raise ValueError(f"resync chain {i} is a {type(chain).__name__}, not PagesStored")
            packed.append(self._check_event(chain))
            if chain.parent_page is not None and chain.parent_page not in seen:
                raise ValueError(
                    f"resync chain {i}: parent page {chain.parent_page} is not stored earlier"
                )
            repeated = seen.intersection(chain.page_ids)
            if repeated:
                raise ValueError(f"resync chain {i}: pages {sorted(repeated)} listed twice")
            seen.update(chain.page_ids)
        self._clock += 1
        self._drop_all(worker)
        for chain, data in zip(chains, packed, strict=True):
            failure = self._store(worker, chain, data)
            assert failure is None, f"validated resync chain failed: {failure}"
        worker.last_seq, worker.desynced = seq, False
        self._events["resyncs"] += 1
        return ApplyResult(True, False, "resynced", seq)

    # ---- queries -------------------------------------------------------------------------

    def match(
        self, namespace: Namespace, tokens: TokenInput, requester: str | None = None
    ) -> MatchResult:
        """The longest prefix of full pages cached by any live worker, page by page.

        Counts the query in the statistics (cluster, tenant = namespace.salt, requester)
        and refreshes the last access of the matched pages.

        Args:
            namespace: the prompt's namespace; nothing is shared across namespaces.
            tokens: the prompt, as little-endian int32 bytes or a sequence of ints.
            requester: the asking worker: pages it holds itself count as local hits.

        Returns:
            A MatchResult; its holders are live workers only.

        Raises:
            TypeError: namespace is not a Namespace.
            ValueError: tokens not int32 (or bytes not a multiple of 4 long).
        """
        data = self._checked(namespace, tokens)
        requester_slot = self._requester_slot(requester)
        self._clock += 1
        clock, last_access, holder_slot = self._clock, self._last_access, self._holder_slot
        pages: list[PageMatch] = []
        local = 0
        for node in self._walk(namespace, data):
            last_access[node] = clock
            pages.append(_new_tuple(PageMatch, (self._holders(node),)))
            if holder_slot[node] == requester_slot or (
                node in self._extra_holders and self._held_page(node, requester_slot) is not None
            ):
                local += 1
        matched = len(pages) * self.page_tokens
        self._record(namespace, requester, len(data) // 4, matched, local * self.page_tokens)
        return MatchResult(matched, tuple(pages))

    def route(
        self, namespace: Namespace, tokens: TokenInput, loads: Mapping[str, float]
    ) -> RouteDecision:
        """Choose the live worker that should take a prompt, weighing cache against load.

        For each live candidate w (a key of `loads` that is registered):

            score(w) = held(w) - load_weight * load(w) * prompt_tokens

        held(w) is the number of prompt tokens w holds itself as a contiguous prefix from
        the start of the prompt: what it reuses without copying anything in. The load
        term is in the same unit: with load as a utilisation (0 idle .. 1 saturated), a
        saturated worker must hold `load_weight` of the prompt more than an idle one to
        win it. Pages held only elsewhere do not count: any chosen worker can copy those.
        Ties go to the least loaded, then to the smallest worker id, so the choice is
        deterministic. With nothing cached anywhere the score is load alone, which makes
        the least loaded worker the fallback ("least_loaded").

        Routing is a read: no statistics are counted and no access time changes (the
        chosen worker's own `match` counts the query).

        Args:
            namespace: the prompt's namespace.
            tokens: the prompt, as little-endian int32 bytes or a sequence of ints.
            loads: worker id -> current load (>= 0); unregistered ids are ignored.

        Returns:
            A RouteDecision; worker_id None ("no_live_worker") when no candidate is live.

        Raises:
            TypeError: namespace is not a Namespace.
            ValueError: tokens not int32, or a load negative or not finite.
        """
        data = self._checked(namespace, tokens)
        candidates: dict[int, tuple[str, float]] = {}
        for worker_id, load in loads.items():
            if not (math.isfinite(load) and load >= 0):
                raise ValueError(f"load of worker {worker_id!r} must be finite and >= 0: {load}")
            worker = self._workers.get(worker_id)
            if worker is not None:
                candidates[worker.slot] = (worker_id, float(load))
        if not candidates:
            return RouteDecision(None, 0, 0.0, "no_live_worker")
        held = self._held_prefix_pages(namespace, data, set(candidates))
        prompt_tokens = len(data) // 4

        def rank(slot: int) -> tuple[float, float, str]:
            worker_id, load = candidates[slot]
            score = held.get(slot, 0) * self.page_tokens - self.load_weight * load * prompt_tokens
            return (-score, load, worker_id)

        best = min(candidates, key=rank)
        worker_id, load = candidates[best]
        matched = held.get(best, 0) * self.page_tokens
        score = matched - self.load_weight * load * prompt_tokens
        return RouteDecision(worker_id, matched, score, "prefix" if matched else "least_loaded")

    # ---- statistics and checks -----------------------------------------------------------

    @property
    def num_pages(self) -> int:
        """Pages (non-root nodes) in the index."""
        return self._num_pages

    def stats(self) -> dict[str, Any]:
        """Hit statistics and sizes as a plain dict (msgpack-friendly).

        Returns:
            {"page_tokens", "pages", "holdings", "workers_live",
             "cluster": counters, "tenants": {salt: counters},
             "workers": {worker id: counters + "pages" held + "live"},
             "events": {"batches", "duplicates", "resyncs_requested", "resyncs"},
             "removed_workers": {reason: count}}
            where counters are queries, queried_tokens, hit_tokens, local_hit_tokens,
            remote_hit_tokens, miss_tokens, alignment_lost_tokens.
        """
        workers: dict[str, dict] = {}
        for worker_id in sorted(set(self._by_worker) | set(self._workers)):
            counters = self._by_worker.get(worker_id) or _Counters()
            worker = self._workers.get(worker_id)
            workers[worker_id] = counters.as_dict() | {
                "pages": worker.pages.size if worker else 0,
                "live": worker is not None,
            }
        return {
            "page_tokens": self.page_tokens,
            "pages": self._num_pages,
            "holdings": sum(worker.pages.size for worker in self._workers.values()),
            "workers_live": len(self._workers),
            "cluster": self._cluster.as_dict(),
            "tenants": {salt: c.as_dict() for salt, c in sorted(self._by_tenant.items())},
            "workers": workers,
            "events": dict(self._events),
            "removed_workers": dict(self._removed_workers),
        }

    def check_integrity(self) -> None:
        """Raise AssertionError unless nodes, links, holders and reverse maps all agree."""
        used = [False] * len(self._keys)
        for namespace, root in self._roots.items():
            assert self._root_namespace.get(root) == namespace, f"root {root} of {namespace}"
            assert self._parent[root] == _NONE, f"root {root} has parent {self._parent[root]}"
            assert self._first_child[root] != _NONE, f"root {root} of {namespace} is empty"
            used[root] = True
        assert len(self._root_namespace) == len(self._roots), (
            f"{len(self._root_namespace)} root namespaces for {len(self._roots)} roots"
        )
        for key, node in self._children.items():
            assert self._keys[node] is key or self._keys[node] == key, f"node {node} key"
            parent = _NODE_ID.unpack_from(key)[0]
            assert self._parent[node] == parent, (
                f"node {node}: parent {self._parent[node]} but key names {parent}"
            )
            assert len(key) == 4 + self._page_bytes, f"node {node} key is {len(key)} bytes"
            used[node] = True
        assert len(self._children) == self._num_pages, (
            f"{len(self._children)} keyed nodes but {self._num_pages} pages counted"
        )
        free = set(self._free_nodes)
        assert len(free) == len(self._free_nodes), "a node is on the free list twice"
        in_use = sum(used)
        assert in_use + len(free) == len(self._keys), (
            f"{in_use} nodes in use + {len(free)} free != {len(self._keys)} allocated"
        )
        for node in free:
            assert not used[node], f"node {node} is both free and in use"
            assert self._holder_slot[node] == _NONE, f"free node {node} has a holder"
        reached = self._check_links(used)
        assert reached == in_use, f"{reached} nodes reachable from roots, {in_use} in use"
        holdings = self._check_holders(used)
        mapped = sum(worker.pages.size for worker in self._workers.values())
        assert holdings == mapped, f"{holdings} holders on nodes, {mapped} in reverse maps"

    # ---- internals: validation -----------------------------------------------------------

    def _tier_code(self, tier: str) -> int:
        code = self._tier_codes.get(tier)
        if code is None:
            if len(self._tiers) == 256:
                raise ValueError(f"more than 256 tiers: cannot add {tier!r}")
            code = self._tier_codes[tier] = len(self._tiers)
            self._tiers.append(tier)
        return code

    def _checked(self, namespace: Namespace, tokens: TokenInput) -> bytes:
        if not isinstance(namespace, Namespace):
            raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
        return pack_tokens(tokens)

    def _check_event(self, event: KvEvent) -> bytes | None:
        """Raise ValueError for a malformed event; the packed tokens of a PagesStored."""
        if isinstance(event, PagesStored):
            if not isinstance(event.namespace, Namespace):
                raise ValueError(f"PagesStored namespace is a {type(event.namespace).__name__}")
            count = len(event.page_ids)
            self._check_pages(event.page_ids)
            if event.parent_page is not None:
                self._check_pages((event.parent_page,))
            if len(event.generations) != count:
                raise ValueError(f"{len(event.generations)} generations for {count} pages")
            for generation in event.generations:
                if not isinstance(generation, int) or not 0 <= generation <= _INT64_MAX:
                    raise ValueError(f"generations must be ints in [0, 2**63), got {generation!r}")
            if len(event.tokens) != count * self.page_tokens:
                raise ValueError(
                    f"{len(event.tokens)} tokens for {count} pages of {self.page_tokens}"
                )
            if len(set(event.page_ids)) != count:
                raise ValueError(f"a page id repeats within one chain: {event.page_ids}")
            return pack_tokens(event.tokens)
        if isinstance(event, PagesRemoved):
            if event.reason not in REMOVAL_REASONS:
                raise ValueError(f"removal reason {event.reason!r} not in {REMOVAL_REASONS}")
            self._check_pages(event.page_ids)
            return None
        if isinstance(event, AllCleared):
            return None
        raise ValueError(f"unknown event type {type(event).__name__}")

    @staticmethod
    def _check_pages(page_ids: Sequence[int]) -> None:
        for page in page_ids:
            if not isinstance(page, int) or not 0 <= page <= _INT64_MAX:
                raise ValueError(f"page ids must be ints in [0, 2**63), got {page!r}")

    def _refusal(self, worker: _Worker | None, epoch: int) -> ApplyResult | None:
        if worker is None:
            self._events["resyncs_requested"] += 1
            return ApplyResult(False, True, "unknown_worker", 0)
        if epoch != worker.epoch:
            self._events["resyncs_requested"] += 1
            return ApplyResult(False, True, "epoch_mismatch", worker.last_seq)
        return None

    def _desync(self, worker: _Worker, reason: str) -> ApplyResult:
        worker.desynced = True
        self._events["resyncs_requested"] += 1
        return ApplyResult(False, True, reason, worker.last_seq)

    # ---- internals: the trie -------------------------------------------------------------

    def _store(self, worker: _Worker, event: PagesStored, data: bytes | None) -> str | None:
        """Hang a chain of pages under the worker's parent page; a failure reason or None."""
        assert data is not None
        if not event.page_ids:
            return None
        if event.parent_page is None:
            parent = self._root(event.namespace)
        else:
            parent = worker.pages.get(event.parent_page)
            if parent is None:
                return "unknown_parent"
        size = self._page_bytes
        for i, (page, generation) in enumerate(zip(event.page_ids, event.generations, strict=True)):
            key = _NODE_ID.pack(parent) + data[i * size : (i + 1) * size]
            node = self._children.get(key)
            old = worker.pages.get(page)
            if old is not None and old != node:
                # The worker reused the page id: what it held there (and beneath) is gone.
                if self._is_ancestor_or_self(old, parent):
                    return "page_conflict"
                self._drop_subtree(worker, old)
                if event.parent_page is None:  # the drop may have pruned an emptied root
                    parent = self._root(event.namespace)
                    key = _NODE_ID.pack(parent) + data[i * size : (i + 1) * size]
                node = self._children.get(key)
            if node is None:
                node = self._new_node(parent, key)
            self._add_holder(node, worker, page, generation)
            self._last_access[node] = self._clock
            parent = node
        return None

    def _root(self, namespace: Namespace) -> int:
        root = self._roots.get(namespace)
        return self._new_root(namespace) if root is None else root

    def _new_root(self, namespace: Namespace) -> int:
        root = self._allocate()
        self._roots[namespace] = root
        self._root_namespace[root] = namespace
        return root

    def _new_node(self, parent: int, key: bytes) -> int:
        node = self._allocate()
        self._keys[node] = key
        self._parent[node] = parent
        first = self._first_child[parent]
        self._next_sibling[node] = first
        if first != _NONE:
            self._prev_sibling[first] = node
        self._first_child[parent] = node
        self._children[key] = node
        self._num_pages += 1
        return node

    def _allocate(self) -> int:
        if self._free_nodes:
            return self._free_nodes.pop()
        node = len(self._keys)
        self._keys.append(None)
        self._parent.append(_NONE)
        self._first_child.append(_NONE)
        self._next_sibling.append(_NONE)
        self._prev_sibling.append(_NONE)
        self._holder_slot.append(_NONE)
        self._holder_page.append(0)
        self._holder_generation.append(0)
        self._holder_tier.append(0)
        self._last_access.append(0)
        return node

    def _release(self, node: int) -> None:
        """Unlink an empty, childless node from its parent and put it on the free list."""
        parent = self._parent[node]
        if parent != _NONE:
            prev, following = self._prev_sibling[node], self._next_sibling[node]
            if prev != _NONE:
                self._next_sibling[prev] = following
            else:
                self._first_child[parent] = following
            if following != _NONE:
                self._prev_sibling[following] = prev
            del self._children[self._keys[node]]
            self._num_pages -= 1
        else:
            del self._roots[self._root_namespace.pop(node)]
        self._keys[node] = None
        self._parent[node] = self._next_sibling[node] = self._prev_sibling[node] = _NONE
        self._free_nodes.append(node)

    def _prune(self, node: int) -> None:
        """Remove `node` and then its ancestors while they have no holders and no children."""
        while self._holder_slot[node] == _NONE and self._first_child[node] == _NONE:
            parent = self._parent[node]
            self._release(node)
            if parent == _NONE:
                return
            node = parent

    def _is_ancestor_or_self(self, ancestor: int, node: int) -> bool:
        while node != _NONE:
            if node == ancestor:
                return True
            node = self._parent[node]
        return False

    # ---- internals: holders --------------------------------------------------------------

    def _holders(self, node: int) -> tuple[Holder, ...]:
        # tuple.__new__ skips the NamedTuple constructor: half the cost, on the match path.
        slots, tiers = self._slots, self._tiers
        first = _new_tuple(
            Holder,
            (
                slots[self._holder_slot[node]].worker_id,
                self._holder_page[node],
                self._holder_generation[node],
                tiers[self._holder_tier[node]],
            ),
        )
        extra = self._extra_holders.get(node)
        if extra is None:
            return (first,)
        return (
            first,
            *(_new_tuple(Holder, (slots[s].worker_id, p, g, tiers[t])) for s, p, g, t in extra),
        )

    def _walk(self, namespace: Namespace, data: bytes) -> list[int]:
        """The nodes of the longest cached prefix of full pages of `data`, in order."""
        nodes: list[int] = []
        node = self._roots.get(namespace)
        if node is None:
            return nodes
        get, key_prefix, size = self._children.get, _NODE_ID.pack, self._page_bytes
        for start in range(0, len(data) - size + 1, size):
            node = get(key_prefix(node) + data[start : start + size])
            if node is None:
                break
            nodes.append(node)
        return nodes

    def _held_page(self, node: int, slot: int) -> int | None:
        if self._holder_slot[node] == slot:
            return self._holder_page[node]
        for holder_slot, page, _, _ in self._extra_holders.get(node, ()):
            if holder_slot == slot:
                return page
        return None

    def _add_holder(self, node: int, worker: _Worker, page: int, generation: int) -> None:
        slot, old_page = worker.slot, None
        if self._holder_slot[node] in (slot, _NONE):
            if self._holder_slot[node] == slot:
                old_page = self._holder_page[node]
            self._holder_slot[node] = slot
            self._holder_page[node] = page
            self._holder_generation[node] = generation
            self._holder_tier[node] = worker.tier
        else:
            extra = self._extra_holders.setdefault(node, [])
            for i, (holder_slot, held, _, _) in enumerate(extra):
                if holder_slot == slot:
                    old_page = held
                    extra[i] = (slot, page, generation, worker.tier)
                    break
            else:
                extra.append((slot, page, generation, worker.tier))
        if old_page is not None and old_page != page:
            # The worker holds this prefix under a new page id now; newest wins.
            worker.pages.pop(old_page)
        worker.pages.set(page, node)

    def _remove_holder(self, node: int, slot: int) -> int:
        """Take the worker's holder off a node; its page id."""
        extra = self._extra_holders.get(node)
        if self._holder_slot[node] == slot:
            page = self._holder_page[node]
            if extra:
                # Promote the next holder inline, keeping the holders in storing order.
                slot_, page_, generation, tier = extra.pop(0)
                self._holder_slot[node], self._holder_page[node] = slot_, page_
                self._holder_generation[node], self._holder_tier[node] = generation, tier
            else:
                self._holder_slot[node] = _NONE
        else:
            assert extra, f"slot {slot} holds nothing on node {node}"
            i = next(i for i, holder in enumerate(extra) if holder[0] == slot)
            page = extra.pop(i)[1]
        if extra is not None and not extra:
            del self._extra_holders[node]
        return page

    def _drop_subtree(self, worker: _Worker, top: int) -> int:
        """Drop the worker's holdings of `top` and of everything it holds beneath it."""
        held, stack = [], [top]
        while stack:
            node = stack.pop()
            if self._held_page(node, worker.slot) is None:
                continue  # prefix-closed: nothing of the worker's below either
            held.append(node)
            child = self._first_child[node]
            while child != _NONE:
                stack.append(child)
                child = self._next_sibling[child]
        for node in reversed(held):  # children before parents, so pruning climbs once
            worker.pages.pop(self._remove_holder(node, worker.slot))
            self._prune(node)
        return len(held)

    def _drop_all(self, worker: _Worker) -> int:
        """Drop every holding of the worker, pruning nodes left empty."""
        held = worker.pages.items()
        worker.pages.clear()
        # Any order works: a node emptied here has no holders below it (prefix closure),
        # so it is released when the last of its children is, whichever comes last.
        for _, node in held:
            self._remove_holder(node, worker.slot)
            self._prune(node)
        return len(held)

    # ---- internals: queries and checks ---------------------------------------------------

    def _requester_slot(self, requester: str | None) -> int:
        worker = self._workers.get(requester) if requester is not None else None
        return _NONE - 1 if worker is None else worker.slot  # matches no holder, not even "none"

    def _record(
        self, namespace: Namespace, requester: str | None, queried: int, hit: int, local: int
    ) -> None:
        lost = queried % self.page_tokens
        self._cluster.add(queried, hit, local, lost)
        tenant = self._by_tenant.get(namespace.salt)
        if tenant is None:
            tenant = self._by_tenant[namespace.salt] = _Counters()
        tenant.add(queried, hit, local, lost)
        if requester is not None:
            counters = self._by_worker.get(requester)
            if counters is None:
                counters = self._by_worker[requester] = _Counters()
            counters.add(queried, hit, local, lost)

    def _held_prefix_pages(
        self, namespace: Namespace, data: bytes, slots: set[int]
    ) -> dict[int, int]:
        """slot -> how many leading pages of the prompt that worker holds itself."""
        held: dict[int, int] = {}
        for node in self._walk(namespace, data):
            holding = {self._holder_slot[node]}
            holding.update(holder[0] for holder in self._extra_holders.get(node, ()))
            slots = slots & holding
            if not slots:
                break
            for slot in slots:
                held[slot] = held.get(slot, 0) + 1
        return held

    def _check_links(self, used: list[bool]) -> int:
        """Walk the child lists from every root; the number of nodes reached."""
        reached = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            reached += 1
            assert reached <= len(used), "the child lists loop"
            child, prev = self._first_child[node], _NONE
            while child != _NONE:
                assert used[child], f"child {child} of node {node} is not in use"
                assert self._parent[child] == node, (
                    f"node {child} is linked under {node} but its parent is {self._parent[child]}"
                )
                assert self._prev_sibling[child] == prev, f"node {child}: broken sibling link"
                stack.append(child)
                prev, child = child, self._next_sibling[child]
        return reached

    def _check_holders(self, used: list[bool]) -> int:
        """Check every non-root node's holders against the reverse maps; the holder count."""
        holdings = 0
        for node, in_use in enumerate(used):
            if not in_use or node in self._root_namespace:
                continue
            slots = [self._holder_slot[node]]
            pages = [self._holder_page[node]]
            extra = self._extra_holders.get(node)
            if extra is not None:
                assert extra, f"node {node} has an empty extra-holder list"
                slots += [holder[0] for holder in extra]
                pages += [holder[1] for holder in extra]
            assert slots[0] != _NONE, f"node {node} survives with no holder"
            assert len(set(slots)) == len(slots), f"node {node}: a worker holds it twice {slots}"
            parent = self._parent[node]
            for slot, page in zip(slots, pages, strict=True):
                worker = self._slots[slot] if 0 <= slot < len(self._slots) else None
                assert worker is not None, f"node {node} held by dead slot {slot}"
                mapped = worker.pages.get(page)
                assert mapped == node, (
                    f"{worker.worker_id} page {page}: holds node {node}, reverse map {mapped}"
                )
                assert (
                    parent in self._root_namespace or self._held_page(parent, slot) is not None
                ), f"{worker.worker_id} holds node {node} but not its parent {parent}"
            holdings += len(slots)
        for node in self._extra_holders:
            assert used[node], f"free node {node} has extra holders"
        return holdings


def measure_bytes_per_page(n_pages: int, page_tokens: int = 16) -> float:
    """Build an index of `n_pages` pages and measure its memory per page with tracemalloc.

    One worker stores chains of 128 pages of random token ids below 49,152 (a realistic
    vocabulary), each chain a distinct prompt, so every page is a node of its own.

    Args:
        n_pages: pages to index.
        page_tokens: tokens per page.

    Returns:
        Traced bytes held by the index, per indexed page.

    Raises:
        ValueError: n_pages not positive.
    """
    if n_pages <= 0:
        raise ValueError(f"n_pages must be positive, got {n_pages}")
    rng = np.random.default_rng(0)
    namespace = Namespace("measure")
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = GlobalIndex(page_tokens=page_tokens)
        index.register("w0", epoch=1, node_id="n0", now=0.0)
        chain = 128
        for seq, first in enumerate(range(0, n_pages, chain), start=1):
            count = min(chain, n_pages - first)
            event = PagesStored(
                namespace,
                None,
                tuple(range(first, first + count)),
                (0,) * count,
                tuple(rng.integers(0, 49_152, size=count * page_tokens).tolist()),
            )
            index.apply_events("w0", 1, seq, [event])
            del event
        assert index.num_pages == n_pages, f"{index.num_pages} pages indexed, {n_pages} stored"
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        if started:
            tracemalloc.stop()
    return used / n_pages
