"""`kvmesh replay`: a Mooncake-format trace through the real global index and local caches.

One process, no model, no KV bytes: each simulated worker is a real `PrefixCache` over a
real `PagePool`, and one real `GlobalIndex` is fed by the workers' own KV events. What is
measured is how many prompt tokens each request reuses instead of computing.

Tokens. A trace line names its prompt by `hash_ids`, one per 512-token block (the last
block may be partial). Each hash id expands to a deterministic block of synthetic token
ids (`block_tokens`): equal hash ids give equal tokens, different ones differ with
overwhelming probability, and the prompt is the concatenation of its blocks truncated to
`input_length`. The generator is a counter-based hash (splitmix64 of hash id and
position), so a block is recomputed in microseconds and nothing needs caching: the trace
has ~183k distinct blocks, which would be ~375 MB as int32 arrays.

A trace line must be consistent: `input_length` needs exactly ceil(input_length / 512)
blocks. The Mooncake conversation trace satisfies this on every line, so a line that
does not is an error rather than something to clip silently.

One request, in order (no concurrency):

    route       GlobalIndex.route(prompt, loads, policy): the routing policy named
                (`cache_service.routing`; "prefix" is kvmesh's own, round-robin takes
                worker i % N).
    acquire     the worker's cache matches its local prefix (full pages, then maybe a
                copy-on-write of part of a page; never the last prompt token).
    copy in     with the mesh (every policy but round-robin, which replays per-worker
                caches): full pages that other workers hold beyond the local match,
                per GlobalIndex.match, count as remote hits.
    publish     the whole prompt: the copied-in pages become local like computed ones.
    release     then the worker's KV events go to the index (one batch, seq + 1).
    heartbeats  every worker takes the index's notices of its pages that another worker
                has stored since (`GlobalIndex.held_elsewhere`): its cache evicts those
                first (`cache.cluster_eviction`; `--local-eviction` turns it off;
                round-robin's workers copy nothing, so they never do).

Accounting, per request of n prompt tokens:

    local   = allocation.cached_tokens (full pages + copy-on-write tokens, <= n - 1)
    remote  = max(0, min(matched_tokens, n - 1) - local)   (with the mesh only)
    hit     = local + remote;   computed = n - hit

The cap at n - 1 and the copy-on-write are the local cache's own rules, and a remote copy
obeys the same cap (the model needs the last token's logits), so a remote hit never
counts a token a local hit could not. `infinite_hit_rate` is this very replay on one
worker whose pool holds every page the trace can ever publish (it never evicts): the
same code, the same counting, so `hit_rate / infinite_hit_rate` compares like with like.
The remote match sees full pages only; a copy-on-write of part of a page happens only
against the worker's own cache, in both replays.

Output tokens are not simulated: in this trace a follow-up turn's prompt already
contains the earlier answer as new hash ids (the trace's own hit figure counts them as
misses), and decode pages of synthetic tokens could never match those blocks; they would
only take capacity. `infinite_block_hit_rate` is the trace's own figure, from hash-id
prefixes alone (blocks whose whole prefix was seen before): 0.366 on the conversation
trace. `infinite_hit_rate` counts tokens and comes out a little higher (0.373): misses
gather in the partial last blocks, which weigh less in tokens than in blocks. (Weighting
the hash-id figure by tokens gives 0.3736; the cache finds 0.3734 because a partial last
page is never cached, only reachable by a copy-on-write of a full page.)

Cost on the conversation trace (12,031 requests, 145M prompt tokens, 512-token pages):
about 20 s per pass and two passes (the replay, then the infinite cache), ~1 GB peak:
every cached page is keyed by its 2 KiB of tokens, in a worker's trie and in the index.

Loads for routing: kvmesh's routing weighs each worker's queue in prompt
tokens against what it would compute and copy (`cache_service.routing`). Trace
timestamps are not used (serving speed is not modelled), so the replay stands in for a
worker's queue with what it computed over the last `load_window` requests beyond the
workers' mean: what it would still have to compute, were the workers equally fast and
fed at the mean rate. Simulated workers share one node: copies cost a memcpy's rate.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from cache_service.events import Namespace
from cache_service.index import GlobalIndex
from cache_service.routing import POLICIES
from cache_service.tokens import pack_tokens
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.store.page_pool import PagePool

TRACE_BLOCK_TOKENS = 512  # a Mooncake hash id covers 512 tokens
VOCAB = 49_152  # SmolLM2's vocabulary size
NAMESPACE = Namespace("replay")
LOAD_WINDOW = 64  # requests: long enough to smooth one long prompt, short enough to react
_MAX_HASH_ID = 2**63 - 1

# splitmix64 constants
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_SALT = np.uint64(0x6B766D657368)  # keeps hash id 0 off splitmix64's fixed point


class TraceRequest(NamedTuple):
    """One trace line."""

    timestamp: float  # arrival, in the trace's unit (milliseconds for Mooncake)
    input_length: int  # prompt tokens
    output_length: int  # generated tokens (not simulated)
    hash_ids: tuple[int, ...]  # one per 512-token block of the prompt


class ReplayProgress(NamedTuple):
    """What a progress callback receives (at most ~10 times a second, and at the end)."""

    phase: str  # "replay" or "infinite"
    done: int
    total: int
    hit_rate: float  # so far
    elapsed_s: float


ProgressFn = Callable[[ReplayProgress], None]


# ---------------------------------------------------------------------------- trace


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake-format JSON-lines trace.

    Args:
        path: the trace file (gzipped when its name ends in .gz); blank lines are skipped.
        limit: read at most this many requests (None: all).

    Returns:
        The requests, in file order.

    Raises:
        FileNotFoundError: no such file.
        ValueError: limit not positive, or a line that is not a valid request (the
            message names the file, the line number and the field).
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    requests: list[TraceRequest] = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if line.strip():
                requests.append(_parse_line(line, f"{path}:{lineno}"))
    return requests


def _parse_line(line: str, where: str) -> TraceRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not valid JSON: {error}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for name in TraceRequest._fields:
        if name not in row:
            raise ValueError(f"{where}: missing field {name!r}")
    timestamp = row["timestamp"]
    if not _is_number(timestamp) or not math.isfinite(timestamp) or timestamp < 0:
        raise ValueError(f"{where}: field 'timestamp' must be a number >= 0, got {timestamp!r}")
    input_length = row["input_length"]
    if not _is_int(input_length) or input_length < 1:
        raise ValueError(
            f"{where}: field 'input_length' must be an integer >= 1, got {input_length!r}"
        )
    output_length = row["output_length"]
    if not _is_int(output_length) or output_length < 0:
        raise ValueError(
            f"{where}: field 'output_length' must be an integer >= 0, got {output_length!r}"
        )
    hash_ids = row["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
        _is_int(h) and 0 <= h <= _MAX_HASH_ID for h in hash_ids
    ):
        raise ValueError(
            f"{where}: field 'hash_ids' must be a list of integers in [0, 2**63), got "
            f"{_clip(hash_ids)}"
        )
    needed = -(-input_length // TRACE_BLOCK_TOKENS)
    if len(hash_ids) != needed:
        raise ValueError(
            f"{where}: field 'hash_ids' has {len(hash_ids)} blocks but input_length "
            f"{input_length} needs {needed} blocks of {TRACE_BLOCK_TOKENS} tokens"
        )
    return TraceRequest(timestamp, input_length, output_length, tuple(hash_ids))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _clip(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ---------------------------------------------------------------------------- tokens


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _MUL1
    x = (x ^ (x >> np.uint64(27))) * _MUL2
    return x ^ (x >> np.uint64(31))


def _blocks(hash_ids: Sequence[int], block_tokens: int) -> np.ndarray:
    """The token blocks of `hash_ids`.  # (len(hash_ids), block_tokens) int32"""
    seeds = _mix64(np.asarray(hash_ids, dtype=np.uint64) ^ _SALT)  # (B,)
    steps = np.arange(1, block_tokens + 1, dtype=np.uint64) * _GAMMA  # (T,)
    return (_mix64(seeds[:, None] + steps[None, :]) % np.uint64(VOCAB)).astype(np.int32)


