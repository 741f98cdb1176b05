"""`kvmesh bench batch`: one worker's batches with same-batch prefix sharing, without it,
and one request at a time.

Sixteen requests share a 1,024-token system prompt nobody has cached, each with a
64-token question of its own, and ask for 32 new tokens (greedy), SmolLM2-135M on the
CPU. They are served by the worker's own serving components (`workers.serving.scheduler`,
`workers.serving.loop`, `workers.serving.batch_runner` over a shared-memory page store and the local
prefix cache: what a worker runs, without the service around it), each run from an
empty cache:

  (a) all sixteen submitted at once, same-batch sharing on: the first request computes
      the system prompt, the other fifteen only their questions;
  (b) all at once, sharing off: every request computes its whole prompt, as engines
      without same-batch sharing do;
  (c) one by one, each waiting for the one before.

What the model ran is counted by hooks on the model itself (its rotary embedding sees
every token's position in every forward call): `computed_ratio` is the prompt tokens run
in (a) over the prompt tokens of the batch (about (1,024 + 16 x 64) / (16 x 1,088) =
0.12), `forward_calls_prefill` the forward calls of (a) that ran prompt tokens.
`speedup_vs_no_sharing` is the wall time of (b) over (a); `tokens_per_s_*` the new
tokens of each run over its wall time; `mismatches` the requests whose tokens differ
between (a), (b) and (c).

Then a copy from a slow peer beside decoding sequences (`benchmarks.slow_copy`):
`decode_step_slowdown_during_slow_copy` is the decode step time of running sequences
while another request copies from a slow peer, over the step time without that copy.
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any

import torch

from benchmarks import slow_copy
from cache_service.events import Namespace
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.serving.batch_runner import BatchRunner
from workers.serving.loop import ServingLoop
from workers.serving.model_loader import load_smollm2, store_layout_for
from workers.serving.sampling import Sampler
from workers.serving.scheduler import Scheduler, SchedulerConfig
from workers.serving.sequence import Sequence
from workers.store.page_store import SharedPageStore

REQUESTS = 16
PREFIX_TOKENS = 1024
QUESTION_TOKENS = 64
NEW_TOKENS = 32
PAGE_TOKENS = 16
NAMESPACE = Namespace("smollm2-135m", "", "bench-batch")


class ForwardCounter:
    """Counts what the model runs, from a hook on its rotary embedding (called once per
    forward with every token's position): calls, tokens, and prompt tokens (positions
    before the prompt's end; every prompt here has the same length)."""

    def __init__(self, model: Any, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.calls = 0
        self.tokens = 0
        self.prefill_tokens = 0
        self.prefill_calls = 0
        self._handle = model.model.rotary_emb.register_forward_pre_hook(self._seen)

    def _seen(self, module: Any, args: tuple) -> None:
        positions = args[1]  # (1, T)
        prompt = int((positions < self.prompt_tokens).sum())
        self.calls += 1
        self.tokens += positions.numel()
        self.prefill_tokens += prompt
        self.prefill_calls += prompt > 0

    def close(self) -> None:
        self._handle.remove()


def _prompts(seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    # Ordinary vocabulary ids (SmolLM2's specials sit at the start of its vocabulary).
    system = [rng.randrange(1000, 40_000) for _ in range(PREFIX_TOKENS)]
    return [system + [rng.randrange(1000, 40_000) for _ in range(QUESTION_TOKENS)]
            for _ in range(REQUESTS)]  # fmt: skip


def _serve(model, prompts: list[list[int]], sharing: bool, together: bool) -> dict[str, Any]:
    """One run from an empty store: the outputs, wall time and what the model ran."""
    total = REQUESTS * (PREFIX_TOKENS + QUESTION_TOKENS + NEW_TOKENS)
    pages = 2 * (total // PAGE_TOKENS)  # room for every request at once, with slack
    store = SharedPageStore.create(store_layout_for(model, pages, PAGE_TOKENS), tag="bench")
    counter = ForwardCounter(model, PREFIX_TOKENS + QUESTION_TOKENS)
    loop = None
    try:
        cache = PrefixCache(store, PrefixCacheConfig(page_tokens=PAGE_TOKENS))
        config = SchedulerConfig(max_running=REQUESTS, batch_sharing=sharing)
        loop = ServingLoop(BatchRunner(model, store), Scheduler(cache, config))
        sequences = [
            Sequence(i, list(p), NAMESPACE, NEW_TOKENS, Sampler(None))
            for i, p in enumerate(prompts)
        ]
        start = time.perf_counter()
        if together:
            loop.submit(sequences)
        for seq in sequences:
            if not together:
                loop.submit([seq])
            seq.result()
        seconds = time.perf_counter() - start
        loop.stop()
        cache.check_integrity()
        store.check_integrity()
        return {
            "outputs": [seq.output for seq in sequences],
            "seconds": seconds,
            "calls": counter.calls,
            "prefill_calls": counter.prefill_calls,
            "prefill_tokens": counter.prefill_tokens,
            "new_tokens": sum(len(seq.output) for seq in sequences),
        }
    finally:
        counter.close()
        if loop is not None and loop.alive:
            loop.stop()
        store.close()


def run(log=sys.stderr) -> dict[str, Any]:
    """Run the benchmark; returns the named figures (also the JSON line of the CLI)."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print("loading SmolLM2-135M...", file=log)
    model, _ = load_smollm2()
    prompts = _prompts()
    runs = {}
    for name, sharing, together in (("a", True, True), ("b", False, True), ("c", True, False)):
        print(f"run ({name}): sharing {'on' if sharing else 'off'}, "
              f"{'all at once' if together else 'one by one'}...", file=log)  # fmt: skip
        runs[name] = _serve(model, prompts, sharing, together)
        print(f"  {runs[name]['seconds']:.1f} s, {runs[name]['calls']} forward calls", file=log)
    a, b, c = runs["a"], runs["b"], runs["c"]
    mismatches = sum(
        not (x == y == z) for x, y, z in zip(a["outputs"], b["outputs"], c["outputs"], strict=True)
    )
    batch_prompt_tokens = REQUESTS * (PREFIX_TOKENS + QUESTION_TOKENS)
    print("a copy from a slow peer beside decoding sequences...", file=log)
    copy_figures = slow_copy.run(model, log)
    return {
        "requests": REQUESTS,
        "prefix_tokens": PREFIX_TOKENS,
        "question_tokens": QUESTION_TOKENS,
        "new_tokens": NEW_TOKENS,
        "computed_ratio": round(a["prefill_tokens"] / batch_prompt_tokens, 4),
        "computed_ratio_b": round(b["prefill_tokens"] / batch_prompt_tokens, 4),
        "forward_calls_prefill": a["prefill_calls"],
        "forward_calls_a": a["calls"],
        "forward_calls_b": b["calls"],
        "forward_calls_c": c["calls"],
        "seconds_a": round(a["seconds"], 2),
        "seconds_b": round(b["seconds"], 2),
        "seconds_c": round(c["seconds"], 2),
        "speedup_vs_no_sharing": round(b["seconds"] / a["seconds"], 2),
        "tokens_per_s_a": round(a["new_tokens"] / a["seconds"], 1),
        "tokens_per_s_b": round(b["new_tokens"] / b["seconds"], 1),
        "tokens_per_s_c": round(c["new_tokens"] / c["seconds"], 1),
        "mismatches": mismatches,
        **copy_figures,
    }
