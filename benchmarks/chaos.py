"""`kvmesh bench chaos`: a shared-prefix workload that must stay correct while faults hit.

A simulated two-node Ray cluster (two nodes of 2 CPUs, both this machine) runs the service
and three workers on the tiny model (so time goes to the cache path, not to compute), with
`workers.max_restarts: -1`, and a default deadline of REQUEST_TIMEOUT_S (`requests.timeout_s`)
for every request. Three client threads send routed requests in a loop: four shared
prefixes (64 to 128 tokens) x twelve suffixes, two tenants. Before anything else, the
no-cache reference of every prompt the workload can send is computed (`reuse=False`:
greedy, so identical prompts give identical token ids), and every output is compared
with it.

Phases (`duration_s` of workload, split by PHASES, plus the waits they need):

- warm-up: no faults; `hit_rate_before` is hit tokens / prompt tokens over its last half;
- chaos: a fault every 1 to 3 s, drawn from a seeded RNG; the first round draws each
  kind once, so every kind is met in any run;
- recovery: no faults; wait until the front door has every worker live again and the
  service reports them all, then `hit_rate_after_recovery` is measured as before;
- outage: the workload stops; a few prompts are computed on every worker (so whichever
  worker a routed request lands on holds them), then sent in a loop, one at a time, in
  OUTAGE_ROUNDS rounds of UP_S with the service up then OUTAGE_S while it is unreachable
  (its process stopped with SIGSTOP, as a hung or cut-off service would be, then
  continued, and the workers seen asking it again before the next round), and for
  OUTAGE_S right after a restart (`ray.kill`). The rounds interleave the two windows so
  that a burst of load from elsewhere on the machine falls on both alike.
  `outage_slowdown` is the median request time (wall time around `mesh.generate`) while
  stopped / while up, over all rounds, `restart_slowdown` the same after the restart
  against up, each over the requests whose every full page was a local hit: the outage's
  overhead, not lost reuse. (A prompt's tail short of a page is cached nowhere, so the
  worker still asks the service about it: that is part of what an outage costs.)

The faults:

- worker_kill: SIGKILL of a worker's process (pid from the actor), as the OOM killer
  would; Ray restarts it with an empty store. Only while every worker is live, so a live
  worker is always left to route to.
- service_restart: `ray.kill(service, no_restart=False)`: Ray restarts it with the same
  arguments, a new epoch and an empty index, which the workers rebuild by resyncing.
- event_drop: the worker's next batch of KV events is lost on its way to the service,
  while its publisher believes it delivered (its client's `publish_events` is shadowed
  for one call, inside the worker's process): the service must see the gap in the
  sequence numbers at the following batch and ask for a resync.
- worker_forgotten: the service loses all it knew of a live worker (a front-door
  `report_dead`): its pages leave the index, and the worker must register and resync.
- malformed: one message of each kind in `malformed_probes` (truncated msgpack, wrong
  version, unknown type, oversize fields and frames, bad field types, too deep, a
  request the front door may not send, ...), each from a fresh ZMQ DEALER with the front
  door's CurveZMQ keys (one with a key the mesh does not know), to the service's socket.
  Each must get an error reply, or no reply where that is the right answer (a frame
  over the size limit, a stranger's key), and the service must answer a good request
  after them.

Faults inside a worker, installed in its process by `benchmarks.faults` (on a live worker
drawn at random):

- pass_failure: its next forward pass raises (`failing_passes`): the sequences of that
  pass fail with the injected error, the loop goes on.
- loop_failure: its scheduler raises once (`loop_failure`): the serving loop dies, fails
  what it held with ServingStopped (the front door routes those requests elsewhere) and
  starts again after a second. At most one a worker within the loop's restart window,
  so that no loop stays down for good.
- nan_logits: its next forward pass returns NaN logits: sampling fails those sequences.
- slow_peer: every page source it opens waits SLOW_PEER_S per fetch (its copy-ins are
  slow, off the serving thread); healed at the next fault.
- slow_service: the service answers each of its matches SLOW_SERVICE_S late (slow, not
  dead); healed at the next fault.

And requests of the chaos' own, beside the workload:

- abandoned_streams: one or two streams of a workload prompt with ABANDONED_TOKENS to
  decode (`ignore_eos`), pinned to a live worker that serves, are read for a chunk or two
  and closed. The worker must end each with RequestCancelled (`cancelled_requests`) and, once
  CANCEL_WAIT_S and two more of its passes went by, no sequence it cancelled may hold a
  page (`pages_held_by_cancelled`).
- short_deadline: a routed request with SHORT_DEADLINE_S to decode SHORT_DEADLINE_TOKENS:
  it should end with DeadlineExceeded (`short_deadline_exceeded`; finishing in time is
  fine too), and by its deadline plus HUNG_GRACE_S.

`faults` counts them by kind, with the outage phase's own `service_pause` and restart;
`loop_failures_injected` is its loop_failure count.

Every failed request is explained by an injected fault (its error names it: "injected:",
"logits hold NaN", or a worker that stopped serving after an injected loop failure), by
a deadline (DeadlineExceeded) or by a cancellation (RequestCancelled), or by nothing:
`failed_requests` counts those (the target is 0), `errors` shows a few of them, and
`explained_failures` counts the others by what explains them. `deadline_exceeded` counts
the workload's requests (all with the default deadline) that passed it (target 0), and
`hung_requests` the requests that ended later than their deadline plus HUNG_GRACE_S, or
never (client threads still in a request at the end): target 0.

At the end (every request done), each live worker's pages must be free or cached
(`leaked_pages`: total - free - cached, over the workers), the index must hold what the
workers hold, and after shutdown no `/dev/shm/kvmesh-*` segment created during the run may
be left (`leaked_shm_segments`).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import ray
import zmq
from ray.cluster_utils import Cluster

import cluster
from benchmarks import faults as worker_faults
from cache_service import protocol
from cache_service.actor import RAY_NAMESPACE, get_service
from cache_service.events import Namespace
from cache_service.messages import ApplyResult, GetStats, Match, PublishEvents
from cache_service.protocol import PROTOCOL_VERSION
from cluster.config import config_from_dict
from cluster.errors import DeadlineExceeded, RequestCancelled
from workers.service.client import ServiceClient, ServiceUnavailable, ray_resolver

DEFAULT_SECONDS = 50.0
SECONDS_ENV = "KVMESH_CHAOS_SECONDS"  # the default duration, for short runs (tests)
WORKERS = 3
REQUEST_TIMEOUT_S = 30.0  # the mesh's default deadline: far past what any request needs
CONFIG = {
    "model": {"name": "tiny"},
    # 256 pages a worker: fewer than the workload's prompts need, so pages are evicted.
    "store": {"num_pages": 256},
    "workers": {
        "count": WORKERS,
        "threads": 1,
        "num_cpus": 1,
        "max_restarts": -1,
        "publish_interval_s": 0.2,
        "copy_policy": "always",
    },
    "requests": {"timeout_s": REQUEST_TIMEOUT_S},
}
PREFIX_LENGTHS = (64, 80, 100, 128)  # 100: a prefix that ends inside a page
SUFFIXES = 12  # per prefix
SUFFIX_TOKENS = (8, 40)  # lengths drawn in this range
TENANTS = ("acme", "globex")
NEW_TOKENS = 4
CLIENTS = 3
# Shares of duration_s: warm-up, chaos, recovery (measured after the workers are back).
PHASES = {"warmup": 0.2, "chaos": 0.45, "recovery": 0.2}
FAULT_GAP_S = (1.0, 3.0)
FAULT_WEIGHTS = {
    "worker_kill": 3,
    "service_restart": 2,
    "event_drop": 2,
    "worker_forgotten": 1,
    "malformed": 2,
    "pass_failure": 1,
    "loop_failure": 1,
    "nan_logits": 1,
    "slow_peer": 1,
    "slow_service": 1,
    "abandoned_streams": 2,
    "short_deadline": 2,
}
# How long chaos may outlast its share to meet every kind once: twelve kinds, a gap of up
# to FAULT_GAP_S before each, and the waits some of them need (the service back, replies).
CHAOS_OVERRUN_S = 75.0
SLOW_PEER_S = 2.0  # a slowed peer's wait per fetch
SLOW_SERVICE_S = 1.5  # a slowed service's wait per match
# A loop failure per worker within the serving loop's restart window at most: a loop that
# fails more often than it may restart stays down, and the worker with it.
LOOP_FAILURE_SPACING_S = 60.0
# An abandoned stream's tokens to decode: far more than it decodes before it is closed
# (prompt and all within the tiny model's 1024 positions).
ABANDONED_TOKENS = 800
CANCEL_WAIT_S = 0.5  # after the streams closed, before asking the worker what they hold
CANCEL_PASSES = 2  # and the worker's passes after that (a cancellation ends in one or two)
SHORT_DEADLINE_S = 0.05
SHORT_DEADLINE_TOKENS = 400  # far more than SHORT_DEADLINE_S decodes
HUNG_GRACE_S = 1.0  # a request that ends later than its deadline and this is hung
# What explains a failed request, by a piece of its error (the first that matches).
INJECTED_ERRORS = (
    ("injected: a forward pass failed", "pass_failure"),
    ("logits hold NaN", "nan_logits"),
    ("injected: the serving loop failed", "loop_failure"),
    ("injected:", "injected"),
)
RECOVERY_TIMEOUT_S = 120.0
OUTAGE_ROUNDS = 3  # of (service up, service stopped)
OUTAGE_S = 2.5  # the service stopped this long in a round (its first request waits a timeout)
UP_S = 1.5  # the same requests measured with the service up, just before
OUTAGE_PROMPTS = 6
REPLY_WAIT_S = 3.0  # for an error reply to a malformed frame
SILENCE_WAIT_S = 1.0  # listening for a reply that must not come
SETTLE_S = 10.0  # for the last processes to unlink their segments after shutdown
SHM = Path("/dev/shm")


class Record(NamedTuple):
    """One request, as the client saw it."""

    phase: str
    started: float  # seconds since the run started
    seconds: float  # wall time around mesh.generate
    prompt: int  # index into the workload's prompts
    tenant: str
    worker: str  # where it ran ("" when it failed)
    prompt_tokens: int
    hit_tokens: int  # local + remote hits
    local_tokens: int
    correct: bool
    error: str  # "" when it succeeded
    cause: str  # what explains its error (`explain`): "" when it succeeded or nothing does


class Probe(NamedTuple):
    """One malformed message for the service: its frames, and the right answer to it
    ("error": an error reply; "silence": none; "either": an error reply or none)."""

    name: str
    frames: list[bytes]
    expect: str
    stranger: bool = False  # sent with a key the mesh does not know


# ---------------------------------------------------------------------------------- run


def run(duration_s: float | None = None, seed: int = 0, log=sys.stderr) -> dict[str, Any]:
    """Run the benchmark; returns the named figures (also the JSON line of the CLI).

    Args:
        duration_s: seconds of workload, split between the phases (default: $KVMESH_CHAOS_SECONDS
            or DEFAULT_SECONDS); the start, the waits for recovery and the shutdown add to it.
        seed: seeds the prompts, the clients' choices and the faults.
        log: where progress goes.
    """
    if duration_s is None:
        duration_s = float(os.environ.get(SECONDS_ENV, DEFAULT_SECONDS))
    started = time.monotonic()
    segments_before = _segments()
    sim = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    sim.add_node(num_cpus=2)
    sim.wait_for_nodes()
    ray.init(address=sim.address, namespace=RAY_NAMESPACE, log_to_driver=False)
    mesh = None
    try:
        mesh = cluster.connect(config_from_dict(CONFIG), log=log)
        figures = _run_phases(mesh, duration_s, seed, started, log)
    finally:
        if mesh is not None:
            mesh.shutdown()
        ray.shutdown()
        sim.shutdown()
    leaked = _settled_segments(segments_before)
    if leaked:
        print(f"shared-memory segments left behind: {sorted(leaked)}", file=log)
    figures["leaked_shm_segments"] = len(leaked)
    figures["duration_s"] = duration_s
    figures["seconds"] = round(time.monotonic() - started, 1)
    return _ordered(figures)


def _run_phases(mesh, duration_s: float, seed: int, started: float, log) -> dict[str, Any]:
    workload = Workload(mesh, seed, started, log)
    workload.compute_references()
    chaos = Chaos(mesh, workload, random.Random(seed), log)
    try:
        figures = _under_load(mesh, workload, chaos, duration_s, log)
        figures.update(_measure_outage(mesh, workload, chaos, log))
        ended = _outcomes(workload, chaos)
        return {
            **workload.summary(),
            **chaos.summary(),
            **ended,
            **_end_state(mesh, log),
            **figures,
        }
    finally:
        chaos.client.close()


def _under_load(mesh, workload: Workload, chaos: Chaos, duration_s: float, log) -> dict:
    """Warm-up, chaos and recovery, with the client threads running throughout."""
    workload.start()
    try:
        workload.enter("warmup", PHASES["warmup"] * duration_s)
        before = workload.hit_rate("warmup")
        print(f"hit rate before the faults: {before:.3f}", file=log)
        workload.phase = "chaos"
        chaos.run(PHASES["chaos"] * duration_s)
        workload.phase = "recovery"
        recovery_s = _await_recovery(mesh, chaos.client, log)
        workload.enter("recovered", PHASES["recovery"] * duration_s)
        after = workload.hit_rate("recovered")
        print(f"hit rate after recovery: {after:.3f}", file=log)
    finally:
        workload.stop()
    return {
        "hit_rate_before": round(before, 4),
        "hit_rate_after_recovery": round(after, 4),
        "recovery_s": round(recovery_s, 1),
    }


# ---------------------------------------------------------------------------------- workload


class Workload:
    """Client threads sending routed requests for the shared-prefix prompts, each output
    checked against the no-cache reference."""

    def __init__(self, mesh, seed: int, started: float, log):
        self.mesh = mesh
        self.log = log
        self.seed = seed
        self.started = started
        self.prompts = _prompts(random.Random(seed))
        self.references: list[list[int]] = []
        self.records: list[Record] = []  # appended by the client threads (atomic)
        self.phase = "warmup"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.stuck = 0  # client threads still in a request when the workload stopped
        # Set once a loop failure was injected: a worker that stopped serving is explained.
        self.loop_failed = threading.Event()

    def compute_references(self) -> None:
        """The output of every prompt with nothing reused (the workers take turns)."""
        print(f"computing the no-cache reference of {len(self.prompts)} prompts...", file=self.log)
        workers = sorted(self.mesh.workers)
        self.references = [
            self.mesh.generate(
                tokens, NEW_TOKENS, "reference", worker=workers[i % len(workers)], reuse=False
            ).token_ids
            for i, tokens in enumerate(self.prompts)
        ]

    def start(self) -> None:
        for lane in range(CLIENTS):
            rng = random.Random(self.seed * 1000 + lane)
            # Daemon threads: a request that never returns is reported, not waited for.
            thread = threading.Thread(
                target=self._client, args=(rng,), name=f"chaos-client-{lane}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def enter(self, phase: str, seconds: float) -> None:
        """Run `phase` for `seconds` (the threads label their requests with it)."""
        print(f"phase {phase} ({seconds:.0f}s)", file=self.log)
        self.phase = phase
        time.sleep(seconds)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)
        self.stuck = sum(1 for thread in self._threads if thread.is_alive())
        if self.stuck:
            print(f"{self.stuck} client threads stuck in a request", file=self.log)

    def _client(self, rng: random.Random) -> None:
        while not self._stop.is_set():
            self.request(rng.randrange(len(self.prompts)), rng.choice(TENANTS), self.phase)

    def request(self, prompt: int, tenant: str, phase: str, worker: str | None = None) -> Record:
        """Send one request (routed, unless `worker` is given) and keep its record (never
        raises)."""
        start, error, cause = time.monotonic(), "", ""
        try:
            out = self.mesh.generate(self.prompts[prompt], NEW_TOKENS, tenant, worker=worker)
        except Exception as exc:  # a failed request is counted, and a finding unless explained
            error, cause = _error_text(exc), explain(exc, self.loop_failed.is_set())
            print(f"request failed ({cause or 'unexplained'}): {error}", file=self.log)
            out = None
        seconds = time.monotonic() - start
        stats = out.stats if out is not None else {}
        record = Record(
            phase=phase,
            started=start - self.started,
            seconds=seconds,
            prompt=prompt,
            tenant=tenant,
            worker=stats.get("worker", ""),
            prompt_tokens=stats.get("prompt_tokens", 0),
            hit_tokens=stats.get("local_hit_tokens", 0) + stats.get("remote_hit_tokens", 0),
            local_tokens=stats.get("local_hit_tokens", 0),
            correct=out is not None and out.token_ids == self.references[prompt],
            error=error,
            cause=cause,
        )
        if out is not None and not record.correct:
            print(f"wrong output for prompt {prompt} on {record.worker}", file=self.log)
        self.records.append(record)
        return record

    def hit_rate(self, phase: str) -> float:
        """Hit tokens / prompt tokens over the last half (by time) of a phase's requests."""
        done = [r for r in self.records if r.phase == phase and not r.error]
        if not done:
            return 0.0
        middle = (min(r.started for r in done) + max(r.started for r in done)) / 2
        tail = [r for r in done if r.started >= middle]
        return sum(r.hit_tokens for r in tail) / max(1, sum(r.prompt_tokens for r in tail))

    def summary(self) -> dict[str, Any]:
        """The workload's figures (its requests all have the mesh's default deadline)."""
        failed = [r for r in self.records if r.error]
        return {
            "requests": len(self.records),
            "wrong_outputs": sum(1 for r in self.records if not r.error and not r.correct),
            "deadline_exceeded": sum(1 for r in failed if r.cause == "deadline"),
            "requests_during_chaos": sum(1 for r in self.records if r.phase == "chaos"),
            "stuck_clients": self.stuck,
            "max_request_s": round(max((r.seconds for r in self.records), default=0.0), 3),
        }


