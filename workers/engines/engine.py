"""A vLLM engine as a member of the mesh: its pages, and the loads and saves of its blocks.

`workers.engines.vllm_connector` is the thin vLLM side; this module is everything that is
kvmesh's, so it is tested without vLLM. An engine is a `MeshMember` (its page store,
prefix cache, page server, publisher, peers and copy-in, as a worker's) that keeps copies
of vLLM's prompt blocks as pages (`save`) and loads pages other members hold into vLLM's
blocks (`load`); `blocks` holds the layouts and the copies between the two, `enrollment`
who the engine is. `EngineIndex` is its scheduler side: how many blocks of a prompt it
could load.

Peers: an engine copies from holders of the same model and KV format wherever they run:
on its own node through their shared memory, on other nodes through their page servers
(the same validated copy as a worker's either way: generation before and after, and the
digest the holder recorded at publish must be the one this prompt's tokens give). Each
engine runs a page server of its own, on the address and with the encryption the mesh's
configuration gives its workers (`workers.host`, `security.encrypt_pages`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from cache_service.events import Namespace
from cache_service.messages import HolderSpan
from workers.cache.prefix_cache import PrefixCacheConfig
from workers.engines.enrollment import SERVICE_BACKOFF_S, Enrollment
from workers.engines.kv_copier import KVCopier
from workers.engines.kv_layouts import LayerKV
from workers.member import MeshMember
from workers.peer_lookup import look_up_peer
from workers.service.client import ServiceClient, ServiceError, ServiceUnavailable, recover
from workers.store.layout import StoreLayout
from workers.transfer.peers import PEER_TTL_S, PeerInfo, Peers

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5  # how often the scheduler side asks a silent service whether it is back


class LoadSpec(NamedTuple):
    """Load prompt blocks [first, end) of a request from holders into vLLM's blocks.

    Attributes:
        namespace: the request's namespace (model and KV format, adapter, salt).
        tokens: the prompt's first `end * block_size` tokens.
        first: the first block to load (vLLM computed or cached the ones before).
        block_ids: vLLM's block for each prompt block [0, end).
        spans: the holders the service named that this engine can copy from.
        peers: how to reach each of them.
    """

    request_id: str
    namespace: Namespace
    tokens: tuple[int, ...]
    first: int
    block_ids: tuple[int, ...]
    spans: tuple[HolderSpan, ...]
    peers: tuple[PeerInfo, ...]

    @property
    def end(self) -> int:
        return len(self.block_ids)


class SaveSpec(NamedTuple):
    """Keep prompt blocks [0, len(block_ids)) of a request, read from vLLM's blocks, in the
    engine's store and publish them (pages the store holds already are not copied)."""

    request_id: str
    namespace: Namespace
    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]


