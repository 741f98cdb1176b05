"""GPU check of the page store on a device: CUDA IPC between processes, staging, rates.

`run(device, quick)` checks, on one device:

- a store created on the device, filled through `write_pages` with digests;
- write-back to a host shared-memory store and load-back, validated, byte-exact, and a
  page rewritten by its owner during a write-back detected (generation before, copy,
  generation after);
- a copy by a peer process (spawned; it opens the store with `SharedPageStore.open_peer`,
  through the IPC handle's plain fields the owner left in the store's segment at
  creation) out of the store's device pages, validated, byte-exact, and a page the owner rewrites
  while the peer copies detected; where the platform refuses CUDA IPC (or on the CPU) the
  error is recorded and the peer's host fallback is checked and timed instead: a validated
  load-back from the owner's host store into the peer's own device store;
- rates for scattered pages of SmolLM2-135M's layout (30 layers, 3 KV heads, head dim 64,
  16 tokens, bfloat16: 360 KiB a page), each against a plain torch copy of the same bytes
  (device to device; device to pinned host; pinned host to device), as ratios.

It raises AssertionError on any correctness failure and returns a dict of figures. With
device="cpu" the same paths run, with a "cpu" device store standing in for the device
(`pages_in_segment=False`); rates then compare CPU memcpy with CPU memcpy.
"""

from __future__ import annotations

import multiprocessing
import random
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import msgpack
import torch

import workers.store.validated_copy as validated_copy
from workers.store.cuda_ipc import CudaIpcHandle
from workers.store.page_store import CudaIpcError, SharedPageStore, StoreLayout
from workers.store.staging import load_back, staging_buffer, write_back

REPLY_TIMEOUT_S = 120.0  # a peer that says nothing for this long has failed


def smollm2_layout(num_pages: int) -> StoreLayout:
    return StoreLayout(num_pages, num_layers=30, num_kv_heads=3, page_tokens=16, head_dim=64,
                       dtype="bfloat16")  # fmt: skip


def run(device: str, quick: bool) -> dict[str, Any]:
    """Run the checks on `device` ("cuda", "cuda:N" or "cpu"); `quick` keeps it to a few
    MiB. Returns a dict of figures; raises AssertionError on any correctness failure."""
    n = 8 if quick else 4096  # pages per timed copy: 2.9 MiB quick, 1.4 GiB full
    repeat = 3 if quick else 7
    layout = smollm2_layout(2 * n + 2)
    rng = random.Random(0)
    with (
        SharedPageStore.create(layout, device=device, pages_in_segment=False) as store,
        SharedPageStore.create(smollm2_layout(n + 1)) as host,
    ):
        pages = store.allocate(layout.num_pages)
        digests = [page.to_bytes(4, "little") * 4 for page in range(1, layout.num_pages + 1)]
        fill(store, pages, digests)
        timed = rng.sample(pages[:-2], n)  # scattered, in no order
        victims = pages[-2:]  # rewritten by the owner during the copies that check that
        result: dict[str, Any] = {"device": str(store.device), "pages": n,
                                  "bytes": n * layout.page_bytes}  # fmt: skip
        result.update(check_staging(store, host, timed, victims[0], digests, repeat))
        result.update(check_peer(store, host, timed, victims[1], digests, repeat))
        store.check_integrity()
        host.check_integrity()
    return result


def fill(store: SharedPageStore, pages: list[int], digests: list[bytes]) -> None:
    gen = torch.Generator(device=store.device).manual_seed(0)
    for start in range(0, len(pages), 256):
        rows = pages[start : start + 256]
        kv = torch.randn((len(rows), *store.layout.page_shape), generator=gen,
                         device=store.device).to(store.layout.torch_dtype)  # fmt: skip
        store.write_pages(rows, kv, [digests[p] for p in rows])


def checksums(pages: torch.Tensor) -> list[int]:
    """An exact checksum per page: the sum of its bits as integers."""
    bits = pages.view(torch.int16 if pages.element_size() == 2 else torch.int32)
    return bits.reshape(len(pages), -1).sum(dim=1, dtype=torch.int64).tolist()


# -- staging -------------------------------------------------------------------------------


