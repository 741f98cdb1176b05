"""The worker side's layers, checked in a fresh interpreter for each package: what every
module of it loads, and so what it may depend on.

    engines/  worker.py  actor.py (Ray)       the members' own compute, and the Ray seam
         \\      |      /
          member.py   api.py                  one mesh member; the typed seam
          disk_link.py  host_link.py          its tier below: disk under host memory,
          tier_link.py  tier_setup.py         host memory under a device; what they share;
                                              the member's tiers opened together
         /    |    \\    \\
    service/ transfer/ serving/               the service link, moving pages, serving
         \\      |      /
          cache/  ->  store/                  the trie (pure Python) over the page store

The trie and the service link never load torch; nothing below the actor loads Ray; the
serving engine never speaks ZMQ; transfer never reaches the cache or the serving engine;
the mesh member is built without a model, so an engine (vLLM) joins without ours. The
typed API and the settings it carries load no torch, so neither does the front door.
"""

from __future__ import annotations

import pytest

from tests.layers import loaded_modules, violations

ABOVE_MEMBER = ["workers.worker", "workers.actor", "workers.engines"]
FORBIDDEN = {
    "workers.store": [
        "ray",
        "zmq",
        "workers.cache",
        "workers.transfer",
        "workers.service",
        "workers.serving",
        "workers.member",
        *ABOVE_MEMBER,
    ],
    "workers.cache": [
        "torch",
        "ray",
        "zmq",
        "msgpack",
        "workers.transfer",
        "workers.service",
        "workers.serving",
        "workers.member",
        *ABOVE_MEMBER,
    ],
    "workers.transfer": [
        "ray",
        "transformers",
        "workers.cache",
        "workers.service",
        "workers.serving",
        "workers.member",
        *ABOVE_MEMBER,
    ],
    "workers.service": [
        "torch",
        "ray",
        "workers.transfer",
        "workers.serving",
        "workers.member",
        *ABOVE_MEMBER,
    ],
    "workers.serving": [
        "ray",
        "zmq",
        "workers.transfer",
        "workers.service",
        "workers.member",
        *ABOVE_MEMBER,
    ],
    "workers.member": ["ray", "transformers", "workers.serving", *ABOVE_MEMBER],
    "workers.api": ["ray", "torch", "transformers", "workers.member", *ABOVE_MEMBER],
    # The settings a config holds, read without torch (the modules that use them do).
    "workers.serving.config": ["torch", "ray", "zmq"],
    "workers.serving.health": ["torch", "ray", "zmq"],
    # What a request ends with, read by the front door, the API and the engine alike.
    "workers.errors": ["torch", "numpy", "ray", "zmq", "workers.serving", "workers.member"],
    "workers.serving.compaction.config": ["torch", "ray", "zmq"],
    **{
        module: ["torch", "ray", "zmq", "numpy"]
        for module in ("workers.cache.disk_settings", "workers.cache.device_settings")
    },
    # The tiers below the cache's store: cache, store and transfer glued, like the member.
    **{
        module: ["ray", "transformers", "workers.serving", *ABOVE_MEMBER]
        for module in (
            "workers.disk_link",
            "workers.host_link",
            "workers.tier_link",
            "workers.tier_setup",
        )
    },
    "workers.store.layout": ["torch", "ray", "zmq"],
    # CUDA IPC is loaded only for a CUDA store, when one is placed or opened.
    "workers.store.page_store": ["ray", "zmq", "workers.store.cuda_ipc"],
    "workers.engines.engine": ["ray", "transformers", "workers.serving", "workers.worker"],
    # vLLM's KV layouts and the copies on a device: run by the GPU checks on machines
    # without vLLM, Ray or ZeroMQ.
    **{
        module: ["vllm", "ray", "zmq", "workers.member", "workers.engines.engine"]
        for module in (
            "workers.engines.kv_layouts",
            "workers.engines.kv_copier",
            "benchmarks.gpu_checks.layouts",
        )
    },
    "workers.worker": ["ray", "transformers", "workers.actor", "workers.engines"],
    # Ray loads an actor's class to make a handle to it: a front door that attaches to a
    # mesh (`kvmesh status`, `cluster.connect(address=...)`) imports this module to hold
    # the workers' handles, so it loads no model code; a worker imports transformers when
    # it builds its model and runner.
    "workers.actor": ["transformers"],
    "cache_service.routing": [
        "ray",
        "zmq",
        "torch",
        "msgpack",
        "numpy",
        "cache_service.index",
        "cache_service.protocol",
    ],
    "cluster.inflight": ["ray", "zmq", "torch"],
    # The front door reaches workers through the typed API and their actors' names: one
    # that launches, attaches or reports (`kvmesh up`, `status`, `down`) never loads the
    # model code. Only starting a worker imports it (`cluster.actors.start_workers`).
    **{
        module: ["torch", "transformers", "workers.worker", "workers.actor"]
        for module in ("cluster.cli", "cluster.config", "cluster.launch", "cluster.mesh")
    },
}


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str]]:
    return loaded_modules(FORBIDDEN)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_layer_loads_nothing_above_it(loaded, package):
    found = violations(loaded[package], FORBIDDEN[package])
    assert not found, f"importing {package} loads {found}"
