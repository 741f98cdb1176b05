"""`kvmesh bench chaos`: a shared-prefix workload that must stay correct while faults hit.

A simulated two-node Ray cluster (two nodes of 2 CPUs, both this machine) runs the service
and three workers on the tiny model (so time goes to the cache path, not to compute), with
`workers.max_restarts: -1`. Three client threads send routed requests in a loop: four
shared prefixes (64 to 128 tokens) x twelve suffixes, two tenants. Before anything else,
the no-cache reference of every prompt the workload can send is computed (`reuse=False`:
greedy, so identical prompts give identical token ids), and every output is compared
with it.

Phases (`duration_s` of workload, split by PHASES, plus the waits they need):

- warm-up: no faults; `hit_rate_before` is hit tokens / prompt tokens over its last half;
- chaos: a fault every 1 to 3 s, drawn from a seeded RNG; the first round draws each
  kind once, so every kind is met in any run;
- recovery: no faults; wait until the front door has every worker live again and the
  service reports them all, then `hit_rate_after_recovery` is measured as before;
- outage: the workload stops; a few prompts are computed on every worker (so whichever
  worker a routed request lands on holds them), then sent in a loop, one at a time: for
  UP_S with the service up, for OUTAGE_S while it is unreachable (its process stopped with
  SIGSTOP, as a hung or cut-off service would be, then continued), and for OUTAGE_S right
  after a restart (`ray.kill`). `outage_slowdown` is the median request time (wall time
  around `mesh.generate`) while stopped / while up, `restart_slowdown` the same after the
  restart, each over the requests whose every full page was a local hit: the outage's
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

`faults` counts them by kind, with the outage phase's own `service_pause` and restart.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import ray
import zmq
from ray.cluster_utils import Cluster

import cluster
from cache_service import protocol
from cache_service.actor import RAY_NAMESPACE, get_service
from cache_service.events import Namespace
from cache_service.messages import ApplyResult, GetStats, Match, PublishEvents
from cache_service.protocol import PROTOCOL_VERSION
from cluster.config import config_from_dict
from workers.service.client import ServiceClient, ServiceUnavailable, ray_resolver

DEFAULT_SECONDS = 50.0
SECONDS_ENV = "KVMESH_CHAOS_SECONDS"  # the default duration, for short runs (tests)
WORKERS = 3
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
}
CHAOS_OVERRUN_S = 45.0  # how long chaos may outlast its share to meet every kind once
RECOVERY_TIMEOUT_S = 120.0
OUTAGE_S = 4.0  # the service stopped this long
UP_S = 3.0  # the same requests measured with the service up, just before
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
    chaos = Chaos(mesh, random.Random(seed), log)
    try:
        figures = _under_load(mesh, workload, chaos, duration_s, log)
        figures.update(_measure_outage(mesh, workload, chaos, log))
        return {**workload.summary(), **chaos.summary(), **_end_state(mesh, log), **figures}
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
        chaos.run(PHASES["chaos"] * duration_s, workload)
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
        start, error = time.monotonic(), ""
        try:
            out = self.mesh.generate(self.prompts[prompt], NEW_TOKENS, tenant, worker=worker)
        except Exception as exc:  # a failed request is a finding, counted
            error = f"{type(exc).__name__}: {exc}"[:300]
            print(f"request failed: {error}", file=self.log)
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
        errors = [r.error for r in self.records if r.error]
        return {
            "requests": len(self.records),
            "failed_requests": len(errors),
            "wrong_outputs": sum(1 for r in self.records if not r.error and not r.correct),
            "requests_during_chaos": sum(1 for r in self.records if r.phase == "chaos"),
            "stuck_clients": self.stuck,
            "errors": sorted(set(errors))[:5],
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

    def __init__(self, mesh, rng: random.Random, log):
        self.mesh = mesh
        self.rng = rng
        self.log = log
        self.faults: Counter[str] = Counter()
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
        }

    def run(self, seconds: float, workload: Workload) -> None:
        """A fault every FAULT_GAP_S for `seconds`, and until each kind was met once."""
        print(f"phase chaos ({seconds:.0f}s)", file=self.log)
        start = time.monotonic()
        pending = list(FAULT_WEIGHTS)
        self.rng.shuffle(pending)
        while time.monotonic() - start < seconds or pending:
            if time.monotonic() - start > seconds + CHAOS_OVERRUN_S:
                print(f"chaos ended before faults {pending} could be injected", file=self.log)
                break
            time.sleep(self.rng.uniform(*FAULT_GAP_S))
            kind = self._draw(pending)
            if kind is not None and self._inject[kind]():
                self.faults[kind] += 1
                with contextlib.suppress(ValueError):
                    pending.remove(kind)
                total = sum(self.faults.values())
                done = len(workload.records)
                print(f"  fault {total}: {kind} ({done} requests so far)", file=self.log)

    def _draw(self, pending: list[str]) -> str | None:
        """The next kind: the first pending one that can be injected now, else a weighted
        draw among those that can."""
        all_live = len(self.mesh.live_workers()) == WORKERS
        possible = [k for k in FAULT_WEIGHTS if k != "worker_kill" or all_live]
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
        f"phase outage: {UP_S:.0f}s with the service up, {OUTAGE_S:.0f}s stopped, "
        f"{OUTAGE_S:.0f}s after a restart",
        file=log,
    )
    up = _loop(workload, probes, "up", UP_S)
    skipped = mesh.service_client.skipped
    paused = _while_paused(workload, probes)
    skipped = mesh.service_client.skipped - skipped
    chaos.faults["service_pause"] += 1
    _await_recovery(mesh, chaos.client, log)
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
    "wrong_outputs",
    "faults_injected",
    "faults",
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
