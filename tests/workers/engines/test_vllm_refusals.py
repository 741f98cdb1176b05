"""kvmesh's connector refuses, at its start, the deployments it would serve wrong KV in
or fail requests in: tensor, pipeline or data parallelism, a model with a second KV-cache
group, a `kv_load_failure_policy` other than "recompute".

The connector is built as vLLM builds it (`KvmeshConnector(vllm_config, role,
kv_cache_config)`), from a real `VllmConfig` of SmolLM2 and vLLM's own KV-cache classes,
in the vLLM venv; each refusal comes before the connector joins any mesh."""

from __future__ import annotations

import pytest

from benchmarks.vllm import model_dir, run_in_vllm_venv

pytestmark = pytest.mark.slow

CHECK = r"""
import json, sys
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec,
)
from workers.engines.vllm_connector import KvmeshConnector

def config(policy="recompute"):
    transfer = KVTransferConfig(
        kv_connector="KvmeshConnector",
        kv_connector_module_path="workers.engines.vllm_connector",
        kv_role="kv_both",
        kv_load_failure_policy=policy,
        kv_connector_extra_config={"engine_id": "refused", "enroll_token": "t" * 44},
    )
    return EngineArgs(
        model=sys.argv[1], dtype="bfloat16", max_model_len=1024, kv_transfer_config=transfer
    ).create_engine_config()

def groups(*specs):
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)],
    )

full = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
window = SlidingWindowSpec(
    block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, sliding_window=256
)
cases = {
    "fail_policy": (config("fail"), groups(full)),
    "two_groups": (config(), groups(full, window)),
}
for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
    parallel = config()
    setattr(parallel.parallel_config, name, 2)
    cases[name] = (parallel, groups(full))
said = {}
for name, (vllm_config, kv_cache_config) in cases.items():
    try:
        KvmeshConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
        said[name] = "started"
    except Exception as exc:
        said[name] = f"{type(exc).__name__}: {exc}"
print("REFUSALS " + json.dumps(said))
"""


def test_unsupported_deployments_are_refused_at_start_with_what_was_wrong():
    said = run_in_vllm_venv(CHECK, "REFUSALS", str(model_dir()))
    assert said["fail_policy"].startswith('ValueError: kv_load_failure_policy is "fail"')
    assert '"recompute"' in said["fail_policy"]
    assert said["two_groups"].startswith("ValueError: the model has 2 KV-cache groups")
    assert "SlidingWindowSpec" in said["two_groups"]
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        assert said[name].startswith("ValueError: ") and f"{name}=2" in said[name], said[name]
