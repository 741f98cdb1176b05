"""Tests for the page store's device path on the CPU: a store whose pages live outside its
segment (`pages_in_segment=False`, as on a GPU), its readers, the CUDA IPC handle's plain
fields, and staging between it and a host store (workers/store/staging.py)."""

from __future__ import annotations

import os
import sys

import msgpack
import pytest
import torch

import workers.store.validated_copy as validated_copy
from tests.workers.store.store_helpers import DIGESTS, make_kv, make_layout
from workers.store.cuda_ipc import CudaIpcHandle
from workers.store.digests import EMPTY_DIGEST
from workers.store.page_store import (
    SHM_DIR,
    CudaIpcError,
    NotOwnerError,
    PageStoreError,
    SegmentFormatError,
    SharedPageStore,
    ValidatedCopy,
)
from workers.store.segment import PLACEMENT_DEVICE, pack_header, regions, unpack_header
from workers.store.staging import load_back, stage_pages, staging_buffer, write_back


@pytest.fixture
def device_store():
    """An owned 8-page store whose pages are a private CPU tensor, as a device's would be."""
    with SharedPageStore.create(make_layout(), tag="dev", pages_in_segment=False) as s:
        yield s


@pytest.fixture
def host_store():
    with SharedPageStore.create(make_layout(), tag="host") as s:
        yield s


def write_kvs(store, pages, seeds):
    kvs = [make_kv(store.layout, seed) for seed in seeds]
    for page, kv in zip(pages, kvs, strict=True):
        store.write_page(page, kv)
    return kvs


@pytest.fixture
def rewrite_during_copy(monkeypatch):
    """Makes the next validated copies run `write()` (a real write by the pages' owner)
    right after their bytes land, between the two generation reads."""

    def arm(write):
        copy_rows = validated_copy.copy_rows

        def copy_then_write(pages, rows, out):
            copy_rows(pages, rows, out)
            write()

        monkeypatch.setattr(validated_copy, "copy_rows", copy_then_write)

    return arm


# -- the store ---------------------------------------------------------------------------


def test_a_device_store_keeps_only_metadata_in_its_segment(device_store):
    layout = device_store.layout
    assert not device_store.pages_in_segment and device_store.device == torch.device("cpu")
    size = os.path.getsize(os.path.join(SHM_DIR, device_store.name))
    assert size == regions(layout, PLACEMENT_DEVICE).total_bytes < layout.num_pages * 8 * 1024
    pages = device_store.allocate(3)
    assert pages == [0, 1, 2]
    kvs = write_kvs(device_store, pages, [1, 2, 3])
    device_store.set_digests(pages[:2], DIGESTS[:2])
    assert torch.equal(device_store.read_pages([2, 0]), torch.stack([kvs[2], kvs[0]]))
    assert device_store.generations(pages) == [1, 1, 1]  # bumped by each write
    with SharedPageStore.attach(device_store.name) as reader:  # metadata only
        assert not reader.pages_in_segment and reader.device is None
        assert reader.generations(pages) == [1, 1, 1]
        assert reader.digests(pages) == [DIGESTS[0], DIGESTS[1], EMPTY_DIGEST]
        with pytest.raises(PageStoreError, match="has no pages: its owner keeps them on a dev"):
            reader.page(0)
        with pytest.raises(NotOwnerError):
            reader.write_pages([0], kvs[0][None])
        reader.check_integrity()
    device_store.check_integrity()


def test_write_pages_bumps_every_generation_and_records_digests(device_store):
    pages = device_store.allocate(4)
    kv = torch.stack([make_kv(device_store.layout, seed) for seed in range(3)])
    device_store.write_pages([3, 0, 1], kv, DIGESTS[:3])
    assert torch.equal(device_store.read_pages([3, 0, 1]), kv)
    assert device_store.generations(pages) == [1, 1, 0, 1]
    assert device_store.digests(pages) == [DIGESTS[1], DIGESTS[2], EMPTY_DIGEST, DIGESTS[0]]
    device_store.write_pages([0], kv[:1])  # a rewrite without digests clears the old one
    assert device_store.digests([0]) == [EMPTY_DIGEST] and device_store.generations([0]) == [2]
    device_store.check_integrity()


