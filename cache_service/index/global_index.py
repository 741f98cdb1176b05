"""`GlobalIndex`: the facade over the index's parts (workers, events, match, route, stats).

It checks what callers hand it and has each part do its share (the package docstring
lists them); it keeps only the order of the steps, the logical clock that dates page
accesses and the epochs it issues. One thread owns an index (`owner`): a call from any
other thread is refused, and nothing in here locks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from cache_service.events import KvEvent, Namespace, PagesStored
from cache_service.index.batches import BatchOrder
from cache_service.index.chains import Chains, check_event, check_snapshot
from cache_service.index.holders import Holders, match_spans
from cache_service.index.integrity import check_integrity
from cache_service.index.keys import PrefixKeys
from cache_service.index.nodes import NONE, Nodes
from cache_service.index.owner import ThreadOwned
from cache_service.index.registry import (
    NO_PEER_ADDRESS,
    PeerAddress,
    Registration,
    Registry,
    RegistryFull,
    WorkerInfo,
    checked_peer,
)
from cache_service.index.routes import MAX_RUNS, Router
from cache_service.index.stats import index_stats
from cache_service.index.tallies import UNREGISTERED, Tallies
from cache_service.messages import (
    ApplyResult,
    MatchResult,
    PeerEntry,
    RouteDecision,
)
from cache_service.routing import DEFAULT_POLICY, WorkerLoad
from cache_service.tokens import TokenInput, as_packed

_new_tuple = tuple.__new__
_get_ident = threading.get_ident


class StaleEpoch(ValueError):
    """A worker spoke with an epoch that is not its current one."""


class GlobalIndex(ThreadOwned):
    """Cluster-wide prefix index: page-granular tries of token pages and their holders.

    Args:
        page_tokens: tokens per page, the same on every worker.
        liveness_timeout_s: a worker silent (no register/heartbeat) for longer than this
            is dropped by `expire`.
        load_weight: the weight of a worker's queue in routing (see `route`).
        max_workers: registrations at once; when full, a newcomer takes the place of the
            least recently seen registration that holds no pages.
        max_tenants: tenants the front door names with figures of their own (the rest:
            "(unnamed)").
        max_spans: holders a match names at most (the longest).
        max_capacity: the most pages a worker may register as its capacity (its claims
            are bounded by that capacity).
        max_notices: notices that wait for one worker at most (`held_elsewhere`).

    Raises:
        ValueError: a non-positive page_tokens, timeout or bound, or a negative load_weight.
    """

    def __init__(
        self,
        page_tokens: int = 16,
        liveness_timeout_s: float = 10.0,
        load_weight: float = 1.0,
        max_workers: int = 1024,
        max_tenants: int = 256,
        max_spans: int = 16,
        max_capacity: int = 1 << 20,
        max_notices: int = 4096,
    ):
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {page_tokens}")
        if not liveness_timeout_s > 0:
            raise ValueError(f"liveness_timeout_s must be positive, got {liveness_timeout_s}")
        if not load_weight >= 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        if max_spans < 1:
            raise ValueError(f"max_spans must be positive, got {max_spans}")
        if max_notices < 0:
            raise ValueError(f"max_notices must be >= 0, got {max_notices}")
        self.page_tokens = page_tokens
        self.max_spans = max_spans
        self.liveness_timeout_s = liveness_timeout_s
        super().__init__()  # the calling thread owns the index
        self._keys = PrefixKeys(page_tokens)
        self._holders = Holders()
        self._nodes = Nodes(page_tokens, self._keys, self._holders)
        self._nodes.grow(64)
        self._chains = Chains(self._nodes)
        self._trie = self._nodes.trie
        self._trie.notice_limit = max_notices
        self._registry = Registry(max_workers, max_capacity)
        self._router = Router(self._nodes, self._registry, page_tokens, load_weight)
        self._tallies = Tallies(page_tokens, max_tenants)
        self._clock = 0  # logical: one tick per event batch, resync and match
        # Epochs are issued here, one per registration. They start at the wall clock in
        # microseconds, so a restarted service never reissues an epoch of its predecessor.
        self._last_epoch = time.time_ns() // 1000
        self._batches = BatchOrder()

    # ---- workers -------------------------------------------------------------------------

    def register(
        self,
        worker_id: str,
        node_id: str,
        tier: str = "cpu",
        now: float | None = None,
        peer: PeerAddress = NO_PEER_ADDRESS,
        capacity: int = 0,
    ) -> Registration:
        """Register a new incarnation of a worker, issue its epoch, and mark it alive.

        Whatever an earlier incarnation of the same id held is dropped (the new one
        resyncs), and its sequence numbers restart; messages with the old epoch are refused
        from now on.

        Args:
            worker_id: the worker's name, unique in the cluster.
            node_id: the cluster node the worker runs on.
            tier: its kind of memory, e.g. "cpu" (shown in its entry and info only: spans
                carry each page's tier, from the events).
            now: the current time in seconds (default: time.monotonic()).
            peer: how peers read its pages (page server, shared-memory store, key); it
                replaces the entry of any earlier incarnation (see `peer`).
            capacity: pages its store holds, the most it may hold here (0: a default).

        Returns:
            A Registration with the new epoch; the next event batch carries seq 1.

        Raises:
            ValueError: `peer`'s key is not None nor a z85 key, or `capacity` is negative or
                over max_capacity; nothing changed then.
            RegistryFull: max_workers registered, each holding pages.
        """
        self._own()
        now = time.monotonic() if now is None else now
        peer = checked_peer(peer)
        capacity = self._registry.capacity(worker_id, capacity)
        worker = self._registry.get(worker_id)
        if worker is None and self._registry.full():
            victim = self._registry.evictable()
            if victim is None:
                raise RegistryFull(
                    f"cannot register {worker_id!r}: {self._registry.max_workers} workers "
                    "registered, each holding pages"
                )
            self.remove_worker(victim.worker_id, "evicted")
        self._last_epoch += 1
        dropped = 0
        if worker is None:
            worker = self._registry.add(worker_id, self._last_epoch, node_id, tier, peer)
        else:
            dropped = self._chains.drop_all(worker)
            worker.epoch, worker.last_seq, worker.desynced = self._last_epoch, 0, False
        worker.node_id, worker.tier, worker.last_seen = node_id, tier, now
        worker.peer, worker.capacity = peer, capacity
        return Registration(worker_id, worker.epoch, 0, dropped)

    def heartbeat(self, worker_id: str, epoch: int, now: float | None = None) -> bool:
        """Mark a worker alive at `now` (default: time.monotonic()); False when it is unknown
        (expired or never registered) or `epoch` is not its current one: it must register
        again."""
        self._own()
        worker = self._registry.get(worker_id)
        if worker is None or worker.epoch != epoch:
            return False
        worker.last_seen = time.monotonic() if now is None else now
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Remove every worker silent for longer than `liveness_timeout_s` at `now` (default:
        time.monotonic()); the removed worker ids, sorted."""
        self._own()
        now = time.monotonic() if now is None else now
        silent = self._registry.silent(now, self.liveness_timeout_s)
        for worker_id in silent:
            self.remove_worker(worker_id, "expired")
        return silent

    def remove_worker(self, worker_id: str, reason: str, epoch: int | None = None) -> int:
        """Forget a worker (dead, drained) and all its holdings at once.

        Args:
            worker_id: the worker; an unknown one is a no-op.
            reason: why, counted in `stats()["removed_workers"]`.
            epoch: when given (a worker saying BYE), only that incarnation is removed.

        Returns:
            The number of holdings dropped.

        Raises:
            StaleEpoch: `epoch` is not the worker's current one; nothing changes.
        """
        self._own()
        worker = self._registry.get(worker_id)
        if worker is None:
            return 0
        if epoch is not None and epoch != worker.epoch:
            raise StaleEpoch(
                f"worker {worker_id!r} is at epoch {worker.epoch}, not {epoch}: not removed"
            )
        dropped = self._chains.drop_all(worker)
        self._registry.remove(worker_id, reason)
        self._tallies.fold_requester(worker_id)
        return dropped

    def name_tenant(self, salt: str, name: str) -> None:
        """Show the figures of tenant `salt` under `name` (statistics never show salts)."""
        self._own()
        self._tallies.name(salt, name)

    def tenant_name(self, salt: str) -> str:
        """The name statistics show for `salt` (UNNAMED if the front door gave none)."""
        self._own()
        return self._tallies.shown_name(salt)

    def live_workers(self) -> list[str]:
        """The registered (live) worker ids, sorted."""
        self._own()
        return sorted(self._registry.workers)

    def worker_info(self, worker_id: str) -> WorkerInfo | None:
        """A live worker's registration and state; None when it is not registered."""
        self._own()
        worker = self._registry.get(worker_id)
        return None if worker is None else self._registry.info(worker)

    def peer(self, worker_id: str) -> PeerEntry | None:
        """How peers reach a live worker's pages, as its current incarnation registered;
        None when it is not registered (never, or removed, dead or expired)."""
        self._own()
        worker = self._registry.get(worker_id)
        return None if worker is None else self._registry.entry(worker)

    def peers(self, after: str = "", limit: int = 256) -> tuple[list[PeerEntry], bool]:
        """Up to `limit` live workers' entries in worker id order, those after `after` ("":
        from the first), and whether more follow."""
        self._own()
        if limit < 1:
            raise ValueError(f"limit must be positive, got {limit}")
        return self._registry.entries(after, limit)

    # ---- events --------------------------------------------------------------------------

    def apply_events(
        self, worker_id: str, epoch: int, seq: int, events: Sequence[KvEvent]
    ) -> ApplyResult:
        """Apply one batch of a worker's events, in order.

        Batches are numbered per worker from 1 after registration (or from a resync's seq
        + 1). A batch equal to or older than the last applied is ignored; a gap, an unknown
        worker or epoch, or an event that cannot be placed asks for a resync, and further
        batches are refused until it comes. Each event is idempotent on its own: storing a
        page already held (same node, same page id) only refreshes its generation and tier,
        and removing or demoting an unknown page does nothing (it is counted). A worker
        holds each node once: a demotion, or a stored page on a node it holds in another
        tier, moves that holding (see `cache_service.index.chains`).

        Args:
            worker_id: the sender.
            epoch: its incarnation, as registered.
            seq: the batch's sequence number.
            events: KvEvents (`cache_service.events`), in the order they happened.

        Returns:
            An ApplyResult; see its docstring for the reasons.

        Raises:
            ValueError: a malformed event (lengths, token range, page ids, removal reason,
                tier); nothing is applied then.
        """
        self._own()
        worker = self._registry.get(worker_id)
        refusal = self._batches.batch_refusal(worker, epoch, seq)
        if refusal is not None:
            return refusal
        assert worker is not None
        packed = [check_event(event, self.page_tokens) for event in events]
        self._clock += 1
        failure = self._chains.apply(worker, events, packed, self._clock, notify=True)
        if failure is not None:
            return self._batches.desync(worker, failure)
        return self._batches.applied(worker, seq)

    def held_elsewhere(
        self, worker_id: str, epoch: int, limit: int = 1024
    ) -> tuple[list[int], list[int]]:
        """Pages of the worker's (in any tier, by its ids there) that another worker has
        stored since it did: the mesh keeps them if it lets them go, so its tiers evict
        them first. Each notice is taken once, checked then (the worker holds that id at
        that generation, and someone else the page too); see `chains` for who gets one.

        Args:
            worker_id, epoch: the worker, as registered (another epoch: nothing).
            limit: notices to take at most (the rest wait for the next call).

        Returns:
            (page ids, generations), in the order the copies were stored.
        """
        self._own()
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        worker = self._registry.get(worker_id)
        if worker is None or worker.epoch != epoch:
            return [], []
        pages, generations = self._trie.take_notices(worker.pages, worker.slot, limit)
        return list(pages), list(generations)

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
                snapshot, a page id listed twice, or more pages than the worker's
                capacity; nothing changes then.
        """
        self._own()
        worker = self._registry.get(worker_id)
        refusal = self._batches.sender_refusal(worker, epoch)
        if refusal is not None:
            return refusal
        assert worker is not None
        packed = check_snapshot(chains, self.page_tokens)
        pages = sum(len(chain.page_ids) for chain in chains)  # distinct: checked above
        if pages > worker.capacity:
            raise self._batches.over_capacity(worker, pages)
        self._clock += 1
        self._chains.drop_all(worker)
        for chain, data in zip(chains, packed, strict=True):
            failure = self._chains.store(worker, chain, data, self._clock)
            assert failure is None, f"validated resync chain failed: {failure}"
        return self._batches.resynced(worker, seq)

    # ---- queries -------------------------------------------------------------------------

    def match(
        self, namespace: Namespace, tokens: TokenInput, requester: str | None = None
    ) -> MatchResult:
        """The longest prefix of full pages cached by any live worker, as one span per holder.

        Counts the query in the statistics (cluster, tenant = namespace.salt, requester)
        and refreshes the last access of the matched pages.

        Args:
            namespace: the prompt's namespace; nothing is shared across namespaces.
            tokens: the prompt, as little-endian int32 bytes or a sequence of ints.
            requester: the asking worker: pages it holds itself count as local hits.

        Returns:
            A MatchResult of HolderSpans; its spans name live workers only.

        Raises:
            TypeError: namespace is not a Namespace.
            ValueError: tokens not int32 (or bytes not a multiple of 4 long).
        """
        return _new_tuple(MatchResult, self._match(namespace, tokens, requester, False))

    def match_packed(
        self, namespace: Namespace, tokens: TokenInput, requester: str | None = None
    ) -> MatchResult:
        """`match`, with each span a PackedSpan: page ids and generations as the wire bytes.

        For a server that only forwards the spans. Same arguments, statistics and errors as
        `match`.
        """
        return _new_tuple(MatchResult, self._match(namespace, tokens, requester, True))

    def _match(
        self, namespace: Namespace, tokens: TokenInput, requester: str | None, packed: bool
    ) -> tuple[int, tuple]:
        if _get_ident() != self._owner:
            self._own()
        if type(namespace) is Namespace and type(tokens) is bytes and not len(tokens) & 3:
            data = tokens  # the server's case: checked as _checked would
        else:
            data = _checked(namespace, tokens)
        self._clock = clock = self._clock + 1
        trie = self._trie
        length, found = trie.match(self._nodes.roots.get(namespace), data, MAX_RUNS, clock)
        asking = None if requester is None else self._registry.workers.get(requester)
        spans, local = (), 0
        if found:
            requester_slot = NONE - 1 if asking is None else asking.slot  # matches no holder
            spans, local = match_spans(found, self._registry.slots, requester_slot, packed)
            spans = spans[: self.max_spans]
        page_tokens = self.page_tokens
        matched = length * page_tokens
        if requester is not None and asking is None:
            requester = UNREGISTERED
        local *= page_tokens
        self._tallies.record(namespace.salt, requester, len(data) >> 2, matched, local)
        return matched, spans

    def route(
        self,
        namespace: Namespace,
        tokens: TokenInput,
        loads: Mapping[str, float],
        pending: Mapping[str, float] | None = None,
        reported: Mapping[str, WorkerLoad] | None = None,
        policy: str = DEFAULT_POLICY,
    ) -> RouteDecision:
        """The live worker that should take a prompt, by the routing policy named
        (`cache_service.routing`). A read: no statistics are counted and no access time
        changes (the chosen worker's own `match` counts the query).

        Args:
            namespace: the prompt's namespace.
            tokens: the prompt, as little-endian int32 bytes or a sequence of ints.
            loads: worker id -> prompt tokens the caller has in flight there (>= 0);
                unregistered ids are ignored.
            pending: worker id -> tokens of this prompt it computes for a request in flight.
            reported: worker id -> its load and costs (its disk's reads too), as reported.
            policy: a name of `cache_service.routing.POLICIES`.

        Returns:
            A RouteDecision; worker_id None ("no_live_worker") when no candidate is live.

        Raises:
            TypeError: namespace is not a Namespace.
            ValueError: tokens not int32, a load negative or not finite, or an unknown
                policy.
        """
        self._own()
        data = _checked(namespace, tokens)
        return self._router.route(namespace, data, loads, pending, reported, policy)

    # ---- statistics and checks -----------------------------------------------------------

    @property
    def num_pages(self) -> int:
        """Pages (non-root nodes) in the index."""
        self._own()
        return self._nodes.num_pages

    def stats(self) -> dict[str, Any]:
        """Hit statistics and sizes as a plain dict (msgpack-friendly).

        Returns:
            "page_tokens", "pages", "holdings", "workers_live", "tiers", "removals",
            "demotions", "cluster", "tenants", "workers", "events" and "removed_workers",
            "superseded", as drawn in `cache_service.index.stats`.
        """
        self._own()
        parts = self._nodes, self._registry, self._tallies, self._batches.counts, self._chains
        return index_stats(self.page_tokens, *parts)

    def check_integrity(self) -> None:
        """Raise AssertionError unless nodes, links, keys, holders and reverse maps agree."""
        self._own()
        check_integrity(self._nodes, self._holders, self._registry)
        self._registry.check()
        self._tallies.check(lambda worker_id: worker_id in self._registry.workers)


def _checked(namespace: Namespace, tokens: TokenInput) -> bytes:
    if not isinstance(namespace, Namespace):
        raise TypeError(f"namespace must be a Namespace, got {type(namespace).__name__}")
    return as_packed(tokens)
