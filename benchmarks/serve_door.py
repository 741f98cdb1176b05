"""One front door of `kvmesh bench serve` sending its share of a workload.

The benchmark's own process is the first front door; with `--front-doors 2` a second
process runs this module (`python -m benchmarks.serve_door`), attaches to the same mesh
through Ray (`cluster.connect(address=...)`, as any second front door does) and sends
the jobs it is given. The two processes speak JSON lines over the child's stdin and
stdout, nothing else:

    parent -> child   {"address": ray address, "plan": Plan}
    child  -> parent  "ready"                  (attached, tokenizer loaded)
    parent -> child   {"start_at": unix time}  (both doors start then)
    child  -> parent  [Sent, ...]              (one per request it sent)

Closed loop: `clients` threads each take the next job and send its turns, until none is
left. Open loop: each job starts at its own offset from the start (a Poisson process
drawn by the benchmark), however many are still running.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from typing import Any, NamedTuple

import cluster
from benchmarks.serve_workload import Job, jobs, run_job


class Plan(NamedTuple):
    """What one front door sends."""

    workload: str
    jobs: list[int]  # indexes into the workload's jobs
    clients: int  # closed loop: clients sending jobs one after another; 0: open loop
    offsets: list[float]  # open loop: each job's start, seconds after the start


class Sent(NamedTuple):
    """One request as its client saw it."""

    ttft_s: float  # from the call to the first token: routing and queueing included
    prompt_tokens: int
    reused_tokens: int  # prompt tokens found cached, on the worker or copied in
    done_at: float  # unix time its result came back


def drive(mesh: Any, plan: Plan, start_at: float) -> list[Sent]:
    """Send `plan`'s jobs through `mesh` from `start_at` (unix time) on; the requests'
    figures, once every job ended.

    Raises:
        RuntimeError: a request failed (the first failure named).
    """
    chosen = jobs(plan.workload)
    mine = [chosen[i] for i in plan.jobs]
    tokenizer = mesh.tokenizer if any(job.system for job in mine) else None
    sent: list[Sent] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def ask(tokens: list[int], new_tokens: int) -> Any:
        result = mesh.generate(tokens, new_tokens, ignore_eos=True)
        stats = result.stats
        reused = stats["local_hit_tokens"] + stats["remote_hit_tokens"]
        one = Sent(stats["ttft_client_s"], stats["prompt_tokens"], reused, time.time())
        with lock:
            sent.append(one)
        return result

    def send(job: Job) -> None:
        try:
            run_job(job, ask, tokenizer)
        except BaseException as exc:  # noqa: BLE001 - reported after the run
            with lock:
                errors.append(exc)

    time.sleep(max(0.0, start_at - time.time()))
    if plan.clients:
        work: queue.SimpleQueue = queue.SimpleQueue()
        for job in mine:
            work.put(job)
        threads = [threading.Thread(target=_client, args=(work, send)) for _ in range(plan.clients)]
        for thread in threads:
            thread.start()
    else:
        threads = []
        for job, offset in zip(mine, plan.offsets, strict=True):
            time.sleep(max(0.0, start_at + offset - time.time()))
            thread = threading.Thread(target=send, args=(job,))
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError(f"{len(errors)} jobs failed: {errors[0]!r}")
    return sent


def _client(work: queue.SimpleQueue, send) -> None:
    while True:
        try:
            job = work.get_nowait()
        except queue.Empty:
            return
        send(job)


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    plan = Plan(**spec["plan"])
    mesh = cluster.connect(address=spec["address"], log=sys.stderr)
    try:
        mesh.tokenizer  # noqa: B018 - loaded before the start (requests read it), not during it
        print("ready", flush=True)
        start_at = json.loads(sys.stdin.readline())["start_at"]
        sent = drive(mesh, plan, start_at)
        print(json.dumps([one._asdict() for one in sent]), flush=True)
    finally:
        mesh.shutdown()  # detaches: the mesh is the benchmark's


if __name__ == "__main__":
    main()
