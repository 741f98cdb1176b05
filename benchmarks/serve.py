"""`kvmesh bench serve`: routing under concurrent load, kvmesh's against the routing
registry's baselines, on workers with the mesh and without it.

Eight client threads send 64 requests through the front door to two workers (SmolLM2-135M
on the CPU), each run on a fresh mesh (an empty cache) after a warm-up:

- 24 single questions, eight for each of three system prompts (the demo's support agent,
  coding assistant and travel assistant, 300-350 tokens each);
- eight conversations of five turns each (40 requests), two scripts with four customers
  each: a turn's prompt is the whole conversation so far (the earlier turns' answers
  included), so a client sends a conversation's turns one after the other.

Policies, each the mesh's `routing.policy` (`cache_service.routing`: the service runs it
over its index, the front door's requests in flight and the workers' reported loads):
- `kvmesh`: kvmesh's own (what each worker holds, would copy and compute, against its
  queue and the decodes its passes carry);
- `rr`: round-robin over the workers, request by request;
- `ll`: least-loaded (the shortest queue of prompt tokens);
- `affinity`: SGLang's cache-aware rule (`prefix-affinity`): the worker holding the
  longest prefix while the loads are balanced, the least loaded when they are not.
Each also runs on workers without the mesh (`workers.share: false`: no lookup, no copy,
each worker only its own cache; they still publish, so cache-aware policies still know
who holds what): figures suffixed `_solo`.

The whole set runs `repeats` times, each repeat in an order rotated by one, so no policy
always runs first or last on this shared machine. Figures are client-side
(`ttft_client_s`: from the call to the first token, routing and queueing included), the
median over the repeats: `requests_per_s_<p>`, `ttft_p50_<p>_s`, `ttft_p99_<p>_s`,
`hit_rate_<p>` (prompt tokens reused, locally or copied, over all prompt tokens), and each
repeat's `requests_per_s_<p>_runs` and `ttft_p99_<p>_runs`. `throughput_vs_best` and
`p99_vs_best` weigh kvmesh against the best other policy on the mesh; `mesh_gain` is
kvmesh's requests per second over the best policy's without the mesh. Each request asks
for 16 new tokens (the model's end of turn ignored, so every request does the same work
under every policy).

Not yet here: open-loop (Poisson) arrivals, a workload shaped on the conversation trace,
and two front doors at once.
"""

from __future__ import annotations

import dataclasses
import queue
import random
import statistics
import sys
import threading
import time
from typing import Any

import ray

import cluster
from cluster.config import RoutingConfig, config_from_dict
from cluster.demo_prompts import CONVERSATIONS, QUESTIONS, SYSTEM_PROMPTS

CLIENTS = 8
NEW_TOKENS = 16
CUSTOMERS = 4  # instances of each conversation script
POLICIES = ("kvmesh", "rr", "affinity")


def _jobs(seed: int = 11) -> list[tuple[str, Any]]:
    """("single", (system, question)) and ("conversation", (system, messages)) jobs."""
    jobs: list[tuple[str, Any]] = []
    for system, questions in QUESTIONS.items():
        jobs += [("single", (system, q)) for q in questions]
    for system, turns in CONVERSATIONS:
        for customer in range(CUSTOMERS):
            first = f"(Customer {customer + 1}.) {turns[0]}"
            jobs.append(("conversation", (system, [first, *turns[1:]])))
    random.Random(seed).shuffle(jobs)
    return jobs


# The benchmark's name of each policy -> its name in the routing registry.
REGISTRY_NAMES = {
    "kvmesh": "kvmesh",
    "rr": "round-robin",
    "ll": "least-loaded",
    "affinity": "prefix-affinity",
}
POLICIES = tuple(REGISTRY_NAMES)
WARM_UP = [{"role": "user", "content": "Say hello."}]  # no system prompt of the workload


