"""The worker's scheduler and serving loop (`workers.serving.scheduler`,
`workers.serving.loop`) on the tiny model over a real page store and prefix cache:
batches, same-batch sharing, continuous batching, chunked prefill, preemption; every
output against the same request run alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import pytest
import torch

from tests.workers.model_fixtures import NS, make_prompt, max_diff
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.serving.batch_runner import BatchRunner
from workers.serving.compaction import CompactionConfig, Compactor
from workers.serving.loop import ServingLoop
from workers.serving.model_runner import store_layout_for, tiny_llama
from workers.serving.sampling import Sampler
from workers.serving.scheduler import CacheFull, Scheduler, SchedulerConfig
from workers.serving.sequence import Phase, Sequence
from workers.store.page_store import SharedPageStore

P = 4


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(seed=5)


class Serving(NamedTuple):
    loop: ServingLoop
    scheduler: Scheduler
    runner: BatchRunner
    cache: PrefixCache
    store: SharedPageStore

    def run(self, sequences: list[Sequence]) -> list[Sequence]:
        self.loop.submit(sequences)
        for seq in sequences:
            seq.result(timeout_s=60)
        return sequences

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        self.cache.check_integrity()
        self.store.check_integrity()


@contextmanager
def serving(
    model,
    pages: int = 96,
    chunk_tokens: int = 0,
    compaction: CompactionConfig | None = None,
    **config,
) -> Iterator[Serving]:
    store = SharedPageStore.create(store_layout_for(model, pages, P), tag="sched")
    loop = None
    try:
        cache = PrefixCache(store, PrefixCacheConfig(page_tokens=P, chunk_tokens=chunk_tokens))
        compactor = None if compaction is None else Compactor(store, compaction)
        scheduler = Scheduler(cache, SchedulerConfig(**config), compactor=compactor)
        runner = BatchRunner(model, store)

        def check(step, seconds) -> None:  # every pass: compacted layouts stay whole
            scheduler.check_integrity()
            cache.check_integrity()

        loop = ServingLoop(runner, scheduler, on_pass=check if compactor else None)
        yield Serving(loop, scheduler, runner, cache, store)
    finally:
        if loop is not None:
            loop.stop()
        store.close()


_ids = iter(range(10**9))


def seq(prompt: list[int], new: int = 6, **kwargs) -> Sequence:
    return Sequence(next(_ids), list(prompt), NS, new, Sampler(None), **kwargs)


def alone(model, prompt: list[int], new: int = 6) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and last-prompt logits of the request run by itself, uncached."""
    with serving(model) as s:
        (done,) = s.run([seq(prompt, new, reuse=False, return_logits=True)])
        return done.output, done.logits


def test_one_request_equals_hf_greedy(tiny):
    prompt = make_prompt(21, seed=1)
    with serving(tiny) as s:
        (done,) = s.run([seq(prompt, 8, return_logits=True)])
        assert done.finish_reason == "length" and done.phase is Phase.FINISHED
        expected = tiny.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None
        )[0, len(prompt) :].tolist()
        assert done.output == expected
        with torch.inference_mode():
            reference = tiny(torch.tensor([prompt])).logits[0, -1]
        assert max_diff(done.logits, reference) < 1e-4
        s.check_integrity()


def test_a_batch_computes_its_shared_prefix_once_and_matches_each_request_alone(tiny):
    prefix = make_prompt(32, seed=2)
    suffixes = [make_prompt(6, seed=10 + i, low=200, high=256) for i in range(4)]
    prompts = [prefix + suffix for suffix in suffixes]
    with serving(tiny) as s:
        batch = s.run([seq(p) for p in prompts])
        # Pass 1: the first request's whole prompt; pass 2: the other suffixes (and the
        # first one's first decode token); then decode steps.
        prefill_run = s.runner.tokens_run - sum(len(d.output) - 1 for d in batch)
        assert prefill_run == 32 + 4 * 6
        assert [d.batch_shared for d in batch] == [0, 32, 32, 32]
        assert [d.hits for d in batch] == [(0, 0)] * 4  # computed once is not a hit
        assert s.cache.stats()["batch_shared_tokens"] == 3 * 32
        s.check_integrity()
    for done, prompt in zip(batch, prompts, strict=True):
        output, logits = alone(tiny, prompt)
        assert done.output == output


def test_without_sharing_each_request_computes_its_whole_prompt(tiny):
    prefix = make_prompt(32, seed=2)
    prompts = [prefix + make_prompt(6, seed=10 + i, low=200, high=256) for i in range(4)]
    with serving(tiny, batch_sharing=False) as s:
        batch = s.run([seq(p) for p in prompts])
        prefill_run = s.runner.tokens_run - sum(len(d.output) - 1 for d in batch)
        assert prefill_run == 4 * 38
        s.check_integrity()
    for done, prompt in zip(batch, prompts, strict=True):
        assert done.output == alone(tiny, prompt)[0]


