"""The workers the index knows: registrations, slots, liveness, reverse page maps, pages
per tier, and the entries peers reach them by.

Each live worker has a slot, its number in the holder columns (int16; a removed worker's
slot is reused), and a page map from its own page ids to the nodes it holds them as, so
its events name pages by the ids of its page store. Its peer entry (page server address,
shared-memory store name, page server key) is what its current incarnation sent at
register: replaced when it registers again, gone with its registration. Everything here
is bounded: at most `max_workers` registrations, one entry each (its strings bounded by
the codec). The tier a worker registers is a word for its entry and nothing more: each of
its pages has a tier of its own (the holder columns), and the worker counts its pages per
tier, so a match knows without a look when all of them are in one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from cache_service.events import TIERS
from cache_service.index._compiled import PageMap
from cache_service.messages import PeerEntry

MAX_SLOTS = 2**15 - 1  # worker slots are int16 in the holder columns
Z85_KEY_CHARS = 40  # a CurveZMQ public key as the mesh hands keys out
# The capacity of a worker that registers without one (an older client, or a test that
# registers by hand): what it may hold in the index, so that a key that does not say
# cannot claim pages without bound either. 65,536 pages is 1M tokens at 16 a page, 32x
# the stores `configs/` give a worker, and about 17 MiB of index.
DEFAULT_CAPACITY = 1 << 16


class PeerAddress(NamedTuple):
    """Where a worker's pages are read, as it registered."""

    address: str  # its page server; "" if none
    shm_name: str  # its shared-memory page store; "" if none
    page_key: bytes | None  # its page server's public key (z85); None: no auth


NO_PEER_ADDRESS = PeerAddress("", "", None)


class Registration(NamedTuple):
    """The outcome of `GlobalIndex.register`."""

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
    capacity: int  # the most pages it may hold (as it registered, or DEFAULT_CAPACITY)


class Worker:
    """A registered worker's state in the index."""

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
        "tier_pages",
        "peer",
        "capacity",
    )

    def __init__(
        self,
        worker_id: str,
        slot: int,
        epoch: int,
        node_id: str,
        tier: str,
        peer: PeerAddress = NO_PEER_ADDRESS,
        capacity: int = DEFAULT_CAPACITY,
    ):
        self.worker_id = worker_id
        self.slot = slot  # the worker's number in the holder columns
        self.epoch = epoch
        self.node_id = node_id
        self.tier = tier  # as it registered: shown in its entry, never used for spans
        self.last_seen = 0.0
        self.last_seq = 0
        self.desynced = False  # an event batch failed: refuse batches until a resync
        # Page stores hand out small dense page ids (0..pool size), so the page -> node map
        # is a flat int32 array up to 2**22 pages (16 MiB at most), a hash map beyond.
        self.pages = PageMap()
        self.tier_pages = [0] * len(TIERS)  # pages it holds in each tier, by tier index
        self.peer = peer  # how peers read its pages, as this incarnation registered
        self.capacity = capacity  # the most pages it may hold at once

    def room_for(self, page_ids: Sequence[int]) -> bool:
        """Whether storing `page_ids` keeps the worker within its capacity, counting the
        ids it does not hold yet (an upper bound: storing may also let go of others)."""
        pages = self.pages
        room = self.capacity - pages.size
        if len(page_ids) <= room:  # fits even if every id is new: no lookups (the usual)
            return True
        return sum(pages.get(page) is None for page in page_ids) <= room


class RegistryFull(ValueError):
    """No room for another worker: every registration holds pages."""


