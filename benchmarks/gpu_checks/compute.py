"""GPU check: the batch runner, its pages and the sampler on a device, against the CPU.

A seeded random Llama of SmolLM2-135M's shape (`model_loader.smollm2_shaped`) is built
twice, float32 on `device` and float32 on the CPU, each over a page store of its own on
its own device; the same requests go through both, as a worker runs them (the prefix cache
allocates, shares and publishes pages; the batch runner runs chunks):

1. the first prompt alone, prefilled in chunks, then published (its pages are the prefix
   two other prompts share);
2. the other prompts together, chunk by chunk: the two sharing the prefix read it from the
   first's pages (the cascade over shared pages), the last one alone;
3. greedy decode of every request together, one token each per pass.

The CPU run picks its tokens itself; the device run is fed the same tokens (so every row
of logits is comparable even where a near tie flips a pick) and picks its own with the
sampler on the device. Checked:

- logits: every row either run returns (each chunk's last token), absolute difference of
  the float32 logits at most `MAX_LOGIT_DIFF` everywhere;
- tokens: the device's greedy pick equals the CPU's wherever the CPU logits' top two differ
  by more than `GREEDY_MARGIN` (closer than that, either pick is right).

A failure raises AssertionError with the figures. A third run, bfloat16 on the device, gives
the figures a GPU worker would see (tokens per second of prefill and decode); its logits'
distance from the CPU's is reported, not checked.

`run(device="cpu", quick=True)` runs the same code with both models on the CPU and a
smaller model and batch, in seconds (CI runs it that way).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from cache_service.events import Namespace
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.serving.batch_runner import BatchRunner, Chunk
from workers.serving.model_loader import smollm2_shaped, store_layout_for
from workers.serving.sampling import Sampler
from workers.store.page_store import SharedPageStore, StoreLayout

MAX_LOGIT_DIFF = 1e-3  # absolute, float32 logits, device against CPU
GREEDY_MARGIN = 1e-2  # a greedy pick is compared where the CPU's top two differ by more
PAGE_TOKENS = 16
SEED = 0
NAMESPACE = Namespace("smollm2-shaped", "", "gpu-check-compute")


class Plan(NamedTuple):
    """The requests and the model they run through."""

    prompts: list[list[int]]  # the first three share `shared` tokens
    shared: int
    chunk_tokens: int  # prefill chunk length
    new_tokens: int  # greedy tokens decoded per request
    sizes: dict[str, Any]  # overrides of the SmolLM2 shape


class Served(NamedTuple):
    """What one run returned."""

    logits: torch.Tensor  # (rows, vocab) float32 on the CPU: every row, in pass order
    picks: list[list[int]]  # each request's greedy picks, made on the run's device
    picked_at: list[list[int]]  # the row of `logits` each pick was made from
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


def plan(quick: bool) -> Plan:
    """The batch: three prompts sharing a prefix and one of its own.

    Full: prompts of 200-250 tokens (a 128-token shared prefix), prefilled in 64-token
    chunks, 16 tokens decoded each, the whole SmolLM2 shape. Quick: 2 layers, an 8k
    vocabulary, prompts of 40-60 tokens, 4 tokens decoded.
    """
    gen = torch.Generator().manual_seed(SEED)

    def tokens(n: int) -> list[int]:
        # Ordinary ids: SmolLM2's special tokens sit at the start of its vocabulary.
        return torch.randint(100, 8000, (n,), generator=gen).tolist()

    if quick:
        shared, tails, lone, chunk, new = 32, (16, 8, 24), 40, 16, 4
        sizes = {"num_hidden_layers": 2, "vocab_size": 8192}
    else:
        shared, tails, lone, chunk, new = 128, (96, 72, 120), 200, 64, 16
        sizes = {}
    prefix = tokens(shared)
    prompts = [prefix + tokens(n) for n in tails] + [tokens(lone)]
    return Plan(prompts, shared, chunk, new, sizes)


def run(device: str, quick: bool) -> dict[str, Any]:
    """Run the check on `device` (see the module docstring).

    Args:
        device: a torch device name ("cuda", "cuda:1", "cpu").
        quick: a smaller model and batch (seconds on a CPU).

    Returns:
        Figures: `max_logit_diff` (float32, device against CPU, absolute), `rows_compared`,
        `tokens_compared` and `tokens_near_ties` (picks not compared), `greedy_mismatches`
        (0), `bf16_max_logit_diff` (not checked), and `prefill_tokens_per_s_<run>` and
        `decode_tokens_per_s_<run>` for the runs `cpu_float32`, `device_float32` and
        `device_bfloat16`.

    Raises:
        AssertionError: logits or greedy tokens differ past the tolerances (the message
            holds the figures).
    """
    the_plan = plan(quick)
    previous = torch.get_float32_matmul_precision()
    # Full float32 matmuls on the device: TF32 would round inputs to 10 bits, far past
    # MAX_LOGIT_DIFF. (The default, restored after.)
    torch.set_float32_matmul_precision("highest")
    try:
        reference = _serve(the_plan, "cpu", torch.float32, None, "gpucheck_ref")
        forced = reference.picks
        on_device = _serve(the_plan, device, torch.float32, forced, "gpucheck_f32")
        bf16 = _serve(the_plan, device, torch.bfloat16, forced, "gpucheck_bf16")
    finally:
        torch.set_float32_matmul_precision(previous)
    figures = _compare(reference, on_device)
    figures["bf16_max_logit_diff"] = (bf16.logits - reference.logits).abs().max().item()
    for label, served in (
        ("cpu_float32", reference),
        ("device_float32", on_device),
        ("device_bfloat16", bf16),
    ):
        figures[f"prefill_tokens_per_s_{label}"] = round(served.prefill_tokens_per_s, 1)
        figures[f"decode_tokens_per_s_{label}"] = round(served.decode_tokens_per_s, 1)
    figures.update(
        device=str(device),
        quick=quick,
        layers=the_plan.sizes.get("num_hidden_layers", 30),
        requests=len(the_plan.prompts),
        prompt_tokens=sum(len(p) for p in the_plan.prompts),
        new_tokens=the_plan.new_tokens * len(the_plan.prompts),
    )
    bad = figures["max_logit_diff"] > MAX_LOGIT_DIFF or figures["greedy_mismatches"]
    if bad or figures["tokens_compared"] == 0:
        raise AssertionError(
            f"device {device} disagrees with the CPU (logits within {MAX_LOGIT_DIFF}, "
            f"greedy equal past a margin of {GREEDY_MARGIN}): {figures}"
        )
    return figures


def _compare(reference: Served, other: Served) -> dict[str, Any]:
    """Logit and greedy-pick agreement of `other` with the CPU `reference`."""
    assert reference.logits.shape == other.logits.shape, (reference.logits.shape,)
    diff = (other.logits - reference.logits).abs().max().item()
    top2 = reference.logits.topk(2, dim=-1).values  # (rows, 2)
    clear = (top2[:, 0] - top2[:, 1]) > GREEDY_MARGIN  # (rows,)
    compared = mismatches = near = 0
    pairs = zip(reference.picks, other.picks, reference.picked_at, strict=True)
    for ref_picks, picks, rows in pairs:
        for ref_pick, pick, row in zip(ref_picks, picks, rows, strict=True):
            if not clear[row]:
                near += 1
                continue
            compared += 1
            mismatches += ref_pick != pick
    return {
        "max_logit_diff": diff,
        "rows_compared": reference.logits.shape[0],
        "tokens_compared": compared,
        "tokens_near_ties": near,
        "greedy_mismatches": mismatches,
    }


def _serve(
    the_plan: Plan,
    device: str,
    dtype: torch.dtype,
    forced: list[list[int]] | None,
    tag: str,
) -> Served:
    """One run of the plan's requests on `device` in `dtype`; decode feeds `forced`'s
    tokens when given, else the run's own greedy picks."""
    model = smollm2_shaped(SEED, dtype=dtype, device=device, **the_plan.sizes)
    prompts, new = the_plan.prompts, the_plan.new_tokens
    pages = sum(-(-(len(p) + new) // PAGE_TOKENS) for p in prompts) + 2
    store = _page_store(store_layout_for(model, pages, PAGE_TOKENS), tag, device)
    try:
        cache = PrefixCache(store, PrefixCacheConfig(page_tokens=PAGE_TOKENS))
        runner = BatchRunner(model, store)
        served = _drive(runner, cache, the_plan, forced)
        cache.check_integrity()
        store.check_integrity()
        return served
    finally:
        store.close()


def _drive(
    runner: BatchRunner, cache: PrefixCache, the_plan: Plan, forced: list[list[int]] | None
) -> Served:
    """Prefill (the first prompt, then the rest together) and decode, as the module
    docstring says; every allocation is released at the end."""
    device, greedy = runner.device, Sampler(None)
    prompts, chunk, new = the_plan.prompts, the_plan.chunk_tokens, the_plan.new_tokens
    _warm_up(runner, cache)
    rows = _Rows()
    _sync(device)
    start = time.perf_counter()
    first = cache.acquire(prompts[0], NAMESPACE, extra_token_slots=new)
    last = _prefill(runner, [first], chunk, rows)
    first.publish(first.num_tokens)
    others = [cache.acquire(p, NAMESPACE, extra_token_slots=new) for p in prompts[1:]]
    shared = [a.cached_tokens for a in others[:2]]
    assert shared == [the_plan.shared] * 2, f"the shared prefix was not reused: {shared}"
    last += _prefill(runner, others, chunk, rows)
    _sync(device)
    prefill_s = time.perf_counter() - start
    computed = sum(len(p) for p in prompts) - sum(shared)

    allocations = [first, *others]
    picks: list[list[int]] = [[] for _ in prompts]
    picked_at: list[list[int]] = [[] for _ in prompts]
    start = time.perf_counter()
    for step in range(new):
        chunks = []
        for i, allocation in enumerate(allocations):
            picks[i].append(greedy(rows.row(last[i])))  # one transfer: the token
            picked_at[i].append(last[i])
            token = forced[i][step] if forced is not None else picks[i][-1]
            assert allocation.extend([token]), "the store is sized for every token"
            chunks.append(Chunk(allocation.pages, [token], allocation.num_tokens - 1))
        if step < new - 1:  # the last picks need no pass after them
            last = rows.add(runner.forward(chunks))
    _sync(device)
    decode_s = time.perf_counter() - start
    for allocation in allocations:
        allocation.release()
    decoded = (new - 1) * len(prompts)  # tokens the decode passes ran
    return Served(rows.all(), picks, picked_at, computed / prefill_s, decoded / decode_s)


class _Rows:
    """Every pass's logits, kept on the device until the run ends (one copy then)."""

    def __init__(self) -> None:
        self._passes: list[torch.Tensor] = []
        self._count = 0

    def add(self, logits: torch.Tensor) -> list[int]:
        """Keep a pass's `(n, vocab)` logits; returns their row numbers."""
        self._passes.append(logits)
        numbers = list(range(self._count, self._count + logits.shape[0]))
        self._count += logits.shape[0]
        return numbers

    def row(self, number: int) -> torch.Tensor:
        at = number
        for logits in self._passes:
            if at < logits.shape[0]:
                return logits[at]
            at -= logits.shape[0]
        raise IndexError(number)

    def all(self) -> torch.Tensor:
        return torch.cat(self._passes).cpu()


def _prefill(runner: BatchRunner, allocations: Sequence[Any], chunk: int, rows: _Rows) -> list[int]:
    """Run the allocations' uncomputed prompt tokens together, `chunk` tokens of each per
    pass. Returns the row of each one's prompt's last token."""
    at = [a.cached_tokens for a in allocations]
    last = [-1] * len(allocations)
    while any(pos < a.num_tokens for pos, a in zip(at, allocations, strict=True)):
        chunks, owners = [], []
        for k, allocation in enumerate(allocations):
            end = min(at[k] + chunk, allocation.num_tokens)
            if at[k] < end:
                chunks.append(Chunk(allocation.pages, allocation.tokens[at[k] : end], at[k]))
                owners.append(k)
                at[k] = end
        for k, number in zip(owners, rows.add(runner.forward(chunks)), strict=True):
            last[k] = number
    return last


def _warm_up(runner: BatchRunner, cache: PrefixCache) -> None:
    """One pass before the timed ones (the device's first kernels and handles), its pages
    freed and never published."""
    allocation = cache.acquire([1] * (2 * PAGE_TOKENS), NAMESPACE, private=True)
    runner.forward([Chunk(allocation.pages, allocation.tokens, 0)])
    allocation.release()


def _sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _page_store(layout: StoreLayout, tag: str, device: str) -> SharedPageStore:
    """The page store on `device`, its pages in one tensor there (on the CPU: in shared
    memory, as a CPU worker's)."""
    return SharedPageStore.create(layout, tag=tag, device=device)
