"""Two real hosts: network namespaces joined by a veth pair, a Ray node in each, and
`kvmesh up --address` with configs/multinode.yaml across them.

`ray.cluster_utils.Cluster` puts every node on one address, so it cannot show that
sockets bind where peers on another host reach them; here each host has an address of
its own, and every packet between them crosses the veth pair, inside namespaces this
test makes (and removes). Needs root, as CI has.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.config import load_config
from tests.conftest import kvmesh_segments

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("ss") is None,
        reason="network namespaces need root and iproute2 (CI has both)",
    ),
]

ROOT = Path(__file__).resolve().parents[2]
MULTINODE = ROOT / "configs" / "multinode.yaml"
BIN = Path(sys.executable).parent
RAY_PORT = 6379
LIVENESS_S = 3.0  # the cut test's service liveness timeout
# Run inside host A: attach, compute a prompt on A's worker, copy it into B's worker.
REQUESTS = """\
import json, sys
import cluster
mesh = cluster.connect(address=sys.argv[1])
on = {node["address"]: node["workers"] for node in mesh.stats()["nodes"].values()}
a, b = on[sys.argv[2]][0], on[sys.argv[3]][0]
prompt = "You are a careful assistant for a river shipping company. " * 12 + "Where is Vienna?"
cold = mesh.generate(prompt, max_new_tokens=8, tenant="reference", worker=b)
first = mesh.generate(prompt, max_new_tokens=8, tenant="acme", worker=a)
mesh.flush()  # A's pages in the index before B looks
copied = mesh.generate(prompt, max_new_tokens=8, tenant="acme", worker=b)
print(json.dumps({
    "a": a, "b": b, "cold": cold.stats, "first": first.stats, "copied": copied.stats,
    "outputs": [cold.token_ids, first.token_ids, copied.token_ids],
    "copy_bytes": mesh.stats()["workers"][b]["copy_bytes"],
}))
mesh.shutdown()
"""
NAMED_ACTORS = """\
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
print(sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)))
"""


class Host:
    """One network namespace with one address on the veth pair."""

    def __init__(self, namespace: str, address: str):
        self.namespace = namespace
        self.address = address

    def command(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv]

    def run(self, *argv: str, env, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.command(*argv), env=env, capture_output=True, text=True, timeout=timeout,
            cwd=ROOT,
        )  # fmt: skip

    def kill_all(self) -> None:
        """SIGKILL every process in this namespace (`ip netns pids`), and wait until
        none is left."""
        for _ in range(50):
            out = subprocess.run(
                ["ip", "netns", "pids", self.namespace], capture_output=True, text=True
            ).stdout.split()
            if not out:
                return
            for pid in out:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.2)
        raise AssertionError(f"processes outlived SIGKILL in {self.namespace}: {out}")

    def link(self, state: str) -> None:
        """Take this host's end of the veth pair "down" or "up" (a cut cable, mended)."""
        subprocess.run(
            ["ip", "-n", self.namespace, "link", "set", f"{self.namespace}0", state],
            check=True, capture_output=True,
        )  # fmt: skip

    def listeners(self) -> list[str]:
        """Local addresses of the TCP sockets listening in this namespace (`ss -ltn`)."""
        out = subprocess.run(
            self.command("ss", "-ltnH"), capture_output=True, text=True, check=True
        ).stdout
        return [line.split()[3] for line in out.splitlines() if line.strip()]


