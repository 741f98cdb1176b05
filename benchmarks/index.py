"""`kvmesh bench index`: the global index alone, in one process, on the Mooncake
conversation trace: queries and events per second, with their p50 and p99.

The workload is the one the index is compared on against NVIDIA Dynamo's radix tree
(`../shared/anchors/dynamo-index/`), here without Dynamo, so the project's own figure can
be reproduced with the project's venv alone:

- the trace: `benchmarks/traces/mooncake_conversation_trace.jsonl.gz` (12,031 requests of
  the Mooncake project's FAST'25 conversation trace; a hash id is one page of 16 tokens,
  and the trace is prefix-consistent: a hash id names its whole prefix);
- 4 workers; request i goes to worker i % 4; for each request in trace order, one query
  of its whole page sequence (`GlobalIndex.match_packed`, with the routed worker as the
  requester: what the service's server calls), then one stored event (a one-event batch
  through `apply_events`) of the pages that worker did not hold yet, below the last page
  it held; no event when it held them all. Nothing is removed.

Each page's 16 token ids are derived from its hash id (distinct pages, distinct tokens).
Every query's matched depth per worker is checked against a plain replay of who holds
what. Repeats build a fresh index each; figures are medians over the repeats, and the
process runs pinned to one CPU when the machine allows it.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from benchmarks.replay import load_trace as load_requests
from cache_service.events import Namespace, PagesStored
from cache_service.index import GlobalIndex
from cache_service.tokens import PackedTokens

TRACE = Path(__file__).parent / "traces" / "mooncake_conversation_trace.jsonl.gz"
PAGE_TOKENS = 16
WORKERS = 4
VOCAB = 49_152
REPEATS = 3
NAMESPACE = Namespace("bench-index")


def load_trace(path: Path = TRACE, limit: int | None = None) -> list[list[int]]:
    """The hash ids of each request, in trace order."""
    return [list(request.hash_ids) for request in load_requests(path, limit)]


def page_tokens(hash_ids: np.ndarray) -> np.ndarray:
    """(pages, PAGE_TOKENS) int32 token ids for each hash id: a multiply-xorshift mix of
    (hash id, position), reduced to the vocabulary."""
    with np.errstate(over="ignore"):
        x = hash_ids.astype(np.uint64)[:, None] * np.uint64(0x9E3779B97F4A7C15)
        x = x + np.arange(1, PAGE_TOKENS + 1, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
        for shift, factor in ((31, 0x7FB5D329728EA185), (27, 0x81DADEF4BC2DD44D), (33, 1)):
            x = (x ^ (x >> np.uint64(shift))) * np.uint64(factor)
    return (x % np.uint64(VOCAB)).astype("<i4")


class Step(NamedTuple):
    """One request of the replay: its query, and the event its worker sends after."""

    worker: int
    query: bytes  # the prompt's packed int32 tokens
    depths: dict[int, int]  # worker -> pages it holds of this prompt (> 0 only)
    event: tuple[int | None, tuple[int, ...], bytes] | None  # (parent page, pages, tokens)


def plan(requests: list[list[int]]) -> list[Step]:
    """The replay, built once before any timing: queries, events and the ground truth."""
    parents: dict[int, int | None] = {}
    for ids in requests:
        for i, h in enumerate(ids):
            parent = ids[i - 1] if i else None
            if parents.setdefault(h, parent) != parent:
                raise ValueError(f"hash id {h} has two parents: the trace is not prefix-consistent")
    order = np.fromiter(parents, np.int64, len(parents))
    tokens = page_tokens(order)
    page = {int(h): tokens[k].tobytes() for k, h in enumerate(order)}
    if len(set(page.values())) != len(page):
        raise ValueError("two hash ids got the same page of tokens")
    held: list[dict[int, int]] = [{} for _ in range(WORKERS)]  # hash id -> the worker's page id
    steps = []
    for i, ids in enumerate(requests):
        worker = i % WORKERS
        depths = {}
        for w in range(WORKERS):
            depth = 0
            while depth < len(ids) and ids[depth] in held[w]:
                depth += 1
            if depth:
                depths[w] = depth
        mine, depth = held[worker], depths.get(worker, 0)
        event = None
        if depth < len(ids):
            new = ids[depth:]
            first = len(mine)
            pages = tuple(range(first, first + len(new)))
            mine.update(zip(new, pages, strict=True))
            parent = mine[ids[depth - 1]] if depth else None
            event = (parent, pages, b"".join(page[h] for h in new))
        steps.append(Step(worker, b"".join(page[h] for h in ids), depths, event))
    return steps


def replay(steps: list[Step]) -> dict[str, Any]:
    """One replay on a fresh index: per-call times, checked depths, the index's size."""
    index = GlobalIndex(page_tokens=PAGE_TOKENS, liveness_timeout_s=1e9)
    names = [f"w{w}" for w in range(WORKERS)]
    epochs = [index.register(name, "node-0", now=0.0).epoch for name in names]
    seqs = [0] * WORKERS
    batches = []  # built outside the timing, as a worker's publisher would have them
    for step in steps:
        if step.event is None:
            batches.append(None)
            continue
        parent, pages, data = step.event
        seqs[step.worker] += 1
        stored = PagesStored(NAMESPACE, parent, pages, (1,) * len(pages), PackedTokens(data))
        w = step.worker
        batches.append((names[w], epochs[w], seqs[w], (stored,)))
    match, apply, clock = index.match_packed, index.apply_events, time.perf_counter_ns
    query_ns, event_ns, results = [], [], []
    gc.collect()
    gc.disable()
    try:
        for step, batch in zip(steps, batches, strict=True):
            start = clock()
            result = match(NAMESPACE, step.query, names[step.worker])
            query_ns.append(clock() - start)
            results.append(result)
            if batch is not None:
                start = clock()
                applied = apply(*batch)
                event_ns.append(clock() - start)
                if not applied.applied:
                    raise RuntimeError(f"the index refused a batch: {applied.reason}")
    finally:
        gc.enable()
    wrong = 0
    for step, result in zip(steps, results, strict=True):
        found = {int(span.worker_id[1:]): len(span.page_ids) // 4 for span in result.spans}
        wrong += found != step.depths
        wrong += result.matched_tokens != PAGE_TOKENS * max(step.depths.values(), default=0)
    stats = index.stats()
    index.check_integrity()
    return {
        "query_ns": query_ns,
        "event_ns": event_ns,
        "wrong": wrong,
        "pages": stats["pages"],
        "holdings": stats["holdings"],
    }


def run(log=sys.stderr, repeats: int = REPEATS, limit: int | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the named figures (also the CLI's JSON line).

    Args:
        log: where progress goes.
        repeats: fresh replays of the whole trace (figures: medians over them).
        limit: replay only the first `limit` requests (a quick check of the harness).
    """
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    pinned = _pin_to_one_cpu()
    try:
        return _run(log, repeats, limit, pinned)
    finally:
        if allowed is not None:
            os.sched_setaffinity(0, allowed)


def _run(log, repeats: int, limit: int | None, pinned: int | None) -> dict[str, Any]:
    print(f"loading {TRACE.name}...", file=log)
    requests = load_trace(limit=limit)
    steps = plan(requests)
    events = sum(step.event is not None for step in steps)
    print(f"{len(steps)} queries, {events} events; {repeats} replays", file=log)
    runs = []
    for repeat in range(repeats):
        runs.append(replay(steps))
        r = runs[-1]
        print(
            f"replay {repeat}: query p50 {_quantile(r['query_ns'], 0.5) / 1e3:.1f} us, "
            f"event p50 {_quantile(r['event_ns'], 0.5) / 1e3:.1f} us, wrong {r['wrong']}",
            file=log,
        )
    last = runs[-1]

    def median(key: str, figure) -> float:
        return statistics.median(figure(r[key]) for r in runs)

    return {
        "requests": len(steps),
        "events": events,
        "pages": last["pages"],
        "holdings": last["holdings"],
        "repeats": repeats,
        "pinned_cpu": pinned,
        "queries_per_s": round(median("query_ns", lambda ns: len(ns) / (sum(ns) / 1e9))),
        "events_per_s": round(median("event_ns", lambda ns: len(ns) / (sum(ns) / 1e9))),
        "query_p50_us": round(median("query_ns", lambda ns: _quantile(ns, 0.5)) / 1e3, 2),
        "query_p99_us": round(median("query_ns", lambda ns: _quantile(ns, 0.99)) / 1e3, 2),
        "event_p50_us": round(median("event_ns", lambda ns: _quantile(ns, 0.5)) / 1e3, 2),
        "event_p99_us": round(median("event_ns", lambda ns: _quantile(ns, 0.99)) / 1e3, 2),
        "wrong_depths": sum(r["wrong"] for r in runs),
    }


def _quantile(values: list[int], q: float) -> float:
    return float(np.quantile(np.asarray(values), q)) if values else 0.0


def _pin_to_one_cpu() -> int | None:
    """Pin this process to the last CPU it may run on (the comparison's setting); which
    one, or None where the platform cannot pin."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu
