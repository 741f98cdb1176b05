"""Tests for workers/store/page_store.py: layout, allocation, shared memory across processes,
validated copies, page digests and reclaiming the segments of killed owners."""

from __future__ import annotations

import gc
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch

import workers.store.page_store as page_store
from workers.store.digests import DIGEST_BYTES, EMPTY_DIGEST
from workers.store.page_pool import PagePool
from workers.store.page_store import (
    FORMAT_VERSION,
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
DIGESTS = [bytes([i + 1]) * DIGEST_BYTES for i in range(8)]  # stand-ins, one per page


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


def test_kv_format_names_what_the_bytes_mean_not_how_many_pages():
    layout = make_layout()
    assert layout.kv_format == "kv1:layers=2:kv_heads=3:head_dim=5:page_tokens=4:dtype=float32"
    assert make_layout(num_pages=100).kv_format == layout.kv_format
    others = [
        make_layout(num_layers=3),
        make_layout(num_kv_heads=1),
        make_layout(page_tokens=8),
        make_layout(head_dim=6),
        make_layout(dtype="bfloat16"),
    ]
    assert len({layout.kv_format, *(other.kv_format for other in others)}) == 6


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
    with pytest.raises(ValueError, match="page 1 freed twice"):
        store.free([pages[2], pages[1], pages[1]])  # twice in one call
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


def test_copy_validated_with_digests_wants_both_generation_and_digest(store):
    layout = store.layout
    pages = store.allocate(5)
    kvs = [make_kv(layout, seed) for seed in range(5)]
    for page, kv in zip(pages, kvs, strict=True):
        store.write_page(page, kv)
    store.set_digests(pages[:4], DIGESTS[:4])  # the last page is never published
    gens = store.generations(pages)
    wanted = [DIGESTS[0], DIGESTS[7], DIGESTS[2], DIGESTS[3], DIGESTS[4]]
    with SharedPageStore.attach(store.name) as reader:
        store.free([pages[3]])  # freed: generation and digest both gone
        out = torch.empty((5, *layout.page_shape))
        result = reader.copy_pages_validated(pages, gens, out, digests=wanted)
        # page 1 holds another chain than asked; page 4 records nothing
        assert result == ValidatedCopy([True, False, True, False, False])
        assert torch.equal(out[0], kvs[0]) and torch.equal(out[2], kvs[2])
        # Without digests only the generations count, as before.
        assert reader.copy_pages_validated(pages, gens, out).valid == [True] * 3 + [False, True]
        with pytest.raises(ValueError, match="4 expected digests for 5 pages"):
            reader.copy_pages_validated(pages, gens, out, digests=wanted[:4])
        with pytest.raises(ValueError, match=r"digest must be 16 bytes, got 3 \(page 1\)"):
            reader.copy_pages_validated(pages, gens, out, digests=[DIGESTS[0], b"abc", *wanted[2:]])
        reader.check_integrity()
    store.check_integrity()


def test_a_digest_recorded_while_a_copy_runs_does_not_vouch_for_it(store, monkeypatch):
    # The model writes KV without bumping generations, then publish records the digest:
    # a copy that started before the digest was there may have torn bytes, so the digest
    # read before the copy must already match.
    pages = store.allocate(2)
    gens = store.generations(pages)
    runs = page_store._runs

    def publish_during_copy(rows):
        store.set_digests(pages, DIGESTS[:2])
        return runs(rows)

    monkeypatch.setattr(page_store, "_runs", publish_during_copy)
    out = torch.empty((2, *store.layout.page_shape))
    assert store.copy_pages_validated(pages, gens, out, digests=DIGESTS[:2]).valid == [False] * 2
    monkeypatch.setattr(page_store, "_runs", runs)
    assert store.copy_pages_validated(pages, gens, out, digests=DIGESTS[:2]).all_valid
    store.check_integrity()


# -- digests -------------------------------------------------------------------------------


def test_digests_are_recorded_until_free_or_rewrite(store):
    pages = store.allocate(4)
    assert store.kv_format == store.layout.kv_format
    assert store.digests(pages) == [EMPTY_DIGEST] * 4  # a fresh segment is all zeros
    store.set_digests(pages[::-1], DIGESTS[:4])  # not a run of pages: one by one
    assert store.digests(pages) == DIGESTS[:4][::-1]
    store.set_digests(pages, DIGESTS[:4])  # a run: one copy
    store.set_digest(pages[0], DIGESTS[5])  # recorded again: the last one counts
    assert store.digests(pages[::-1]) == [DIGESTS[3], DIGESTS[2], DIGESTS[1], DIGESTS[5]]
    gens = store.generations(pages)
    store.free([pages[0]])
    store.write_page(pages[1], make_kv(store.layout, 1))
    store.copy_page(pages[3], pages[2], num_tokens=1)  # into page 2: a rewrite of it
    assert store.digests(pages) == [EMPTY_DIGEST] * 3 + [DIGESTS[3]]
    assert store.generations(pages) == [g + 1 for g in gens[:3]] + gens[3:]
    (again,) = store.allocate(1)
    assert again == pages[0] and store.digests([again]) == [EMPTY_DIGEST]
    store.check_integrity()


def test_set_digest_checks_its_input_and_changes_nothing_on_error(store):
    pages = store.allocate(2)
    store.set_digest(pages[0], DIGESTS[0])
    with pytest.raises(ValueError, match="digest must be 16 bytes, got 15"):
        store.set_digest(pages[1], bytes(range(1, 16)))
    with pytest.raises(ValueError, match="empty digest"):
        store.set_digest(pages[1], EMPTY_DIGEST)
    with pytest.raises(ValueError, match="page 5 is free"):
        store.set_digest(5, DIGESTS[5])
    with pytest.raises(ValueError, match=r"page 8 out of range \[0, 8\)"):
        store.set_digest(8, DIGESTS[0])
    with pytest.raises(ValueError, match=r"page -1 out of range"):
        store.set_digests([pages[1], -1], DIGESTS[:2])
    with pytest.raises(ValueError, match="page 5 is free"):
        store.set_digests([pages[1], 5], DIGESTS[:2])  # all or nothing: page 1 untouched
    with pytest.raises(ValueError, match="page 2 is free"):
        store.set_digests([1, 2], DIGESTS[:2])  # a run, partly free
    with pytest.raises(ValueError, match=r"page 8 out of range"):
        store.set_digests([7, 8], DIGESTS[:2])
    with pytest.raises(ValueError, match="digest must be 16 bytes, got 15"):
        store.set_digests(pages, [bytes(15), bytes(17)])  # 32 bytes in all, still refused
    with pytest.raises(ValueError, match="1 digests for 2 pages"):
        store.set_digests(pages, DIGESTS[:1])
    with pytest.raises(ValueError, match=r"pages \[9\] out of range"):
        store.digests([0, 9])
    assert store.digests(pages) == [DIGESTS[0], EMPTY_DIGEST]
    store.check_integrity()


def test_a_reader_reads_digests_but_may_not_record_them(store):
    pages = store.allocate(2)
    store.set_digest(pages[1], DIGESTS[1])
    with SharedPageStore.attach(store.name) as reader:
        assert reader.kv_format == store.kv_format
        assert reader.digests(pages) == [EMPTY_DIGEST, DIGESTS[1]]
        for misuse in (
            lambda: reader.set_digest(pages[0], DIGESTS[0]),
            lambda: reader.set_digests(pages, DIGESTS[:2]),
        ):
            with pytest.raises(NotOwnerError, match=store.name):
                misuse()
        store.free(pages[1:])
        assert reader.digests(pages) == [EMPTY_DIGEST] * 2  # the same memory
        reader.check_integrity()
    store.check_integrity()


def test_check_integrity_catches_a_free_page_with_a_digest(store):
    store._digests[3] = 7  # a bug's work: the owner's own view of the digest region
    with pytest.raises(AssertionError, match=r"free pages \[3\] still record a digest"):
        store.check_integrity()
    store._digests[3] = 0
    store.check_integrity()


def test_a_bare_pool_keeps_digests_the_same_way():
    pool = PagePool(4)
    assert pool.kv_format == "" and PagePool(4, kv_format="kv1:x").kv_format == "kv1:x"
    pages = pool.allocate(3)
    pool.set_digests(pages, DIGESTS[:3])
    pool.bump_generation(pages[2])  # rewritten in place
    assert pool.digests(pages) == [DIGESTS[0], DIGESTS[1], EMPTY_DIGEST]
    pool.free(pages[:1])
    assert pool.digests([pages[0], pages[1]]) == [EMPTY_DIGEST, DIGESTS[1]]
    assert pool.generation(pages[0]) == 1
    with pytest.raises(ValueError, match="page 0 is free"):
        pool.set_digest(pages[0], DIGESTS[0])
    with pytest.raises(ValueError, match=r"digests must be \(4, 16\) uint8"):
        PagePool(4, digests=np.zeros((4, 8), dtype=np.uint8))
    pool.check_integrity()


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


@pytest.mark.parametrize("version", [1, 99])
def test_attach_rejects_another_format_version(store, version):
    # Version 1 segments had no digest region: reading one as ours would misplace the pages.
    assert FORMAT_VERSION == 2
    with open(os.path.join(SHM_DIR, store.name), "r+b") as f:
        f.seek(8)
        f.write(version.to_bytes(8, "little"))
    with pytest.raises(SegmentFormatError, match=f"format version {version}, this build reads 2"):
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
# "<sha256> <generation> <digest hex> <length>" followed by the raw bytes of the page asked
# for (the digest is what the owner recorded for the page, from the digest region).
READ_PAGES_IN_CHILD = """
    import hashlib, sys, torch
    from workers.store.page_store import SharedPageStore

    for arg in sys.argv[1:]:
        name, page = arg.split(":")
        with SharedPageStore.attach(name) as store:
            raw = store.page(int(page)).contiguous().view(torch.uint8).numpy().tobytes()
            generation = store.generation(int(page))
            [digest] = store.digests([int(page)])
        line = f"{hashlib.sha256(raw).hexdigest()} {generation} {digest.hex()} {len(raw)}\\n"
        sys.stdout.buffer.write(line.encode() + raw)
"""

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
            store.set_digest(pages[-1], DIGESTS[seed])
            stores.append((store, pages[-1]))
            written.append(kv.view(torch.uint8).numpy().tobytes())

        child = run_python(READ_PAGES_IN_CHILD, *(f"{s.name}:{p}" for s, p in stores))
        assert child.returncode == 0, child.stderr.decode()
        rest = child.stdout
        for seed, ((store, page), expected) in enumerate(zip(stores, written, strict=True)):
            line, rest = rest.split(b"\n", 1)
            sha, generation, digest, length = line.decode().split()
            raw, rest = rest[: int(length)], rest[int(length) :]
            assert raw == expected
            assert sha == hashlib.sha256(expected).hexdigest()
            assert int(generation) == store.generation(page) == 1
            assert bytes.fromhex(digest) == DIGESTS[seed] == store.digests([page])[0]
            store.check_integrity()
        assert rest == b""


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
