"""`kvmesh bench compaction`: what each compaction policy keeps of the model's quality for
the memory it returns, on real prose and the real model.

The text is the GNU General Public License v3 as Debian's `base-files` package ships it
(`/usr/share/common-licenses/GPL-3`, on every Debian system): English prose, not model
output. Its tokens are cut into windows of 2,048 prompt tokens and the 257 after them.
For each window, with SmolLM2-135M (float32) over a real page store and prefix cache, as a
worker runs them:

- cold: the prompt acquired from an empty cache and prefilled in chunks of 512, every
  token private (compactable);
- after_hit: the window's first 1,024 tokens computed and published by an earlier
  request, then the prompt acquired: those 1,024 are a cache hit (shared pages, never
  compacted) and only the 1,024 after them are computed, private and compactable.

Both prefills run tracked, so the policies' scores come from the attention the prompt's
own queries paid (after a hit: the suffix's queries, which also attend to the shared
prefix). The prefilled state is kept, and every (policy, budget) starts from a copy of
it on fresh pages: compact to the budget (a fraction of each head's compactable tokens),
then feed the next 256 true tokens (teacher forcing, one chunk: exactly what decoding
them one at a time attends to) and compare each next-token prediction with the same run
on the full cache: `agreement` (top-1 equal) and `ppl_ratio` (perplexity of the true
next tokens over the full cache's). `pages_before` is the compactable part's pages,
`pages_freed` what went back on the store's free list, `pages_freed_ratio` their ratio;
quality figures are averaged over the windows, page figures are per window.

Policies: streaming_llm (4 sinks + the most recent), h2o (half recent, half heavy hitters
by accumulated attention), snapkv (a 32-query observation window, max-pooled, kernel 7),
and h2o/snapkv with adaptive per-head budgets (AdaKV-style: the layer's budget goes to the
heads whose attention is most concentrated, so heads keep different numbers of tokens and
the packed lanes return what each one drops). A PNG of agreement and perplexity ratio
against pages freed is written beside the JSON (its path in `plot`).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import torch

from cache_service.events import Namespace
from workers.cache.prefix_cache import Allocation, PrefixCache, PrefixCacheConfig
from workers.serving.batch_runner import BatchRunner, Chunk
from workers.serving.compaction import Compactor, KvState, make_compaction_policy
from workers.serving.compaction.kv_state import SCORES
from workers.serving.model_loader import load_smollm2, store_layout_for
from workers.store.page_store import SharedPageStore

TEXT = Path("/usr/share/common-licenses/GPL-3")
TEXT_SOURCE = "GPL-3 from Debian's base-files (/usr/share/common-licenses/GPL-3)"
PROMPT_TOKENS = 2048
HIT_TOKENS = 1024
EVAL_TOKENS = 256
WINDOWS = 2
CHUNK_TOKENS = 512
PAGE_TOKENS = 16
BUDGETS = (0.5, 0.25)
POLICIES: dict[str, tuple[str, dict[str, Any]]] = {
    "streaming_llm": ("streaming_llm", {"sinks": 4}),
    "h2o": ("h2o", {}),
    "snapkv": ("snapkv", {}),
    "h2o_adaptive": ("h2o", {"adaptive": True}),
    "snapkv_adaptive": ("snapkv", {"adaptive": True}),
}
PLOT = Path("bench-compaction.png")


def text_tokens(tokenizer, needed: int) -> list[int]:
    """The text's token ids (at least `needed`)."""
    if not TEXT.exists():
        raise FileNotFoundError(f"{TEXT} is missing: Debian's base-files package ships it")
    ids = tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < needed:
        raise ValueError(f"{TEXT} has {len(ids)} tokens, the benchmark needs {needed}")
    return ids


class Prefilled:
    """A prompt prefilled tracked, and how to start again from it on fresh pages."""

    def __init__(self, cache, store, runner, compactor, namespace, prompt):
        self.cache, self.store, self.runner = cache, store, runner
        self.namespace, self.prompt = namespace, prompt
        allocation = self._acquire()
        self.state = compactor.track(allocation, SCORES)  # one prefill for every policy
        at = allocation.cached_tokens
        while at < len(prompt):
            chunk = prompt[at : at + CHUNK_TOKENS]
            runner.forward([Chunk(allocation.pages, chunk, at, self.state)])
            at += len(chunk)
        self.hit_tokens = allocation.cached_tokens
        private = allocation.private_pages
        self.kv = store.read_pages(private).clone()
        allocation.release()

    def _acquire(self) -> Allocation:
        allocation = self.cache.acquire(self.prompt, self.namespace, private=True)
        assert allocation is not None, "the benchmark's store is too small"
        return allocation

    def restore(self) -> tuple[Allocation, KvState]:
        """The prefilled prompt again, on fresh private pages, with its scores."""
        allocation = self._acquire()
        assert allocation.cached_tokens == self.hit_tokens
        pages = self.store.page_range(0, self.store.num_pages)
        pages[torch.tensor(allocation.private_pages)] = self.kv
        return allocation, copy.deepcopy(self.state)


def evaluate(runner, allocation: Allocation, state: KvState, upcoming: list[int]) -> torch.Tensor:
    """Teacher-force `upcoming` after the prompt: the log-probabilities after each token."""
    start = allocation.num_tokens
    assert allocation.extend(upcoming), "the benchmark's store is too small"
    (logits,) = runner.forward([Chunk(allocation.pages, upcoming, start, state)], all_logits=True)
    return logits.log_softmax(dim=-1)