def test_a_request_arriving_while_others_decode_joins_the_next_pass(tiny):
    first, second = make_prompt(10, seed=3), make_prompt(12, seed=4)
    with serving(tiny) as s:
        started = threading.Event()
        late = seq(second, 4)

        def on_token(token: int) -> None:
            if not started.is_set():
                started.set()
                s.loop.submit([late])  # arrives while `early` decodes

        early = seq(first, 12, on_token=on_token)
        s.run([early])
        late.result(timeout_s=60)
        # Both ran in the same passes: fewer passes than the two one after the other.
        assert s.runner.calls < (1 + 11) + (1 + 3)
        s.check_integrity()
    assert early.output == alone(tiny, first, 12)[0]
    assert late.output == alone(tiny, second, 4)[0]


def test_chunked_prefill_interleaves_with_decode_and_equals_unchunked(tiny):
    long_prompt, short_prompt = make_prompt(30, seed=6), make_prompt(5, seed=7)
    with serving(tiny, prefill_chunk_tokens=8) as s:
        decoding = seq(short_prompt, 10)
        long = seq(long_prompt, 4, return_logits=True)

        def on_token(token: int) -> None:
            if len(decoding.output) == 1:
                s.loop.submit([long])

        decoding.on_token = on_token
        s.run([decoding])
        long.result(timeout_s=60)
        s.check_integrity()
    output, logits = alone(tiny, long_prompt, 4)
    assert long.output == output and max_diff(long.logits, logits) < 1e-4
    assert decoding.output == alone(tiny, short_prompt, 10)[0]


def test_chunk_alignment_rounds_hits_down_and_counts_what_it_lost(tiny):
    prompt = make_prompt(29, seed=8)
    with serving(tiny, chunk_tokens=8, prefill_chunk_tokens=8) as s:
        s.run([seq(prompt[:22])])  # its 22 prompt tokens are cached (2 in a partial page)
        (again,) = s.run([seq(prompt)])
        assert again.hits == (16, 0)  # 22 cached, rounded down to a chunk boundary
        assert s.cache.stats()["alignment_lost_tokens"] == 6
        s.check_integrity()
    assert again.output == alone(tiny, prompt)[0]


def test_the_newest_sequence_is_preempted_when_pages_run_out_and_recomputed(tiny):
    prompts = [make_prompt(8, seed=20 + i) for i in range(3)]
    # 3 sequences of 8 + 24 tokens need 24 pages; 14 hold two of them at most.
    with serving(tiny, pages=14) as s:
        batch = s.run([seq(p, 24) for p in prompts])
        assert s.scheduler.preemptions >= 1
        assert batch[-1].preemptions >= 1 and batch[0].preemptions == 0
        assert batch[-1].recomputed > 0
        assert all(d.hits == (0, 0) for d in batch)  # recomputed tokens are no hits
        assert all(d.finish_reason == "length" for d in batch)
        s.check_integrity()
    for done, prompt in zip(batch, prompts, strict=True):
        assert done.output == alone(tiny, prompt, 24)[0]


def test_a_request_that_cannot_fit_alone_fails_and_the_rest_go_on(tiny):
    with serving(tiny, pages=8) as s:
        big, small = seq(make_prompt(40, seed=30)), seq(make_prompt(6, seed=31), 2)
        s.loop.submit([big])
        with pytest.raises(CacheFull, match="40 tokens do not fit in 8 pages of 4"):
            big.result(timeout_s=60)
        (done,) = s.run([small])
        assert len(done.output) == 2
        s.check_integrity()


@pytest.mark.parametrize("policy", ["streaming_llm", "h2o", "snapkv"])
def test_under_pressure_the_longest_sequences_are_compacted_instead_of_preempted(tiny, policy):
    prompts = [make_prompt(8, seed=40 + i) for i in range(3)]
    # The preemption case above: 3 sequences of 8 + 24 tokens in 14 pages. Past 70% of
    # the store, each keeps 4 decoded tokens per head (one page of lanes) every 4 tokens,
    # and all three run to the end.
    compaction = CompactionConfig(policy=policy, budget=4, high_water=0.7, min_tokens=4, window=4)
    with serving(tiny, pages=14, compaction=compaction) as s:
        batch = s.run([seq(p, 24) for p in prompts])
        assert s.scheduler.preemptions == 0
        assert s.scheduler.compactions >= 3 and s.scheduler.compacted_pages_freed >= 6
        assert sum(d.compacted_pages_freed for d in batch) == s.scheduler.compacted_pages_freed
        assert all(d.finish_reason == "length" and len(d.output) == 24 for d in batch)
        assert s.cache.stats()["compacted_pages_freed"] == s.scheduler.compacted_pages_freed
        # Nothing compacted was published: the cache holds the prompts' full pages only.
        assert s.cache.num_cached_pages == 3 * 2
        s.check_integrity()


def test_compaction_that_keeps_everything_changes_no_token(tiny):
    prompts = [make_prompt(8, seed=20 + i) for i in range(3)]
    compaction = CompactionConfig(policy="h2o", budget=1.0, high_water=0.5, min_tokens=4)
    with serving(tiny, pages=40, compaction=compaction) as s:
        batch = s.run([seq(p, 24) for p in prompts])
        assert s.scheduler.compactions >= 3
        s.check_integrity()
    for done, prompt in zip(batch, prompts, strict=True):
        assert done.output == alone(tiny, prompt, 24)[0]
