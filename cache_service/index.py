"""The global prefix index: which full pages of which prompts are cached on which worker.

The service holds metadata only, never KV bytes. Workers stream `PagesStored` /
`PagesRemoved` / `AllCleared` events (see `events.py`); the index turns them into one
page-granular trie per `Namespace` and answers, for a prompt, the longest prefix of full
pages that some live worker holds, as one span per holder:

    prompt tokens    |<- page 0 ->|<- page 1 ->|<- page 2 ->|<- page 3 ->|<-partial->|
    w2 holds         |  page 3    |  page 4    |  page 8    |            |
    w1 holds         |  page 10   |  page 11   |            |            |
    match            |<------------ matched_tokens -------->|
    requester w1     |<-- local hit ---------->|<- remote ->|<-- miss -->|<- lost -->|
    spans            HolderSpan("w2", tier, (3, 4, 8), gens), HolderSpan("w1", tier, (10, 11), gens)

Each worker's holdings are prefix-closed (a worker that holds a page holds its parent), so
along one prompt every holder holds a leading run of the matched pages, and one span per
holder says it all. "lost" (alignment_lost_tokens) is the trailing partial page: page
granularity cannot serve it whatever is cached. For every query, queried = hit + miss +
alignment_lost, and hit = local + remote.

Storage is a struct of numpy columns indexed by node id (an int), not one object per
node: the index holds about a million pages, and a Python object per node costs several
hundred bytes. Scalar code reads and writes the columns through memoryviews (as fast as
array.array); `match` reads them for all pages of a prompt at once.

Finding a prompt's nodes: every node has a 64-bit prefix key,

    key(page i of a prompt) = root key + sum(coefficient[t] * token[t] for t < (i + 1) * P)

(mod 2**64, with secret random coefficients per token position and a root key per
namespace). A key table (open addressing in numpy arrays) maps keys to nodes, but a key
only names candidates: a page counts as matched only once its stored tokens equal the
prompt's and its parent is the previous matched node, so a hash collision can cost time,
never make a hit.

Pages published in one chain get consecutive node ids, so `match` walks a prompt by runs:
the key of a run's first page finds its node, and the following node ids extend the run as
far as they continue the chain (a flag per node) and hold the prompt's next pages (one
bytes comparison). A 128-page prompt published at once is one run, a dozen operations. A
path fragmented into many runs is finished with all remaining keys at once (`_lookup`: one
numpy multiply and cumulative sum, a vectorised probe of the key table, one vectorised
check).

Holders: each node has four inline holder columns (worker slot, page id, generation) and a
side dict for more holders. A worker keeps one column along its whole path: the column of a
page's holding is the column of its parent's holding, and only a first page picks a free
column. Two workers never compete for a column (the one already there would hold the parent
in that column too), so along a prompt column c belongs to one worker, and a span is a
slice (or gather) of column c over the matched nodes.

Invariants (checked by `check_integrity`): each worker's holdings are prefix-closed and
column-consistent; a node with no holders never has holders below it and is removed at once,
leaf-up; every page node is in the key table once, under its key.
"""

from __future__ import annotations

import math
import os
import struct
import sys
import time
import tracemalloc
from array import array
from collections.abc import Iterator, Mapping, Sequence
from operator import mul
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

_NONE = -1  # "no node" / "no holder" inside the int columns, never outside this module
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_INT64_MAX = 2**63 - 1
_MASK64 = 2**64 - 1
_TOKEN_DTYPE = np.dtype("<i4")  # the wire format of token ids, and of stored pages
# Page stores hand out small dense page ids (0..pool size), so a worker's page -> node map
# is a flat int32 array up to this many pages (16 MiB at most) and a dict beyond it.
_DENSE_PAGE_LIMIT = 1 << 22
# Inline holder columns per node. Four covers a page shared by a handful of workers
# without touching the side dict; each column costs 14 bytes a node.
_INLINE_HOLDERS = 4
_EXTRA = _INLINE_HOLDERS  # the "column" of a holding kept in the side dict
_MAX_SLOTS = 2**15 - 1  # worker slots are int16 in the holder columns
# A path walked as more runs than this is finished with the vectorised lookup.
_MAX_RUNS = 4
# Depths whose coefficients are kept as Python ints for single-page keys (about 700 bytes
# each); deeper runs start rarely and convert theirs each time.
_CACHED_DEPTHS = 256
_BIG_ENDIAN = sys.byteorder == "big"
_new_tuple = tuple.__new__

assert array("i").itemsize == 4, "array('i') must be 32-bit to pack int32 tokens"


class HolderSpan(NamedTuple):
    """One worker's copy of the first pages of a match: where to fetch them, how to check.

    The worker holds prompt pages 0 .. len(page_ids) - 1; `page_ids[i]` is prompt page i in
    the worker's own page store, `generations[i]` its generation when it was published.
    """

    worker_id: str
    tier: str  # the memory tier the worker registered, e.g. "cpu" or "gpu"
    page_ids: tuple[int, ...]
    generations: tuple[int, ...]  # same length as page_ids


class MatchResult(NamedTuple):
    """The longest cached prefix of full pages and who holds it.

    `spans` has one entry per live holder of at least page 0, longest first, then by
    worker id; the longest covers all `matched_tokens` (page_tokens * its length).
    """

    matched_tokens: int
    spans: tuple[HolderSpan, ...]


class PackedSpan(NamedTuple):
    """A HolderSpan with its page ids and generations packed as on the wire: little-endian
    int32 and int64 bytes (see `GlobalIndex.match_packed`)."""

    worker_id: str
    tier: str
    page_ids: bytes
    generations: bytes


class PackedMatch(NamedTuple):
    """A MatchResult whose spans are PackedSpans."""

    matched_tokens: int
    spans: tuple[PackedSpan, ...]


class _Path(NamedTuple):
    """The nodes of a match, in prompt order.

    Pages published in one chain get consecutive node ids, so a path is usually one run
    start .. start + length - 1 (`nodes` None), read with slices; else `nodes` lists them.
    """

    start: int
    length: int
    nodes: np.ndarray | None  # intp

    def of(self, column: np.ndarray) -> np.ndarray:
        """`column` at the path's nodes, in order (a view for a run)."""
        if self.nodes is None:
            return column[self.start : self.start + self.length]
        return column[self.nodes]  # not take(): that copies a strided column whole first

    def node(self, i: int) -> int:
        return self.start + i if self.nodes is None else int(self.nodes[i])


_NO_PATH = _Path(0, 0, None)


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
        return tokens.astype(_TOKEN_DTYPE, copy=False).tobytes()
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
        self.slot = slot  # the worker's number in the holder columns
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

    def add(self, queries: int, queried: int, hit: int, local: int, lost: int) -> None:
        self.queries += queries
        self.queried_tokens += queried
        self.hit_tokens += hit
        self.local_hit_tokens += local
        self.remote_hit_tokens += hit - local
        self.miss_tokens += queried - hit - lost
        self.alignment_lost_tokens += lost

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _COUNTERS}


# ---- prefix keys ---------------------------------------------------------------------------