def test_bad_writes_raise_with_numbers_and_change_nothing(device_store):
    pages = device_store.allocate(2)
    kv = torch.stack([make_kv(device_store.layout, seed) for seed in range(2)])
    before = device_store.read_pages(pages), device_store.generations(range(8))
    with pytest.raises(ValueError, match=r"pages \[0, 0\]: a page appears twice"):
        device_store.write_pages([0, 0], kv)
    with pytest.raises(ValueError, match="page 5 is free"):
        device_store.write_pages([0, 5], kv)
    with pytest.raises(ValueError, match=r"pages \[8\] out of range \[0, 8\)"):
        device_store.write_pages([0, 8], kv)
    with pytest.raises(ValueError, match=r"kv must be \(1, 2, 2, 3, 4, 5\) torch.float32"):
        device_store.write_pages([0], kv)
    with pytest.raises(ValueError, match="an empty digest records nothing"):
        device_store.write_pages(pages, kv, [DIGESTS[0], EMPTY_DIGEST])
    with pytest.raises(ValueError, match="1 expected digests for 2 pages"):
        device_store.write_pages(pages, kv, DIGESTS[:1])
    assert torch.equal(device_store.read_pages(pages), before[0])
    assert device_store.generations(range(8)) == before[1]
    device_store.check_integrity()


def test_create_and_attach_refuse_what_does_not_fit(device_store, store):
    with pytest.raises(ValueError, match="pages on cuda:0 cannot live in a shared-memory seg"):
        SharedPageStore.create(make_layout(), device="cuda:0", pages_in_segment=True)
    with pytest.raises(ValueError, match="holds its own pages: attach it bare"):
        SharedPageStore.attach(store.name, pages=torch.zeros(1))
    with pytest.raises(ValueError, match=r"pages must be \(8, 2, 2, 3, 4, 5\) torch.float32"):
        SharedPageStore.attach(device_store.name, pages=torch.zeros(7, 2, 2, 3, 4, 5))
    with pytest.raises(CudaIpcError, match="keeps its pages on cpu: only CUDA pages"):
        device_store.export_pages()
    device_store.check_integrity()
    store.check_integrity()


def test_a_header_with_an_unknown_placement_is_refused():
    header = pack_header(make_layout(), PLACEMENT_DEVICE)
    assert unpack_header("x", header) == (make_layout(), PLACEMENT_DEVICE)
    odd = header[:64] + (7).to_bytes(8, "little") + header[72:]
    with pytest.raises(SegmentFormatError, match=r"'x': unknown page placement 7, known \[0, 1\]"):
        unpack_header("x", odd)


# -- readers of the pages --------------------------------------------------------------


def test_a_page_rewritten_during_a_copy_is_detected(device_store, rewrite_during_copy):
    pages = device_store.allocate(3)
    kvs = write_kvs(device_store, pages, [1, 2, 3])
    device_store.set_digests(pages, DIGESTS[:3])
    gens = device_store.generations(pages)
    all_pages = device_store.page_range(0, device_store.num_pages)  # what IPC would open
    with SharedPageStore.attach(device_store.name, pages=all_pages) as reader:
        out = torch.empty((3, *reader.layout.page_shape))
        assert reader.copy_pages_validated(pages, gens, out, DIGESTS[:3]).all_valid
        assert torch.equal(out, torch.stack(kvs))
        rewrite_during_copy(lambda: device_store.write_page(pages[1], make_kv(reader.layout, 9)))
        result = reader.copy_pages_validated(pages, gens, out, DIGESTS[:3])
        assert result == ValidatedCopy([True, False, True])
        assert device_store.generations(pages) == [gens[0], gens[1] + 1, gens[2]]
        reader.check_integrity()
    device_store.check_integrity()


# -- staging -------------------------------------------------------------------------------