def explain(exc: BaseException, loop_failed: bool) -> str:
    """What explains a request's error: "deadline" (DeadlineExceeded), "cancelled"
    (RequestCancelled), the kind of the injected fault its error names (INJECTED_ERRORS),
    "loop_failure" for a worker that stopped serving once a loop failure was injected
    (`loop_failed`), or "" when nothing does: a finding."""
    if isinstance(exc, DeadlineExceeded):
        return "deadline"
    if isinstance(exc, RequestCancelled):
        return "cancelled"
    text = f"{type(exc).__name__}: {exc}"
    for piece, kind in INJECTED_ERRORS:
        if piece in text:
            return kind
    if loop_failed and ("ServingStopped" in text or "stopped serving" in text):
        return "loop_failure"
    return ""


def _error_text(exc: BaseException) -> str:
    """An error in a line: a Ray task error's own last line is its cause (the worker's
    traceback comes before it)."""
    text = str(exc).strip()
    if isinstance(exc, ray.exceptions.RayError) and text:
        text = text.splitlines()[-1].strip()
    return f"{type(exc).__name__}: {text}"[:300]


def _outcomes(workload: Workload, chaos: Chaos) -> dict[str, Any]:
    """How every request ended, the workload's and the chaos' own: the failures nothing
    explains (`failed_requests`, `errors`: the findings), those explained, by what, and
    the requests that ended past their deadline and HUNG_GRACE_S, or never."""
    failures = [(r.cause, r.error) for r in workload.records if r.error] + chaos.failures
    unexplained = [error for cause, error in failures if not cause]
    late = workload.mesh.config.requests.timeout_s + HUNG_GRACE_S
    hung = sum(1 for r in workload.records if r.seconds > late)
    return {
        "failed_requests": len(unexplained),
        "hung_requests": hung + workload.stuck + chaos.late,
        "explained_failures": dict(sorted(Counter(c for c, _ in failures if c).items())),
        "errors": sorted(set(unexplained))[:5],
    }


