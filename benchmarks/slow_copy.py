"""A copy from a slow peer must not slow the sequences decoding beside it: part of
`kvmesh bench batch` (`decode_step_slowdown_during_slow_copy`).

Two workers in this process, SmolLM2-135M on the CPU, with a real service: the holder
computes a 512-token prompt and publishes it; the copier decodes STREAMS sequences of
its own (streams, each token timed as it comes), and, once they are under way, is sent
the holder's prompt, which it copies (copy policy "always") through a page source
slowed by COPY_DELAY_S per fetch (`benchmarks.faults.slow_peer`: a slow link). The
figure is the mean time between two tokens of a decoding sequence while that copy is in
flight, over the same before it started (target at most 1.2). A copy run on the serving
thread would hold every decoding sequence for the copy's whole duration.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from typing import Any

from benchmarks.faults import slow_peer
from cache_service.server import ServerConfig, make_server
from workers.cache.prefix_cache import PrefixCacheConfig
from workers.worker import Worker, WorkerSettings

PAGE_TOKENS = 16
SHARED_TOKENS = 512  # the prompt the copier copies from the holder
STREAMS = 4  # sequences decoding on the copier meanwhile
STREAM_PROMPT_TOKENS = 64
STREAM_NEW_TOKENS = 160
COPY_DELAY_S = 2.0
BASELINE_S = 1.5  # decoding timed before the copy starts


def _worker(service, worker_id: str, model: Any) -> Worker:
    settings = WorkerSettings(
        worker_id=worker_id,
        node_id="bench",
        host="127.0.0.1",
        model="smollm2-135m",
        num_pages=256,
        cache=PrefixCacheConfig(page_tokens=PAGE_TOKENS),
        service_address=service.address,
        publish_interval_s=1.0,  # heartbeats keep both in the service's index
        copy_policy="always",
    )
    return Worker(settings, model=model, tokenizer=None)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40_000) for _ in range(n)]


def run(model: Any, log) -> dict[str, Any]:
    """Decode on the copier with and without a slow copy in flight; the figures."""
    rng = random.Random(11)
    service = make_server(ServerConfig(page_tokens=PAGE_TOKENS))
    service.start()
    workers: list[Worker] = []
    try:
        holder, copier = _worker(service, "holder", model), _worker(service, "copier", model)
        workers += [holder, copier]
        infos = [holder.info(), copier.info()]
        holder.set_peers(infos)
        copier.set_peers(infos)
        shared = _tokens(rng, SHARED_TOKENS)
        holder.generate(shared, 1)
        assert holder.flush(), "the holder's pages did not reach the service"
        stamps: list[list[float]] = [[] for _ in range(STREAMS)]

        def decode(lane: int) -> None:
            request = copier.request(
                _tokens(rng, STREAM_PROMPT_TOKENS), STREAM_NEW_TOKENS, ignore_eos=True
            )
            for item in copier.stream(request):
                if not item.last:
                    stamps[lane].append(time.perf_counter())

        lanes = [threading.Thread(target=decode, args=(i,)) for i in range(STREAMS)]
        for lane in lanes:
            lane.start()
        while min(len(s) for s in stamps) < 2:  # every stream past its prefill
            time.sleep(0.01)
        time.sleep(BASELINE_S)
        sources = slow_peer(copier, COPY_DELAY_S)
        copy_started = time.perf_counter()
        print(f"  copying {SHARED_TOKENS} tokens from a peer {COPY_DELAY_S:g}s slow...", file=log)
        copied = copier.generate(shared, 1)
        copy_ended = max([copy_started, *(s.returned_at for s in sources)])
        for lane in lanes:
            lane.join()
        before = _intervals(stamps, stamps_start(stamps), copy_started)
        during = _intervals(stamps, copy_started, copy_ended)
        for w in workers:
            w.check_integrity()
        return {
            "decode_step_s_without_copy": round(statistics.mean(before), 4),
            "decode_step_s_during_slow_copy": round(statistics.mean(during), 4),
            "decode_step_slowdown_during_slow_copy": round(
                statistics.mean(during) / statistics.mean(before), 3
            ),
            "slow_copy_s": round(copy_ended - copy_started, 2),
            "slow_copy_remote_hit_tokens": copied.stats.remote_hit_tokens,
        }
    finally:
        for w in workers:
            w.shutdown()
        service.stop()


def stamps_start(stamps: list[list[float]]) -> float:
    """When every stream had its first two tokens (decoding under way)."""
    return max(s[1] for s in stamps)


def _intervals(stamps: list[list[float]], start: float, end: float) -> list[float]:
    """Time between consecutive tokens of each stream, for the intervals that overlap
    [start, end] (a stall spanning the whole window counts whole)."""
    return [
        b - a
        for lane in stamps
        for a, b in zip(lane, lane[1:], strict=False)
        if a < end and b > start
    ]