def block_tokens(hash_id: int, block_tokens: int = TRACE_BLOCK_TOKENS) -> np.ndarray:
    """The deterministic block of synthetic token ids (< VOCAB) that a hash id stands for.

    Args:
        hash_id: a trace hash id, in [0, 2**63).
        block_tokens: the block length.

    Returns:
        An int32 array of `block_tokens` token ids; equal hash ids give equal blocks.

    Raises:
        ValueError: hash_id out of range or block_tokens not positive.
    """
    if not _is_int(hash_id) or not 0 <= hash_id <= _MAX_HASH_ID:
        raise ValueError(f"hash_id must be an integer in [0, 2**63), got {hash_id!r}")
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    return _blocks([hash_id], block_tokens)[0]


def request_tokens(request: TraceRequest) -> np.ndarray:
    """A request's prompt: its blocks back to back, truncated to input_length (int32)."""
    blocks = _blocks(request.hash_ids, TRACE_BLOCK_TOKENS)
    assert blocks.size >= request.input_length, f"{request} has too few blocks"
    return blocks.reshape(-1)[: request.input_length]


# ---------------------------------------------------------------------------- replay


class _TraceShape(NamedTuple):
    """Figures of a trace that come from its hash ids alone."""

    blocks: int
    block_hits: int  # blocks whose whole prefix an earlier request had
    distinct_full_pages: int  # full pages the trace can ever publish (page_tokens pages)
    max_request_pages: int