class EngineCache:
    """The engine's side of the mesh, in its worker process: a mesh member whose store
    holds copies of vLLM's blocks as pages (see the module docstring).

    Args:
        enrollment: who the engine is in the mesh (`join_mesh`).
        layout: the store's layout (`engine_layout`).
        block_size: vLLM's tokens per block (a multiple of the layout's page_tokens).
        publish_interval_s: how often the publisher heartbeats and sends events.
        device: where vLLM's caches live (pages cross to the store through `KVCopier`).
    """

    def __init__(
        self,
        enrollment: Enrollment,
        layout: StoreLayout,
        block_size: int,
        publish_interval_s: float = 0.5,
        device: torch.device | str = "cpu",
    ):
        self.enrollment = enrollment
        self.worker_id = enrollment.worker_id
        config = PrefixCacheConfig(page_tokens=layout.page_tokens)
        self.member = MeshMember(enrollment.membership(publish_interval_s), layout, config)
        self.store, self.cache = self.member.store, self.member.cache
        self.page_server = self.member.page_server
        self._lock = threading.Lock()
        self.pages_per_block = block_size // layout.page_tokens
        self.copier = KVCopier(device, layout.page_shape, layout.torch_dtype, block_size)
        self.loaded_blocks = 0
        self.saved_pages = 0
        self.member.start()

    @property
    def refused_pages(self) -> int:
        """Copied pages that failed validation (changed, or holding other tokens)."""
        return self.member.copies_refused

    def admitted(self, salt: str, local: int, remote: int, computed: int) -> None:
        """Count a request vLLM admitted: its prompt tokens found on this engine, copied
        from a peer and computed (the heartbeat's hit rates)."""
        self.member.figures.admitted(salt, local, remote, computed)

    def save(self, spec: SaveSpec, layers: Sequence[LayerKV]) -> int:
        """Keep a request's full prompt blocks as pages and publish them; returns the
        pages written (those the store did not hold). A full store keeps nothing.

        Args:
            spec: the request's blocks.
            layers: vLLM's caches as views (`kv_layouts.layer_views`).
        """
        p, k = self.store.layout.page_tokens, self.pages_per_block
        with self._lock:
            allocation = self._acquire(spec)
            if allocation is None:
                return 0  # the store is full of pages in use: nothing kept, nothing wrong
            try:
                have = allocation.cached_tokens // p  # pages the store holds already
                first_block = have // k
                written = 0
                if first_block < len(spec.block_ids):
                    blocks = spec.block_ids[first_block:]
                    pages = self.copier.gather(layers, blocks)
                    for i in range(have, len(spec.block_ids) * k):
                        self.store.write_page(allocation.pages[i], pages[i - first_block * k])
                        written += 1
                allocation.publish(len(spec.tokens))
            finally:
                allocation.release()
            self.saved_pages += written
        self.member.publisher.nudge()
        return written

    def load(self, spec: LoadSpec, layers: Sequence[LayerKV]) -> set[int]:
        """Copy a request's blocks [first, end) into vLLM's blocks: from this store where it
        holds them, else from the holders, each page validated. Returns the vLLM block ids
        that could not be filled (vLLM recomputes from the first of them): a block with a
        page that failed fails, and so does every block after it, since KV past a gap is
        never used. On CUDA the copy into vLLM's blocks is queued on a stream of its own:
        `loads_done` before the forward."""
        p, k = self.store.layout.page_tokens, self.pages_per_block
        start = time.perf_counter()
        with self._lock:
            allocation = self._acquire(spec)
            if allocation is None:
                return set(spec.block_ids[spec.first :])
            try:
                end = self._copy_in(allocation, spec) // k  # whole blocks only
                if end > spec.first:
                    staged = self.copier.host_pages((end - spec.first) * k)
                    pages = self.store.read_pages(
                        allocation.pages[spec.first * k : end * k], staged
                    )
                    self.copier.scatter(pages, layers, spec.block_ids[spec.first : end])
                allocation.publish(end * k * p)
            finally:
                allocation.release()
            self.loaded_blocks += max(0, end - spec.first)
        seconds = time.perf_counter() - start
        self.member.figures.copy_took(seconds)
        log.info(
            "engine %s loaded %d of %d blocks in %.1f ms",
            self.worker_id,
            max(0, end - spec.first),
            spec.end - spec.first,
            1000 * seconds,
        )
        self.member.publisher.nudge()
        return set(spec.block_ids[max(end, spec.first) :])

    def loads_done(self) -> None:
        """Make vLLM's forward wait for the loads queued this step (see `KVCopier`)."""
        self.copier.loads_done()

    def _acquire(self, spec: LoadSpec | SaveSpec) -> Any:
        """The spec's pages, every one the store holds counted as held. The cache always
        leaves a prompt's last token to compute (so a fully cached prompt would get a
        copy of its last page); here the tokens are whole blocks that vLLM keeps, so one
        token more is asked for, and only the whole blocks are ever published."""
        return self.cache.acquire([*spec.tokens, spec.tokens[-1]], spec.namespace)

    def _copy_in(self, allocation: Any, spec: LoadSpec) -> int:
        """Fill the allocation's pages from where the store's own prefix ends up to the
        spec's end, from its holders; returns where the usable prefix ends, in pages."""
        p = self.store.layout.page_tokens
        have, end = allocation.cached_tokens // p, spec.end * self.pages_per_block
        if have >= end:
            return end
        self.member.learn_peers(spec.peers)  # looked up by the scheduler side just now
        return self.member.copy_in(allocation, spec.tokens, spec.namespace, spec.spans, end)

    def stats(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "store": self.store.name,
            "kv_format": self.store.kv_format,
            "loaded_blocks": self.loaded_blocks,
            "refused_pages": self.refused_pages,
            "saved_pages": self.saved_pages,
            "page_server": self.page_server.address,
            "pages_served": self.page_server.pages_sent,
            "cache": self.cache.stats(),
        }

    def check_integrity(self) -> None:
        self.member.check_integrity()

    def close(self) -> None:
        """Say BYE, stop publishing and serving, and remove the store (peers' copies then
        miss)."""
        self.member.close()


