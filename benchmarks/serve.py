"""`kvmesh bench serve`: routing under concurrent load, kvmesh's against the routing
registry's baselines, on workers with the mesh and without it.

Requests go through the front door to two workers (SmolLM2-135M on the CPU), each policy
on a fresh mesh (an empty cache) after a warm-up. The workload (`--workload`,
`benchmarks.serve_workload`) is the demo's prompts (system prompts, questions and
conversations; 64 requests) or the Mooncake conversation trace scaled down (37
conversations, 64 requests; `benchmarks/traces/`). How requests arrive (`--arrivals`):

- `closed`: eight clients, each sending its next job (a question, or a conversation's
  turns one after the other) when its last one ended;
- `open`: jobs start at the arrivals of a Poisson process (seeded: the same times for
  every policy and repeat) whose requests come at 80% of round-robin's capacity, the
  requests per second it served closed-loop on a fresh mesh of the same kind first
  (`capacity_rr`, `arrival_rate`); a conversation's turns still follow its answers.

With `--front-doors 2` a second process attaches to the mesh (`cluster.connect` with the
Ray address, as any second front door) and sends every other job (closed loop: four
clients each); figures are suffixed `_2fd`.

Policies, each the mesh's `routing.policy` (`cache_service.routing`: the service runs it
over its index, the front doors' requests in flight and the workers' reported loads):
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
median over the repeats: `requests_per_s_<p>` (requests over the time from the start to
the last result), `ttft_p50_<p>_s`, `ttft_p99_<p>_s`, `hit_rate_<p>` (prompt tokens
reused, locally or copied, over all prompt tokens), and each repeat's
`requests_per_s_<p>_runs` and `ttft_p99_<p>_runs`. `throughput_vs_best` and
`p99_vs_best` weigh kvmesh against the best other policy on the mesh; `mesh_gain` is
kvmesh's requests per second over the best policy's without the mesh (each also per
repeat, `..._runs`: a repeat's runs against each other). Every request asks
for its new tokens with the model's end of turn ignored, so every request does the same
work under every policy.
"""

from __future__ import annotations

import dataclasses
import json
import random
import select
import statistics
import subprocess
import sys
import time
from typing import Any, NamedTuple

import ray

import cluster
from benchmarks.serve_door import Plan, Sent, drive
from benchmarks.serve_workload import WORKLOADS, jobs, requests_of
from cluster.config import RoutingConfig, config_from_dict

CLIENTS = 8  # closed loop, over all front doors
WORKERS = 2
LOAD = 0.8  # open loop: arrivals at this fraction of round-robin's measured capacity
SEED = 5  # the open loop's arrival times
READY_TIMEOUT_S = 600.0  # for the second front door to attach and load its tokenizer
RESULTS_TIMEOUT_S = 1200.0  # for its results once both doors started
ARRIVALS = ("closed", "open")

# The benchmark's name of each policy -> its name in the routing registry.
REGISTRY_NAMES = {
    "kvmesh": "kvmesh",
    "rr": "round-robin",
    "ll": "least-loaded",
    "affinity": "prefix-affinity",
}
POLICIES = tuple(REGISTRY_NAMES)
WARM_UP = [{"role": "user", "content": "Say hello."}]  # no system prompt of the workload


class Setup(NamedTuple):
    """What every run of one invocation shares."""

    workload: str
    front_doors: int
    clients: int  # closed loop; 0: open loop
    offsets: list[float]  # open loop: each job's start after the start, in seconds


def _run_policy(name: str, cfg, setup: Setup, log) -> dict[str, Any]:
    """One policy on a fresh mesh: warm up each worker, then send the workload through
    `setup.front_doors` front doors (job i through door i modulo their number)."""
    mesh = cluster.connect(cfg, log=log)
    door = None
    try:
        tokenizer = mesh.tokenizer
        # Each worker runs a short prompt first: its first passes are slower than the rest.
        warm = tokenizer.apply_chat_template(WARM_UP, tokenize=False, add_generation_prompt=True)
        for worker in mesh.workers:
            mesh.generate(list(tokenizer.encode(warm)), 2, worker=worker)
        plans = _plans(setup)
        if setup.front_doors == 2:
            door = _second_door(plans[1], log)
        start_at = time.time() + 0.5
        if door is not None:
            _tell(door, {"start_at": start_at})
        sent = drive(mesh, plans[0], start_at)
        if door is not None:
            sent += _door_results(door)
        mesh.check_integrity()
    finally:
        if door is not None and door.poll() is None:
            door.kill()
            door.wait()
        mesh.stop()
    seconds = max(one.done_at for one in sent) - start_at
    ttfts = sorted(one.ttft_s for one in sent)
    prompt = sum(one.prompt_tokens for one in sent)
    reused = sum(one.reused_tokens for one in sent)
    return {
        f"requests_per_s_{name}": round(len(sent) / seconds, 3),
        f"ttft_p50_{name}_s": round(statistics.median(ttfts), 4),
        f"ttft_p99_{name}_s": round(_quantile(ttfts, 0.99), 4),
        f"hit_rate_{name}": round(reused / prompt, 4),
        f"requests_{name}": len(sent),
    }


