"""`kvmesh bench copy`: page copies between workers against plain copies of the same bytes.

256 MiB of SmolLM2-shaped pages (30 layers, 3 KV heads, 16 tokens, head dim 64, fp32:
720 KiB a page), side by side in one run, each measured several times, alternating, with
the median reported:

- same node: `copy_from_peer` out of the holder's store attached by name (a validated
  copy: generation, memcpy, generation) vs a plain `torch` copy between two ordinary
  tensors of the same size (`shm_ratio`);
- across nodes: `PageClient.fetch` from the holder's `PageServer` over loopback TCP
  (zero-copy out of shared memory, `recv_into` our pages, generations checked after the
  send) vs a bare ZMQ transfer of the same bytes in the same frames (`remote_ratio`).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from workers.page_store import SharedPageStore, StoreLayout
from workers.transfer import PageClient, PageServer, RawZmqPipe, copy_from_peer

TOTAL_BYTES = 256 << 20
ROUNDS = 5


def _layout() -> StoreLayout:
    probe = StoreLayout(1, num_layers=30, num_kv_heads=3, page_tokens=16, head_dim=64)
    return StoreLayout(
        TOTAL_BYTES // probe.page_bytes,
        num_layers=30,
        num_kv_heads=3,
        page_tokens=16,
        head_dim=64,
    )


def _median_rate(nbytes: int, fn) -> float:
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


def run(log=sys.stderr) -> dict[str, float]:
    """Run the benchmark; returns the named figures (also the JSON line of the CLI)."""
    layout = _layout()
    n = layout.num_pages
    nbytes = n * layout.page_bytes
    print(f"{n} pages of {layout.page_bytes} bytes ({nbytes / 2**20:.0f} MiB)", file=log)
    with (
        SharedPageStore.create(layout, tag="bench_holder") as holder,
        SharedPageStore.create(layout, tag="bench_requester") as requester,
    ):
        src = holder.allocate(n)
        dst = requester.allocate(n)
        holder.page_range(0, n).copy_(torch.randn(n, *layout.page_shape))
        gens = holder.generations(src)
        peer = SharedPageStore.attach(holder.name)
        plain_src = torch.randn(n, *layout.page_shape)
        plain_dst = torch.empty_like(plain_src)

        print("same node: shared-memory copy vs torch copy...", file=log)
        torch_rate = shm_rate = 0.0
        for _ in range(2):  # alternate, so drift in the machine's load hits both
            torch_rate = max(torch_rate, _median_rate(nbytes, lambda: plain_dst.copy_(plain_src)))
            shm_rate = max(
                shm_rate,
                _median_rate(nbytes, lambda: copy_from_peer(peer, src, gens, requester, dst)),
            )
        assert all(copy_from_peer(peer, src, gens, requester, dst))
        assert torch.equal(requester.page_range(0, n), holder.page_range(0, n))

        print("across nodes: page server vs raw ZMQ over loopback TCP...", file=log)
        server = PageServer(holder)
        client = PageClient(server.address, timeout_s=60.0)
        pipe = RawZmqPipe(nbytes, layout.page_bytes)
        raw_rate = remote_rate = 0.0
        for _ in range(2):
            raw_rate = max(raw_rate, _median_rate(nbytes, pipe.transfer))
            remote_rate = max(
                remote_rate, _median_rate(nbytes, lambda: client.fetch(src, gens, requester, dst))
            )
        requester.page_range(0, n).zero_()
        assert all(client.fetch(src, gens, requester, dst))
        assert torch.equal(requester.page_range(0, n), holder.page_range(0, n))
        pipe.close()
        client.close()
        server.stop()
        peer.close()
        holder.check_integrity()
        requester.check_integrity()

    gb = 1e9
    return {
        "bytes": nbytes,
        "pages": n,
        "page_bytes": layout.page_bytes,
        "torch_copy_gbps": round(torch_rate / gb, 2),
        "shm_copy_gbps": round(shm_rate / gb, 2),
        "shm_ratio": round(shm_rate / torch_rate, 3),
        "raw_zmq_gbps": round(raw_rate / gb, 2),
        "remote_copy_gbps": round(remote_rate / gb, 2),
        "remote_ratio": round(remote_rate / raw_rate, 3),
    }