class EngineIndex:
    """The engine's scheduler side: how many whole blocks of a prompt the mesh holds
    where this engine can copy them from (its node's stores, other nodes' page servers).

    Args:
        enrollment: who the engine is.
        block_size: vLLM's tokens per block.
        peer_ttl_s: how long a holder's registry entry is used before it is asked for
            again (a restarted holder has a new store and page server).
    """

    def __init__(self, enrollment: Enrollment, block_size: int, peer_ttl_s: float = PEER_TTL_S):
        self.enrollment = enrollment
        self.block_size = block_size
        # vLLM's scheduler loop calls `lookup`: it never waits on a probe of a service that
        # is down (one short try, then skipped); a thread of our own probes meanwhile.
        self.client = ServiceClient(
            enrollment.endpoint,
            timeout_s=1.0,
            retries=0,
            client_keys=enrollment.keypair,
            backoff_s=SERVICE_BACKOFF_S,
            probe=False,
        )
        self._prober = ServiceClient(
            enrollment.endpoint, timeout_s=1.0, retries=0, client_keys=enrollment.keypair
        )
        self._stop = threading.Event()
        self._probing = threading.Thread(
            target=self._probe,
            name=f"kvmesh-engine-prober-{enrollment.worker_id}",
            daemon=True,
        )
        self._probing.start()
        self.peers = Peers(enrollment.worker_id, lambda w: look_up_peer(self.client, w), peer_ttl_s)

    def lookup(
        self, namespace: Namespace, tokens: Sequence[int], limit_blocks: int
    ) -> tuple[int, tuple[HolderSpan, ...], tuple[PeerInfo, ...]]:
        """Blocks of `tokens` [0, n) the mesh holds (n <= limit_blocks), counting only
        holders this engine can copy from (itself included: its store may hold what
        vLLM evicted), with those holders' spans and entries. A service that does not
        answer is a miss."""
        me = self.enrollment.worker_id
        try:
            _, spans = self.client.match(
                namespace, list(tokens[: limit_blocks * self.block_size]), requester=me
            )
        except (ServiceUnavailable, ServiceError) as exc:
            log.info("engine %s: no match from the service (%s)", me, exc)
            return 0, (), ()
        usable, peers = [], []
        for span in spans:
            peer = None if span.worker_id == me else self.peers.get(span.worker_id)
            if span.worker_id == me or self._reachable(peer):
                usable.append(span)
                peers += [] if peer is None else [peer]
        k = self.block_size // self.enrollment.page_tokens
        blocks = max((len(s.page_ids) for s in usable), default=0) // k
        return min(limit_blocks, blocks), tuple(usable), tuple(peers)

    def _reachable(self, peer: PeerInfo | None) -> bool:
        if peer is None:
            return False
        if peer.node_id == self.enrollment.node_id:
            return bool(peer.shm_name)
        # A page server, with the key to check it by when the mesh authenticates.
        return bool(peer.page_address) and (
            self.enrollment.keypair is None or peer.page_key is not None
        )

    def _probe(self) -> None:
        """While the scheduler side skips the service, ask it whether it is back."""
        while not self._stop.wait(PROBE_INTERVAL_S):
            try:
                recover(self.client, self._prober)
            except Exception:  # the prober must outlive whatever one probe hit
                log.exception("engine %s: probing the service failed", self.enrollment.worker_id)

    def close(self) -> None:
        self._stop.set()
        self._probing.join(5.0)
        self.client.close()
        self._prober.close()