def _trace_shape(requests: Sequence[TraceRequest], page_tokens: int) -> _TraceShape:
    # A block's chain id names its whole prefix (hash ids up to and including it), so
    # equal chain ids mean equal tokens up to the end of the block.
    chain_ids: dict[tuple[int, int], int] = {}
    # chain id -> most full pages ending inside that block (truncation may cut some)
    pages_ending: dict[int, int] = {}
    blocks = block_hits = max_pages = 0
    for request in requests:
        chain, n = -1, request.input_length
        max_pages = max(max_pages, -(-n // page_tokens))
        for b, hash_id in enumerate(request.hash_ids):
            key = (chain, hash_id)
            seen = chain_ids.get(key)
            if seen is None:
                seen = chain_ids[key] = len(chain_ids)
            else:
                block_hits += 1
            chain = seen
            start = b * TRACE_BLOCK_TOKENS
            end = min(start + TRACE_BLOCK_TOKENS, n)
            ending = end // page_tokens - start // page_tokens
            if ending > pages_ending.get(chain, 0):
                pages_ending[chain] = ending
        blocks += len(request.hash_ids)
    return _TraceShape(blocks, block_hits, sum(pages_ending.values()), max_pages)


class _Routing(NamedTuple):
    """How requests pick a worker (a policy of the registry), and whether workers copy in
    pages their peers hold."""

    policy: str
    copy_remote: bool


# What `--routing` takes: every routing policy (`cache_service.routing.POLICIES`), and
# "prefix", kvmesh's own under the name it had first. Round-robin replays what a team has
# without kvmesh: per-worker caches, nothing copied between them; every other policy
# replays the mesh (the global index, copies from peers).
ALIASES = {"prefix": "kvmesh"}
ROUTINGS = (*ALIASES, *POLICIES)


def _routing(name: str) -> _Routing:
    """The routing `--routing name` replays.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    policy = ALIASES.get(name, name)
    if policy not in POLICIES:
        raise ValueError(f"unknown routing {name!r}; known: {', '.join(ROUTINGS)}")
    return _Routing(policy, copy_remote=policy != "round-robin")


class _Served(NamedTuple):
    worker_id: str
    local: int
    remote: int


class _Cluster:
    """N simulated workers (real caches over real pools) and the index their events feed."""

    def __init__(
        self,
        workers: int,
        pages_per_worker: int,
        page_tokens: int,
        load_window: int,
        cluster_eviction: bool = True,
    ) -> None:
        config = PrefixCacheConfig(
            page_tokens=page_tokens,
            publish_decode_pages=False,
            cluster_eviction=cluster_eviction,
        )
        self.worker_ids = [f"w{i}" for i in range(workers)]
        self.caches = {
            worker_id: PrefixCache(PagePool(pages_per_worker), config)
            for worker_id in self.worker_ids
        }
        self.index = GlobalIndex(page_tokens=page_tokens, max_capacity=pages_per_worker)
        self.epochs = {
            worker_id: self.index.register(
                worker_id, node_id="replay", now=0.0, capacity=pages_per_worker
            ).epoch
            for worker_id in self.worker_ids
        }
        self.seqs = dict.fromkeys(self.worker_ids, 0)
        self.requests = dict.fromkeys(self.worker_ids, 0)
        self.computed = dict.fromkeys(self.worker_ids, 0)
        self._window: deque[tuple[str, int]] = deque()
        self._window_size = load_window
        self._recent = dict.fromkeys(self.worker_ids, 0)

    def loads(self) -> dict[str, float]:
        """Each worker's queue, in prompt tokens, as routing weighs it: what it computed
        over the last `load_window` requests beyond the workers' mean (what it would still
        have to compute, were the workers equally fast and fed at the mean rate)."""
        mean = sum(self._recent.values()) / len(self._recent)
        return {worker_id: max(0.0, work - mean) for worker_id, work in self._recent.items()}

    def serve(
        self, worker_id: str, tokens: np.ndarray, packed: bytes, copy_remote: bool
    ) -> _Served:
        """Acquire, publish and release one prompt on one worker; then ship its events."""
        cache = self.caches[worker_id]
        n = len(tokens)
        matched = 0
        if copy_remote:
            matched = self.index.match(NAMESPACE, packed, requester=worker_id).matched_tokens
        allocation = cache.acquire(tokens, NAMESPACE)
        assert allocation is not None, f"{n} tokens do not fit worker {worker_id}"
        local = self._own_prefix(worker_id, allocation, packed, n)
        remote = max(0, min(matched, n - 1) - local)
        allocation.publish(n)
        allocation.release()
        self._ship(worker_id)
        self._heartbeats()
        self._account(worker_id, n - local - remote)
        return _Served(worker_id, local, remote)

    def _heartbeats(self) -> None:
        """What each worker's heartbeat brings back: the index's notices of its pages that
        another worker has stored since (`PrefixCache.held_elsewhere`)."""
        for worker_id, cache in self.caches.items():
            pages, generations = self.index.held_elsewhere(worker_id, self.epochs[worker_id])
            if pages:
                cache.held_elsewhere(pages, generations)

    def _own_prefix(self, worker_id: str, allocation, packed: bytes, n: int) -> int:
        """Tokens of the prompt the worker reuses of its own: its cache's match (a tiered
        replay adds what it loads back from its disk)."""
        return allocation.cached_tokens

    def _ship(self, worker_id: str) -> None:
        events = self.caches[worker_id].take_events()
        if not events:
            return
        self.seqs[worker_id] += 1
        epoch = self.epochs[worker_id]
        result = self.index.apply_events(worker_id, epoch, self.seqs[worker_id], events)
        if not result.applied:
            raise RuntimeError(f"index refused {worker_id}'s events: {result}")

    def _account(self, worker_id: str, computed: int) -> None:
        self.requests[worker_id] += 1
        self.computed[worker_id] += computed
        self._window.append((worker_id, computed))
        self._recent[worker_id] += computed
        if len(self._window) > self._window_size:
            old_worker, old_computed = self._window.popleft()
            self._recent[old_worker] -= old_computed

    def check_integrity(self) -> None:
        for cache in self.caches.values():
            cache.check_integrity()
        self.index.check_integrity()


class _Totals:
    __slots__ = ("input", "local", "remote")

    def __init__(self) -> None:
        self.input = self.local = self.remote = 0

    @property
    def hit(self) -> int:
        return self.local + self.remote

    def rate(self, tokens: int) -> float:
        return tokens / self.input if self.input else 0.0


class _ProgressBar:
    """Carriage-return updates on stderr, at most ~10 a second."""

    def __init__(self, stream=None) -> None:
        self._stream = stream or sys.stderr
        self._last = -math.inf

    def __call__(self, progress: ReplayProgress) -> None:
        now = time.monotonic()
        final = progress.done == progress.total
        if not final and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = width * progress.done // max(progress.total, 1)
        bar = "#" * filled + "." * (width - filled)
        line = (
            f"\r{progress.phase:<8} [{bar}] {progress.done}/{progress.total} "
            f"hit {progress.hit_rate:.3f}  {progress.elapsed_s:.1f}s"
        )
        self._stream.write(line + ("\n" if final else ""))
        self._stream.flush()


class _Throttled:
    """Calls `fn` at most ~10 times a second, and always for the last request."""

    def __init__(self, fn: ProgressFn) -> None:
        self._fn = fn
        self._last = -math.inf

    def __call__(self, progress: ReplayProgress) -> None:
        now = time.monotonic()
        if progress.done == progress.total or now - self._last >= 0.1:
            self._last = now
            self._fn(progress)


def _run(
    cluster: _Cluster,
    requests: Sequence[TraceRequest],
    routing: _Routing,
    phase: str,
    report: ProgressFn | None,
) -> _Totals:
    totals = _Totals()
    started = time.perf_counter()
    for i, request in enumerate(requests):
        tokens = request_tokens(request)
        packed = pack_tokens(tokens)
        decision = cluster.index.route(NAMESPACE, packed, cluster.loads(), policy=routing.policy)
        assert decision.worker_id is not None, "every simulated worker is registered"
        served = cluster.serve(decision.worker_id, tokens, packed, routing.copy_remote)
        totals.input += request.input_length
        totals.local += served.local
        totals.remote += served.remote
        if report is not None:
            elapsed = time.perf_counter() - started
            report(ReplayProgress(phase, i + 1, len(requests), totals.rate(totals.hit), elapsed))
    cluster.check_integrity()
    return totals


def _evicted(cluster: _Cluster) -> int:
    return sum(cache.stats()["evictions"].get("evicted", 0) for cache in cluster.caches.values())


def replay(
    requests: Sequence[TraceRequest],
    workers: int,
    pages_per_worker: int,
    routing: str,
    page_tokens: int = TRACE_BLOCK_TOKENS,
    progress: bool | ProgressFn = False,
    load_window: int = LOAD_WINDOW,
    cluster_eviction: bool = True,
) -> dict[str, object]:
    """Replay requests through N simulated workers, then again through one infinite cache.

    See the module docstring for what one request does and how tokens are counted.

    Args:
        requests: the trace (e.g. from `load_trace`), served in order.
        workers: simulated workers, each with its own prefix cache.
        pages_per_worker: pages in each worker's pool.
        routing: a name of ROUTINGS: a routing policy, or "prefix" (kvmesh's).
        page_tokens: tokens per cache page.
        progress: True for a progress bar on stderr, or a callable given a
            ReplayProgress; False for silence.
        load_window: requests over which prefix routing measures each worker's load.
        cluster_eviction: workers evict the pages a peer has stored since first (as
            `cache.cluster_eviction` does); False: each by its own LRU alone.

    Returns:
        The figures: hit_rate, infinite_hit_rate, local_hit_rate, remote_hit_rate,
        requests, seconds, and extras (token totals, evictions, per-worker balance, the
        index's size, the trace's own infinite_block_hit_rate).

    Raises:
        ValueError: no requests, a non-positive count, an unknown routing (the known
            ones are named), or a request longer than a worker's pool.
    """
    chosen = _routing(routing)
    for name, value in (
        ("workers", workers),
        ("pages_per_worker", pages_per_worker),
        ("page_tokens", page_tokens),
        ("load_window", load_window),
    ):
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not requests:
        raise ValueError("no requests to replay")
    shape = _trace_shape(requests, page_tokens)
    if shape.max_request_pages > pages_per_worker:
        raise ValueError(
            f"a request of the trace needs {shape.max_request_pages} pages of {page_tokens} "
            f"tokens but a worker has only {pages_per_worker}"
        )
    if progress is True:
        report: ProgressFn | None = _ProgressBar()
    elif callable(progress):
        report = _Throttled(progress)
    else:
        report = None

    started = time.perf_counter()
    # Workers that copy nothing from each other keep their own copies (as `workers.share:
    # false` does): another's copy spares them nothing.
    cluster_eviction = cluster_eviction and chosen.copy_remote
    cluster = _Cluster(workers, pages_per_worker, page_tokens, load_window, cluster_eviction)
    totals = _run(cluster, requests, chosen, "replay", report)
    replay_s = time.perf_counter() - started
    index_stats = cluster.index.stats()
    figures_cluster = {
        "evicted_pages": _evicted(cluster),
        "index_pages": index_stats["pages"],
        "index_holdings": index_stats["holdings"],
        "requests_per_worker": dict(cluster.requests),
        "computed_tokens_per_worker": dict(cluster.computed),
    }
    del cluster, index_stats  # free the caches before building the infinite one

    # Every page the trace can publish, plus room for the largest request in flight.
    infinite_pages = shape.distinct_full_pages + shape.max_request_pages
    infinite = _Cluster(1, infinite_pages, page_tokens, load_window)
    infinite_totals = _run(infinite, requests, _routing("round-robin"), "infinite", report)
    assert _evicted(infinite) == 0, f"the infinite cache of {infinite_pages} pages evicted"
    del infinite
    seconds = time.perf_counter() - started

    hit_rate = totals.rate(totals.hit)
    infinite_hit_rate = infinite_totals.rate(infinite_totals.hit)
    return {
        "routing": routing,
        "cluster_eviction": cluster_eviction,
        "workers": workers,
        "pages_per_worker": pages_per_worker,
        "page_tokens": page_tokens,
        "requests": len(requests),
        "hit_rate": round(hit_rate, 6),
        "infinite_hit_rate": round(infinite_hit_rate, 6),
        "vs_infinite": round(hit_rate / infinite_hit_rate, 6) if infinite_hit_rate else None,
        "local_hit_rate": round(totals.rate(totals.local), 6),
        "remote_hit_rate": round(totals.rate(totals.remote), 6),
        "infinite_block_hit_rate": round(shape.block_hits / shape.blocks, 6),
        "input_tokens": totals.input,
        "hit_tokens": totals.hit,
        "local_hit_tokens": totals.local,
        "remote_hit_tokens": totals.remote,
        "computed_tokens": totals.input - totals.hit,
        "infinite_hit_tokens": infinite_totals.hit,
        "infinite_pages": infinite_pages,
        **figures_cluster,
        "replay_seconds": round(replay_s, 3),
        "seconds": round(seconds, 3),
    }


# ---------------------------------------------------------------------------- CLI


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `kvmesh replay` arguments to a (sub)parser."""
    parser.add_argument("trace", type=Path, help="Mooncake-format trace (JSON lines)")
    parser.add_argument("--workers", type=_positive_int, required=True, help="simulated workers")
    parser.add_argument(
        "--pages-per-worker", type=_positive_int, required=True, help="pages in each worker's pool"
    )
    parser.add_argument(
        "--routing", choices=ROUTINGS, required=True, help="how requests pick a worker"
    )
    parser.add_argument(
        "--page-tokens",
        type=_positive_int,
        default=TRACE_BLOCK_TOKENS,
        help=f"tokens per cache page (default {TRACE_BLOCK_TOKENS}, one trace block)",
    )
    parser.add_argument(
        "--limit", type=_positive_int, default=None, help="replay only the first K requests"
    )
    parser.add_argument(
        "--local-eviction",
        action="store_true",
        help="workers evict by their own LRU alone, not first what a peer holds too",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def main(args: argparse.Namespace) -> int:
    """Run `kvmesh replay`; prints a table (unless --json) and, last, one JSON line.

    A progress bar goes to stderr when it is a terminal and --json is not given.

    Returns:
        0 on success, 2 for a missing trace or an invalid trace or configuration (the
        reason goes to stderr).
    """
    path = Path(args.trace)
    if not path.is_file():
        print(f"kvmesh replay: error: trace file not found: {path}", file=sys.stderr)
        return 2
    try:
        requests = load_trace(path, limit=args.limit)
        figures = replay(
            requests,
            workers=args.workers,
            pages_per_worker=args.pages_per_worker,
            routing=args.routing,
            page_tokens=args.page_tokens,
            progress=not args.json and sys.stderr.isatty(),
            cluster_eviction=not args.local_eviction,
        )
    except ValueError as error:
        print(f"kvmesh replay: error: {error}", file=sys.stderr)
        return 2
    figures = {"trace": str(path), **figures}
    if not args.json:
        print(f"kvmesh replay: {path.name}, {args.workers} workers, {args.routing} routing")
        _print_table(figures)
    print(json.dumps(figures))
    return 0


def _print_table(figures: dict[str, object]) -> None:
    width = max(len(key) for key in figures)
    for key, value in figures.items():
        print(f"  {key:<{width}}  {value}")
