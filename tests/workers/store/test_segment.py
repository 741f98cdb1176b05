"""Tests for workers/store/segment.py: creating, attaching, unlinking and closing the named
segment, its header and format version, and reading it from another process."""

from __future__ import annotations

import gc
import hashlib
import os
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from tests.workers.store.store_helpers import DIGESTS, OWN_PREFIX, make_kv, make_layout, run_python
from workers.store.layout import (
    NotOwnerError,
    PageStoreError,
    SegmentFormatError,
    SegmentNotFoundError,
)
from workers.store.page_store import SharedPageStore
from workers.store.segment import (
    FORMAT_VERSION,
    PLACEMENT_SEGMENT,
    Segment,
    pack_header,
    unpack_header,
)
from workers.store.segment_names import SHM_DIR


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


@pytest.mark.parametrize("version", [1, 2, 3, 99])
def test_attach_rejects_another_format_version(store, version):
    # Version 1 segments had no digest region, version 2 no placement field, version 3 no
    # peer handle slot: reading one as ours would misplace the pages or misread a handle.
    assert FORMAT_VERSION == 4
    with open(os.path.join(SHM_DIR, store.name), "r+b") as f:
        f.seek(8)
        f.write(version.to_bytes(8, "little"))
    with pytest.raises(SegmentFormatError, match=f"format version {version}, this build reads 4"):
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


# -- the segment on its own ----------------------------------------------------------------


def test_a_reader_segment_maps_the_owners_memory_read_only():
    owner = Segment.create(make_layout(num_pages=2), tag="seg")
    try:
        views = owner.views()
        views.generations[1] = 7
        views.digests[0] = DIGESTS[0][0]
        views.pages[1].fill_(2.5)
        reader = Segment.attach(owner.name)
        assert (reader.name, reader.layout, reader.is_owner) == (owner.name, owner.layout, False)
        seen = reader.views()
        assert seen.generations.tolist() == [0, 7]
        assert bytes(seen.digests[0]) == DIGESTS[0] and not seen.digests[1].any()
        assert seen.pages.shape == (2, *owner.layout.page_shape)
        assert bool((seen.pages[1] == 2.5).all()) and not seen.pages[0].any()
        assert not seen.generations.flags.writeable  # numpy honours the read-only mapping
        with pytest.raises(NotOwnerError, match=f"unlink of segment '{owner.name}'"):
            reader.unlink()
        del seen
        reader.close()
        assert reader.closed and os.path.exists(os.path.join(SHM_DIR, owner.name))
        with pytest.raises(PageStoreError, match="closed"):
            reader.views()
        owner.check_integrity()
    finally:
        owner.close()  # with `views` still alive: the mapping goes when they do
    assert owner.closed and not os.path.exists(os.path.join(SHM_DIR, owner.name))
    assert views.generations[1] == 7
    with pytest.raises(AssertionError, match="closed"):
        owner.check_integrity()


def test_a_header_that_does_not_add_up_is_refused():
    layout = make_layout()
    header = pack_header(layout)
    assert unpack_header("x", header) == (layout, PLACEMENT_SEGMENT)
    bad_dtype = header[:56] + (99).to_bytes(8, "little") + header[64:]
    with pytest.raises(SegmentFormatError, match="'x': unknown dtype code 99"):
        unpack_header("x", bad_dtype)
    no_pages = header[:16] + (0).to_bytes(8, "little") + header[24:]
    with pytest.raises(SegmentFormatError, match="bad layout in header: StoreLayout.num_pages"):
        unpack_header("x", no_pages)
    moved = header[:-8] + (1 << 30).to_bytes(8, "little")  # total_bytes, the last field
    with pytest.raises(SegmentFormatError, match="region offsets .* do not match its layout"):
        unpack_header("x", moved)
