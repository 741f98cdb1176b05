"""Fixtures shared by the whole suite: Ray, and the leak checks every test passes.

Ray: one embedded instance (`ray_local`) and one simulated two-node cluster
(`ray_cluster`) serve every module of a test process that asks for them. A driver holds
one Ray connection at a time, so asking for the other kind shuts the first down and starts
the second; a process runs whole modules one after another (`make test` hands each of its
processes whole files), so that happens a few times per run, not per test.
Each module must leave the Ray it used as it found it: no named kvmesh actor survives it.

Leaks: around every test and every module, no `/dev/shm/kvmesh-*` segment may be left
behind, nor a non-daemon thread, nor a kvmesh thread (every thread kvmesh starts is
named `kvmesh-...`). Teardown of other processes is asynchronous (a Ray actor unlinks its
page store as it exits), so the checks wait a few seconds for the count to settle before
they fail.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SHM = Path("/dev/shm")
SETTLE_S = 5.0
RAY_NAMESPACE = "kvmesh"  # cache_service.actor.RAY_NAMESPACE, without importing Ray here


def kvmesh_segments() -> set[str]:
    """The kvmesh shared-memory segments on this machine, by name."""
    return {path.name for path in SHM.glob("kvmesh-*")}


def stray_threads() -> set[threading.Thread]:
    """Threads a test must not leave running: non-daemon ones and kvmesh's own."""
    return {
        thread
        for thread in threading.enumerate()
        if thread is not threading.main_thread()
        and (not thread.daemon or thread.name.startswith("kvmesh-"))
    }


def _settled(probe, before: set) -> set:
    """What `probe()` holds beyond `before`, once that stops shrinking or SETTLE_S passed."""
    deadline = time.monotonic() + SETTLE_S
    while (extra := probe() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return extra


def _check_leaks(where: str, segments: set[str], threads: set[threading.Thread]) -> None:
    leaked = _settled(kvmesh_segments, segments)
    for name in leaked:  # keep one failure from cascading into the tests after it
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SHM / name)
    assert not leaked, f"{where} left shared-memory segments: {sorted(leaked)}"
    running = _settled(stray_threads, threads)
    assert not running, f"{where} left threads running: {sorted(t.name for t in running)}"


def pytest_collection_modifyitems(config, items) -> None:
    """The slowest modules first (`tests/durations.py` says why); a module's tests keep
    their order, and modules without a record keep file order after those with one."""
    from tests.durations import recorded

    seconds = recorded()
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], 0.0))


@pytest.fixture(scope="module", autouse=True)
def _no_leaks_per_module(request) -> Iterator[None]:
    segments, threads = kvmesh_segments(), stray_threads()
    yield
    _check_leaks(f"module {request.module.__name__}", segments, threads)


@pytest.fixture(autouse=True)
def _no_leaks_per_test(request) -> Iterator[None]:
    segments, threads = kvmesh_segments(), stray_threads()
    yield
    _check_leaks(request.node.nodeid, segments, threads)


class _Rays:
    """The one Ray connection of this test process, of whichever kind was asked last."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.cluster = None  # the ray.cluster_utils.Cluster of kind "cluster"

    def use(self, kind: str):
        import ray

        if kind == self.kind and ray.is_initialized():
            return self.cluster
        self.close()
        if kind == "local":
            ray.init(
                address="local",  # never a cluster that `ray start` left on the machine
                num_cpus=2,
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                namespace=RAY_NAMESPACE,
                log_to_driver=False,
            )
        else:
            from ray.cluster_utils import Cluster

            self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
            self.cluster.add_node(num_cpus=2)
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, namespace=RAY_NAMESPACE, log_to_driver=False)
        self.kind = kind
        return self.cluster

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
        self.kind = None


@pytest.fixture(scope="session")
def _rays() -> Iterator[_Rays]:
    rays = _Rays()
    yield rays
    rays.close()


def _no_kvmesh_actors_left(module: str) -> None:
    import ray

    deadline = time.monotonic() + 10.0
    while True:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        left = sorted(name for name in names if name.startswith("kvmesh"))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"module {module} left Ray actors alive: {left}"


@pytest.fixture(scope="module")
def ray_local(_rays, request) -> Iterator[None]:
    """An embedded single-node Ray (2 CPUs), shared with the other modules that use it."""
    _rays.use("local")
    yield
    _no_kvmesh_actors_left(request.module.__name__)


@pytest.fixture(scope="module")
def ray_cluster(_rays, request):
    """A simulated two-node Ray cluster (2 CPUs each, both this machine), shared likewise;
    the value is the `ray.cluster_utils.Cluster` (its `address` joins it)."""
    cluster = _rays.use("cluster")
    yield cluster
    _no_kvmesh_actors_left(request.module.__name__)