class TwoHosts:
    """Hosts A and B, joined by a veth pair, with a Ray head in A and a Ray node in B."""

    def __init__(self, tmp: Path):
        tag = f"kvm{os.getpid() % 100000}"
        subnet = f"10.213.{os.getpid() % 250}"
        self.a = Host(f"{tag}a", f"{subnet}.1")
        self.b = Host(f"{tag}b", f"{subnet}.2")
        self.ray_address = f"{self.a.address}:{RAY_PORT}"
        self.env = {
            **os.environ,
            "KVMESH_STATE_DIR": str(tmp / "state"),
            "RAY_AUTH_MODE": "token",
            # A cut of a few seconds must not make Ray declare B's node dead (it would end
            # B's worker); kvmesh's own liveness timeout is what the cut test crosses.
            "RAY_health_check_failure_threshold": "60",
        }
        # Short: Ray's socket paths live under it and must stay under 108 bytes.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="kvmesh-2h-"))
        self.logs = tmp
        self.rays: list[subprocess.Popen] = []

    def start(self) -> None:
        links = [
            ["ip", "netns", "add", self.a.namespace],
            ["ip", "netns", "add", self.b.namespace],
            ["ip", "link", "add", f"{self.a.namespace}0", "type", "veth",
             "peer", "name", f"{self.b.namespace}0"],
        ]  # fmt: skip
        for host in (self.a, self.b):
            device = f"{host.namespace}0"
            links += [
                ["ip", "link", "set", device, "netns", host.namespace],
                ["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", device],
                ["ip", "-n", host.namespace, "link", "set", device, "up"],
                ["ip", "-n", host.namespace, "link", "set", "lo", "up"],
            ]
        for argv in links:
            subprocess.run(argv, check=True, capture_output=True)
        ray = [str(BIN / "ray"), "start", "--num-cpus=1", "--disable-usage-stats", "--block"]
        self._ray(self.a, "head", ray + ["--head", f"--port={RAY_PORT}",
                  f"--node-ip-address={self.a.address}", f"--temp-dir={self.temp_dir}",
                  "--include-dashboard=false"])  # fmt: skip
        self._ray(self.b, "node", ray + [f"--address={self.ray_address}",
                  f"--node-ip-address={self.b.address}"])  # fmt: skip

    def _ray(self, host: Host, name: str, argv: list[str], tries: int = 3) -> None:
        """Start a Ray node in `host` and wait until the cluster has it. Ray gives a new
        node's raylet 30 s to register with the GCS (a constant in ray/_private/node.py);
        on this 2-core machine, beside another test's vLLM engines, a start can take
        longer, and then `ray start` exits with "timed out during startup". A start that
        fails is cleared away (every process in the host's namespace) and tried again, up
        to `tries` times."""
        for attempt in range(1, tries + 1):
            with open(self.logs / f"ray-{name}.log", "w") as log:
                self.rays.append(
                    subprocess.Popen(
                        host.command(*argv),
                        env=self.env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )  # fmt: skip
                )
            try:
                self._wait_for_nodes(len(self.rays))
                return
            except AssertionError as failure:
                if attempt == tries:
                    raise
                host.kill_all()  # that start and what it left running (its GCS, its raylet)
                self.rays.pop().wait()
                print(f"Ray {name}, try {attempt}: {str(failure)[:200]}; again", flush=True)

    def _wait_for_nodes(self, count: int, timeout_s: float = 90) -> None:
        probe = (
            "import sys, ray; ray.init(address=sys.argv[1], logging_level='ERROR'); "
            "print(sum(n['Alive'] for n in ray.nodes()))"
        )
        deadline = time.monotonic() + timeout_s
        while True:
            for process, name in zip(self.rays, ("head", "node"), strict=False):
                log = (self.logs / f"ray-{name}.log").read_text()[-3000:]
                assert process.poll() is None, f"the Ray {name} exited:\n{log}"
            try:
                out = self.a.run(
                    str(sys.executable), "-c", probe, self.ray_address, env=self.env, timeout=30
                )
                if out.returncode == 0 and out.stdout.strip().endswith(str(count)):
                    return
            except subprocess.TimeoutExpired:
                pass  # the head is not serving yet
            assert time.monotonic() < deadline, f"{count} Ray nodes not up in {timeout_s}s"
            time.sleep(1)

    def stop(self) -> None:
        """Stop the Ray node, then the head (SIGTERM: each stops its own processes), and
        remove the namespaces (which removes the veth pair)."""
        for process in reversed(self.rays):
            # The `ray start --block` process only: it drains its node through the GCS
            # and stops its own processes; signalling them all at once stalls the drain.
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for host in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Both hosts and their Ray nodes, for the module's tests; each test ups its own mesh."""
    two = TwoHosts(tmp_path_factory.mktemp("two-hosts"))
    try:
        two.start()
        yield two
    finally:
        two.stop()


