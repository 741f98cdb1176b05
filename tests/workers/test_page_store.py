"""Tests for workers/page_store.py: layout, allocation, shared memory across processes,
validated copies and reclaiming the segments of killed owners."""

from __future__ import annotations

import gc
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from workers.page_store import (
    SHM_DIR,
    NotOwnerError,
    PageStoreError,
    SegmentFormatError,
    SegmentNotFoundError,
    SharedPageStore,
    StoreLayout,
    ValidatedCopy,
    process_start_time,
    reclaim_dead_segments,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
OWN_PREFIX = f"kvmesh-{os.getpid()}-"


def make_layout(**overrides: object) -> StoreLayout:
    fields = dict(num_pages=8, num_layers=2, num_kv_heads=3, page_tokens=4, head_dim=5)
    fields.update(overrides)
    return StoreLayout(**fields)


def make_kv(layout: StoreLayout, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layout.page_shape, generator=gen).to(layout.torch_dtype)


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        timeout=60,
    )


def start_python(code: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.fixture
def store():
    with SharedPageStore.create(make_layout(), tag="unit") as s:
        yield s


# -- layout ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_pages", 0),
        ("num_layers", -1),
        ("num_kv_heads", 1.5),
        ("page_tokens", True),
        ("head_dim", "64"),
    ],
)
def test_layout_rejects_bad_sizes_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"StoreLayout.{field} .*{value!r}"):
        make_layout(**{field: value})


def test_layout_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="StoreLayout.dtype .*'int8'"):
        make_layout(dtype="int8")


def test_layout_shape_and_bytes():
    layout = make_layout(dtype="bfloat16")
    assert layout.page_shape == (2, 2, 3, 4, 5)
    assert layout.torch_dtype is torch.bfloat16
    assert layout.page_bytes == 2 * 2 * 3 * 4 * 5 * 2
    assert make_layout().page_bytes == 2 * 2 * 3 * 4 * 5 * 4


# -- allocation ----------------------------------------------------------------------------


def test_fresh_store_hands_out_ascending_ids(store):
    assert store.is_owner and store.name.startswith(OWN_PREFIX) and store.name.endswith("-unit")
    assert (store.num_pages, store.num_free) == (8, 8)
    assert store.allocate(3) == [0, 1, 2]
    assert store.allocate(2) == [3, 4]
    assert store.num_free == 3
    assert store.can_allocate(3) and not store.can_allocate(4)
    assert store.allocate(4) is None  # running out is a return value, and takes nothing
    assert store.num_free == 3
    store.check_integrity()


def test_free_bumps_generation_in_shared_memory(store):
    pages = store.allocate(3)
    assert store.generations(pages) == [0, 0, 0]
    store.free([pages[1]])
    assert store.generations(pages) == [0, 1, 0]
    assert store.generation(1) == 1
    # LIFO: the page just freed is the next one handed out.
    assert store.allocate(1) == [1]
    store.check_integrity()


def test_double_free_raises_and_changes_nothing(store):
    pages = store.allocate(3)
    store.free([pages[0]])
    with pytest.raises(ValueError, match="page 0 freed twice"):
        store.free([pages[2], pages[0]])
    assert store.num_free == 6
    assert store.generations(pages) == [1, 0, 0]
    with pytest.raises(ValueError, match=r"page 8 out of range \[0, 8\)"):
        store.free([8])
    assert store.num_free == 6
    store.check_integrity()


def test_create_rejects_bad_tag_and_other_devices():
    with pytest.raises(ValueError, match="tag must match"):
        SharedPageStore.create(make_layout(), tag="Bad-Tag")
    with pytest.raises(NotImplementedError, match="cuda"):
        SharedPageStore.create(make_layout(), device="cuda")
    with SharedPageStore.create(make_layout(), tag="twice") as store:
        with pytest.raises(PageStoreError, match="already exists"):
            SharedPageStore.create(make_layout(), tag="twice")
        store.check_integrity()


# -- page access ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_write_and_read_pages(dtype):
    layout = make_layout(dtype=dtype)
    with SharedPageStore.create(layout) as store:
        pages = store.allocate(3)
        kvs = [make_kv(layout, seed) for seed in range(3)]
        for page, kv in zip(pages, kvs, strict=True):
            store.write_page(page, kv)
        assert store.generations(pages) == [1, 1, 1]  # a write is a rewrite
        assert torch.equal(store.page(1), kvs[1])
        gathered = store.read_pages([2, 0])
        assert torch.equal(gathered, torch.stack([kvs[2], kvs[0]]))
        out = torch.empty((2, *layout.page_shape), dtype=layout.torch_dtype)
        assert store.read_pages([1, 2], out=out) is out
        assert torch.equal(out, torch.stack([kvs[1], kvs[2]]))
        store.check_integrity()