def test_write_back_then_load_back_round_trips_with_generations_and_digests(
    device_store, host_store
):
    pages = device_store.allocate(4)
    kvs = write_kvs(device_store, pages, [1, 2, 3, 4])
    device_store.set_digests(pages, DIGESTS[:4])
    host_pages = host_store.allocate(6)[2:]  # [2, 3, 4, 5]
    staging = staging_buffer(device_store, 4)
    order = [pages[3], pages[0], pages[2]]  # scattered, out of order
    gens = device_store.generations(order)
    wanted = [DIGESTS[3], DIGESTS[0], DIGESTS[2]]
    result = write_back(device_store, order, gens, host_store, host_pages[:3], wanted, staging)
    assert result == ValidatedCopy([True, True, True])
    assert torch.equal(host_store.read_pages(host_pages[:3]), torch.stack([kvs[3], kvs[0], kvs[2]]))
    assert host_store.generations(host_pages) == [1, 1, 1, 0]
    assert host_store.digests(host_pages) == [*wanted, EMPTY_DIGEST]
    # And up again, into fresh device pages.
    up = device_store.allocate(3)
    host_gens = host_store.generations(host_pages[:3])
    result = load_back(host_store, host_pages[:3], host_gens, device_store, up, wanted, staging)
    assert result.all_valid
    assert torch.equal(device_store.read_pages(up), torch.stack([kvs[3], kvs[0], kvs[2]]))
    assert device_store.digests(up) == wanted and device_store.generations(up) == [1, 1, 1]
    host_store.check_integrity()
    device_store.check_integrity()


def test_a_page_rewritten_during_write_back_is_not_written(
    device_store, host_store, rewrite_during_copy
):
    pages = device_store.allocate(2)
    kvs = write_kvs(device_store, pages, [1, 2])
    device_store.set_digests(pages, DIGESTS[:2])
    gens = device_store.generations(pages)
    host_pages = host_store.allocate(2)
    old = host_store.read_pages(host_pages)
    rewrite_during_copy(lambda: device_store.write_page(pages[0], make_kv(device_store.layout, 9)))
    result = write_back(device_store, pages, gens, host_store, host_pages, DIGESTS[:2])
    assert result == ValidatedCopy([False, True])
    assert torch.equal(host_store.read_pages([host_pages[0]]), old[:1])  # left as it was
    assert torch.equal(host_store.read_pages([host_pages[1]]), kvs[1][None])
    assert host_store.generations(host_pages) == [0, 1]
    assert host_store.digests(host_pages) == [EMPTY_DIGEST, DIGESTS[1]]
    host_store.check_integrity()
    device_store.check_integrity()


def test_bad_staging_input_raises_with_numbers_and_changes_nothing(device_store, host_store):
    pages = device_store.allocate(2)
    write_kvs(device_store, pages, [1, 2])
    gens = device_store.generations(pages)
    host_pages = host_store.allocate(2)
    before = host_store.read_pages(range(8)), host_store.generations(range(8))
    with pytest.raises(ValueError, match="2 source pages, 1 destination pages, 2 expected gen"):
        write_back(device_store, pages, gens, host_store, host_pages[:1])
    with pytest.raises(ValueError, match="destination|page 6 is free"):
        write_back(device_store, pages, gens, host_store, [host_pages[0], 6])
    with pytest.raises(ValueError, match="a page appears twice"):
        write_back(device_store, pages, gens, host_store, [host_pages[0]] * 2)
    with pytest.raises(
        ValueError, match=r"staging must be a CPU \(2\+, .*got \(1, 2, 2, 3, 4, 5\)"
    ):
        write_back(
            device_store, pages, gens, host_store, host_pages, None, torch.empty(1, 2, 2, 3, 4, 5)
        )
    with pytest.raises(ValueError, match="not a shared-memory store"):
        write_back(device_store, pages, gens, device_store, pages)
    other = SharedPageStore.create(make_layout(num_layers=3), tag="other")
    with other, pytest.raises(ValueError, match="pages of kv1:layers=2.* into a store of kv1:l"):
        stage_pages(device_store, pages, gens, other, [0, 1])
    reader = SharedPageStore.attach(host_store.name)
    with reader, pytest.raises(NotOwnerError, match="staging into attached store"):
        stage_pages(device_store, pages, gens, reader, host_pages)
    with pytest.raises(ValueError, match="a staging buffer of 0 pages: need at least 1"):
        staging_buffer(device_store, 0)
    assert torch.equal(host_store.read_pages(range(8)), before[0])
    assert host_store.generations(range(8)) == before[1]
    host_store.check_integrity()
    device_store.check_integrity()