@pytest.fixture
def mesh_down(hosts):
    """Stops a mesh that a failed test left up."""
    yield
    if (Path(hosts.env["KVMESH_STATE_DIR"]) / "mesh.json").exists():
        hosts.a.run(str(BIN / "kvmesh"), "down", env=hosts.env)


def split(address: str) -> tuple[str, str]:
    """("10.0.0.1", "5555") from "tcp://10.0.0.1:5555", "10.0.0.1:5555", "*:5555"."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, port


def kvmesh_sockets(status: dict) -> set[tuple[str, str]]:
    """(host, port) of every socket kvmesh listens on: the service and each page server."""
    workers = status["workers"].values()
    return {split(a) for a in [status["service_address"], *(w["address"] for w in workers)]}


def run_in_a(hosts: TwoHosts, name: str, text: str) -> dict:
    """Run a driver script in host A (given Ray's address and both hosts' addresses);
    the JSON object its last line prints."""
    script = hosts.logs / name
    script.write_text(text)
    run = hosts.a.run(
        str(sys.executable), str(script), hosts.ray_address, hosts.a.address, hosts.b.address,
        env=hosts.env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_prompt_computed_on_one_host_is_copied_to_the_other(hosts, mesh_down):
    kvmesh = str(BIN / "kvmesh")
    up = hosts.a.run(
        kvmesh, "up", "--config", str(MULTINODE), "--address", hosts.ray_address,
        "--min-nodes", "2", env=hosts.env,
    )  # fmt: skip
    assert up.returncode == 0, up.stderr[-3000:]

    status = hosts.a.run(kvmesh, "status", "--json", env=hosts.env)
    assert status.returncode == 0, status.stderr[-3000:]
    figures = json.loads(status.stdout.strip().splitlines()[-1])
    by_host = {node["address"]: node["workers"] for node in figures["nodes"].values()}
    assert sorted(by_host) == sorted([hosts.a.address, hosts.b.address])
    assert sorted(len(workers) for workers in by_host.values()) == [1, 1]
    assert figures["auth"] is True

    # kvmesh's sockets listen on their host's own address, never on every interface
    # (Ray's own gRPC servers bind the wildcard in Ray 2.60; none of those is ours).
    ours = kvmesh_sockets(figures)
    assert len(ours) == 3 and {h for h, _ in ours} == {hosts.a.address, hosts.b.address}
    assert split(figures["service_address"])[0] == hosts.a.address  # on the head node
    for host in (hosts.a, hosts.b):
        mine = {port for h, port in ours if h == host.address}
        listening = [split(listener) for listener in host.listeners()]
        assert {port for h, port in listening if h == host.address} >= mine
        wildcard = [(h, port) for h, port in listening if port in mine and h != host.address]
        assert not wildcard, f"{host.namespace}: kvmesh sockets on {wildcard}"
    for worker_id, worker in figures["workers"].items():
        host = next(h for h, ids in by_host.items() if worker_id in ids)
        assert split(worker["address"])[0] == host  # its page server, on its own host

    # Not requests.py: that would shadow a module.
    result = run_in_a(hosts, "mesh_requests.py", REQUESTS)
    cold, first, copied = result["cold"], result["first"], result["copied"]
    assert cold["computed_tokens"] == cold["prompt_tokens"]  # the no-cache run
    assert first["computed_tokens"] == first["prompt_tokens"]  # tenants share nothing
    outputs = result["outputs"]
    assert outputs[0] == outputs[1] == outputs[2]
    page_tokens = load_config(MULTINODE).cache.page_tokens
    full_pages = (copied["prompt_tokens"] - 1) // page_tokens
    assert copied["remote_hit_tokens"] == full_pages * page_tokens  # every full page copied
    assert copied["computed_tokens"] == copied["prompt_tokens"] - full_pages * page_tokens
    page_bytes = load_config(MULTINODE).store_layout().page_bytes
    assert result["copy_bytes"] == {"same_node": 0, "remote": full_pages * page_bytes}

    status = hosts.a.run(kvmesh, "status", "--json", env=hosts.env)
    assert status.returncode == 0, status.stderr[-3000:]
    print(f"\nkvmesh status --json (two hosts): {status.stdout.strip().splitlines()[-1]}")
    after = json.loads(status.stdout.strip().splitlines()[-1])
    assert after["workers"][result["b"]]["prompt_tokens"]["remote_hit"] == full_pages * page_tokens
    assert after["workers"][result["a"]]["pages_served"] == full_pages
    assert after["tenants"]["acme"]["remote_hit_tokens"] >= full_pages * page_tokens

    down = hosts.a.run(kvmesh, "down", env=hosts.env)
    assert down.returncode == 0, down.stderr[-3000:]
    actors = hosts.a.run(str(sys.executable), "-c", NAMED_ACTORS, hosts.ray_address, env=hosts.env)
    assert actors.returncode == 0, actors.stderr[-3000:]
    assert actors.stdout.strip().splitlines()[-1] == "[]"
    for host in (hosts.a, hosts.b):  # the mesh's sockets are closed
        assert not {split(listener) for listener in host.listeners()} & ours
    assert not kvmesh_segments()


# The cut test's driver, inside host A: one process for the whole test (attaching while the
# link is down would wait on B), answering one JSON line per command read from stdin.
CUT_DRIVER = """\
import json, sys, time
import cluster
from cache_service.events import Namespace
from workers.service.client import ServiceClient, ray_resolver