def test_write_page_rejects_bad_input_and_free_pages(store):
    layout = store.layout
    (page,) = store.allocate(1)
    with pytest.raises(ValueError, match="write_page needs"):
        store.write_page(page, torch.zeros(layout.page_shape, dtype=torch.float16))
    with pytest.raises(ValueError, match="write_page needs"):
        store.write_page(page, torch.zeros((1, *layout.page_shape)))
    with pytest.raises(ValueError, match="page 5 is free"):
        store.write_page(5, make_kv(layout, 0))
    with pytest.raises(ValueError, match="out of range"):
        store.read_pages([0, 8])
    with pytest.raises(ValueError, match="out must be"):
        store.read_pages([0], out=torch.empty(layout.page_shape))
    assert store.generation(page) == 0  # nothing written
    store.check_integrity()


def test_copy_page_copies_only_the_first_tokens(store):
    layout = store.layout
    src, dst = store.allocate(2)
    src_kv, dst_kv = make_kv(layout, 1), make_kv(layout, 2)
    store.write_page(src, src_kv)
    store.write_page(dst, dst_kv)
    generation = store.generation(dst)
    store.copy_page(src, dst, num_tokens=3)
    # page: (num_layers, 2, num_kv_heads, page_tokens, head_dim); tokens are dim 3.
    expected = dst_kv.clone()
    expected[:, :, :, :3] = src_kv[:, :, :, :3]
    assert torch.equal(store.page(dst), expected)
    assert torch.equal(store.page(src), src_kv)
    assert store.generation(dst) == generation + 1
    with pytest.raises(ValueError, match="num_tokens 5 outside"):
        store.copy_page(src, dst, num_tokens=5)
    with pytest.raises(ValueError, match="onto itself"):
        store.copy_page(src, src, num_tokens=1)
    with pytest.raises(ValueError, match="page 7 is free"):
        store.copy_page(src, 7, num_tokens=1)
    store.check_integrity()


# -- validated copies ----------------------------------------------------------------------


def test_copy_validated_reports_freed_and_rewritten_pages(store):
    layout = store.layout
    pages = store.allocate(4)
    kvs = [make_kv(layout, seed) for seed in range(4)]
    for page, kv in zip(pages, kvs, strict=True):
        store.write_page(page, kv)
    expected = store.generations(pages)  # what the owner would advertise with the pages
    with SharedPageStore.attach(store.name) as reader:
        store.free([pages[1]])  # the owner frees one page...
        store.write_page(pages[3], make_kv(layout, 9))  # ...and rewrites another
        out = torch.empty((4, *layout.page_shape))
        result = reader.copy_pages_validated(pages, expected, out)
        assert result == ValidatedCopy([True, False, True, False])
        assert not result.all_valid
        assert torch.equal(out[0], kvs[0]) and torch.equal(out[2], kvs[2])
        reader.check_integrity()
        with pytest.raises(ValueError, match="3 expected generations for 4 pages"):
            reader.copy_pages_validated(pages, expected[:3], out)
    store.check_integrity()


def test_copy_validated_all_unchanged(store):
    pages = store.allocate(2)
    out = torch.empty((2, *store.layout.page_shape))
    assert store.copy_pages_validated(pages, store.generations(pages), out).all_valid
    store.check_integrity()


# -- attached readers ----------------------------------------------------------------------


def test_attached_store_is_read_only(store):
    (page,) = store.allocate(1)
    store.write_page(page, make_kv(store.layout, 3))
    with SharedPageStore.attach(store.name) as reader:
        assert not reader.is_owner and reader.layout == store.layout
        assert torch.equal(reader.page(page), store.page(page))
        assert reader.generation(page) == 1
        for misuse in (
            lambda: reader.allocate(1),
            lambda: reader.free([page]),
            lambda: reader.can_allocate(1),
            lambda: reader.num_free,
            lambda: reader.write_page(page, make_kv(store.layout, 4)),
            lambda: reader.copy_page(page, 1, 1),
            reader.unlink,
        ):
            with pytest.raises(NotOwnerError, match=store.name):
                misuse()
        reader.check_integrity()
    assert reader.closed
    assert os.path.exists(os.path.join(SHM_DIR, store.name))  # a reader's close keeps it
    with pytest.raises(PageStoreError, match="closed"):
        reader.page(0)
    store.check_integrity()


