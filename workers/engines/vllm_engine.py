"""A vLLM engine in a process of its own, driven by JSON lines: for the tests and
`kvmesh bench vllm`, which run in the main venv while vLLM lives in its own.

    python -m workers.engines.vllm_engine --model DIR [--kvmesh ENGINE_ID --enroll-token TOKEN]
        [--example-connector DIR]

Each line on stdin is a request, `{"prompt_token_ids": [...], "max_tokens": n,
"cache_salt": s}` (cache_salt optional); each line on stdout its answer,
`{"token_ids": [...], "num_cached_tokens": n, "seconds": s}` (`seconds`: the call's wall
time; with `max_tokens: 1` it is the time to first token); `{"reset_prefix_cache": true}`
empties vLLM's own prefix cache; `{"batch": [request, ...]}` runs its requests together
and answers `{"batch": [answer, ...], "preemptions": n}` (n: the engine's preemptions so
far). The first line out is
`{"ready": true}` once the engine serves. Greedy decoding, always.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def kv_transfer_config(args: argparse.Namespace) -> dict | None:
    """The `--kv-transfer-config` a user would pass, for kvmesh or vLLM's example."""
    if args.kvmesh:
        return {
            "kv_connector": "KvmeshConnector",
            "kv_connector_module_path": "workers.engines.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "engine_id": args.kvmesh,
                "enroll_token": args.enroll_token,
                "ray_address": args.ray_address,
                "num_blocks": args.num_blocks,
                "model_name": args.model_name,
                "node_ip_address": args.node_ip_address,
            },
        }
    if args.example_connector:
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": args.example_connector},
        }
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.engines.vllm_engine")
    parser.add_argument("--model", required=True, help="an HF model folder")
    parser.add_argument("--model-name", default="smollm2-135m")
    parser.add_argument("--kvmesh", metavar="ENGINE_ID", help="join the mesh as this engine")
    parser.add_argument("--enroll-token", help="a token from `kvmesh enroll-token`")
    parser.add_argument("--ray-address", default="auto")
    parser.add_argument("--node-ip-address", help="this machine's Ray node (default: Ray's pick)")
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--example-connector", metavar="DIR", help="vLLM's ExampleConnector")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--num-gpu-blocks", type=int, help="vLLM's KV blocks (default: from its KV space)"
    )
    parser.add_argument(
        "--no-prefix-caching", action="store_true", help="vLLM's own prefix cache off"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM takes 19 by default
    # The engine core in this process, not in two more of its own: this driver sends one
    # request at a time, so a separate core overlaps nothing, and each extra process
    # imports vLLM again (an engine started in 55 s that way here, 24 s in process). The
    # connector is the same either way: both its roles live with the engine core.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # vLLM logs to stdout (and so do the processes it spawns): the answers get a file of
    # their own, and everything else written to fd 1 goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from vllm import LLM

    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=args.max_model_len,
        kv_transfer_config=kv_transfer_config(args),
        enable_prefix_caching=not args.no_prefix_caching,
        num_gpu_blocks_override=args.num_gpu_blocks,
        disable_log_stats=False,  # the preemption count a batch answers with
    )
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request.get("reset_prefix_cache"):
            # vLLM's own cache forgets: the next hit can only come through the connector.
            answer = {"reset": bool(llm.reset_prefix_cache())}
        elif "batch" in request:
            answer = {"batch": generate(llm, request["batch"]), "preemptions": preemptions(llm)}
        else:
            (answer,) = generate(llm, [request])
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


def generate(llm, requests: list[dict]) -> list[dict]:
    """Greedy answers to `requests`, run together (one batch, as vLLM schedules it)."""
    from vllm import SamplingParams, TokensPrompt

    prompts, params = [], []
    for request in requests:
        prompt = TokensPrompt(prompt_token_ids=request["prompt_token_ids"])
        if request.get("cache_salt"):
            prompt["cache_salt"] = request["cache_salt"]
        prompts.append(prompt)
        params.append(SamplingParams(temperature=0.0, max_tokens=request.get("max_tokens", 1)))
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return [
        {
            "token_ids": list(result.outputs[0].token_ids),
            "num_cached_tokens": result.num_cached_tokens,
            "seconds": seconds,
        }
        for result in results
    ]


def preemptions(llm) -> int:
    """The engine's preemptions so far (vLLM's `vllm:num_preemptions` counter)."""
    return int(
        sum(
            getattr(metric, "value", 0)
            for metric in llm.get_metrics()
            if metric.name == "vllm:num_preemptions"
        )
    )


if __name__ == "__main__":  # the engine spawns processes: nothing runs on import
    sys.exit(main())