mesh = cluster.connect(address=sys.argv[1])
on = {node["address"]: node["workers"] for node in mesh.stats()["nodes"].values()}
a, b = on[sys.argv[2]][0], on[sys.argv[3]][0]
service = ServiceClient(ray_resolver(), timeout_s=2.0, client_keys=mesh.keys.front_door)
prompts = [[(11 * i + 3 * j) % 250 + 1 for j in range(70)] for i in range(3)]  # 4 pages + 6
reference = [mesh.generate(p, 4, tenant="cut", worker=a, reuse=False).token_ids for p in prompts]

def holding(worker):
    return service.stats()["workers"].get(worker, {"live": False, "pages": 0})

def wait(predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True

def answer(**fields):
    print(json.dumps(fields), flush=True)

for command in sys.stdin:
    command = command.strip()
    if command == "fill":  # B computes every prompt; the index names B for them
        for p in prompts:
            mesh.generate(p, 4, tenant="cut", worker=b)
        mesh.flush()
        cached = mesh.stats()["workers"][b]["cache"]["cached_pages"]
        answer(a=a, b=b, b_index=holding(b), b_cached=cached)
    elif command == "cut":  # the link is down: B's holdings expire; A serves alone
        expired = wait(lambda: not holding(b)["live"], 30)
        service_view = service.stats()
        started = time.monotonic()
        routed = mesh.generate(prompts[0], 4, tenant="cut")
        answer(expired=expired, b_index=holding(b), removed=service_view["removed_workers"],
               routed=routed.stats, routed_ok=routed.token_ids == reference[0],
               routed_s=time.monotonic() - started, live=mesh.live_workers())
    elif command == "healed":  # the link is up again: B registers anew and resyncs
        back = wait(lambda: holding(b)["live"] and holding(b)["pages"] > 0, 90)
        mesh.flush()
        b_stats = mesh.stats()["workers"][b]
        copied = mesh.generate(prompts[1], 4, tenant="cut", worker=a)
        answer(back=back, b_index=holding(b), b_cached=b_stats["cache"]["cached_pages"],
               b_resyncs=b_stats["publisher"]["resyncs"], copied=copied.stats,
               copied_ok=copied.token_ids == reference[1], live=mesh.live_workers())
    elif command == "quit":
        mesh.check_integrity()
        answer(ok=True)
        break
service.close()
mesh.shutdown()
"""


def up_tiny(hosts: TwoHosts, name: str, num_pages: int, **service: Any) -> dict:
    """`kvmesh up` across both hosts with multinode.yaml on the tiny model (copies always:
    it computes faster than a copy), `store.num_pages` and `service` settings changed;
    returns the configuration."""
    config = hosts.logs / f"{name}.yaml"
    cfg = yaml.safe_load(MULTINODE.read_text())
    cfg["model"] = {"name": "tiny"}
    cfg["workers"]["copy_policy"] = "always"
    cfg["store"]["num_pages"] = num_pages
    cfg["service"].update(service)
    config.write_text(yaml.safe_dump(cfg))
    up = hosts.a.run(
        str(BIN / "kvmesh"), "up", "--config", str(config), "--address", hosts.ray_address,
        "--min-nodes", "2", env=hosts.env,
    )  # fmt: skip
    assert up.returncode == 0, up.stderr[-3000:]
    return cfg


class Driver:
    """A Python process in a host, spoken to one line at a time."""

    def __init__(self, host: Host, script: Path, *argv: str, env):
        self.process = subprocess.Popen(
            host.command(str(sys.executable), str(script), *argv), env=env, cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def ask(self, command: str, timeout_s: float = 180) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.process.kill()
            raise AssertionError(f"the driver gave no answer to {command!r}: {self.stderr()}")
        return json.loads(line)

    def stderr(self) -> str:
        self.process.kill()
        return self.process.communicate(timeout=30)[1][-3000:]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


def test_a_network_cut_expires_the_far_worker_and_healing_brings_it_back(hosts, mesh_down):
    """The veth link goes down for longer than the liveness timeout: the service drops the
    cut-off worker's holdings and routes around it; once the link is up, the worker registers
    again, resyncs, and its pages are copied (checked) as before."""
    kvmesh = str(BIN / "kvmesh")
    cfg = up_tiny(hosts, "cut", num_pages=128, liveness_timeout_s=LIVENESS_S)
    script = hosts.logs / "cut_driver.py"
    script.write_text(CUT_DRIVER)
    driver = Driver(hosts.a, script, hosts.ray_address, hosts.a.address, hosts.b.address,
                    env=hosts.env)  # fmt: skip
    try:
        filled = driver.ask("fill")
        assert filled["b_index"]["live"] and filled["b_index"]["pages"] == filled["b_cached"] > 0

        hosts.a.link("down")
        cut_at = time.monotonic()
        try:
            cut = driver.ask("cut")
            # Down for twice the liveness timeout at least, as a real outage would be.
            time.sleep(max(0.0, cut_at + 2 * LIVENESS_S - time.monotonic()))
        finally:
            hosts.a.link("up")
        assert cut["expired"], "the service never dropped the cut-off worker"
        assert cut["b_index"] == {**cut["b_index"], "live": False, "pages": 0}
        assert cut["removed"].get("expired", 0) >= 1
        # Routed while B is unreachable: to A, recomputed (nothing copied from B), correct.
        assert cut["routed"]["worker"] == filled["a"] and cut["routed_ok"]
        assert cut["routed"]["remote_hit_tokens"] == 0
        assert sorted(cut["live"]) == sorted([filled["a"], filled["b"]])  # cut off, not dead

        healed = driver.ask("healed")
        print(f"\nduring the cut: {json.dumps(cut)}\nafter healing: {json.dumps(healed)}")
        assert healed["back"], "the worker did not register again after the link came up"
        # The index holds what B holds now, by a resync, not by remembering the cut-off past.
        assert healed["b_index"]["live"] and healed["b_index"]["pages"] == healed["b_cached"]
        assert healed["b_resyncs"] >= 2  # the first registration's and the one after the cut
        page_tokens = cfg["cache"]["page_tokens"]
        full_pages = (len(range(70)) - 1) // page_tokens
        assert healed["copied"]["remote_hit_tokens"] == full_pages * page_tokens
        assert healed["copied_ok"]  # copied pages checked (generation, digest), output exact
        assert driver.ask("quit") == {"ok": True}
    finally:
        driver.close()
    down = hosts.a.run(kvmesh, "down", env=hosts.env)
    assert down.returncode == 0, down.stderr[-3000:]
    assert not kvmesh_segments()


# Inside host A: B's worker computes prompts until the first ones are only on its disk;
# A's worker then copies the first through B's page server.
DISK_REQUESTS = """\
import json, sys
import cluster
mesh = cluster.connect(address=sys.argv[1])
on = {node["address"]: node["workers"] for node in mesh.stats()["nodes"].values()}
a, b = on[sys.argv[2]][0], on[sys.argv[3]][0]
prompts = [[(11 * i + 3 * j) % 250 + 1 for j in range(70)] for i in range(6)]  # 4 pages + 6
reference = mesh.generate(prompts[0], 4, tenant="disk", worker=a, reuse=False).token_ids
for p in prompts:
    mesh.generate(p, 4, tenant="disk", worker=b)
mesh.flush()
before = mesh.stats()
copied = mesh.generate(prompts[0], 4, tenant="disk", worker=a)
mesh.flush()  # the workers' figures reach the service with this heartbeat
after = mesh.stats()
mesh.check_integrity()
print(json.dumps({"copied": copied.stats, "ok": copied.token_ids == reference,
                  "disk": [before["tiers"].get("disk"), after["tiers"].get("disk")],
                  "served": [before["workers"][b]["pages_served"],
                             after["workers"][b]["pages_served"]],
                  "a_copy_bytes": after["workers"][a]["copy_bytes"]}))
mesh.shutdown()
"""


def test_a_prompt_only_on_one_hosts_disk_is_copied_through_its_page_server(hosts, mesh_down):
    """B's worker holds a prompt only in its disk tier (its shared memory took later
    prompts); A's worker copies it across the veth pair from B's page server, which reads
    and verifies each record, and answers as a run without any cache does."""
    cfg = up_tiny(hosts, "disk", num_pages=12)
    result = run_in_a(hosts, "disk_requests.py", DISK_REQUESTS)
    print(f"\ncopied from a disk on the other host: {json.dumps(result)}")
    page_tokens = cfg["cache"]["page_tokens"]
    page_bytes = load_config(hosts.logs / "disk.yaml").store_layout().page_bytes
    assert result["ok"]
    assert result["copied"]["remote_hit_tokens"] == 4 * page_tokens
    before, after = result["disk"]
    assert before["demotions"] > 0
    assert after["bytes_read"] - before["bytes_read"] == 4 * page_bytes  # B's disk, for A
    assert result["served"][1] - result["served"][0] == 4
    assert result["a_copy_bytes"] == {"same_node": 0, "remote": 4 * page_bytes}
    down = hosts.a.run(str(BIN / "kvmesh"), "down", env=hosts.env)
    assert down.returncode == 0, down.stderr[-3000:]
    assert not kvmesh_segments()


# Inside host A: the figures the service and its metrics give for the engines.
ENGINE_FIGURES = """\
import json, sys, urllib.request
import cluster
from prometheus_client.parser import text_string_to_metric_families
mesh = cluster.connect(address=sys.argv[1])
status = mesh.stats()
if status["metrics_url"] is None:  # the service did not answer (a loaded machine): again
    print(json.dumps({"engines": {}, "samples": {}}))
    mesh.shutdown()
    sys.exit(0)