def compare(full: torch.Tensor, got: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement with the full cache, perplexity ratio against it)."""
    agreement = float((got.argmax(-1) == full.argmax(-1)).float().mean())
    nll_full = -full.gather(1, targets[:, None]).mean()
    nll_got = -got.gather(1, targets[:, None]).mean()
    return agreement, float(torch.exp(nll_got - nll_full))


def run(
    log=sys.stderr,
    prompt_tokens: int = PROMPT_TOKENS,
    hit_tokens: int = HIT_TOKENS,
    eval_tokens: int = EVAL_TOKENS,
    windows: int = WINDOWS,
    plot: Path | None = PLOT,
) -> dict[str, Any]:
    """Run the benchmark; returns the named figures (also the JSON line of the CLI)."""
    print("loading SmolLM2-135M...", file=log)
    model, tokenizer = load_smollm2()
    span = prompt_tokens + eval_tokens + 1
    ids = text_tokens(tokenizer, windows * span)
    per_sequence = -(-span // PAGE_TOKENS)
    layout = store_layout_for(model, 4 * per_sequence, PAGE_TOKENS)
    store = SharedPageStore.create(layout, tag="bench_compaction")
    sums: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    try:
        cache = PrefixCache(store, PrefixCacheConfig(page_tokens=PAGE_TOKENS))
        runner = BatchRunner(model, store)
        compactor = Compactor(store)
        for w in range(windows):
            text = ids[w * span : (w + 1) * span]
            prompt, upcoming = text[:prompt_tokens], text[prompt_tokens:-1]
            targets = torch.tensor(text[prompt_tokens + 1 :])
            namespace = Namespace("smollm2-135m", "", f"bench-compaction-{w}")
            for case in ("cold", "after_hit"):
                if case == "after_hit":  # an earlier request computed the first part
                    owner = cache.acquire(prompt[:hit_tokens], namespace)
                    runner.forward([Chunk(owner.pages, prompt[:hit_tokens], 0)])
                    owner.publish(hit_tokens)
                    owner.release()
                print(f"window {w + 1}/{windows}, {case}: prefill...", file=log)
                scope = namespace if case == "after_hit" else Namespace("cold", "", str(w))
                snapshot = Prefilled(cache, store, runner, compactor, scope, prompt)
                allocation, state = snapshot.restore()
                full = evaluate(runner, allocation, state, upcoming)
                allocation.release()
                for label, (name, params) in POLICIES.items():
                    policy = make_compaction_policy(name, **params)
                    for budget in BUDGETS:
                        allocation, state = snapshot.restore()
                        free = store.num_free
                        result = compactor.compact(allocation, state, budget, policy)
                        assert store.num_free - free == result.pages_freed
                        state.check_integrity(allocation.pages, allocation.num_tokens)
                        cache.check_integrity()
                        got = evaluate(runner, allocation, state, upcoming)
                        allocation.release()
                        agreement, ppl_ratio = compare(full, got, targets)
                        sums.setdefault((label, str(budget), case), []).append(
                            {
                                "pages_before": result.pages_before,
                                "pages_freed": result.pages_freed,
                                "agreement": agreement,
                                "ppl_ratio": ppl_ratio,
                            }
                        )
                        print(f"  {label} {budget}: agreement {agreement:.3f}, ppl x"
                              f"{ppl_ratio:.3f}, {result.pages_freed}/{result.pages_before} "
                              "pages freed", file=log)  # fmt: skip
        cache.check_integrity()
        store.check_integrity()
    finally:
        store.close()
    policies: dict[str, Any] = {}
    for (label, budget, case), runs in sums.items():
        before = _mean(r["pages_before"] for r in runs)
        freed = _mean(r["pages_freed"] for r in runs)
        leaf = {
            "pages_before": before,
            "pages_freed": freed,
            "pages_freed_ratio": round(freed / before, 4),
            "agreement": round(sum(r["agreement"] for r in runs) / len(runs), 4),
            "ppl_ratio": round(sum(r["ppl_ratio"] for r in runs) / len(runs), 4),
        }
        policies.setdefault(label, {}).setdefault(budget, {})[case] = leaf
    figures: dict[str, Any] = {
        "text": TEXT_SOURCE,
        "windows": windows,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit_tokens,
        "eval_tokens": eval_tokens,
        "policies": policies,
    }
    if plot is not None:
        figures["plot"] = str(draw(policies, plot).resolve())
    return figures


def _mean(values) -> float:
    values = list(values)
    mean = sum(values) / len(values)
    return int(mean) if mean.is_integer() else round(mean, 2)


def draw(policies: dict[str, Any], path: Path) -> Path:
    """Agreement and perplexity ratio against the share of pages freed, a line per policy
    and case (cold: solid, after a hit: dashed)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(1, 2, figsize=(11, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, budgets) in enumerate(policies.items()):
        for case, style in (("cold", "-"), ("after_hit", "--")):
            leaves = [budgets[b][case] for b in sorted(budgets, key=float, reverse=True)]
            x = [0.0] + [leaf["pages_freed_ratio"] for leaf in leaves]
            kwargs = {"color": colors[i % len(colors)], "linestyle": style, "marker": "o"}
            name = f"{label} ({case.replace('_', ' ')})"
            top.plot(x, [1.0] + [leaf["agreement"] for leaf in leaves], label=name, **kwargs)
            bottom.plot(x, [1.0] + [leaf["ppl_ratio"] for leaf in leaves], **kwargs)
    top.set(xlabel="share of compactable pages freed", ylabel="top-1 agreement with full KV")
    bottom.set(xlabel="share of compactable pages freed", ylabel="perplexity / full KV")
    top.set_title("quality against memory returned (SmolLM2-135M, GPL-3 text)")
    top.legend(fontsize=7)
    for axes in (top, bottom):
        axes.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    import json

    print(json.dumps(run()))