def check_staging(store, host, timed, victim, digests, repeat) -> dict[str, Any]:
    n, sync = len(timed), synchronizer(store.device)
    staging = staging_buffer(store, n)
    want = [digests[p] for p in timed]
    host_pages = host.allocate(n)
    gens = store.generations(timed)
    assert write_back(store, timed, gens, host, host_pages, want, staging).all_valid
    assert checksums(host.read_pages(host_pages)) == checksums(store.read_pages(timed))
    assert host.digests(host_pages) == want
    # The owner rewrites a page while its write-back copies it: refused, left unwritten.
    extra = host.allocate(1)
    before = host.generations(extra)
    with rewrite_during_copy(lambda: store.write_page(victim, store.read_pages([victim])[0])):
        pair = [timed[0], victim]
        result = write_back(store, pair, store.generations(pair), host, host_pages[:1] + extra,
                            [want[0], digests[victim]], staging)  # fmt: skip
    assert result.valid == [True, False], result
    assert host.generations(extra) == before
    host.free(extra)
    # Load-back into the victim's neighbours' places: fresh device pages of the same bytes.
    spare = [p for p in range(store.num_pages) if p not in set(timed)][:n]
    host_gens = host.generations(host_pages)
    assert load_back(host, host_pages, host_gens, store, spare, want, staging).all_valid
    assert checksums(store.read_pages(spare)) == checksums(host.read_pages(host_pages))
    assert store.digests(spare) == want
    # Rates, each against a plain copy of the same bytes.
    nbytes = n * store.layout.page_bytes
    src = store.read_pages(timed)  # contiguous, on the device
    pinned = staging[:n]
    figures = {
        "write_back_bps": rate(nbytes, repeat, sync, lambda: write_back(
            store, timed, store.generations(timed), host, host_pages, want, staging)),
        "stage_d2h_bps": rate(nbytes, repeat, sync, lambda: store.copy_pages_validated(
            timed, store.generations(timed), pinned, want)),
        "plain_d2h_bps": rate(nbytes, repeat, sync, lambda: pinned.copy_(src, non_blocking=True)),
        "load_back_bps": rate(nbytes, repeat, sync, lambda: load_back(
            host, host_pages, host.generations(host_pages), store, spare, want, staging)),
        "plain_h2d_bps": rate(nbytes, repeat, sync, lambda: src.copy_(pinned, non_blocking=True)),
    }  # fmt: skip
    figures["write_back_ratio"] = figures["write_back_bps"] / figures["plain_d2h_bps"]
    figures["stage_d2h_ratio"] = figures["stage_d2h_bps"] / figures["plain_d2h_bps"]
    figures["load_back_ratio"] = figures["load_back_bps"] / figures["plain_h2d_bps"]
    # The timed write-backs rewrote the host pages with the same bytes and digests.
    assert checksums(host.read_pages(host_pages)) == checksums(store.read_pages(timed))
    return figures


# -- a peer process ------------------------------------------------------------------------


def check_peer(store, host, timed, victim, digests, repeat) -> dict[str, Any]:
    """A spawned peer copies `timed` pages (validated, timed) and, once, `[timed[0],
    victim]` while this owner rewrites `victim`; through CUDA IPC, or the host tier."""
    try:
        handle: dict[str, Any] | None = store.export_pages().to_fields()
        ipc_error = None
    except CudaIpcError as e:
        handle, ipc_error = None, str(e)
    if handle is None:  # the peer reads the host tier: the pages must be there
        source, source_pages = host, host.allocate(1) + list(range(len(timed)))
        host.write_pages(source_pages[:1], store.read_pages([victim]).cpu(), [digests[victim]])
        rewrite = (host, source_pages[0])
        sums = checksums(host.read_pages(source_pages[1:]))
    else:
        source, source_pages = store, [victim, *timed]
        rewrite = (store, victim)
        sums = checksums(store.read_pages(timed))
    plan = {
        "store": source.name, "handle": handle, "device": str(store.device),
        "pages": source_pages[1:], "gens": source.generations(source_pages[1:]),
        "digests": [digests[p] for p in timed], "sums": sums, "victim": source_pages[0],
        "victim_gen": source.generation(source_pages[0]), "victim_digest": digests[victim],
        "repeat": repeat,
    }  # fmt: skip
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    peer = ctx.Process(target=peer_main, args=(theirs,), daemon=True)
    peer.start()
    try:
        ours.send_bytes(msgpack.packb(plan))
        assert receive(ours, peer) == {"copied": True}  # the peer is mid-copy: rewrite
        owner, page = rewrite
        owner.write_page(page, owner.read_pages([page])[0])
        ours.send_bytes(msgpack.packb({"rewritten": True}))
        figures = receive(ours, peer)
    finally:
        peer.join(REPLY_TIMEOUT_S)
        if peer.is_alive():
            peer.kill()
    assert peer.exitcode == 0, f"peer exited with {peer.exitcode}"
    assert "error" not in figures, figures.get("error")
    return {"peer_path": "cuda_ipc" if handle else "host_fallback", "ipc_error": ipc_error,
            **figures}  # fmt: skip