def _prompts(rng: random.Random) -> list[list[int]]:
    """Every prompt the workload sends: each shared prefix with each of its suffixes."""
    prompts = []
    for length in PREFIX_LENGTHS:
        prefix = [rng.randrange(1, 256) for _ in range(length)]
        for _ in range(SUFFIXES):
            suffix = [rng.randrange(1, 256) for _ in range(rng.randint(*SUFFIX_TOKENS))]
            prompts.append(prefix + suffix)
    return prompts


# ---------------------------------------------------------------------------------- faults


class Chaos:
    """Injects the faults (see the module docstring) and counts them."""

    def __init__(self, mesh, workload: Workload, rng: random.Random, log):
        self.mesh = mesh
        self.workload = workload
        self.rng = rng
        self.log = log
        self.faults: Counter[str] = Counter()
        self.failures: list[tuple[str, str]] = []  # (cause, error) of its own requests
        self.late = 0  # its own requests that ended past their deadline and HUNG_GRACE_S
        self.cancelled = 0  # abandoned streams their worker ended with RequestCancelled
        self.not_cancelled = 0  # abandoned streams it did not (finished, or still running)
        self.held_by_cancelled = 0  # pages cancelled sequences held after a pass or two
        self.short: Counter[str] = Counter()  # short-deadline requests: exceeded / completed
        self.short_max_s = 0.0
        self._slowed: set[str] = set()  # workers with a slow fault, healed at the next
        self._loop_failed_at: dict[str, float] = {}  # worker -> its last loop failure
        self.malformed: Counter[str] = Counter()  # answered / dropped / unexpected
        self.codes: Counter[str] = Counter()  # the error codes of the replies
        self.unexpected: list[str] = []
        self.unresponsive = 0  # bursts after which the service did not answer
        front_door = mesh.keys.front_door
        self.keys = (front_door.public, front_door.secret)
        # The benchmark's own client: no circuit breaker, re-resolves after a timeout.
        self.client = ServiceClient(ray_resolver(), timeout_s=1.0, retries=1, client_keys=self.keys)
        self._inject: dict[str, Callable[[], bool]] = {
            "worker_kill": self.kill_worker,
            "service_restart": self.restart_service,
            "event_drop": self.drop_events,
            "worker_forgotten": self.forget_worker,
            "malformed": self.send_malformed,
            "pass_failure": self.fail_pass,
            "loop_failure": self.fail_loop,
            "nan_logits": self.poison_logits,
            "slow_peer": self.slow_peer,
            "slow_service": self.slow_service,
            "abandoned_streams": self.abandon_streams,
            "short_deadline": self.short_deadline,
        }

    def run(self, seconds: float) -> None:
        """A fault every FAULT_GAP_S for `seconds`, and until each kind was met once."""
        print(f"phase chaos ({seconds:.0f}s)", file=self.log)
        start = time.monotonic()
        pending = list(FAULT_WEIGHTS)
        self.rng.shuffle(pending)
        try:
            while time.monotonic() - start < seconds or pending:
                if time.monotonic() - start > seconds + CHAOS_OVERRUN_S:
                    print(f"chaos ended before faults {pending} could be injected", file=self.log)
                    break
                time.sleep(self.rng.uniform(*FAULT_GAP_S))
                self._heal_slowed()
                kind = self._draw(pending)
                if kind is not None and self._inject[kind]():
                    self.faults[kind] += 1
                    with contextlib.suppress(ValueError):
                        pending.remove(kind)
                    total = sum(self.faults.values())
                    done = len(self.workload.records)
                    print(f"  fault {total}: {kind} ({done} requests so far)", file=self.log)
        finally:
            self._heal_slowed()

    def _draw(self, pending: list[str]) -> str | None:
        """The next kind: the first pending one that can be injected now, else a weighted
        draw among those that can."""
        all_live = len(self.mesh.live_workers()) == WORKERS
        possible = [
            k
            for k in FAULT_WEIGHTS
            if (k != "worker_kill" or all_live) and (k != "loop_failure" or self._loop_failable())
        ]
        for kind in pending:
            if kind in possible:
                return kind
        if not possible:
            return None
        return self.rng.choices(possible, [FAULT_WEIGHTS[k] for k in possible])[0]

    def kill_worker(self) -> bool:
        victim = self.rng.choice(sorted(self.mesh.live_workers()))
        try:
            _, pid = ray.get(self.mesh.workers[victim].process.remote(), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            return False  # dead or stuck already: nothing killed, nothing counted
        os.kill(pid, signal.SIGKILL)
        print(f"  SIGKILL {victim} (pid {pid})", file=self.log)
        return True

    def restart_service(self) -> bool:
        if not self.await_service(15.0):
            return False  # still coming back from the last restart
        ray.kill(get_service(), no_restart=False)
        print("  service killed (Ray restarts it)", file=self.log)
        return True

    def drop_events(self) -> bool:
        victim = self.rng.choice(sorted(self.mesh.live_workers()))
        try:
            ray.get(self.mesh.workers[victim].__ray_call__.remote(_lose_next_batch), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            return False
        print(f"  {victim}'s next event batch will be lost", file=self.log)
        return True

    def forget_worker(self) -> bool:
        victim = self.rng.choice(sorted(self.mesh.live_workers()))
        if not self.await_service(15.0):
            return False
        try:
            self.client.report_dead(victim)
        except (ServiceUnavailable, RuntimeError):
            return False
        print(f"  the service forgot {victim}", file=self.log)
        return True

    def send_malformed(self) -> bool:
        if not self.await_service(15.0):
            return False
        endpoint = ray.get(get_service().endpoint.remote(), timeout=10)
        probes = malformed_probes(self.rng.randrange(1, 1 << 31))
        for probe in probes:
            self._check(probe, _send(endpoint, self.keys, probe))
        if not self.await_service(5.0):
            self.unresponsive += 1
            print("  the service stopped answering after malformed frames", file=self.log)
        print(f"  {len(probes)} malformed frames sent", file=self.log)
        return True

    # -- faults inside a worker (benchmarks.faults) --------------------------------------

    def fail_pass(self) -> bool:
        victim = self._install(self._live(), "failing_passes", 1)
        if victim is not None:
            print(f"  {victim}'s next forward pass will raise", file=self.log)
        return victim is not None

    def fail_loop(self) -> bool:
        victim = self._install(self._loop_failable(), "loop_failure")
        if victim is None:
            return False
        self._loop_failed_at[victim] = time.monotonic()
        self.workload.loop_failed.set()
        print(f"  {victim}'s serving loop will fail once", file=self.log)
        return True

    def poison_logits(self) -> bool:
        victim = self._install(self._live(), "nan_logits", 1)
        if victim is not None:
            print(f"  {victim}'s next forward pass will return NaN logits", file=self.log)
        return victim is not None

    def slow_peer(self) -> bool:
        victim = self._install(self._live(), "slow_peer", SLOW_PEER_S)
        if victim is None:
            return False
        self._slowed.add(victim)
        print(f"  {victim}'s peers answer {SLOW_PEER_S:g}s late per fetch", file=self.log)
        return True

    def slow_service(self) -> bool:
        victim = self._install(self._live(), "slow_service", SLOW_SERVICE_S)
        if victim is None:
            return False
        self._slowed.add(victim)
        print(f"  the service answers {victim}'s matches {SLOW_SERVICE_S:g}s late", file=self.log)
        return True

    def _live(self) -> list[str]:
        return sorted(self.mesh.live_workers())

    def _loop_failable(self) -> list[str]:
        """Live workers whose serving loop may fail once more (LOOP_FAILURE_SPACING_S)."""
        now = time.monotonic()
        return [
            worker
            for worker in self._live()
            if now - self._loop_failed_at.get(worker, -LOOP_FAILURE_SPACING_S)
            >= LOOP_FAILURE_SPACING_S
        ]

    def _install(self, workers: list[str], fault: str, *args: Any) -> str | None:
        """Install `fault` (a name of benchmarks.faults.FAULTS) in one of `workers`, drawn
        at random; the worker, or None when there was none or it did not answer."""
        if not workers:
            return None
        victim = self.rng.choice(workers)
        try:
            ray.get(worker_faults.install(self.mesh.workers[victim], fault, *args), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            return None  # dead or stuck already: nothing installed, nothing counted
        return victim

    def _heal_slowed(self) -> None:
        """Take the slow faults away (a worker restarted since has none left)."""
        for victim in sorted(self._slowed):
            try:
                ray.get(worker_faults.install(self.mesh.workers[victim], "heal"), timeout=10)
            except (ray.exceptions.RayError, TimeoutError):
                print(f"  could not heal {victim} (gone or stuck)", file=self.log)
        self._slowed.clear()

    # -- requests of its own -------------------------------------------------------------

    def abandon_streams(self) -> bool:
        """Streams on one live worker, each read for a chunk or two and closed; then what
        the worker made of them (see the module docstring)."""
        live = self._live()
        if not live:
            return False
        victim = self.rng.choice(live)
        handle = self.mesh.workers[victim]
        # A stream pinned to a worker fails when the worker is gone (as it should): only on
        # one serving now (no other fault comes while the streams run).
        try:
            if not ray.get(handle.health.remote(), timeout=10).serving:
                return False
        except (ray.exceptions.RayError, TimeoutError):
            return False
        # The streams with their iterators: an iterator dropped cancels its stream too.
        streams: list[tuple[cluster.TokenStream, Iterator[cluster.StreamChunk]]] = []
        try:
            for _ in range(self.rng.randint(1, 2)):
                streams.append(self._open_stream(victim))
            watched = ray.get(handle.__ray_call__.remote(_watch, ABANDONED_TOKENS), timeout=10)
        except Exception as exc:  # explained (a fault met on the way) or a finding
            self._failed("an abandoned stream", exc)
            return False
        finally:
            for stream, _ in streams:
                stream.close()
        time.sleep(CANCEL_WAIT_S)
        try:
            cancelled, held = ray.get(
                handle.__ray_call__.remote(_after_cancel, CANCEL_PASSES), timeout=30
            )
        except (ray.exceptions.RayError, TimeoutError) as exc:
            print(f"  {victim} did not say what its cancelled streams hold: {exc}", file=self.log)
            return False
        self.cancelled += cancelled
        self.not_cancelled += watched - cancelled
        self.held_by_cancelled += held
        print(
            f"  {len(streams)} streams abandoned on {victim}: {cancelled} of {watched} running "
            f"cancelled there, {held} pages still held by cancelled sequences",
            file=self.log,
        )
        return True

    def _open_stream(
        self, worker: str
    ) -> tuple[cluster.TokenStream, Iterator[cluster.StreamChunk]]:
        """A long stream of a workload prompt on `worker`, read for a chunk or two; the
        stream and its iterator."""
        prompts = self.workload.prompts
        stream = self.mesh.stream(
            prompts[self.rng.randrange(len(prompts))],
            ABANDONED_TOKENS,
            self.rng.choice(TENANTS),
            worker=worker,
            ignore_eos=True,
        )
        chunks = iter(stream)
        for _ in range(self.rng.randint(1, 2)):
            next(chunks)
        return stream, chunks

    def short_deadline(self) -> bool:
        """A routed request with a deadline far too short for it: it must end by then."""
        prompts = self.workload.prompts
        start = time.monotonic()
        try:
            self.mesh.generate(
                prompts[self.rng.randrange(len(prompts))],
                SHORT_DEADLINE_TOKENS,
                self.rng.choice(TENANTS),
                ignore_eos=True,
                timeout_s=SHORT_DEADLINE_S,
            )
            outcome = "completed"
        except DeadlineExceeded:
            outcome = "exceeded"
        except Exception as exc:
            self._failed("a short-deadline request", exc)
            outcome = "failed"
        seconds = time.monotonic() - start
        self.short[outcome] += 1
        self.short_max_s = max(self.short_max_s, seconds)
        if seconds > SHORT_DEADLINE_S + HUNG_GRACE_S:
            self.late += 1
            print(f"  a short-deadline request ended after {seconds:.2f}s (hung)", file=self.log)
        print(f"  a {SHORT_DEADLINE_S:g}s request {outcome} in {seconds:.3f}s", file=self.log)
        return True

    def _failed(self, what: str, exc: BaseException) -> None:
        cause, error = explain(exc, self.workload.loop_failed.is_set()), _error_text(exc)
        self.failures.append((cause, error))
        print(f"  {what} failed ({cause or 'unexplained'}): {error}", file=self.log)

    # -- malformed frames ----------------------------------------------------------------

    def _check(self, probe: Probe, reply: protocol.Message | None) -> None:
        is_error = reply is not None and reply.type == protocol.ERROR
        if is_error:
            self.codes[reply.body.code] += 1
        good = {
            "error": is_error,
            "silence": reply is None,
            "either": reply is None or is_error,
        }[probe.expect]
        if not good:
            self.malformed["unexpected"] += 1
            got = "no reply" if reply is None else f"a {reply.type} reply"
            self.unexpected.append(f"{probe.name}: {got}")
            print(f"  malformed {probe.name}: expected {probe.expect}, got {got}", file=self.log)
        else:
            self.malformed["answered" if is_error else "dropped"] += 1

    def await_service(self, timeout_s: float) -> bool:
        """Whether the service answers a stats request within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                self.client.stats()
                return True
            except (ServiceUnavailable, RuntimeError):
                time.sleep(0.2)
        return False

    def summary(self) -> dict[str, Any]:
        return {
            "faults_injected": sum(self.faults.values()),
            "faults": dict(sorted(self.faults.items())),
            "loop_failures_injected": self.faults["loop_failure"],
            "cancelled_requests": self.cancelled,
            "pages_held_by_cancelled": self.held_by_cancelled,
            "abandoned_not_cancelled": self.not_cancelled,
            "short_deadline_exceeded": self.short["exceeded"],
            "short_deadline_completed": self.short["completed"],
            "short_deadline_max_s": round(self.short_max_s, 3),
            "malformed_frames": sum(self.malformed.values()),
            "malformed_answered": self.malformed["answered"],
            "malformed_dropped": self.malformed["dropped"],
            "malformed_unexpected": self.malformed["unexpected"],
            "malformed_error_codes": dict(sorted(self.codes.items())),
            "unresponsive_after_malformed": self.unresponsive,
            "unexpected_replies": self.unexpected[:5],
        }


def _lose_next_batch(worker) -> None:
    """(Runs in the worker's process.) The publisher's next events batch never reaches
    the service, and the publisher takes it as applied, as a batch lost on the wire after
    the sender moved on would be."""
    client = worker.member.publisher.client

    def lost(worker_id, epoch, seq, events):
        del client.publish_events  # the instance attribute: one batch only
        return ApplyResult(True, False, "applied", seq)

    client.publish_events = lost


def _watch(worker, max_new_tokens: int) -> int:
    """(Runs in a worker's process.) Keep the streams running there with `max_new_tokens`
    (the chaos' own, about to be abandoned) for `_after_cancel`; how many there are."""
    worker.chaos_watched = [
        seq
        for seq in list(worker.scheduler.running)
        if seq.on_token is not None and seq.max_new_tokens == max_new_tokens
    ]
    return len(worker.chaos_watched)


def _after_cancel(worker, passes: int, timeout_s: float = 10.0) -> tuple[int, int]:
    """(Runs in a worker's process.) Once `passes` more steps ran (or `timeout_s` passed,
    with nothing to run): how many watched streams ended with RequestCancelled, and the
    pages still held by sequences ended by a cancellation."""
    scheduler = worker.scheduler
    until, deadline = scheduler.steps + passes, time.monotonic() + timeout_s
    while scheduler.steps < until and time.monotonic() < deadline:
        time.sleep(0.005)
    watched = worker.__dict__.pop("chaos_watched", [])
    cancelled = sum(1 for seq in watched if isinstance(seq.error, RequestCancelled))
    held = 0
    for seq in list(scheduler.running):
        allocation = seq.allocation  # read once: the serving thread may release it now
        if isinstance(seq.ending, RequestCancelled) and allocation is not None:
            held += len(allocation.pages)
    return cancelled, held


def _pid(actor) -> int:
    """(Runs in an actor's process.) Its pid."""
    return os.getpid()


# ---------------------------------------------------------------------------------- malformed


def malformed_probes(request_id: int) -> list[Probe]:
    """One message of each kind that breaks the protocol (or the front door's role)."""
    good = protocol.encode(protocol.request(request_id, GetStats()))
    match = _encode(request_id, Match(Namespace("tiny", "", "s"), [1] * 64, None))

    def envelope(kind="stats", body=None, version=PROTOCOL_VERSION, rid=request_id) -> bytes:
        return msgpack.packb({"v": version, "t": kind, "id": rid, "b": body or {}})

    def match_body(namespace=("tiny", "", "s"), tokens=b"\0" * 16) -> bytes:
        body = {"namespace": list(namespace), "tokens": tokens, "requester": None}
        return envelope("match", body)

    nested: Any = 1
    for _ in range(40):
        nested = [nested]
    oversize = b"\x01" * (protocol.DEFAULT_LIMITS.max_frame_bytes + 8192)
    forbidden = PublishEvents("w0", 1, 1, [])
    return [
        Probe("truncated_msgpack", [match[: len(match) // 2]], "error"),
        Probe("reserved_byte", [b"\xc1" * 8], "error"),
        Probe("not_a_map", [msgpack.packb([1, 2, 3])], "error"),
        Probe("huge_declared_array", [b"\xdd\x7f\xff\xff\xff"], "error"),
        Probe("wrong_version", [envelope(version=PROTOCOL_VERSION + 7)], "error"),
        Probe("version_as_text", [envelope(version=str(PROTOCOL_VERSION))], "error"),
        Probe("unknown_type", [envelope("drop_tables")], "error"),
        Probe("reply_type_as_request", [envelope("ok")], "error"),
        Probe("negative_request_id", [envelope(rid=-5)], "error"),
        Probe("unknown_field", [envelope(body={"extra": 1})], "error"),
        Probe("missing_field", [envelope("match", {"namespace": ["tiny", "", "s"]})], "error"),
        Probe("tokens_as_text", [match_body(tokens="one two three")], "error"),
        Probe("tokens_not_int32", [match_body(tokens=b"\0" * 15)], "error"),
        Probe("namespace_as_int", [match_body(namespace=[42, 0, None])], "error"),
        Probe("oversize_string", [match_body(namespace=("x" * 5000, "", "s"))], "error"),
        Probe("oversize_tokens", [match_body(tokens=b"\0" * (4 << 20) + b"\0" * 8)], "error"),
        Probe("too_deep", [envelope(body={"stats": nested})], "error"),
        Probe("two_payload_frames", [good, b"extra"], "error"),
        Probe("front_door_publishing", [_encode(request_id, forbidden)], "error"),
        Probe("oversize_frame", [oversize], "either"),
        Probe("stranger_key", [good], "silence", stranger=True),
    ]


def _encode(request_id: int, body) -> bytes:
    return protocol.encode(protocol.request(request_id, body))


def _send(endpoint: dict[str, Any], keys: tuple[bytes, bytes], probe: Probe):
    """Send one probe from a fresh DEALER; the decoded reply, or None when none came."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    public, secret = zmq.curve_keypair() if probe.stranger else keys
    socket.curve_serverkey = endpoint["server_key"]
    socket.curve_publickey = public
    socket.curve_secretkey = secret
    socket.connect(endpoint["address"])
    try:
        socket.send_multipart(probe.frames)
        wait_s = REPLY_WAIT_S if probe.expect == "error" else SILENCE_WAIT_S
        if not socket.poll(int(wait_s * 1000)):
            return None
        return protocol.decode(socket.recv(), "reply")
    finally:
        socket.close(linger=0)


# ---------------------------------------------------------------------------------- recovery


def _await_recovery(mesh, client: ServiceClient, log) -> float:
    """Wait until every worker is live for the front door, registered with the service and
    published; returns how long that took (RECOVERY_TIMEOUT_S when it never happened)."""
    start = time.monotonic()
    print("waiting for every worker to be back...", file=log)
    while time.monotonic() - start < RECOVERY_TIMEOUT_S:
        if len(mesh.live_workers()) == WORKERS and _service_live(client) == WORKERS:
            with contextlib.suppress(cluster.MeshError):
                mesh.flush()
                took = time.monotonic() - start
                print(f"all {WORKERS} workers back in {took:.1f}s", file=log)
                return took
        time.sleep(0.2)
    print(f"the workers were not all back after {RECOVERY_TIMEOUT_S:.0f}s", file=log)
    return RECOVERY_TIMEOUT_S


def _service_live(client: ServiceClient) -> int:
    """Workers the service reports live (0 when it does not answer)."""
    try:
        stats = client.stats()
    except (ServiceUnavailable, RuntimeError):
        return 0
    return sum(1 for figures in stats["workers"].values() if figures["live"])


# ---------------------------------------------------------------------------------- outage


def _measure_outage(mesh, workload: Workload, chaos: Chaos, log) -> dict[str, Any]:
    """Routed requests for prompts every worker holds: with the service up, while it is
    stopped (SIGSTOP: unreachable, as a hung or cut-off service is), and right after a
    restart (`ray.kill`); each window's median over its requests served from the landing
    worker's own cache."""
    probes = _outage_prompts(mesh, workload)
    print(
        f"phase outage: {OUTAGE_ROUNDS} rounds of {UP_S:.1f}s with the service up and "
        f"{OUTAGE_S:.1f}s stopped, then {OUTAGE_S:.1f}s after a restart",
        file=log,
    )
    up: list[Record] = []
    paused: list[Record] = []
    skipped = 0
    for _ in range(OUTAGE_ROUNDS):
        up += _loop(workload, probes, "up", UP_S)
        before = mesh.service_client.skipped
        paused += _while_paused(workload, probes)
        skipped += mesh.service_client.skipped - before
        chaos.faults["service_pause"] += 1
        _await_recovery(mesh, chaos.client, log)
        # Request-path clients ask the service again once a heartbeat has reached it
        # (each publisher round): the next up window must not run on skipped calls.
        time.sleep(3 * mesh.config.workers.publish_interval_s)
    ray.kill(get_service(), no_restart=False)
    chaos.faults["service_restart"] += 1
    restarted = _loop(workload, probes, "restart", OUTAGE_S)
    _await_recovery(mesh, chaos.client, log)
    page = mesh.config.cache.page_tokens
    (up_s, up_n), (down_s, down_n), (restart_s, restart_n) = (
        _local_median(records, page) for records in (up, paused, restarted)
    )
    print(
        f"median request {up_s * 1e3:.1f} ms up, {down_s * 1e3:.1f} ms stopped, "
        f"{restart_s * 1e3:.1f} ms after a restart",
        file=log,
    )
    return {
        "outage_slowdown": _ratio(down_s, up_s),
        "restart_slowdown": _ratio(restart_s, up_s),
        "up_median_s": round(up_s, 4),
        "outage_median_s": round(down_s, 4),
        "restart_median_s": round(restart_s, 4),
        "outage_max_s": round(max(r.seconds for r in paused), 3),
        "up_requests": up_n,  # of them, those served from the landing worker's cache
        "outage_requests": down_n,
        "restart_requests": restart_n,
        "outage_routes_skipped": skipped,
    }


def _outage_prompts(mesh, workload: Workload) -> list[tuple[int, str]]:
    """A few (prompt, tenant) pairs, computed on every live worker so that whichever worker
    a routed request lands on holds it."""
    rng = random.Random(workload.seed + 1)
    count = len(workload.prompts)
    probes = [(rng.randrange(count), rng.choice(TENANTS)) for _ in range(OUTAGE_PROMPTS)]
    for worker in mesh.live_workers():
        for prompt, tenant in probes:
            workload.request(prompt, tenant, "outage-prep", worker=worker)
    mesh.flush()
    return probes


def _while_paused(workload: Workload, probes: list[tuple[int, str]]) -> list[Record]:
    """The requests sent while the service's process is stopped for OUTAGE_S."""
    pid = ray.get(get_service().__ray_call__.remote(_pid), timeout=10)
    os.kill(pid, signal.SIGSTOP)
    try:
        return _loop(workload, probes, "stopped", OUTAGE_S)
    finally:
        os.kill(pid, signal.SIGCONT)


def _loop(workload: Workload, probes: list[tuple[int, str]], phase: str, seconds: float):
    """One request at a time, cycling through `probes`, for `seconds`."""
    records = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        prompt, tenant = probes[len(records) % len(probes)]
        records.append(workload.request(prompt, tenant, phase))
    return records


def _local_median(records: list[Record], page_tokens: int) -> tuple[float, int]:
    """Median time of the requests whose every full page was a local hit (what no cache
    holds, the tail of a last page, is computed in every case), and how many there were."""
    local = [
        r.seconds
        for r in records
        if not r.error and r.local_tokens >= page_tokens * ((r.prompt_tokens - 1) // page_tokens)
    ]
    return (statistics.median(local) if local else 0.0), len(local)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if a and b else None


# ---------------------------------------------------------------------------------- the end


def _end_state(mesh, log) -> dict[str, Any]:
    """Pages and index once every request is done: leaks, and whether the index holds
    what each worker holds."""
    with contextlib.suppress(cluster.MeshError):
        mesh.flush()
    stats = mesh.stats()
    leaked = in_use = 0
    mismatched = []
    service = stats["service"].get("workers", {})
    for worker_id, figures in sorted(stats["workers"].items()):
        if not figures.get("alive"):
            continue
        cache = figures["cache"]
        in_use += cache["in_use_pages"]
        leaked += cache["total_pages"] - cache["free_pages"] - cache["cached_pages"]
        if service.get(worker_id, {}).get("pages") != cache["cached_pages"]:
            mismatched.append(worker_id)
    integrity = []
    try:
        mesh.check_integrity()
    except Exception as exc:  # a broken invariant is a finding, reported
        integrity.append(f"{type(exc).__name__}: {exc}"[:300])
    if leaked or in_use or mismatched or integrity:
        print(
            f"end state: leaked {leaked}, in use {in_use}, index differs for {mismatched}, "
            f"integrity {integrity}",
            file=log,
        )
    return {
        "leaked_pages": leaked,
        "pages_in_use_at_end": in_use,
        "index_mismatched_workers": mismatched,
        "integrity_errors": integrity,
        "workers_live_at_end": len(mesh.live_workers()),
    }


def _segments() -> set[str]:
    return {path.name for path in SHM.glob("kvmesh-*")}


def _settled_segments(before: set[str]) -> set[str]:
    """The segments created during the run that are still there once SETTLE_S passed."""
    deadline = time.monotonic() + SETTLE_S
    while (extra := _segments() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    return extra


KEY_ORDER = (
    "requests",
    "failed_requests",
    "hung_requests",
    "deadline_exceeded",
    "explained_failures",
    "wrong_outputs",
    "faults_injected",
    "faults",
    "loop_failures_injected",
    "cancelled_requests",
    "pages_held_by_cancelled",
    "malformed_frames",
    "leaked_pages",
    "leaked_shm_segments",
    "hit_rate_before",
    "hit_rate_after_recovery",
    "outage_slowdown",
)


def _ordered(figures: dict[str, Any]) -> dict[str, Any]:
    """The headline figures first, the details after."""
    head = {key: figures[key] for key in KEY_ORDER}
    return {**head, **{k: v for k, v in figures.items() if k not in head}}
