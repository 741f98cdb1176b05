"""`kvmesh up / status / down` as an operator runs them: real commands, a real Ray head."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cache_service import enroll_tokens
from tests.conftest import kvmesh_segments

pytestmark = pytest.mark.slow

KVMESH = str(Path(sys.executable).with_name("kvmesh"))
TINY = """\
model: {name: tiny}
store: {num_pages: 64}
workers: {count: 2, num_cpus: 1, publish_interval_s: 0.1, copy_policy: always}
"""
# copy_policy always: the attach below checks that a page copy between the workers works;
# whether copying beats recomputing 40 tokens of the tiny model is a measurement that a
# loaded machine can tip either way (tests/workers/transfer/test_costs.py checks it).
# A front door in another process: attach, compute a prompt on w0, copy it into w1.
ATTACH = """\
import json, sys
import cluster
mesh = cluster.connect(address=sys.argv[1])
prompt = list(range(3, 3 + 40))
first = mesh.generate(prompt, max_new_tokens=4, worker="w0")
mesh.flush()  # w0's pages in the index before w1 looks
second = mesh.generate(prompt, max_new_tokens=4, worker="w1")
print(json.dumps({"owned": mesh.owned, "first": first.stats, "second": second.stats,
                  "same": first.token_ids == second.token_ids}))