with urllib.request.urlopen(status["metrics_url"], timeout=10) as reply:
    text = reply.read().decode()
samples = {}
for family in text_string_to_metric_families(text):
    for s in family.samples:
        if s.labels.get("worker", "").startswith("vllm-") and s.name in (
            "kvmesh_prompt_tokens_total", "kvmesh_copy_bytes_total"
        ):
            key = f"{s.name}:{s.labels['worker']}:{s.labels.get('source') or s.labels.get('kind')}"
            samples[key] = samples.get(key, 0) + s.value
print(json.dumps({"engines": status["engines"], "samples": samples}))
mesh.shutdown()
"""


def engine_figures(hosts: TwoHosts, pages: int, timeout_s: float = 120) -> dict:
    """The engines' figures once vllm-a holds `pages` pages in the index."""
    script = hosts.logs / "engine_figures.py"
    script.write_text(ENGINE_FIGURES)
    deadline = time.monotonic() + timeout_s
    while True:
        run = hosts.a.run(str(sys.executable), str(script), hosts.ray_address, env=hosts.env)
        assert run.returncode == 0, run.stderr[-3000:]
        figures = json.loads(run.stdout.strip().splitlines()[-1])
        if figures["engines"].get("vllm-a", {}).get("pages", 0) >= pages:
            return figures
        assert time.monotonic() < deadline, f"vllm-a never held {pages} pages: {figures}"
        time.sleep(1)