def _plans(setup: Setup) -> list[Plan]:
    """Each front door's share: job i to door i modulo the doors, the clients split."""
    doors = setup.front_doors
    count = len(jobs(setup.workload))
    out = []
    for door in range(doors):
        mine = list(range(door, count, doors))
        offsets = [setup.offsets[i] for i in mine] if setup.offsets else []
        out.append(Plan(setup.workload, mine, setup.clients // doors, offsets))
    return out


def _second_door(plan: Plan, log) -> subprocess.Popen:
    """Start the second front door's process and wait until it has attached."""
    door = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.serve_door"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=_file_of(log),
        text=True,
    )
    address = ray.get_runtime_context().gcs_address
    _tell(door, {"address": address, "plan": plan._asdict()})
    line = _read_line(door, READY_TIMEOUT_S)
    if line != "ready":
        raise RuntimeError(f"the second front door did not attach (it said {line!r})")
    return door


def _file_of(log) -> Any:
    """`log` where a child process can write to it (a real file), else None (the child
    then writes to this process's stderr)."""
    try:
        log.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return None
    return log


def _tell(door: subprocess.Popen, message: dict) -> None:
    door.stdin.write(json.dumps(message) + "\n")
    door.stdin.flush()


def _read_line(door: subprocess.Popen, timeout_s: float) -> str:
    """The door's next line ("" when it ended first, or said nothing within timeout_s)."""
    ready, _, _ = select.select([door.stdout], [], [], timeout_s)
    return door.stdout.readline().strip() if ready else ""


def _door_results(door: subprocess.Popen) -> list[Sent]:
    # Its requests have deadlines of their own: this only bounds a door that hangs.
    line = _read_line(door, RESULTS_TIMEOUT_S)
    if not line.startswith("["):
        raise RuntimeError(f"the second front door failed (it said {line[:200]!r})")
    return [Sent(**one) for one in json.loads(line)]


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile of sorted values (linear between the closest ranks)."""
    at = q * (len(values) - 1)
    low = int(at)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (at - low)


def run(
    log=sys.stderr,
    repeats: int = 3,
    policies: tuple[str, ...] = POLICIES,
    workload: str = "demo",
    arrivals: str = "closed",
    front_doors: int = 1,
) -> dict[str, Any]:
    """Run the benchmark; returns the named figures (also the JSON line of the CLI).

    Args:
        repeats: how often the whole set of runs is repeated (each in a rotated order).
        policies: the benchmark's names of the policies to run (REGISTRY_NAMES).
        workload: "demo" or "trace" (`benchmarks.serve_workload`).
        arrivals: "closed" (CLIENTS clients, each sending its next job when its last one
            ended) or "open" (jobs start at Poisson arrivals, at LOAD of round-robin's
            requests per second measured closed-loop on a fresh mesh first).
        front_doors: 1, or 2 (a second process attached to the mesh sends every other
            job; figures suffixed `_2fd`).

    Raises:
        ValueError: a bad argument (its value named).
    """
    if type(repeats) is not int or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    unknown = [p for p in policies if p not in REGISTRY_NAMES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(REGISTRY_NAMES)}")
    if workload not in WORKLOADS or arrivals not in ARRIVALS or front_doors not in (1, 2):
        raise ValueError(
            f"workload {workload!r} (known: {', '.join(WORKLOADS)}), arrivals {arrivals!r} "
            f"(known: {', '.join(ARRIVALS)}), front_doors {front_doors!r} (1 or 2)"
        )
    cfg = config_from_dict({"workers": {"count": WORKERS, "threads": 1}})
    suffix = "_2fd" if front_doors == 2 else ""
    closed = Setup(workload, front_doors, CLIENTS, [])
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, namespace="kvmesh", log_to_driver=False)
    results: dict[str, list[dict[str, Any]]] = {}
    figures: dict[str, Any] = {"workload": workload, "arrivals": arrivals}
    try:
        setup = closed
        if arrivals == "open":
            print("round-robin's capacity, closed loop on a fresh mesh...", file=log)
            rate = _run_policy("capacity", _policy_config(cfg, "rr", True), closed, log)
            capacity = rate["requests_per_s_capacity"]
            figures[f"capacity_rr{suffix}"] = capacity
            figures[f"arrival_rate{suffix}"] = round(LOAD * capacity, 3)
            setup = Setup(workload, front_doors, 0, _arrivals(workload, LOAD * capacity))
        runs = [(name, share) for share in (True, False) for name in policies]
        for repeat in range(repeats):
            turn = repeat % len(runs)
            for name, share in runs[turn:] + runs[:turn]:
                key = (name if share else f"{name}_solo") + suffix
                how = f"{CLIENTS} clients" if setup.clients else "open-loop arrivals"
                print(
                    f"repeat {repeat + 1}/{repeats}, {key}: a fresh mesh, {how}, "
                    f"{front_doors} front door(s)...",
                    file=log,
                )
                one = _run_policy(key, _policy_config(cfg, name, share), setup, log)
                results.setdefault(key, []).append(one)
                print(
                    f"  {one[f'requests_per_s_{key}']} requests/s, TTFT p50 "
                    f"{one[f'ttft_p50_{key}_s']} s, p99 {one[f'ttft_p99_{key}_s']} s, "
                    f"hit rate {one[f'hit_rate_{key}']}",
                    file=log,
                )
    finally:
        if started:
            ray.shutdown()
    return figures | _summary(results, repeats, setup, suffix)


def _policy_config(cfg, name: str, share: bool):
    workers = dataclasses.replace(cfg.workers, share=share)
    return dataclasses.replace(cfg, workers=workers, routing=RoutingConfig(REGISTRY_NAMES[name]))


def _arrivals(workload: str, requests_per_s: float) -> list[float]:
    """Each job's start (seconds after the first): a Poisson process whose jobs bring
    `requests_per_s` requests a second (a job of n turns counts n)."""
    chosen = jobs(workload)
    per_s = requests_per_s * len(chosen) / requests_of(chosen)
    draw = random.Random(SEED)
    out, at = [], 0.0
    for _ in chosen:
        out.append(round(at, 4))
        at += draw.expovariate(per_s)
    return out


def _summary(
    results: dict[str, list[dict[str, Any]]], repeats: int, setup: Setup, suffix: str
) -> dict[str, Any]:
    """Medians over the repeats, each repeat's throughput and p99, and the ratios."""
    figures: dict[str, Any] = {
        "clients": setup.clients,
        "front_doors": setup.front_doors,
        "workers": WORKERS,
        "repeats": repeats,
        "requests": requests_of(jobs(setup.workload)),
    }
    for key, runs in results.items():
        for figure in ("requests_per_s", "ttft_p50", "ttft_p99", "hit_rate"):
            name = f"{figure}_{key}_s" if figure.startswith("ttft") else f"{figure}_{key}"
            figures[name] = round(statistics.median(run[name] for run in runs), 4)
        figures[f"requests_per_s_{key}_runs"] = [run[f"requests_per_s_{key}"] for run in runs]
        figures[f"ttft_p99_{key}_runs"] = [run[f"ttft_p99_{key}_s"] for run in runs]
    mine = f"kvmesh{suffix}"
    others = [f"{p}{suffix}" for p in REGISTRY_NAMES if p != "kvmesh"]
    others = [key for key in others if key in results]
    solo = [f"{p}_solo{suffix}" for p in REGISTRY_NAMES]
    solo = [key for key in solo if key in results]
    if mine not in results:
        return figures
    ratios = []  # (name, figure, the policies weighed against, which of theirs is best)
    if others:  # kvmesh against the best other policy on the mesh
        ratios += [("throughput_vs_best", "requests_per_s", others, max)]
        ratios += [("p99_vs_best", "ttft_p99", others, min)]
    if solo:  # kvmesh against the best policy without the mesh
        ratios += [("mesh_gain", "requests_per_s", solo, max)]
    for name, figure, against, best in ratios:
        unit = "_s" if figure.startswith("ttft") else ""
        medians = {key: figures[f"{figure}_{key}{unit}"] for key in (mine, *against)}
        figures[f"{name}{suffix}"] = round(medians[mine] / best(medians[k] for k in against), 3)
        # Each repeat's own: kvmesh's run against the others' runs of the same repeat.
        runs = {key: [run[f"{figure}_{key}{unit}"] for run in results[key]] for key in medians}
        figures[f"{name}{suffix}_runs"] = [
            round(runs[mine][r] / best(runs[k][r] for k in against), 3) for r in range(repeats)
        ]
    return figures
