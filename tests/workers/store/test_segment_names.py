"""Tests for workers/store/segment_names.py: segment names, owners' start times, and
reclaiming the segments of owners that have died."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.workers.store.store_helpers import OWN_PREFIX, make_layout, start_python
from workers.store.page_store import SharedPageStore
from workers.store.segment_names import (
    SHM_DIR,
    owner_alive,
    process_start_time,
    reclaim_dead_segments,
    segment_name,
    segment_path,
    worker_tag,
)

# Creates a store, prints its name, then waits for a line on stdin before closing it.
OWN_STORE_IN_CHILD = """
    import sys
    from workers.store.page_store import SharedPageStore, StoreLayout

    layout = StoreLayout(num_pages=2, num_layers=1, num_kv_heads=1, page_tokens=4, head_dim=8)
    with SharedPageStore.create(layout, tag=sys.argv[1]) as store:
        print(store.name, flush=True)
        sys.stdin.readline()
"""


@pytest.mark.slow
def test_a_killed_owner_not_yet_reaped_is_dead_to_the_reclaimer():
    child = start_python(OWN_STORE_IN_CHILD, "zombie")
    try:
        name = child.stdout.readline().decode().strip()
        assert name.startswith(f"kvmesh-{child.pid}-"), child.stderr.read().decode()
        os.kill(child.pid, signal.SIGKILL)
        stat = Path(f"/proc/{child.pid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":  # not waited for yet
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.01)
        assert process_start_time(child.pid) is None
        assert reclaim_dead_segments(prefix=f"kvmesh-{child.pid}-") == [name]
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(10)


@pytest.mark.slow
def test_killed_owner_segment_is_reclaimed_live_one_is_not():
    doomed = start_python(OWN_STORE_IN_CHILD, "doomed")
    alive = start_python(OWN_STORE_IN_CHILD, "alive")
    try:
        doomed_name = doomed.stdout.readline().decode().strip()
        alive_name = alive.stdout.readline().decode().strip()
        assert doomed_name.startswith(f"kvmesh-{doomed.pid}-"), doomed.stderr.read().decode()
        assert alive_name.startswith(f"kvmesh-{alive.pid}-"), alive.stderr.read().decode()
        doomed_path = os.path.join(SHM_DIR, doomed_name)
        alive_path = os.path.join(SHM_DIR, alive_name)

        os.kill(doomed.pid, signal.SIGKILL)
        assert doomed.wait(timeout=10) == -signal.SIGKILL
        assert os.path.exists(doomed_path)  # a SIGKILLed owner cleans nothing up

        # A segment whose pid is ours but whose start time is not: the pid was reused.
        reused = f"{OWN_PREFIX}{process_start_time(os.getpid()) + 1}-x"
        Path(SHM_DIR, reused).touch()
        assert reclaim_dead_segments(prefix=OWN_PREFIX) == [reused]
        assert os.path.exists(doomed_path)  # outside the prefix asked for

        # create() reclaims first: the killed owner's segment goes, the live one stays.
        with SharedPageStore.create(make_layout()) as store:
            assert not os.path.exists(doomed_path)
            assert os.path.exists(alive_path)
            store.check_integrity()
        assert reclaim_dead_segments(prefix=f"kvmesh-{alive.pid}-") == []

        # A live peer can still attach to the survivor.
        with SharedPageStore.attach(alive_name) as reader:
            reader.check_integrity()
        alive.stdin.write(b"done\n")
        alive.stdin.flush()
        assert alive.wait(timeout=10) == 0
        assert not os.path.exists(alive_path)  # a clean owner exit unlinks
    finally:
        for child in (doomed, alive):
            if child.poll() is None:
                child.kill()
            child.wait()
            for stream in (child.stdin, child.stdout, child.stderr):
                stream.close()
            reclaim_dead_segments(prefix=f"kvmesh-{child.pid}-")


def test_names_carry_the_owner_and_a_tag():
    name = segment_name("w0")
    assert name == f"{OWN_PREFIX}{process_start_time(os.getpid())}-w0"
    assert owner_alive(name) and segment_path(name) == os.path.join(SHM_DIR, name)
    assert len(segment_name(None).rsplit("-", 1)[1]) == 8  # a random tag, 4 bytes in hex
    for tag in ("W0", "a-b", "", "x" * 33, 7):
        with pytest.raises(ValueError, match="tag must match"):
            segment_name(tag)
    for bad in ("../etc/passwd", "kvmesh-1-2-", f"{name}/..", "kvmesh-1-2-UP"):
        with pytest.raises(ValueError, match="not a kvmesh segment name"):
            segment_path(bad)
        assert not owner_alive(bad)
    reused = f"{OWN_PREFIX}{process_start_time(os.getpid()) + 1}-w0"  # our pid, not our start
    assert not owner_alive(reused)


def test_worker_tag_keeps_what_a_tag_allows():
    assert worker_tag("Worker-0.a") == "worker_0_a"
    assert worker_tag("w" * 40) == "w" * 32
    assert worker_tag("") == "worker"