def receive(conn, peer) -> dict[str, Any]:
    if not conn.poll(REPLY_TIMEOUT_S):
        raise AssertionError(f"peer silent for {REPLY_TIMEOUT_S} s (exit code {peer.exitcode})")
    return msgpack.unpackb(conn.recv_bytes())


def peer_main(conn) -> None:
    """The peer process: attach, copy validated, report figures (as msgpack)."""
    try:
        plan = msgpack.unpackb(conn.recv_bytes())
        conn.send_bytes(msgpack.packb(peer_copy(plan, conn)))
    except BaseException as e:  # noqa: BLE001  reported to the owner, which asserts on it
        conn.send_bytes(msgpack.packb({"error": f"{type(e).__name__}: {e}"}))
        raise


def peer_copy(plan: dict[str, Any], conn) -> dict[str, Any]:
    device = torch.device(plan["device"])
    sync = synchronizer(device)
    pages, gens, want = plan["pages"], plan["gens"], plan["digests"]
    n = len(pages)
    handle = plan["handle"] and CudaIpcHandle.from_fields(plan["handle"])
    opened = SharedPageStore.open_peer if handle else SharedPageStore.attach
    with opened(plan["store"]) as source:
        if handle:  # what the segment carried is what the owner exported
            assert msgpack.unpackb(source._segment.peer_handle()) == plan["handle"]
        layout = source.layout
        if handle:  # straight out of the owner's device pages, into ours
            out = torch.empty((n, *layout.page_shape), dtype=layout.torch_dtype, device=device)

            def copy(ids, expected, digests, rows):
                return source.copy_pages_validated(ids, expected, out[:rows], digests)
        else:  # the host fallback: load-back from the owner's host tier into our store
            mine = SharedPageStore.create(smollm2_layout(n), device=device, pages_in_segment=False)
            mine_pages = mine.allocate(n)
            staging = staging_buffer(mine, n)
            out = mine.page_range(0, n)

            def copy(ids, expected, digests, rows):
                return load_back(source, ids, expected, mine, mine_pages[:rows], digests, staging)

        # Validated and exact.
        assert copy(pages, gens, want, n).all_valid
        sync()
        assert checksums(out) == plan["sums"], "peer copy differs from the owner's pages"
        # The owner rewrites the victim between our two generation reads.
        pair, pair_gens = [pages[0], plan["victim"]], [gens[0], plan["victim_gen"]]

        def ask_owner_to_rewrite() -> None:
            conn.send_bytes(msgpack.packb({"copied": True}))
            assert msgpack.unpackb(conn.recv_bytes()) == {"rewritten": True}

        with rewrite_during_copy(ask_owner_to_rewrite):
            result = copy(pair, pair_gens, [want[0], plan["victim_digest"]], 2)
        assert result.valid == [True, False], result
        # Rates: ours against a plain copy of the same bytes in this process.
        nbytes = n * layout.page_bytes
        figures = {"peer_copy_bps": rate(nbytes, plan["repeat"], sync,
                                         lambda: copy(pages, gens, want, n))}  # fmt: skip
        if handle:
            src = torch.empty_like(out)
            figures["plain_d2d_bps"] = rate(nbytes, plan["repeat"], sync, lambda: out.copy_(src))
            figures["peer_copy_ratio"] = figures["peer_copy_bps"] / figures["plain_d2d_bps"]
        else:
            pinned = staging[:n]
            figures["plain_h2d_bps"] = rate(
                nbytes, plan["repeat"], sync, lambda: out.copy_(pinned, non_blocking=True)
            )
            figures["peer_copy_ratio"] = figures["peer_copy_bps"] / figures["plain_h2d_bps"]
            mine.check_integrity()
            mine.close()
        source.check_integrity()
    return figures


# -- helpers -------------------------------------------------------------------------------


@contextmanager
def rewrite_during_copy(write: Callable[[], None]):
    """Run `write` (a real write by the pages' owner, here or in another process) right
    after the next copies' bytes land, between their two generation reads."""
    copy_rows = validated_copy.copy_rows

    def copy_then_write(pages, rows, out):
        copy_rows(pages, rows, out)
        write()

    validated_copy.copy_rows = copy_then_write
    try:
        yield
    finally:
        validated_copy.copy_rows = copy_rows


def synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def rate(nbytes: int, repeat: int, sync: Callable[[], None], copy: Callable[[], object]) -> float:
    """Bytes per second of `copy`, the median of `repeat` timed runs after a warm-up."""
    copy()
    sync()
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        copy()
        sync()
        seconds.append(time.perf_counter() - start)
    return nbytes / statistics.median(seconds)


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(sys.argv[1] if len(sys.argv) > 1 else "cuda", "--quick" in sys.argv)))
