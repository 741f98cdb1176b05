"""`kvmesh bench copy`: page copies between workers against plain copies of the same bytes.

256 MiB of SmolLM2-shaped pages (30 layers, 3 KV heads, 16 tokens, head dim 64, fp32:
720 KiB a page), side by side in one run, each measured several times, alternating, with
the median reported:

- same node: `copy_from_peer` out of the holder's store attached by name (a validated
  copy: generation, memcpy, generation) vs a plain `torch` copy between two ordinary
  tensors of the same size (`shm_ratio`);
- across nodes: `PageClient.fetch` from the holder's `PageServer` over loopback TCP
  (zero-copy out of shared memory, `recv_into` our pages, generations checked after the
  send) vs a bare ZMQ transfer of the same bytes in the same frames, three ways:
  - no authentication (`remote_ratio`, against raw ZMQ);
  - signed requests, page bytes in the clear (`remote_signed_ratio`, against raw ZMQ);
  - CurveZMQ, encrypted (`remote_curve_ratio`, against raw ZMQ with CURVE on both ends);
  and what encryption costs the page server (`curve_cost`: curve / plain throughput).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from cache_service.auth import KeyPair
from workers.store.page_store import SharedPageStore, StoreLayout
from workers.transfer import PageClient, PageServer, RawZmqPipe, TransferAuth, copy_from_peer

TOTAL_BYTES = 256 << 20
ROUNDS = 5
ALTERNATIONS = 2  # each figure is the best of this many medians, measured in turn


def _layout(total_bytes: int) -> StoreLayout:
    probe = StoreLayout(1, num_layers=30, num_kv_heads=3, page_tokens=16, head_dim=64)
    return StoreLayout(
        max(1, total_bytes // probe.page_bytes),
        num_layers=30,
        num_kv_heads=3,
        page_tokens=16,
        head_dim=64,
    )


def _median_rate(nbytes: int, fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times)


def _best_rates(nbytes: int, contenders: dict, rounds: int) -> dict[str, float]:
    """The best median rate of each contender, measured alternately so that drift in the
    machine's load hits them all."""
    best = dict.fromkeys(contenders, 0.0)
    for _ in range(ALTERNATIONS):
        for name, fn in contenders.items():
            best[name] = max(best[name], _median_rate(nbytes, fn, rounds))
    return best


def _mesh_auth(encrypt: bool) -> tuple[TransferAuth, TransferAuth]:
    """The holder's and the requester's credentials in one mesh of two workers."""
    holder, requester = KeyPair.generate(), KeyPair.generate()
    peers = frozenset((holder.public, requester.public))
    secret = bytes(range(32))
    return (
        TransferAuth(holder, peers, secret, encrypt),
        TransferAuth(requester, peers, secret, encrypt),
    )


def run(log=sys.stderr, total_bytes: int = TOTAL_BYTES, rounds: int = ROUNDS) -> dict[str, float]:
    """Run the benchmark; returns the named figures (also the JSON line of the CLI)."""
    layout = _layout(total_bytes)
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
        same_node = _best_rates(
            nbytes,
            {
                "torch": lambda: plain_dst.copy_(plain_src),
                "shm": lambda: copy_from_peer(peer, src, gens, requester, dst),
            },
            rounds,
        )
        assert all(copy_from_peer(peer, src, gens, requester, dst))
        assert torch.equal(requester.page_range(0, n), holder.page_range(0, n))
        peer.close()

        print("across nodes: page server vs raw ZMQ over loopback TCP...", file=log)
        signed_server, signed_client = _mesh_auth(encrypt=False)
        curve_server, curve_client = _mesh_auth(encrypt=True)
        servers = {
            "remote": PageServer(holder),
            "signed": PageServer(holder, auth=signed_server),
            "curve": PageServer(holder, auth=curve_server),
        }
        clients = {
            "remote": PageClient(servers["remote"].address, timeout_s=60.0),
            "signed": PageClient(servers["signed"].address, timeout_s=60.0, auth=signed_client),
            "curve": PageClient(
                servers["curve"].address,
                timeout_s=60.0,
                auth=curve_client,
                server_key=curve_server.keypair.public,
            ),
        }
        pipes = {
            "raw": RawZmqPipe(nbytes, layout.page_bytes),
            "raw_curve": RawZmqPipe(nbytes, layout.page_bytes, curve=True),
        }
        try:
            contenders = {name: pipe.transfer for name, pipe in pipes.items()}
            for name, client in clients.items():
                contenders[name] = lambda c=client: c.fetch(src, gens, requester, dst)
            across = _best_rates(nbytes, contenders, rounds)
            for name, client in clients.items():
                requester.page_range(0, n).zero_()
                assert all(client.fetch(src, gens, requester, dst)), name
                assert torch.equal(requester.page_range(0, n), holder.page_range(0, n)), name
        finally:
            for pipe in pipes.values():
                pipe.close()
            for client in clients.values():
                client.close()
            for server in servers.values():
                server.stop()
        holder.check_integrity()
        requester.check_integrity()

    gb = 1e9
    return {
        "bytes": nbytes,
        "pages": n,
        "page_bytes": layout.page_bytes,
        "torch_copy_gbps": round(same_node["torch"] / gb, 2),
        "shm_copy_gbps": round(same_node["shm"] / gb, 2),
        "shm_ratio": round(same_node["shm"] / same_node["torch"], 3),
        "raw_zmq_gbps": round(across["raw"] / gb, 2),
        "remote_copy_gbps": round(across["remote"] / gb, 2),
        "remote_ratio": round(across["remote"] / across["raw"], 3),
        "remote_signed_gbps": round(across["signed"] / gb, 2),
        "remote_signed_ratio": round(across["signed"] / across["raw"], 3),
        "raw_zmq_curve_gbps": round(across["raw_curve"] / gb, 2),
        "remote_curve_gbps": round(across["curve"] / gb, 2),
        "remote_curve_ratio": round(across["curve"] / across["raw_curve"], 3),
        "curve_cost": round(across["curve"] / across["remote"], 3),
    }