def test_attach_missing_or_foreign_segment_is_a_clear_error():
    missing = f"{OWN_PREFIX}1-nosuchstore"
    with pytest.raises(SegmentNotFoundError, match=missing) as info:
        SharedPageStore.attach(missing)
    assert isinstance(info.value, FileNotFoundError)
    with pytest.raises(ValueError, match="not a kvmesh segment name"):
        SharedPageStore.attach("../etc/passwd")
    foreign = os.path.join(SHM_DIR, f"{OWN_PREFIX}1-foreign")
    Path(foreign).write_bytes(b"NOTKVMSH" + bytes(8192))
    try:
        with pytest.raises(SegmentFormatError, match="bad magic"):
            SharedPageStore.attach(os.path.basename(foreign))
    finally:
        os.unlink(foreign)


def test_attach_rejects_another_format_version(store):
    with open(os.path.join(SHM_DIR, store.name), "r+b") as f:
        f.seek(8)
        f.write((99).to_bytes(8, "little"))
    with pytest.raises(SegmentFormatError, match="format version 99"):
        SharedPageStore.attach(store.name)
    with pytest.raises(AssertionError, match="header no longer matches"):
        store.check_integrity()


def test_owner_close_unlinks_and_is_idempotent():
    store = SharedPageStore.create(make_layout())
    path = os.path.join(SHM_DIR, store.name)
    view = store.page(0)  # a live view must not make close() fail
    assert os.path.exists(path)
    store.close()
    store.close()
    assert not os.path.exists(path)
    assert view.shape == store.layout.page_shape
    with pytest.raises(PageStoreError, match="closed"):
        store.allocate(1)
    with pytest.raises(AssertionError, match="closed"):
        store.check_integrity()


def test_owner_dropped_without_close_still_unlinks():
    store = SharedPageStore.create(make_layout())
    path = os.path.join(SHM_DIR, store.name)
    del store
    gc.collect()
    assert not os.path.exists(path)


def test_unlink_keeps_the_owner_usable(store):
    store.unlink()
    store.unlink()
    assert not os.path.exists(os.path.join(SHM_DIR, store.name))
    with pytest.raises(SegmentNotFoundError):
        SharedPageStore.attach(store.name)
    assert store.allocate(1) == [0]
    store.check_integrity()


# -- other processes -----------------------------------------------------------------------

# Attaches to each store named on the command line and writes, per store, a line
# "<sha256> <generation> <length>" followed by the raw bytes of the page asked for.
READ_PAGES_IN_CHILD = """
    import hashlib, sys, torch
    from workers.page_store import SharedPageStore

    for arg in sys.argv[1:]:
        name, page = arg.split(":")
        with SharedPageStore.attach(name) as store:
            raw = store.page(int(page)).contiguous().view(torch.uint8).numpy().tobytes()
            generation = store.generation(int(page))
        line = f"{hashlib.sha256(raw).hexdigest()} {generation} {len(raw)}\\n"
        sys.stdout.buffer.write(line.encode() + raw)
"""

# Creates a store, prints its name, then waits for a line on stdin before closing it.
OWN_STORE_IN_CHILD = """
    import sys
    from workers.page_store import SharedPageStore, StoreLayout

    layout = StoreLayout(num_pages=2, num_layers=1, num_kv_heads=1, page_tokens=4, head_dim=8)
    with SharedPageStore.create(layout, tag=sys.argv[1]) as store:
        print(store.name, flush=True)
        sys.stdin.readline()
"""


@pytest.mark.slow
def test_second_process_reads_the_exact_bytes():
    # One child for every dtype: starting a process that imports torch is the slow part.
    with ExitStack() as stack:
        stores, written = [], []
        for seed, dtype in enumerate(["float32", "float16", "bfloat16"]):
            layout = make_layout(dtype=dtype)
            store = stack.enter_context(SharedPageStore.create(layout))
            pages = store.allocate(seed + 1)
            kv = make_kv(layout, seed)
            store.write_page(pages[-1], kv)
            stores.append((store, pages[-1]))
            written.append(kv.view(torch.uint8).numpy().tobytes())

        child = run_python(READ_PAGES_IN_CHILD, *(f"{s.name}:{p}" for s, p in stores))
        assert child.returncode == 0, child.stderr.decode()
        rest = child.stdout
        for (store, page), expected in zip(stores, written, strict=True):
            line, rest = rest.split(b"\n", 1)
            digest, generation, length = line.decode().split()
            raw, rest = rest[: int(length)], rest[int(length) :]
            assert raw == expected
            assert digest == hashlib.sha256(expected).hexdigest()
            assert int(generation) == store.generation(page) == 1
            store.check_integrity()
        assert rest == b""


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