mesh.check_integrity()  # the workers' caches and stores, and the service's index
mesh.shutdown()
"""


def kvmesh(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([KVMESH, *args], env=env, capture_output=True, text=True, timeout=timeout)


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if text.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.fixture
def operator(tmp_path):
    """An environment of its own for the commands: a state directory and a config."""
    (tmp_path / "tiny.yaml").write_text(TINY)
    env = {**os.environ, "KVMESH_STATE_DIR": str(tmp_path / "state"), "RAY_AUTH_MODE": "token"}
    yield env, tmp_path
    record = tmp_path / "state" / "mesh.json"
    if record.exists():  # a failed test: stop what it left
        kvmesh("down", env=env)


def test_up_status_attach_down(operator):
    env, root = operator
    config = str(root / "tiny.yaml")
    up = kvmesh("up", "--config", config, env=env)
    assert up.returncode == 0, up.stderr
    record = json.loads((root / "state" / "mesh.json").read_text())
    assert record["config"] == config and record["ray_auth_mode"] == "token"
    head_pid, temp_dir = record["head_pid"], record["ray_temp_dir"]
    assert head_pid in processes_mentioning("--head")
    assert "w0" in up.stdout and "w1" in up.stdout and "kvmesh is up" in up.stdout
    # The key of the enrollment tokens, readable by this user alone; `up` printed a token
    # of it and `enroll-token` issues more.
    key_file = root / "state" / "enroll.key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    key = bytes.fromhex(key_file.read_text())
    printed = up.stdout.split("an enrollment token for one vLLM engine: ")[1].split()[0]
    issued = kvmesh("enroll-token", "--count", "2", env=env)
    assert issued.returncode == 0, issued.stderr
    tokens = [printed, *issued.stdout.split()]
    assert len(set(tokens)) == 3
    for token in tokens:
        enroll_tokens.check(key, token)

    # A second `up` is refused, on this machine and in that cluster.
    again = kvmesh("up", "--config", config, env=env)
    assert again.returncode == 1
    assert "already up" in again.stderr and "kvmesh down" in again.stderr
    elsewhere = {**env, "KVMESH_STATE_DIR": str(root / "other")}
    again = kvmesh("up", "--config", config, "--address", record["address"], env=elsewhere)
    assert again.returncode == 1
    assert "already runs in the Ray cluster" in again.stderr
    assert json.loads((root / "state" / "mesh.json").read_text()) == record

    # Another process attaches, uses the mesh (a page copy between workers) and detaches.
    script = root / "attach.py"
    script.write_text(ATTACH)
    attach = subprocess.run(
        [sys.executable, str(script), record["address"]],
        env=env, capture_output=True, text=True, timeout=180, cwd=Path(__file__).parents[2],
    )  # fmt: skip
    assert attach.returncode == 0, attach.stderr
    used = json.loads(attach.stdout.strip().splitlines()[-1])
    assert used["owned"] is False and used["same"] is True
    assert used["first"]["computed_tokens"] == 40
    # Two pages from w0 (same node: shm).
    assert used["second"]["remote_hit_tokens"] == 32, used

    # The mesh outlived that front door: status shows what it did.
    status = kvmesh("status", "--json", env=env)
    assert status.returncode == 0, status.stderr
    figures = json.loads(status.stdout.strip().splitlines()[-1])
    assert figures["ray_address"] == record["address"]
    assert isinstance(figures["epoch"], int) and figures["auth"] is True
    assert [sorted(node["workers"]) for node in figures["nodes"].values()] == [["w0", "w1"]]
    assert figures["pages"]["total"] == 128
    assert figures["prompt_tokens"] == {"local_hit": 0, "remote_hit": 32, "computed": 48}
    assert figures["workers"]["w1"]["prompt_tokens"]["remote_hit"] == 32
    assert figures["workers"]["w0"]["requests"] == figures["workers"]["w1"]["requests"] == 1
    assert figures["tenants"]["default"]["queries"] >= 1
    assert {"dashboard_url", "metrics_url"} <= set(figures)
    text = kvmesh("status", env=env)
    assert text.returncode == 0 and "workers by node" in text.stdout and "w1" in text.stdout
    # Nobody is in quarantine; clearing one who is not says so and fails.
    listed = kvmesh("quarantine", "--json", env=env)
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr
    cleared = kvmesh("quarantine", "--clear", "w0", env=env)
    assert cleared.returncode == 1 and "'w0' is not in quarantine" in cleared.stderr

    down = kvmesh("down", env=env)
    assert down.returncode == 0, down.stderr
    assert "kvmesh is down" in down.stdout
    assert not (root / "state" / "mesh.json").exists()
    assert not key_file.exists()
    assert processes_mentioning(temp_dir) == []  # the head and every Ray process it ran
    assert not kvmesh_segments()

    after = kvmesh("status", env=env)
    assert after.returncode == 1 and "no `kvmesh up` is recorded" in after.stderr
    again = kvmesh("down", env=env)
    assert again.returncode == 0 and "nothing to stop" in again.stderr
    after = kvmesh("enroll-token", env=env)
    assert after.returncode == 1 and "where `kvmesh up` ran" in after.stderr


def test_up_with_a_bad_config_starts_nothing(operator):
    env, root = operator
    (root / "bad.yaml").write_text(textwrap.dedent("workers: {count: 2, num_cpu: 1}\n"))
    up = kvmesh("up", "--config", str(root / "bad.yaml"), env=env)
    assert up.returncode == 2
    assert "workers.num_cpu" in up.stderr and "Traceback" not in up.stderr
    assert not (root / "state" / "mesh.json").exists()
    assert not processes_mentioning(str(root))


def test_an_unplaceable_up_leaves_nothing(operator):
    env, root = operator
    (root / "big.yaml").write_text(TINY.replace("count: 2", "count: 5"))
    heads_before = set(processes_mentioning("kvmesh-ray-"))
    up = kvmesh("up", "--config", str(root / "big.yaml"), env=env)
    assert up.returncode == 1, up.stderr
    assert "cannot place 5 workers of CPU 1" in up.stderr and "missing CPU 3" in up.stderr, (
        up.stderr
    )
    assert "starting a Ray head" in up.stderr  # it got that far, and stopped it again
    assert not (root / "state" / "mesh.json").exists()
    assert set(processes_mentioning("kvmesh-ray-")) <= heads_before

    # Nodes that never join: --min-nodes gives up after its timeout, leaving nothing.
    config = str(root / "tiny.yaml")
    up = kvmesh("up", "--config", config, "--min-nodes", "2", "--nodes-timeout", "1", env=env)
    assert up.returncode == 1, up.stderr
    assert "has 1 live node(s)" in up.stderr and "--min-nodes asked for 2" in up.stderr, up.stderr
    assert not (root / "state" / "mesh.json").exists()
    assert set(processes_mentioning("kvmesh-ray-")) <= heads_before