def _run_policy(name: str, cfg, jobs, log) -> dict[str, Any]:
    mesh = cluster.connect(cfg, log=log)
    try:
        tokenizer = mesh.tokenizer
        # Each worker runs a short prompt first: its first passes are slower than the rest.
        warm = tokenizer.apply_chat_template(WARM_UP, tokenize=False, add_generation_prompt=True)
        for worker in mesh.workers:
            mesh.generate(list(tokenizer.encode(warm)), 2, worker=worker)
        results: list[Any] = []
        errors: list[BaseException] = []
        lock = threading.Lock()
        work: queue.SimpleQueue = queue.SimpleQueue()
        for job in jobs:
            work.put(job)

        def ask(messages: list[dict[str, str]]) -> Any:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            tokens = list(tokenizer.encode(text))
            result = mesh.generate(tokens, NEW_TOKENS, ignore_eos=True)
            with lock:
                results.append(result)
            return result

        def client() -> None:
            try:
                while True:
                    try:
                        kind, (system, payload) = work.get_nowait()
                    except queue.Empty:
                        return
                    messages = [{"role": "system", "content": SYSTEM_PROMPTS[system]}]
                    if kind == "single":
                        ask([*messages, {"role": "user", "content": payload}])
                        continue
                    for turn in payload:
                        messages.append({"role": "user", "content": turn})
                        answer = ask(messages)
                        messages.append({"role": "assistant", "content": answer.text})
            except BaseException as exc:  # noqa: BLE001 - reported after the run
                with lock:
                    errors.append(exc)

        start = time.perf_counter()
        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
        if errors:
            raise RuntimeError(f"policy {name}: {len(errors)} requests failed: {errors[0]!r}")
        mesh.check_integrity()
    finally:
        mesh.stop()
    ttfts = sorted(r.stats["ttft_client_s"] for r in results)
    prompt = sum(r.stats["prompt_tokens"] for r in results)
    reused = sum(r.stats["local_hit_tokens"] + r.stats["remote_hit_tokens"] for r in results)
    return {
        f"requests_per_s_{name}": round(len(results) / seconds, 3),
        f"ttft_p50_{name}_s": round(statistics.median(ttfts), 4),
        f"ttft_p99_{name}_s": round(_quantile(ttfts, 0.99), 4),
        f"hit_rate_{name}": round(reused / prompt, 4),
        f"requests_{name}": len(results),
    }


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile of sorted values (linear between the closest ranks)."""
    at = q * (len(values) - 1)
    low = int(at)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (at - low)


def run(log=sys.stderr, repeats: int = 3, policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    """Run the benchmark; returns the named figures (also the JSON line of the CLI).

    Raises:
        ValueError: repeats below 1, or a policy the benchmark does not know.
    """
    if type(repeats) is not int or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    unknown = [p for p in policies if p not in REGISTRY_NAMES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(REGISTRY_NAMES)}")
    cfg = config_from_dict({"workers": {"count": 2, "threads": 1}})
    jobs = _jobs()
    runs = [(name, share) for share in (True, False) for name in policies]
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, namespace="kvmesh", log_to_driver=False)
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        for repeat in range(repeats):
            turn = repeat % len(runs)
            for name, share in runs[turn:] + runs[:turn]:
                key = name if share else f"{name}_solo"
                print(
                    f"repeat {repeat + 1}/{repeats}, {key}: a fresh mesh, {CLIENTS} clients...",
                    file=log,
                )
                workers = dataclasses.replace(cfg.workers, share=share)
                routed = dataclasses.replace(
                    cfg, workers=workers, routing=RoutingConfig(REGISTRY_NAMES[name])
                )
                figures = _run_policy(key, routed, jobs, log)
                results.setdefault(key, []).append(figures)
                print(
                    f"  {figures[f'requests_per_s_{key}']} requests/s, TTFT p50 "
                    f"{figures[f'ttft_p50_{key}_s']} s, p99 {figures[f'ttft_p99_{key}_s']} s, "
                    f"hit rate {figures[f'hit_rate_{key}']}",
                    file=log,
                )
    finally:
        if started:
            ray.shutdown()
    return _summary(results, repeats)


def _summary(results: dict[str, list[dict[str, Any]]], repeats: int) -> dict[str, Any]:
    """Medians over the repeats, each repeat's throughput and p99, and the ratios."""
    figures: dict[str, Any] = {
        "clients": CLIENTS,
        "workers": 2,
        "repeats": repeats,
        "requests": next(iter(results.values()))[0][f"requests_{next(iter(results))}"],
    }
    for key, runs in results.items():
        for figure in ("requests_per_s", "ttft_p50", "ttft_p99", "hit_rate"):
            name = f"{figure}_{key}_s" if figure.startswith("ttft") else f"{figure}_{key}"
            figures[name] = round(statistics.median(run[name] for run in runs), 4)
        figures[f"requests_per_s_{key}_runs"] = [run[f"requests_per_s_{key}"] for run in runs]
        figures[f"ttft_p99_{key}_runs"] = [run[f"ttft_p99_{key}_s"] for run in runs]
    others = [key for key in results if key in REGISTRY_NAMES and key != "kvmesh"]
    solo = [key for key in results if key.endswith("_solo")]
    if "kvmesh" in results and others:
        best_rate = max(figures[f"requests_per_s_{key}"] for key in others)
        best_p99 = min(figures[f"ttft_p99_{key}_s"] for key in others)
        figures["throughput_vs_best"] = round(figures["requests_per_s_kvmesh"] / best_rate, 3)
        figures["p99_vs_best"] = round(figures["ttft_p99_kvmesh_s"] / best_p99, 3)
    if "kvmesh" in results and solo:
        best_solo = max(figures[f"requests_per_s_{key}"] for key in solo)
        figures["mesh_gain"] = round(figures["requests_per_s_kvmesh"] / best_solo, 3)
    return figures
