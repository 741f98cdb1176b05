"""The worker's scheduler and serving loop (`workers.serving.scheduler`,
`workers.serving.loop`) on the tiny model over a real page store and prefix cache:
batches, same-batch sharing, continuous batching, chunked prefill, preemption; every
output against the same request run alone. Generation over cached pages against HF's
own `generate`: greedy, stop tokens, seeded sampling, streaming, running out of pages;
and the real model (marked slow) reusing a long prefix."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import pytest
import torch

from cache_service.events import Namespace
from tests.workers.model_fixtures import (
    NS,
    hf_greedy,
    make_prompt,
    max_diff,
    reference_logits,
)
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.serving.batch_runner import BatchRunner, Chunk
from workers.serving.compaction import CompactionConfig, Compactor
from workers.serving.loop import ServingLoop
from workers.serving.model_loader import eos_token_ids, store_layout_for, tiny_llama
from workers.serving.sampling import Sampler, SamplingParams
from workers.serving.scheduler import CacheFull, Scheduler, SchedulerConfig
from workers.serving.sequence import Phase, Sequence
from workers.store.page_store import SharedPageStore
from workers.transfer.spot_check import SpotCheck, kv_error, tolerance

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
    page_tokens: int = P,
    **config,
) -> Iterator[Serving]:
    store = SharedPageStore.create(store_layout_for(model, pages, page_tokens), tag="sched")
    loop = None
    try:
        cache = PrefixCache(
            store, PrefixCacheConfig(page_tokens=page_tokens, chunk_tokens=chunk_tokens)
        )
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


def seq(
    prompt: list[int], new: int = 6, sampling: SamplingParams | None = None, **kwargs
) -> Sequence:
    return Sequence(next(_ids), list(prompt), NS, new, Sampler(sampling), **kwargs)


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


@pytest.mark.parametrize("sharing", [True, False])
def test_requests_that_arrived_apart_but_are_admitted_together_share_their_prefix(tiny, sharing):
    prefix = make_prompt(32, seed=2)
    prompts = [prefix + make_prompt(6, seed=20 + i, low=200, high=256) for i in range(3)]
    other = Namespace("m", "", "another-tenant")
    store = SharedPageStore.create(store_layout_for(tiny, 96, P), tag="apart")
    try:
        cache = PrefixCache(store, PrefixCacheConfig(page_tokens=P))
        scheduler = Scheduler(cache, SchedulerConfig(batch_sharing=sharing))
        first, second, third = (seq(p) for p in prompts)
        elsewhere = Sequence(next(_ids), prompts[0], other, 6, Sampler(None))
        for group in ([first], [second], [elsewhere], [third]):  # four callers, one by one
            scheduler.add(group)
        step = scheduler.schedule()
        if sharing:
            # The first two admitted as one plan: the second waits for the prefix the first
            # computes. The third's namespace differs: the merge stops there (in order).
            assert second.depends_on == [first] and step.sequences == [first, elsewhere, third]
            assert [len(c.tokens) for c in step.chunks] == [38, 38, 38]
            assert third.depends_on == []
        else:
            assert step.sequences == [first, second, elsewhere, third]
            assert second.depends_on == []
        scheduler.fail_all(RuntimeError("the test ends here"))
        assert all(s.phase is Phase.FINISHED for s in (first, second, third, elsewhere))
        scheduler.check_integrity()
        cache.check_integrity()
    finally:
        store.close()


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


def test_the_load_counts_the_most_decode_steps_any_sequence_has_left(tiny):
    first, second = make_prompt(10, seed=3), make_prompt(12, seed=4)
    with serving(tiny) as s:
        loads: list[dict[str, int]] = []
        late = seq(second, 4)

        def on_token(token: int) -> None:
            if not loads:
                s.loop.submit([late])  # queued behind `early`, 4 tokens to decode
            loads.append(s.scheduler.load())

        early = seq(first, 12, on_token=on_token)
        s.run([early])
        late.result(timeout_s=60)
        # At early's first token: 11 steps left to it, late's 12 prompt tokens queued.
        assert loads[0] == {"running": 1, "waiting": 1, "queued_tokens": 12, "decode_steps": 11}
        assert [load["decode_steps"] for load in loads[-3:]] == [2, 1, 0]
        assert s.scheduler.load() == dict.fromkeys(loads[0], 0)
        s.check_integrity()


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


# ---------------------------------------------------------------------------- generation

FILLER = make_prompt(8, seed=99, low=200, high=256)  # never equal to a prompt token


def test_generation_over_cached_pages_equals_hf_greedy_and_its_answer_is_reused(tiny):
    prompt = make_prompt(22, seed=1)
    with serving(tiny) as s:
        s.run([seq(prompt[:13] + FILLER, 1)])  # leaves 13 of the prompt's tokens cached
        (done,) = s.run([seq(prompt, 8)])
        assert done.hits == (13, 0)  # three full pages and one token copied on write
        assert done.output == hf_greedy(tiny, prompt, 8, eos_token_id=None)
        assert done.finish_reason == "length"
        # Every answer token but the last (never run) had its KV written, across two page
        # boundaries, and published: a follow-up turn reuses every full page of it, and
        # its logits over those pages are a full prefill's.
        turn = prompt + done.output[:-1] + FILLER[:3]
        (follow_up,) = s.run([seq(turn, 1, return_logits=True)])
        assert follow_up.hits == (28, 0)
        assert max_diff(follow_up.logits, reference_logits(tiny, turn)) < 1e-4
        s.check_integrity()


@pytest.mark.parametrize(
    ("seed", "finish"), [(4, "stop"), (1, "length"), (6, "stop"), (3, "length")]
)
def test_greedy_with_the_models_eos_equals_hf_generate(tiny, seed, finish):
    prompt = make_prompt(22, seed=seed)
    # HF stops at the model's EOS (the tiny config's default, id 2), so the request is
    # given the same stop tokens, as the worker gives it.
    stops = eos_token_ids(tiny)
    with serving(tiny) as s:
        s.run([seq(prompt[:9] + FILLER, 1)])
        (done,) = s.run([seq(prompt, 12, stops=stops)])
        assert done.hits == (9, 0)
        expected = hf_greedy(tiny, prompt, 12)
        assert done.output == expected
        assert done.finish_reason == finish
        assert (expected[-1] in stops) == (finish == "stop")
        s.check_integrity()


@pytest.mark.parametrize("earliest", [0, 5], ids=["first-token", "later"])
def test_a_stop_token_ends_generation_as_hf_eos_does_and_is_never_run(tiny, earliest):
    prompt = make_prompt(22, seed=1)
    greedy = hf_greedy(tiny, prompt, 12, eos_token_id=None)
    assert len(greedy) == 12
    # the first token at or after `earliest` not seen before, so it first appears there
    k = next(i for i in range(earliest, 12) if greedy[i] not in greedy[:i])
    stop = greedy[k]
    with serving(tiny) as s:
        (done,) = s.run([seq(prompt, 12, stops=frozenset({stop}))])
        assert done.finish_reason == "stop"
        assert done.output == greedy[: k + 1]
        assert done.output == hf_greedy(tiny, prompt, 12, eos_token_id=stop)
        # returned, but never run: the prompt, then one decode step per token before it
        assert s.runner.tokens_run == len(prompt) + k
        s.check_integrity()


def test_a_sequence_that_cannot_grow_with_nothing_else_running_finishes_out_of_pages(tiny):
    prompt = make_prompt(8, seed=4)  # exactly two pages, and the store has only two
    with serving(tiny, pages=2) as s:
        (done,) = s.run([seq(prompt, 4)])
        assert done.finish_reason == "out_of_pages"
        assert done.output == hf_greedy(tiny, prompt, 1, eos_token_id=None)
        assert s.scheduler.preemptions == 0
        assert s.cache.stats()["in_use_pages"] == 0
        s.check_integrity()


SAMPLING = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)


def test_seeded_sampling_is_the_same_cold_and_over_cached_pages(tiny):
    """The cached run's logits come from gathered pages, not a full prefill: equal to
    ~1e-5, not bit for bit. The seeded tokens must not care."""
    prompt = make_prompt(22, seed=5)
    with serving(tiny) as s:
        (cold,) = s.run([seq(prompt, 12, SAMPLING, return_logits=True)])
        (cached,) = s.run([seq(prompt, 12, SAMPLING, return_logits=True)])
        assert (cold.hits, cached.hits) == ((0, 0), (21, 0))
        assert max_diff(cold.logits, cached.logits) < 1e-4
        assert cold.output == cached.output and len(cold.output) == 12
        other_seed = SamplingParams.from_dict(SAMPLING.to_dict() | {"seed": 4321})
        (other,) = s.run([seq(prompt, 12, other_seed)])
        assert other.output != cold.output
        s.check_integrity()


@pytest.mark.parametrize("stop", [False, True], ids=["length", "stop"])
def test_on_token_hands_each_token_over_before_the_next_pass(tiny, stop):
    prompt = make_prompt(22, seed=6)
    greedy = hf_greedy(tiny, prompt, 8, eos_token_id=None)
    k = next(i for i in range(2, 8) if greedy[i] not in greedy[:i])
    stops = frozenset({greedy[k]}) if stop else frozenset()
    with serving(tiny) as s:
        seen: list[tuple[int, int]] = []  # (token, forward passes run when it came)

        def on_token(token: int) -> None:
            seen.append((token, s.runner.calls))

        (done,) = s.run([seq(prompt, 8, stops=stops, on_token=on_token)])
        expected = greedy[: k + 1] if stop else greedy
        assert done.output == expected
        # token i comes after pass i + 1 (the prefill, then i decode steps), before the next
        assert seen == [(token, i + 1) for i, token in enumerate(expected)]
        s.check_integrity()


def test_an_on_token_error_fails_its_request_only_with_the_pages_whole(tiny):
    prompt, other = make_prompt(22, seed=7), make_prompt(10, seed=8)

    def on_token(token: int) -> None:
        raise RuntimeError(f"client gone at {token}")

    with serving(tiny) as s:
        failing, going = seq(prompt, 8, on_token=on_token), seq(other, 4)
        s.loop.submit([failing, going])
        with pytest.raises(RuntimeError, match="client gone"):
            failing.result(timeout_s=60)
        assert failing.output == hf_greedy(tiny, prompt, 1, eos_token_id=None)
        assert going.result(timeout_s=60).output == hf_greedy(tiny, other, 4, eos_token_id=None)
        assert s.loop.alive and s.cache.stats()["in_use_pages"] == 0
        # The prompt's full pages, published as its prefill wrote them, hold its KV.
        (again,) = s.run([seq(prompt, 1, return_logits=True)])
        assert again.hits == (20, 0)
        assert max_diff(again.logits, reference_logits(tiny, prompt)) < 1e-4
        s.check_integrity()


# ---------------------------------------------------------------------------- SmolLM2

CHAT = [
    {
        "role": "system",
        "content": "You are a careful assistant for a team that runs LLM inference services. "
        "Answer in plain English, in short paragraphs, and say when you are unsure. "
        "The team cares about latency, memory, and correctness above all else.",
    },
    {
        "role": "user",
        "content": "Our service keeps the attention keys and values of every prompt in fixed "
        "size pages of shared memory. When a new prompt starts with the same tokens as an "
        "earlier one, a worker copies those pages instead of computing them again, and only "
        "runs the model on the rest of the prompt. Pages are indexed in a trie keyed by the "
        "exact token ids, so two prompts share a page only when every token in it matches. "
        "Workers on other machines can fetch pages over the network from the worker that "
        "holds them, and a central service tracks which worker holds which prefix. "
        "Each page carries a generation counter that changes when the page is freed or "
        "rewritten, so a reader can tell a stale copy from a good one. Explain in three "
        "sentences why reusing cached pages reduces the time to the first token, and what "
        "could go wrong if the page index matched prompts by hash alone without comparing "
        "the tokens. Then list two ways a worker could check that a copied page is still "
        "valid after the copy, and say which one you would choose for a cluster where "
        "workers come and go every few minutes and the network sometimes drops messages. "
        "Keep the whole answer under two hundred words.",
    },
]


@pytest.mark.slow
def test_smollm2_reuses_a_250_token_prefix(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    prompt = list(prompt)
    assert len(prompt) >= 290, f"chat prompt has {len(prompt)} tokens, 290 wanted"
    other_ending = tokenizer.encode(" Please answer in French instead.")
    with serving(model, pages=48, page_tokens=16) as s:
        s.run([seq(prompt[:250] + other_ending, 1)])
        (done,) = s.run([seq(prompt, 8, return_logits=True)])
        assert done.hits == (250, 0)  # 15 full pages and 10 tokens copied on write
        assert max_diff(done.logits, reference_logits(model, prompt)) < 1e-4
        assert done.output == hf_greedy(model, prompt, 8)
        print(
            f"\nSmolLM2 {len(prompt)}-token chat prompt, 250 cached: first token after "
            f"{done.first_token_at - done.admitted_at:.3f} s; 8 tokens "
            f"{tokenizer.decode(done.output)!r}",
            file=sys.stderr,
        )
        s.check_integrity()


def test_a_spot_checked_copy_leaves_every_other_sequence_its_own_chunk_and_logits(tiny):
    """A copy's spot check rides in the pass after every sequence's chunk: the sequences
    admitted beside it keep their own chunks, and each is sampled from its own row."""
    copied, short, long = (
        make_prompt(24, seed=40),
        make_prompt(9, seed=41),
        make_prompt(30, seed=42),
    )
    judged = []

    def copy_in(seq: Sequence) -> int:
        if seq.prompt != copied:
            return seq.allocation.cached_tokens
        # The first 4 pages from a holder: the same prompt computed under another tenant.
        pages = seq.allocation.pages
        for page, source in zip(pages[:4], donor.pages[:4], strict=True):
            store.write_page(page, store.page(source).clone())
        slot = store.page(pages[3])[:, :, :, P - 1]
        held = slot.clone()

        def judge() -> bool:
            judged.append(kv_error(held, slot))
            return judged[-1] <= tolerance("float32")

        seq.checks.append(SpotCheck(4 * P - 1, judge))
        return 4 * P

    store = SharedPageStore.create(store_layout_for(tiny, 96, P), tag="copied")
    try:
        cache = PrefixCache(store, PrefixCacheConfig(page_tokens=P))
        scheduler = Scheduler(cache, SchedulerConfig(copy_threads=3), copy_in=copy_in)
        runner = BatchRunner(tiny, store)  # the passes are run here, one by one
        donor = cache.acquire(copied, Namespace(NS.model, "", "holder"))
        runner.forward([Chunk(donor.pages, copied, 0)])
        batch = [seq(copied, 1), seq(long, 1), seq(short, 1)]
        for x in batch:
            x.checks = []
        scheduler.add(batch)
        assert not scheduler.schedule().chunks  # admitted: copying
        for x in batch:
            x.copying.result(timeout=30)
        step = scheduler.schedule()
        assert step.sequences == batch and len(step.checks) == 1
        assert [(c.start, c.end) for _, c in step.pairs()] == [(16, 24), (0, 30), (0, 9)]
        logits = runner.forward(step.chunks)
        scheduler.after_forward(step)
        assert judged and judged[0] <= tolerance("float32")
        assert [x.computed for x in batch] == [24, 30, 9]
        assert [x.hits for x in batch] == [(0, 16), (0, 0), (0, 0)]
        for x, row in zip(batch, logits, strict=False):
            assert max_diff(row, alone(tiny, x.prompt)[1]) < 1e-4
            scheduler.finish(x, "length")
        donor.release()
        scheduler.check_integrity()
        cache.check_integrity()
        store.check_integrity()
        scheduler.close()
    finally:
        store.close()
