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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

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
        self._wait_for_nodes(1)
        self._ray(self.b, "node", ray + [f"--address={self.ray_address}",
                  f"--node-ip-address={self.b.address}"])  # fmt: skip
        self._wait_for_nodes(2)

    def _ray(self, host: Host, name: str, argv: list[str]) -> None:
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


@pytest.fixture
def hosts(tmp_path):
    two = TwoHosts(tmp_path)
    try:
        two.start()
        yield two
    finally:
        if (tmp_path / "state" / "mesh.json").exists():  # a failed test: stop the mesh
            two.a.run(str(BIN / "kvmesh"), "down", env=two.env)
        two.stop()


def split(address: str) -> tuple[str, str]:
    """("10.0.0.1", "5555") from "tcp://10.0.0.1:5555", "10.0.0.1:5555", "*:5555"."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, port


def kvmesh_sockets(status: dict) -> set[tuple[str, str]]:
    """(host, port) of every socket kvmesh listens on: the service and each page server."""
    workers = status["workers"].values()
    return {split(a) for a in [status["service_address"], *(w["address"] for w in workers)]}


def test_a_prompt_computed_on_one_host_is_copied_to_the_other(hosts):
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

    script = hosts.logs / "mesh_requests.py"  # not requests.py: that would shadow a module
    script.write_text(REQUESTS)
    run = hosts.a.run(
        str(sys.executable), str(script), hosts.ray_address, hosts.a.address, hosts.b.address,
        env=hosts.env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
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