def _draw_coefficients(rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` random even int64 coefficients, one per token position.

    Even coefficients and odd root keys keep every key odd, so 0 can mark an empty slot of
    the key table.
    """
    drawn = rng.integers(-(2**63), 2**63 - 1, size=count, dtype=np.int64, endpoint=True)
    return drawn & np.int64(-2)


def _root_key(secret: int, namespace: Namespace) -> int:
    """The key of a namespace's root: odd, and the same whenever the root is re-created
    (keys computed before a root was pruned stay valid)."""
    return hash((secret, namespace)) | 1


# ---- the key table -------------------------------------------------------------------------

_TABLE_MIN_BITS = 10
_TABLE_PAD = 64  # slots past the last home slot: probes run on into them, never wrap around
_WINDOW = np.arange(8, dtype=np.intp)  # slots a vectorised lookup reads per key


class _KeyTable:
    """Prefix key -> node id, a multimap in two numpy arrays (open addressing, linear probing).

    A Python dict of int -> int costs about 100 bytes an entry (two int objects and the
    entry); this table costs 12 bytes a slot at a load between 1/8 and 1/2, and it looks up
    all keys of a prompt in a dozen numpy operations. Keys are odd, so 0 marks an empty
    slot. Equal keys may repeat (two different prefixes whose keys collide): lookups return
    candidates, and the caller compares tokens and parents exactly. Probing never wraps
    around: the arrays run on past the last home slot, and the last slot is always empty, so
    every probe ends at an empty slot.
    """

    __slots__ = ("size", "_bits", "_shift", "_keys", "_nodes", "_keys_arr", "_nodes_arr")

    def __init__(self) -> None:
        self.size = 0
        self._place(_TABLE_MIN_BITS, np.zeros(0, np.int64), np.zeros(0, np.int32))

    def insert(self, key: int, node: int) -> None:
        if 2 * (self.size + 1) > 1 << self._bits:
            self._place_all(self._bits + 1)
        keys = self._keys
        slot = self._home(key)
        while keys[slot]:
            slot += 1
        if slot == len(keys) - 1:  # keep the last slot empty: lay the table out afresh
            self._place_all(self._bits)
            self.insert(key, node)
            return
        keys[slot] = key
        self._nodes[slot] = node
        self.size += 1

    def remove(self, key: int, node: int) -> None:
        keys, nodes = self._keys, self._nodes
        slot = self._home(key)
        while keys[slot] != key or nodes[slot] != node:
            assert keys[slot], f"node {node} is not in the key table under {key}"
            slot += 1
        # Backward-shift deletion: pull later entries of the run into the hole when their
        # home allows, so no tombstones are needed and every probe still ends at a gap.
        hole, slot = slot, slot + 1
        while moved := keys[slot]:
            if self._home(moved) <= hole:
                keys[hole], nodes[hole] = moved, nodes[slot]
                hole = slot
            slot += 1
        keys[hole] = 0
        self.size -= 1
        if self._bits > _TABLE_MIN_BITS and 8 * self.size < 1 << self._bits:
            self._place_all(self._bits - 1)

    def candidates(self, key: int) -> Iterator[int]:
        """The nodes stored under `key`, in probe order."""
        keys, nodes = self._keys, self._nodes
        slot = self._home(key)
        while found := keys[slot]:
            if found == key:
                yield nodes[slot]
            slot += 1

    def find_run(self, keys: np.ndarray) -> np.ndarray:
        """For the longest leading run of `keys` present in the table, each one's first node.

        Args:
            keys: int64 keys, in prompt order.

        Returns:
            The node ids (intp), possibly shorter than `keys`; candidates to verify.
        """
        home = (keys.view(np.uint64) >> np.uint64(self._shift)).view(np.intp)
        window = self._keys_arr.take(home[:, None] + _WINDOW)  # (pages, 8)
        found = window == keys[:, None]
        slots = home + found.argmax(1)
        hit = found.any(1)
        run = 0
        while not hit[run:].all():
            run += int(hit[run:].argmin())
            if not window[run].all():  # an empty slot in the window: the key is absent
                break
            slot = self._probe(int(keys[run]), int(home[run]) + len(_WINDOW))
            if slot is None:
                break
            slots[run] = slot
            run += 1
        else:
            run = len(keys)
        return self._nodes_arr.take(slots[:run]).astype(np.intp)

    def check(self) -> tuple[np.ndarray, np.ndarray]:
        """Check the layout; the (keys, nodes) of the occupied slots."""
        keys = self._keys_arr
        occupied = np.flatnonzero(keys)
        assert len(occupied) == self.size, f"{len(occupied)} keys stored, size {self.size}"
        assert keys[-1] == 0, "the key table's last slot is occupied"
        assert len(keys) >= (1 << self._bits) + len(_WINDOW), "the key table lost its padding"
        home = (keys[occupied].view(np.uint64) >> np.uint64(self._shift)).astype(np.intp)
        assert (home <= occupied).all(), "a key sits before its home slot"
        # No empty slot between a key's home and the key: else probes would stop short.
        empty_through = np.cumsum(keys == 0)
        gapless = (keys[home] != 0) & (empty_through[occupied] == empty_through[home])
        assert gapless.all(), "a probe run has a gap"
        assert (keys[occupied] & 1).all(), "an even key"
        return keys[occupied], self._nodes_arr[occupied].astype(np.intp)

    def _home(self, key: int) -> int:
        return (key & _MASK64) >> self._shift

    def _probe(self, key: int, slot: int) -> int | None:
        keys = self._keys
        while found := keys[slot]:
            if found == key:
                return slot
            slot += 1
        return None

    def _place_all(self, bits: int) -> None:
        occupied = np.flatnonzero(self._keys_arr)
        self._place(bits, self._keys_arr[occupied], self._nodes_arr[occupied])

    def _place(self, bits: int, keys: np.ndarray, nodes: np.ndarray) -> None:
        """Lay out the entries afresh in a table of 2**bits home slots, vectorised.

        Inserting entries in order of home slot puts entry i at max(home[i], slot[i-1] + 1),
        which is i + the running maximum of home[i] - i.
        """
        shift = 64 - bits
        home = (keys.view(np.uint64) >> np.uint64(shift)).astype(np.intp)
        order = np.argsort(home, kind="stable")
        ranks = np.arange(len(order))
        slots = np.maximum.accumulate(home[order] - ranks) + ranks
        last = int(slots[-1]) + 1 if len(slots) else 0
        self._keys_arr = np.zeros(max(1 << bits, last) + _TABLE_PAD, np.int64)
        self._nodes_arr = np.zeros(len(self._keys_arr), np.int32)
        self._keys_arr[slots] = keys[order]
        self._nodes_arr[slots] = nodes[order]
        self._keys, self._nodes = memoryview(self._keys_arr), memoryview(self._nodes_arr)
        self._bits, self._shift = bits, shift


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
        # Prefix keys: secret, so no client can aim collisions at the key table.
        self._secret = int.from_bytes(os.urandom(8), "little")
        self._rng = np.random.default_rng(self._secret)
        self._coefficients = np.zeros(0, np.int64)  # one per token position, grown on demand
        # The same as Python ints, per depth, for keys of single pages (runs start at the
        # first page and where chains branch).
        self._depth_coefficients: dict[int, tuple[int, ...]] = {}
        self._page_struct = struct.Struct(f"<{page_tokens}i")
        self._table = _KeyTable()
        # Nodes: numpy columns indexed by node id (`_x_arr`), read and written one value at
        # a time through memoryviews of them (`_x`); `_grow` replaces both together.
        self._capacity = 0
        self._allocated = 0  # node ids handed out so far; the free ones are in _free_nodes
        self._tokens_arr = np.zeros((0, page_tokens), _TOKEN_DTYPE)  # (nodes, page_tokens)
        self._parent_arr = np.zeros(0, np.intp)
        self._first_child_arr = np.zeros(0, np.int32)
        self._next_sibling_arr = np.zeros(0, np.int32)
        self._prev_sibling_arr = np.zeros(0, np.int32)
        self._key_arr = np.zeros(0, np.int64)  # prefix key; a root's is its namespace's
        self._depth_arr = np.zeros(0, np.int32)  # pages from the root: 1 for a first page
        self._last_access_arr = np.zeros(0, np.int64)  # logical clock, see self._clock
        self._holder_count_arr = np.zeros(0, np.int16)  # inline + side-dict holders
        self._chained_arr = np.zeros(0, np.uint8)  # 1: the node's parent is node id - 1
        # Inline holders: (nodes, columns), so the spans of one path share cache lines.
        self._holder_slot_arr = np.zeros((0, _INLINE_HOLDERS), np.int16)  # _NONE: empty
        self._holder_page_arr = np.zeros((0, _INLINE_HOLDERS), np.int32)
        self._holder_generation_arr = np.zeros((0, _INLINE_HOLDERS), np.int64)
        self._grow(64)
        # Holders beyond the inline columns: node -> [(slot, page, generation)].
        self._extra_holders: dict[int, list[tuple[int, int, int]]] = {}
        self._roots: dict[Namespace, int] = {}
        self._root_namespace: dict[int, Namespace] = {}
        self._free_nodes: list[int] = []
        self._num_pages = 0
        self._max_depth = 0  # no prompt matches deeper than the deepest node ever made
        self._clock = 0
        # Workers.
        self._workers: dict[str, _Worker] = {}
        self._slots: list[_Worker | None] = []
        self._free_slots: list[int] = []
        self._tiers: list[str] = []
        self._tier_codes: dict[str, int] = {}
        # Statistics: (tenant salt, requester) -> [queries, queried, hit, local, lost]
        # tokens, summed up by `stats` (a match updates one list, not three counter sets).
        self._tallies: dict[tuple[str, str | None], list[int]] = {}
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
            tier: the memory tier its pages live in (reported on its spans).
            now: the current time in seconds (default: time.monotonic()).

        Returns:
            A Registration; the next event batch carries seq `last_seq + 1`.

        Raises:
            ValueError: epoch older than the registered one, more than 256 tiers, or more
                than 32,767 workers registered at once.
        """
        now = time.monotonic() if now is None else now
        tier_code = self._tier_code(tier)
        worker = self._workers.get(worker_id)
        dropped = 0
        if worker is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slots)
            if slot >= _MAX_SLOTS:
                raise ValueError(f"cannot register {worker_id!r}: {_MAX_SLOTS} workers live")
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
        """The longest prefix of full pages cached by any live worker, as one span per holder.

        Counts the query in the statistics (cluster, tenant = namespace.salt, requester)
        and refreshes the last access of the matched pages.

        Args:
            namespace: the prompt's namespace; nothing is shared across namespaces.
            tokens: the prompt, as little-endian int32 bytes or a sequence of ints.
            requester: the asking worker: pages it holds itself count as local hits.

        Returns:
            A MatchResult; its spans name live workers only.

        Raises:
            TypeError: namespace is not a Namespace.
            ValueError: tokens not int32 (or bytes not a multiple of 4 long).
        """
        return _new_tuple(MatchResult, self._match(namespace, tokens, requester, False))

    def match_packed(
        self, namespace: Namespace, tokens: TokenInput, requester: str | None = None
    ) -> PackedMatch:
        """`match`, with each span's page ids and generations packed as in a match reply.

        For a server that only forwards the spans: the codec sends the bytes as they are,
        where a HolderSpan's ints would be made and then packed again (about 4 us a
        128-page span). Same arguments, statistics and errors as `match`.
        """
        return _new_tuple(PackedMatch, self._match(namespace, tokens, requester, True))

    def _match(
        self, namespace: Namespace, tokens: TokenInput, requester: str | None, packed: bool
    ) -> tuple[int, tuple]:
        data = self._checked(namespace, tokens)
        path = self._path(namespace, data)
        self._clock += 1
        spans: tuple = ()
        local = 0
        if path.length:
            start, length, nodes = path
            if nodes is None:
                self._last_access_arr[start : start + length].fill(self._clock)
            else:
                self._last_access_arr.put(nodes, self._clock)
            holdings = self._holdings(path)
            requester_slot = self._requester_slot(requester)
            for slot, held, _ in holdings:
                if slot == requester_slot:
                    local = held
            built = [self._span(path, *holding, packed) for holding in holdings]
            if len(built) > 1:
                built.sort(key=_span_order)  # packed lengths are 4x, in the same order
            spans = tuple(built)
        matched = path.length * self.page_tokens
        self._record(namespace, requester, len(data) // 4, matched, local * self.page_tokens)
        return matched, spans

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
        path = self._path(namespace, data)
        held = {slot: pages for slot, pages, _ in self._holdings(path)} if path.length else {}
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
        cluster = _Counters()
        tenants: dict[str, _Counters] = {}
        requesters: dict[str, _Counters] = {}
        for (salt, requester), tally in self._tallies.items():
            cluster.add(*tally)
            tenants.setdefault(salt, _Counters()).add(*tally)
            if requester is not None:
                requesters.setdefault(requester, _Counters()).add(*tally)
        workers: dict[str, dict] = {}
        for worker_id in sorted(set(requesters) | set(self._workers)):
            counters = requesters.get(worker_id) or _Counters()
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
            "cluster": cluster.as_dict(),
            "tenants": {salt: c.as_dict() for salt, c in sorted(tenants.items())},
            "workers": workers,
            "events": dict(self._events),
            "removed_workers": dict(self._removed_workers),
        }

    def check_integrity(self) -> None:
        """Raise AssertionError unless nodes, links, keys, holders and reverse maps agree."""
        used = np.zeros(self._allocated, bool)
        for namespace, root in self._roots.items():
            assert self._root_namespace.get(root) == namespace, f"root {root} of {namespace}"
            assert self._parent[root] == _NONE, f"root {root} has parent {self._parent[root]}"
            assert self._first_child[root] != _NONE, f"root {root} of {namespace} is empty"
            assert self._depth[root] == 0, f"root {root} at depth {self._depth[root]}"
            assert self._key[root] == _root_key(self._secret, namespace), f"root {root} key"
            assert self._holder_count[root] == 0, f"root {root} has holders"
            used[root] = True
        assert len(self._root_namespace) == len(self._roots), (
            f"{len(self._root_namespace)} root namespaces for {len(self._roots)} roots"
        )
        keys, pages = self._table.check()
        assert len(pages) == self._num_pages, (
            f"{len(pages)} nodes in the key table but {self._num_pages} pages counted"
        )
        assert not used[pages].any(), "a root is in the key table"
        used[pages] = True
        assert used.sum() == len(self._roots) + self._num_pages, "a node is in the key table twice"
        assert (self._key_arr[pages] == keys).all(), (
            "a node sits in the key table under a wrong key"
        )
        free = np.array(self._free_nodes, np.intp)
        assert len(set(self._free_nodes)) == len(free), "a node is on the free list twice"
        assert not used[free].any(), "a node is both free and in use"
        assert used.sum() + len(free) == self._allocated, (
            f"{used.sum()} nodes in use + {len(free)} free != {self._allocated} allocated"
        )
        assert (self._holder_count_arr[free] == 0).all(), "a free node has holders"
        parents = self._parent_arr[: self._allocated]
        chained = used & (parents != _NONE) & (parents == np.arange(self._allocated) - 1)
        assert (self._chained_arr[: self._allocated] == chained).all(), "a wrong chained flag"
        assert (self._holder_slot_arr[free] == _NONE).all(), "a free node has inline holders"
        reached = self._check_links(used)
        assert reached == used.sum(), f"{reached} nodes reachable from roots, {used.sum()} in use"
        pages.sort()
        self._check_keys(pages)
        holdings = self._check_holders(pages)
        mapped = sum(worker.pages.size for worker in self._workers.values())
        assert holdings == mapped, f"{holdings} holders on nodes, {mapped} in reverse maps"
        self._check_reverse_maps()

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
        # Page ids travel as int32 in match replies; page stores number pages from 0.
        for page in page_ids:
            if not isinstance(page, int) or not 0 <= page <= _INT32_MAX:
                raise ValueError(f"page ids must be ints in [0, 2**31), got {page!r}")

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
        keys = self._chain_keys(self._key[parent], self._depth[parent], data).tolist()
        # The worker's column on the parent is its column all along the chain.
        column = None if event.parent_page is None else self._column_of(parent, worker.slot)
        size = self._page_bytes
        for i, (page, generation) in enumerate(zip(event.page_ids, event.generations, strict=True)):
            tokens = data[i * size : (i + 1) * size]
            node = self._child(parent, keys[i], tokens)
            old = worker.pages.get(page)
            if old is not None and old != node:
                # The worker reused the page id: what it held there (and beneath) is gone.
                if self._is_ancestor_or_self(old, parent):
                    return "page_conflict"
                self._drop_subtree(worker, old)
                if i == 0 and event.parent_page is None:  # the drop may have pruned the root
                    parent = self._root(event.namespace)
                node = self._child(parent, keys[i], tokens)
            if node is None:
                node = self._new_node(parent, keys[i], tokens)
            column = self._add_holder(node, worker, page, generation, column)
            self._last_access[node] = self._clock
            parent = node
        return None

    def _chain_keys(self, start: int, depth: int, data: bytes) -> np.ndarray:
        """The prefix keys of the pages of `data`, hung below a node of key `start` at
        `depth`.

        key of page i = start + sum of coefficient * token over token positions from
        depth * page_tokens to the end of page i, wrapping mod 2**64 (int64 arithmetic).
        """
        size = self.page_tokens
        count = len(data) // self._page_bytes * size
        first = depth * size
        if len(self._coefficients) < first + count:
            grown = max(first + count, 2 * len(self._coefficients), 4096)
            extra = _draw_coefficients(self._rng, grown - len(self._coefficients))
            self._coefficients = np.concatenate([self._coefficients, extra])
        prefix = (
            np.frombuffer(data, _TOKEN_DTYPE, count) * self._coefficients[first : first + count]
        )
        prefix[:1] += start
        prefix.cumsum(out=prefix)
        return prefix[size - 1 :: size]

    def _child(self, parent: int, key: int, tokens: bytes) -> int | None:
        """The child of `parent` whose page is exactly `tokens`, found through its key."""
        if self._first_child[parent] == _NONE:  # e.g. the next page of a new chain
            return None
        size = self._page_bytes
        for node in self._table.candidates(key):
            if (
                self._parent[node] == parent
                and self._token_bytes[node * size : (node + 1) * size].tobytes() == tokens
            ):
                return node
        return None

    def _root(self, namespace: Namespace) -> int:
        root = self._roots.get(namespace)
        return self._new_root(namespace) if root is None else root

    def _new_root(self, namespace: Namespace) -> int:
        root = self._allocate()
        self._key[root] = _root_key(self._secret, namespace)
        self._depth[root] = 0
        self._roots[namespace] = root
        self._root_namespace[root] = namespace
        return root

    def _new_node(self, parent: int, key: int, tokens: bytes) -> int:
        node = self._allocate()
        size = self._page_bytes
        self._token_bytes[node * size : (node + 1) * size] = tokens
        self._key[node] = key
        depth = self._depth[node] = self._depth[parent] + 1
        self._max_depth = max(self._max_depth, depth)
        self._parent[node] = parent
        self._chained[node] = parent == node - 1
        first = self._first_child[parent]
        self._next_sibling[node] = first
        if first != _NONE:
            self._prev_sibling[first] = node
        self._first_child[parent] = node
        self._table.insert(key, node)
        self._num_pages += 1
        return node

    def _allocate(self) -> int:
        """A node id with empty links and no holders."""
        if self._free_nodes:
            return self._free_nodes.pop()
        if self._allocated == self._capacity:
            # A quarter more each time: amortised O(1), and at most a fifth of the columns
            # idle (doubling would leave up to half of them idle).
            self._grow(self._capacity + self._capacity // 4 + 64)
        self._allocated += 1
        return self._allocated - 1

    def _grow(self, capacity: int) -> None:
        """Extend every node column to `capacity` nodes and rebind the memoryviews."""
        self._tokens_arr = tokens = _grown(self._tokens_arr, capacity, 0)
        # One page per element, for gathering the pages of a path in one `take`.
        self._page_records = tokens.view(f"V{self._page_bytes}").reshape(capacity)
        self._token_bytes = memoryview(tokens).cast("B")
        self._parent_arr = _grown(self._parent_arr, capacity, _NONE)
        self._first_child_arr = _grown(self._first_child_arr, capacity, _NONE)
        self._next_sibling_arr = _grown(self._next_sibling_arr, capacity, _NONE)
        self._prev_sibling_arr = _grown(self._prev_sibling_arr, capacity, _NONE)
        self._key_arr = _grown(self._key_arr, capacity, 0)
        self._depth_arr = _grown(self._depth_arr, capacity, 0)
        self._last_access_arr = _grown(self._last_access_arr, capacity, 0)
        self._holder_count_arr = _grown(self._holder_count_arr, capacity, 0)
        self._chained_arr = _grown(self._chained_arr, capacity, 0)
        self._holder_slot_arr = _grown(self._holder_slot_arr, capacity, _NONE)
        self._holder_page_arr = _grown(self._holder_page_arr, capacity, 0)
        self._holder_generation_arr = _grown(self._holder_generation_arr, capacity, 0)
        self._parent = memoryview(self._parent_arr)
        self._first_child = memoryview(self._first_child_arr)
        self._next_sibling = memoryview(self._next_sibling_arr)
        self._prev_sibling = memoryview(self._prev_sibling_arr)
        self._key = memoryview(self._key_arr)
        self._depth = memoryview(self._depth_arr)
        self._last_access = memoryview(self._last_access_arr)
        self._holder_count = memoryview(self._holder_count_arr)
        self._chained = memoryview(self._chained_arr)
        # One strided view (and memoryview) per holder column.
        self._holder_slot_cols = list(self._holder_slot_arr.T)
        self._holder_page_cols = list(self._holder_page_arr.T)
        self._holder_generation_cols = list(self._holder_generation_arr.T)
        self._holder_slot = [memoryview(column) for column in self._holder_slot_cols]
        self._holder_page = [memoryview(column) for column in self._holder_page_cols]
        self._holder_generation = [memoryview(column) for column in self._holder_generation_cols]
        self._capacity = capacity

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
            self._table.remove(self._key[node], node)
            self._num_pages -= 1
        else:
            del self._roots[self._root_namespace.pop(node)]
        self._parent[node] = self._next_sibling[node] = self._prev_sibling[node] = _NONE
        self._key[node] = self._chained[node] = 0
        self._free_nodes.append(node)

    def _prune(self, node: int) -> None:
        """Remove `node` and then its ancestors while they have no holders and no children."""
        while self._holder_count[node] == 0 and self._first_child[node] == _NONE:
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

    def _column_of(self, node: int, slot: int) -> int | None:
        """The column of the worker's holding on `node` (_EXTRA: the side dict); None: none."""
        if self._holder_count[node] == 0:
            return None
        for column, slots in enumerate(self._holder_slot):
            if slots[node] == slot:
                return column
        for held_by, _, _ in self._extra_holders.get(node, ()):
            if held_by == slot:
                return _EXTRA
        return None

    def _held_page(self, node: int, slot: int) -> int | None:
        column = self._column_of(node, slot)
        if column is None or column < _EXTRA:
            return None if column is None else self._holder_page[column][node]
        return next(page for held_by, page, _ in self._extra_holders[node] if held_by == slot)

    def _add_holder(
        self, node: int, worker: _Worker, page: int, generation: int, parent_column: int | None
    ) -> int:
        """Record that the worker holds `node` as `page`; the column it holds it in.

        `parent_column` is the worker's column on the node's parent (None for a first
        page): its column here too, and free here (see the module docstring).
        """
        slot, old_page = worker.slot, None
        column = self._column_of(node, slot)
        assert column is None or parent_column in (None, column), f"{column} != {parent_column}"
        if column is None:
            self._holder_count[node] += 1
            column = parent_column
            if column is None:  # a first page: any free column will do
                column = next(
                    (c for c, slots in enumerate(self._holder_slot) if slots[node] == _NONE),
                    _EXTRA,
                )
        elif column < _EXTRA:
            old_page = self._holder_page[column][node]
        if column < _EXTRA:
            assert self._holder_slot[column][node] in (_NONE, slot), f"column {column} taken"
            self._holder_slot[column][node] = slot
            self._holder_page[column][node] = page
            self._holder_generation[column][node] = generation
        else:
            extra = self._extra_holders.setdefault(node, [])
            for i, (held_by, held, _) in enumerate(extra):
                if held_by == slot:
                    old_page = held
                    extra[i] = (slot, page, generation)
                    break
            else:
                extra.append((slot, page, generation))
        if old_page is not None and old_page != page:
            # The worker holds this prefix under a new page id now; newest wins.
            worker.pages.pop(old_page)
        worker.pages.set(page, node)
        return column

    def _remove_holder(self, node: int, slot: int) -> int:
        """Take the worker's holding off a node; its page id."""
        column = self._column_of(node, slot)
        assert column is not None, f"slot {slot} holds nothing on node {node}"
        self._holder_count[node] -= 1
        if column < _EXTRA:
            self._holder_slot[column][node] = _NONE
            return self._holder_page[column][node]
        extra = self._extra_holders[node]
        i = next(i for i, holder in enumerate(extra) if holder[0] == slot)
        page = extra.pop(i)[1]
        if not extra:
            del self._extra_holders[node]
        return page

    def _drop_subtree(self, worker: _Worker, top: int) -> int:
        """Drop the worker's holdings of `top` and of everything it holds beneath it."""
        held, stack = [], [top]
        while stack:
            node = stack.pop()
            if self._column_of(node, worker.slot) is None:
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

    # ---- internals: queries --------------------------------------------------------------

    def _path(self, namespace: Namespace, data: bytes) -> _Path:
        """The nodes of the longest cached prefix of full pages of `data`, in order.

        Pages published together are consecutive node ids, so the walk goes by runs: find
        the node of the next page through its key (checking its parent and tokens), then
        take as many of the following node ids as continue the chain (a parent of node
        id - 1, a flag per node) and hold the prompt's next pages (one bytes comparison).
        A fragmented path (more than _MAX_RUNS runs) is finished with every remaining
        page's key at once (`_lookup`).
        """
        root = self._roots.get(namespace)
        pages = min(len(data) // self._page_bytes, self._max_depth)
        if root is None or pages == 0:
            return _NO_PATH
        runs: list[tuple[int, int]] = []  # (first node, pages)
        parent, done = root, 0
        size = self._page_bytes
        while done < pages and self._first_child[parent] != _NONE:
            if len(runs) == _MAX_RUNS:
                rest = self._lookup(parent, done, pages, data)
                return _Path(0, done + len(rest), np.concatenate([*map(_node_range, runs), rest]))
            key = self._page_key(parent, done, data)
            node = self._child(parent, key, data[done * size : (done + 1) * size])
            if node is None:
                break
            length = self._run_length(node, done, pages, data)
            runs.append((node, length))
            done += length
            parent = node + length - 1
        if len(runs) == 1:
            return _new_tuple(_Path, (*runs[0], None))
        if not runs:
            return _NO_PATH
        return _Path(0, done, np.concatenate([*map(_node_range, runs)]))

    def _page_key(self, parent: int, depth: int, data: bytes) -> int:
        """The key of prompt page `depth` as a child of `parent` (see `_chain_keys`).

        In Python ints (one page is too small for numpy to pay off), wrapped to int64 at the
        end, which gives what numpy's wrapping int64 arithmetic gives.
        """
        coefficients = self._depth_coefficients.get(depth)
        if coefficients is None:
            size = self.page_tokens
            coefficients = tuple(self._coefficients[depth * size : (depth + 1) * size].tolist())
            if depth < _CACHED_DEPTHS:
                self._depth_coefficients[depth] = coefficients
        tokens = self._page_struct.unpack_from(data, depth * self._page_bytes)
        key = self._key[parent] + sum(map(mul, tokens, coefficients))
        return ((key + 2**63) & _MASK64) - 2**63

    def _run_length(self, node: int, depth: int, pages: int, data: bytes) -> int:
        """How many consecutive node ids from `node` (which holds prompt page `depth`)
        continue its chain and hold the prompt's following pages, in order."""
        most = min(pages - depth, self._allocated - node)
        broken = self._chained[node + 1 : node + most].tobytes().find(0)
        if broken >= 0:
            most = broken + 1
        size = self._page_bytes
        stored = self._token_bytes[node * size : (node + most) * size].tobytes()
        wanted = data[depth * size : (depth + most) * size]
        if stored == wanted:
            return most
        equal, unequal = 1, most  # the first `equal` pages agree, the first `unequal` do not
        while unequal - equal > 1:
            middle = (equal + unequal) // 2
            if stored[: middle * size] == wanted[: middle * size]:
                equal = middle
            else:
                unequal = middle
        return equal

    def _lookup(self, parent: int, depth: int, pages: int, data: bytes) -> np.ndarray:
        """The nodes of prompt pages depth .. pages - 1 below `parent`, all keys at once.

        Every page's key in one multiply and cumulative sum, the key table's first
        candidate for each, then one exact check of all of them (stored tokens equal the
        prompt's pages, each node's parent the node before). A collision fails that check
        and takes the exact walk instead, which tries every candidate.
        """
        size = self._page_bytes
        data = data[depth * size : pages * size]
        keys = self._chain_keys(self._key[parent], depth, data)
        nodes = self._table.find_run(keys)
        if len(nodes) == 0:
            return nodes
        parents = self._parent_arr.take(nodes)
        if (
            parents[0] == parent
            and parents[1:].tobytes() == nodes[:-1].tobytes()
            and self._page_records.take(nodes).tobytes() == data[: len(nodes) * size]
        ):
            return nodes
        found = []
        for i, key in enumerate(keys.tolist()):
            parent = self._child(parent, key, data[i * size : (i + 1) * size])
            if parent is None:
                break
            found.append(parent)
        return np.array(found, dtype=np.intp)

    def _holdings(self, path: _Path) -> list[tuple[int, int, int]]:
        """(slot, pages held, column) of every holder of the first node of a path.

        Each holder holds a leading run of the path (prefix closure) in one column
        (column consistency), so column c along the path is its holder's run, then empty.
        """
        start, length, nodes = path
        if nodes is None:
            first, last = start, start + length - 1
        else:
            first, last = int(nodes[0]), int(nodes[-1])
        holdings = []
        for column, slots in enumerate(self._holder_slot):
            slot = slots[first]
            if slot == _NONE:
                continue
            if slots[last] == slot:
                held = length
            else:
                held = int(np.count_nonzero(path.of(self._holder_slot_cols[column]) == slot))
            holdings.append((slot, held, column))
        for slot, _, _ in self._extra_holders.get(first, ()):
            held = 1
            while held < length and self._column_of(path.node(held), slot) == _EXTRA:
                held += 1
            holdings.append((slot, held, _EXTRA))
        return holdings

    def _span(
        self, path: _Path, slot: int, held: int, column: int, packed: bool = False
    ) -> HolderSpan | PackedSpan:
        worker = self._slots[slot]
        assert worker is not None, f"a holding of dead slot {slot}"
        start, _, nodes = path
        if column < _EXTRA:
            pages = self._holder_page_cols[column]
            generations = self._holder_generation_cols[column]
            if nodes is None:  # a run of node ids: slices
                pages, generations = pages[start : start + held], generations[start : start + held]
            else:
                nodes = nodes[:held]
                pages, generations = pages[nodes], generations[nodes]
            if packed:
                page_ids = pages.astype("<i4", copy=False).tobytes()
                generations = generations.astype("<i8", copy=False).tobytes()
                return _new_tuple(
                    PackedSpan, (worker.worker_id, self._tiers[worker.tier], page_ids, generations)
                )
            page_ids, generations = tuple(pages.tolist()), tuple(generations.tolist())
        else:
            found = [
                next(holder for holder in self._extra_holders[path.node(i)] if holder[0] == slot)
                for i in range(held)
            ]
            page_ids = tuple(holder[1] for holder in found)
            generations = tuple(holder[2] for holder in found)
            if packed:
                page_ids = struct.pack(f"<{held}i", *page_ids)
                generations = struct.pack(f"<{held}q", *generations)
                return _new_tuple(
                    PackedSpan, (worker.worker_id, self._tiers[worker.tier], page_ids, generations)
                )
        return _new_tuple(
            HolderSpan, (worker.worker_id, self._tiers[worker.tier], page_ids, generations)
        )

    def _requester_slot(self, requester: str | None) -> int:
        worker = self._workers.get(requester) if requester is not None else None
        return _NONE - 1 if worker is None else worker.slot  # matches no holder, not even "none"

    def _record(
        self, namespace: Namespace, requester: str | None, queried: int, hit: int, local: int
    ) -> None:
        key = (namespace.salt, requester)
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = [0, 0, 0, 0, 0]
        tally[0] += 1
        tally[1] += queried
        tally[2] += hit
        tally[3] += local
        tally[4] += queried % self.page_tokens

    # ---- internals: checks ---------------------------------------------------------------

    def _check_links(self, used: np.ndarray) -> int:
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

    def _check_keys(self, pages: np.ndarray) -> None:
        """Every page's depth and key follow from its parent's and its own tokens."""
        size = self.page_tokens
        deepest = self._depth_arr[pages].max() if len(pages) else 0
        assert self._max_depth >= deepest, f"a node at depth {deepest} > {self._max_depth}"
        positions = np.arange(size)
        for start in range(0, len(pages), 1 << 16):  # in chunks: bounded temporaries
            chunk = pages[start : start + (1 << 16)]
            parents = self._parent_arr[chunk]
            depth = self._depth_arr[chunk]
            assert (depth == self._depth_arr[parents] + 1).all(), "a node at the wrong depth"
            coefficients = self._coefficients[(depth[:, None] - 1) * size + positions]
            sums = (self._tokens_arr[chunk] * coefficients).sum(1) + self._key_arr[parents]
            assert (sums == self._key_arr[chunk]).all(), "a node's key does not match its page"

    def _check_holders(self, pages: np.ndarray) -> int:
        """Counts, columns and prefix closure of every page's holders; the holder count."""
        slots = self._holder_slot_arr[pages].T  # (columns, pages)
        inline = (slots != _NONE).sum(0)
        extra = np.zeros(len(pages), np.int64)
        for node, holders in self._extra_holders.items():
            assert holders, f"node {node} has an empty extra-holder list"
            where = np.searchsorted(pages, node)
            assert where < len(pages) and pages[where] == node, f"free node {node} has holders"
            extra[where] = len(holders)
        counts = self._holder_count_arr[pages]
        assert (counts == inline + extra).all(), "a holder count is off"
        assert (counts > 0).all(), f"nodes survive with no holder: {pages[counts == 0][:5]}"
        for a in range(_INLINE_HOLDERS):
            assert all(
                ((slots[a] == _NONE) | (slots[a] != slots[b])).all()
                for b in range(a + 1, _INLINE_HOLDERS)
            ), "a worker holds a node in two columns"
        live = np.array([worker is not None for worker in self._slots] + [False], bool)
        assert live[slots[slots != _NONE]].all(), "a node is held by a dead slot"
        # Prefix closure and column consistency: a holder of a page below a first page holds
        # the parent in the same column.
        parents = self._parent_arr[pages]
        below = self._depth_arr[pages] > 1
        parent_slots = self._holder_slot_arr[parents].T
        closed = (slots == _NONE) | (slots == parent_slots) | ~below
        assert closed.all(), "a worker holds a page but not its parent in the same column"
        for node, holders in self._extra_holders.items():
            held_by = [holder[0] for holder in holders]
            assert len(set(held_by)) == len(held_by), f"node {node}: a worker holds it twice"
            for slot in held_by:
                assert self._slots[slot] is not None, f"node {node} held by dead slot {slot}"
                assert slot not in slots[:, np.searchsorted(pages, node)], (
                    f"node {node}: slot {slot} both inline and extra"
                )
                parent = self._parent[node]
                assert self._depth[node] == 1 or self._column_of(parent, slot) == _EXTRA, (
                    f"slot {slot} holds node {node} in the side dict but not its parent"
                )
        return int(counts.sum())

    def _check_reverse_maps(self) -> None:
        """Every page of a worker's page map is a holding of that worker, under that page."""
        for worker in self._workers.values():
            for page, node in worker.pages.items():
                assert self._held_page(node, worker.slot) == page, (
                    f"{worker.worker_id} page {page}: reverse map says node {node}, which "
                    f"holds {self._held_page(node, worker.slot)}"
                )


def _grown(column: np.ndarray, capacity: int, fill: int) -> np.ndarray:
    """`column` extended to `capacity` nodes (its first axis), the new entries `fill`."""
    grown = np.full((capacity, *column.shape[1:]), fill, column.dtype)
    grown[: len(column)] = column
    return grown


def _node_range(run: tuple[int, int]) -> np.ndarray:
    first, length = run
    return np.arange(first, first + length, dtype=np.intp)


def _span_order(span: HolderSpan | PackedSpan) -> tuple[int, str]:
    return (-len(span.page_ids), span.worker_id)


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