# -- CUDA IPC handles ----------------------------------------------------------------------


def test_an_ipc_handle_travels_as_plain_msgpack_fields():
    handle = CudaIpcHandle(0, b"\x01" * 64, 4096, 512, b"/torch_1_2_3", 8, b"\x02" * 64, True)
    wire = msgpack.packb(handle.to_fields())
    assert CudaIpcHandle.from_fields(msgpack.unpackb(wire)) == handle
    with pytest.raises(CudaIpcError, match="field storage_size_bytes: -1 is not a int"):
        CudaIpcHandle.from_fields({**handle.to_fields(), "storage_size_bytes": -1})
    with pytest.raises(CudaIpcError, match="field handle: 'x' is not a bytes"):
        CudaIpcHandle.from_fields({**handle.to_fields(), "handle": "x"})
    with pytest.raises(CudaIpcError, match="fields .* expected"):
        CudaIpcHandle.from_fields({"device_index": 0})


def test_the_cpu_path_never_loads_the_cuda_module(device_store, host_store, monkeypatch):
    monkeypatch.delitem(sys.modules, "workers.store.cuda_ipc", raising=False)
    pages, host_pages = device_store.allocate(2), host_store.allocate(2)
    gens = device_store.generations(pages)
    assert write_back(device_store, pages, gens, host_store, host_pages).all_valid
    assert load_back(host_store, host_pages, [1, 1], device_store, pages).all_valid
    assert "workers.store.cuda_ipc" not in sys.modules
    device_store.check_integrity()
    host_store.check_integrity()


def test_a_same_node_peer_opens_pages_through_the_handle_left_in_the_segment(
    device_store, host_store
):
    """The owner of CUDA pages leaves its IPC handle's fields in its segment's header; a
    peer reads them there (checked against their crc32). Without a handle (pages on the
    CPU, or an export CUDA refused) opening is a CudaIpcError, the peer's cue to read the
    owner's page server instead; a store of shared-memory pages opens as it attaches."""
    with pytest.raises(CudaIpcError, match="left no CUDA IPC handle"):
        SharedPageStore.open_peer(device_store.name)
    with SharedPageStore.open_peer(host_store.name) as peer:
        assert peer.pages_in_segment and torch.equal(peer.page(0), host_store.page(0))
    segment = device_store._segment
    layout = device_store.layout
    size = layout.num_pages * layout.page_bytes
    handle = CudaIpcHandle(0, b"\x01" * 64, size, 0, b"/torch_1_2_3", 8, b"\x02" * 64, True)
    segment.set_peer_handle(msgpack.packb(handle.to_fields()))
    with SharedPageStore.attach(device_store.name) as reader:
        assert CudaIpcHandle.from_fields(msgpack.unpackb(reader._segment.peer_handle())) == handle
        with pytest.raises(NotOwnerError, match="owner only"):
            reader._segment.set_peer_handle(b"x")
    # Found and decoded; here, opening it is what fails: no CUDA on this machine.
    with pytest.raises(CudaIpcError, match="no CUDA device on this machine"):
        SharedPageStore.open_peer(device_store.name)
    segment.set_peer_handle(b"\xc1")  # not msgpack
    with pytest.raises(CudaIpcError, match="does not decode"):
        SharedPageStore.open_peer(device_store.name)
    with pytest.raises(ValueError, match="1 to 3064"):
        segment.set_peer_handle(b"x" * 4000)
    # A slot whose bytes do not match their crc32 (torn, or foreign) holds no handle.
    with open(os.path.join(SHM_DIR, device_store.name), "r+b") as f:
        f.seek(1024 + 8)
        f.write(b"\x00")
    assert segment.peer_handle() is None
    device_store.check_integrity()