def test_vllm_engines_on_two_hosts_share_a_prefix_through_page_servers(hosts, mesh_down):
    """vLLM engine A on host A computes a prompt; engine B on host B, given another prompt
    with the same first 512 tokens, loads them from A's page server (CurveZMQ, keys from
    the mesh) instead of computing them, and produces the greedy tokens it computes alone."""
    from benchmarks.vllm import (
        close_engines,
        count_mismatches,
        kvmesh_engine,
        model_dir,
        shared_prompts,
        start_engines,
    )

    kvmesh = str(BIN / "kvmesh")
    up_tiny(hosts, "engines", num_pages=64)  # the mesh's own workers idle: the engines share
    folder = model_dir()
    prefix, suffixes = shared_prompts(2)
    prompts = [prefix[:512] + suffix for suffix in suffixes]  # four blocks shared, then 64
    issued = hosts.a.run(kvmesh, "enroll-token", "--count", "2", env=hosts.env)
    assert issued.returncode == 0, issued.stderr[-3000:]
    token_a, token_b = issued.stdout.split()
    engines = start_engines(
        {
            # Both Ray nodes run on this one machine: each engine names its own.
            "a": kvmesh_engine(folder, hosts.ray_address, "vllm-a", token_a, hosts.a.address),
            "b": kvmesh_engine(folder, hosts.ray_address, "vllm-b", token_b, hosts.b.address),
        },
        hosts.logs,
        wrappers={"a": hosts.a.command(), "b": hosts.b.command()},
        env=hosts.env,
    )
    a, b = engines["a"], engines["b"]
    try:
        assert a.generate(prompts[0], 8, "acme")["num_cached_tokens"] == 0
        before = engine_figures(hosts, 512 // 16)
        hit = b.generate(prompts[1], 12, "acme")
        assert hit["num_cached_tokens"] == 512  # four blocks from A, across the veth pair
        reference = b.generate(prompts[1], 12, "nobody")  # a salt nobody used: all computed
        assert reference["num_cached_tokens"] == 0 and len(set(reference["token_ids"])) > 4
        assert count_mismatches(hit["token_ids"], reference["token_ids"]) == 0
        time.sleep(1.5)  # B's next heartbeats carry its figures
        after = engine_figures(hosts, 512 // 16)
    finally:
        close_engines(engines.values())
    print(f"\nengines on two hosts: {json.dumps(after)}")
    found = after["engines"]
    assert found["vllm-a"]["address"] == hosts.a.address
    assert found["vllm-b"]["address"] == hosts.b.address
    samples = after["samples"]
    page_bytes = 30 * 2 * 3 * 16 * 64 * 2  # SmolLM2's KV in bfloat16, 16 tokens a page
    assert samples.get("kvmesh_copy_bytes_total:vllm-b:remote") == 32 * page_bytes
    assert samples.get("kvmesh_copy_bytes_total:vllm-b:same_node", 0) == 0
    assert samples["kvmesh_prompt_tokens_total:vllm-b:remote_hit"] == 512
    assert before["samples"].get("kvmesh_prompt_tokens_total:vllm-b:remote_hit", 0) == 0

    down = hosts.a.run(kvmesh, "down", env=hosts.env)
    assert down.returncode == 0, down.stderr[-3000:]
    assert not kvmesh_segments()
