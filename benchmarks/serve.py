"""`kvmesh bench serve`: routing under concurrent load, kvmesh's against round-robin and
prefix affinity.

Eight client threads send 64 requests through the front door to two workers (SmolLM2-135M
on the CPU), each policy on a fresh mesh (an empty cache):

- 24 single questions, eight for each of three system prompts (the demo's support agent,
  coding assistant and travel assistant, 300-350 tokens each);
- eight conversations of five turns each (40 requests), two scripts with four customers
  each: a turn's prompt is the whole conversation so far (the earlier turns' answers
  included), so a client sends a conversation's turns one after the other.

Policies, each the mesh's `routing.policy` (`cache_service.routing`: the service runs it
over its index, the front door's requests in flight and the workers' reported loads):
- `kvmesh`: kvmesh's own (what each worker holds, would copy and compute, against its
  queue and the requests in flight);
- `rr`: round-robin over the workers, request by request;
- `affinity`: SGLang's cache-aware rule (`prefix-affinity`): the worker holding the
  longest prefix while the loads are balanced, the least loaded when they are not.

Figures are client-side (`ttft_client_s`: from the call to the first token, routing and
queueing included): `requests_per_s_<p>`, `ttft_p50_<p>_s`, `ttft_p99_<p>_s`, and
`hit_rate_<p>` (prompt tokens reused, locally or copied, over all prompt tokens). Each
request asks for 16 new tokens (the model's end of turn ignored, so every request does
the same work under every policy).
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
REGISTRY_NAMES = {"kvmesh": "kvmesh", "rr": "round-robin", "affinity": "prefix-affinity"}


def _run_policy(name: str, cfg, jobs, log) -> dict[str, Any]:
    mesh = cluster.connect(cfg, log=log)
    try:
        tokenizer = mesh.tokenizer
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


def run(log=sys.stderr, policies: tuple[str, ...] = POLICIES) -> dict[str, Any]:
    """Run the benchmark; returns the named figures (also the JSON line of the CLI)."""
    cfg = config_from_dict({"workers": {"count": 2, "threads": 1}})
    jobs = _jobs()
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, namespace="kvmesh", log_to_driver=False)
    figures: dict[str, Any] = {
        "clients": CLIENTS,
        "workers": 2,
        "requests": sum(1 if kind == "single" else len(p[1]) for kind, p in jobs),
    }
    try:
        for name in policies:
            print(f"policy {name}: a fresh mesh, {CLIENTS} clients...", file=log)
            routed = dataclasses.replace(cfg, routing=RoutingConfig(REGISTRY_NAMES[name]))
            figures |= _run_policy(name, routed, jobs, log)
            print(
                f"  {figures[f'requests_per_s_{name}']} requests/s, TTFT p50 "
                f"{figures[f'ttft_p50_{name}_s']} s, p99 {figures[f'ttft_p99_{name}_s']} s",
                file=log,
            )
    finally:
        if started:
            ray.shutdown()
    if set(POLICIES) <= set(policies):
        best_rate = max(figures["requests_per_s_rr"], figures["requests_per_s_affinity"])
        best_p99 = min(figures["ttft_p99_rr_s"], figures["ttft_p99_affinity_s"])
        figures["throughput_vs_best"] = round(figures["requests_per_s_kvmesh"] / best_rate, 3)
        figures["p99_vs_best"] = round(figures["ttft_p99_kvmesh_s"] / best_p99, 3)
    return figures