class Registry:
    """Workers by id and by slot, and the removal counts.

    Args:
        max_workers: registrations at once (at most MAX_SLOTS).
        max_capacity: the most pages one worker may say it holds (`capacity`).
    """

    def __init__(self, max_workers: int = 1024, max_capacity: int = 1 << 20) -> None:
        if not 1 <= max_workers <= MAX_SLOTS:
            raise ValueError(f"max_workers must be in [1, {MAX_SLOTS}], got {max_workers}")
        if max_capacity < 1:
            raise ValueError(f"max_capacity must be positive, got {max_capacity}")
        self.max_workers = max_workers
        self.max_capacity = max_capacity
        self.workers: dict[str, Worker] = {}
        self.slots: list[Worker | None] = []
        self._free_slots: list[int] = []
        self.removed: dict[str, int] = {}  # reason -> workers removed for it

    def capacity(self, worker_id: str, capacity: int) -> int:
        """The capacity `worker_id` registers with (0: it did not say: DEFAULT_CAPACITY,
        or max_capacity if that is lower).

        Raises:
            ValueError: not an int in [0, max_capacity].
        """
        if type(capacity) is not int or not 0 <= capacity <= self.max_capacity:
            raise ValueError(
                f"cannot register {worker_id!r} with a capacity of {capacity!r} pages: "
                f"0 to {self.max_capacity} (0: the default)"
            )
        return capacity or min(DEFAULT_CAPACITY, self.max_capacity)

    def get(self, worker_id: str | None) -> Worker | None:
        return None if worker_id is None else self.workers.get(worker_id)

    def full(self) -> bool:
        return len(self.workers) >= self.max_workers

    def evictable(self) -> Worker | None:
        """The registration to drop for a newcomer when full: the least recently seen one
        that holds no pages (a worker with pages is never pushed out); None if none."""
        empty = [worker for worker in self.workers.values() if worker.pages.size == 0]
        return min(empty, key=lambda w: (w.last_seen, w.worker_id), default=None)

    def add(
        self,
        worker_id: str,
        epoch: int,
        node_id: str,
        tier: str,
        peer: PeerAddress = NO_PEER_ADDRESS,
    ) -> Worker:
        """A new worker in a free slot (the caller made room: see `full`)."""
        assert not self.full(), f"{len(self.workers)} workers registered, the most"
        slot = self._free_slots.pop() if self._free_slots else len(self.slots)
        worker = Worker(worker_id, slot, epoch, node_id, tier, peer)
        if slot == len(self.slots):
            self.slots.append(worker)
        else:
            self.slots[slot] = worker
        self.workers[worker_id] = worker
        return worker

    def remove(self, worker_id: str, reason: str) -> Worker | None:
        """Take a worker out (its holdings must be dropped first); None if unknown."""
        worker = self.workers.pop(worker_id, None)
        if worker is not None:
            self.slots[worker.slot] = None
            self._free_slots.append(worker.slot)
            self.removed[reason] = self.removed.get(reason, 0) + 1
        return worker

    def silent(self, now: float, timeout_s: float) -> list[str]:
        """The workers not seen for longer than `timeout_s`, sorted."""
        return sorted(
            worker_id
            for worker_id, worker in self.workers.items()
            if now - worker.last_seen > timeout_s
        )

    def info(self, worker: Worker) -> WorkerInfo:
        return WorkerInfo(
            worker.worker_id,
            worker.epoch,
            worker.node_id,
            worker.tier,
            worker.last_seen,
            worker.last_seq,
            worker.pages.size,
            worker.desynced,
            worker.capacity,
        )

    def entry(self, worker: Worker) -> PeerEntry:
        """How peers reach `worker`'s pages: its current registration."""
        return PeerEntry(worker.worker_id, worker.epoch, worker.node_id, worker.tier, *worker.peer)

    def entries(self, after: str, limit: int) -> tuple[list[PeerEntry], bool]:
        """Up to `limit` entries of the workers whose ids sort after `after`, in id order,
        and whether more follow."""
        ids = sorted(worker_id for worker_id in self.workers if worker_id > after)
        page = [self.entry(self.workers[worker_id]) for worker_id in ids[:limit]]
        return page, len(ids) > limit

    def by_worker(
        self,
        holdings: Iterable[tuple[int, int, int]],
        page_tokens: int,
    ) -> tuple[dict[str, int], dict[str, str], dict[str, int]]:
        """(slot, pages, pages before its first on disk) holdings of a prompt as (worker id
        -> tokens held, worker id -> node, worker id -> tokens held before its first page
        on disk, for the holders with any): what routing weighs."""
        held, nodes, held_host = {}, {}, {}
        for slot, pages, host in holdings:
            worker = self.slots[slot]
            held[worker.worker_id] = pages * page_tokens
            nodes[worker.worker_id] = worker.node_id
            if host < pages:
                held_host[worker.worker_id] = host * page_tokens
        return held, nodes, held_host

    def holdings(self) -> int:
        """Pages held, summed over the live workers."""
        return sum(worker.pages.size for worker in self.workers.values())

    def tier_holdings(self) -> list[int]:
        """Pages held in each tier (by tier index), summed over the live workers."""
        totals = [0] * len(TIERS)
        for worker in self.workers.values():
            totals = [total + pages for total, pages in zip(totals, worker.tier_pages, strict=True)]
        return totals

    def check(self) -> None:
        """Slots agree with the workers; each worker's pages per tier add up to its pages;
        each worker's peer entry is whole and names it."""
        for worker_id, worker in self.workers.items():
            assert self.slots[worker.slot] is worker, f"{worker_id} is not in its slot"
            assert worker.worker_id == worker_id, f"{worker_id} is filed as {worker.worker_id}"
            _check_peer(worker_id, worker.peer)
            assert worker.pages.size <= worker.capacity, (
                f"{worker_id} holds {worker.pages.size} pages, over its capacity {worker.capacity}"
            )
            assert len(worker.tier_pages) == len(TIERS) and min(worker.tier_pages) >= 0, (
                f"{worker_id} holds {worker.tier_pages} pages per tier"
            )
            assert sum(worker.tier_pages) == worker.pages.size, (
                f"{worker_id} holds {worker.pages.size} pages, {worker.tier_pages} per tier"
            )
            # An empty worker may keep the tier it had: it is read only for a holder.
        live = sum(worker is not None for worker in self.slots)
        assert live == len(self.workers), f"{live} slots taken for {len(self.workers)} workers"


def checked_peer(peer: PeerAddress) -> PeerAddress:
    """`peer` as a PeerAddress of its checked fields.

    Raises:
        TypeError: its address or store name is not a str.
        ValueError: its key is neither None nor a Z85_KEY_CHARS-char z85 key.
    """
    address, shm_name, page_key = peer
    if type(address) is not str or type(shm_name) is not str:
        raise TypeError(f"a peer's address and store name are str, got {peer!r:.80}")
    if page_key is not None and (type(page_key) is not bytes or len(page_key) != Z85_KEY_CHARS):
        raise ValueError(
            f"a page key is a {Z85_KEY_CHARS}-char z85 key or None, got {page_key!r:.20}"
        )
    return PeerAddress(address, shm_name, page_key)


def _check_peer(worker_id: str, peer: PeerAddress) -> None:
    assert type(peer) is PeerAddress, f"{worker_id}: peer entry {peer!r:.60}"
    address, shm_name, page_key = peer
    assert type(address) is str and type(shm_name) is str, f"{worker_id}: {peer!r:.60}"
    assert page_key is None or (type(page_key) is bytes and len(page_key) == Z85_KEY_CHARS), (
        f"{worker_id}: page key {page_key!r:.20} is not a {Z85_KEY_CHARS}-char z85 key"
    )
