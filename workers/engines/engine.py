"""An inference engine (vLLM) as a worker of the mesh: its join, its namespaces, its pages.

`workers.engines.vllm_connector` is the thin vLLM side; this module is everything that is
kvmesh's, so it is tested without vLLM: the engine's page store, prefix cache and
publisher, the copy of its blocks into pages and back, and the copy-in from holders.

How a vLLM block maps to kvmesh pages: a block is `block_size / page_tokens` consecutive
pages. The mesh's index keys every page at one granularity (the service's page_tokens,
16 by default), so an engine's pages are cut at that size too, and its prompts are
walked, matched and counted exactly as a worker's. On CPU vLLM's block holds 128 tokens
and a layer's cache is `(num_blocks, kv_heads, block_size, 2 * head_dim)` (K and V side by
side); a kvmesh page holds its tokens for every layer, `(num_layers, 2 [k, v], kv_heads,
page_tokens, head_dim)`, so moving a block is a strided copy per layer (`blocks_to_pages`,
`pages_to_blocks`). vLLM hits are whole blocks: a match is rounded down to one. The KV
format (`StoreLayout.kv_format`: layers, heads, head dim, tokens per page, dtype) is part
of the engine's namespace and of every page digest, so an engine's bfloat16 pages never
meet a kvmesh worker's float32 pages.

Who the engine is: it joins the mesh's Ray cluster (a running `kvmesh up`) and asks the
service actor to enroll it (`ServiceActor.enroll`), which gives it a CurveZMQ key bound to
its worker id and the mesh secret. It then registers like any worker (its store's
shared-memory name, its node), heartbeats and publishes through an `EventPublisher`, so
it shows in `kvmesh status`, the dashboard and the metrics.

Peers: an engine copies from holders of the same model and KV format wherever they run:
on its own node through their shared memory, on other nodes through their page servers
(the same validated copy as a worker's either way: generation before and after, and the
digest the holder recorded at publish must be the one this prompt's tokens give). Each
engine runs a page server of its own, on the address and with the encryption the mesh's
configuration gives its workers (`workers.host`, `security.encrypt_pages`), and
registers it; it admits the keys of the mesh's enrolled engines (who else could hold a
page of an engine's namespace), including those that enroll after it started
(`cache_service.zap.LateKeys` over the enrolled keys Ray keeps).
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from cache_service.auth import KeyPair, tenant_salt
from cache_service.events import Namespace
from cache_service.messages import HolderSpan
from cache_service.zap import LateKeys
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.service.client import (
    ServiceClient,
    ServiceEndpoint,
    ServiceError,
    ServiceUnavailable,
    ray_resolver,
)
from workers.service.figures import WorkerFigures
from workers.service.publisher import EventPublisher
from workers.store.digests import page_digests
from workers.store.layout import StoreLayout
from workers.store.page_store import SharedPageStore
from workers.store.segment_names import reclaim_dead_segments, worker_tag
from workers.transfer import ENCRYPT_PAGES_DEFAULT, PageServer, TransferAuth
from workers.transfer.copy_in import CopyExecutor, CopyPlan, PeerInfo, Sources, plan_copy
from workers.transfer.costs import measure_links

log = logging.getLogger(__name__)

DEFAULT_TENANT = "default"  # the salt of requests without a cache_salt
SERVICE_BACKOFF_S = 5.0
# How long the scheduler side uses a holder's registry entry: one GetPeer (~0.3 ms) per
# holder this often, against a restarted holder's pages missed for that long.
PEER_TTL_S = 5.0


class Enrollment(NamedTuple):
    """What an engine got from the mesh when it joined."""

    worker_id: str
    keypair: KeyPair | None  # None: the mesh runs without authentication
    secret: bytes
    # Where the service listens: an address, or (joined through Ray) a resolver that asks
    # the service actor, so a restarted service is found at its new port.
    endpoint: ServiceEndpoint | Callable[[], ServiceEndpoint]
    node_id: str
    page_tokens: int  # the index's tokens per page
    page_host: str = "127.0.0.1"  # where its page server listens (an address, resolved)
    encrypt_pages: bool = ENCRYPT_PAGES_DEFAULT  # page bytes under CurveZMQ, or signed
    # Who may read its pages through its page server: the engines enrolled now or later
    # (None: nobody; anyone who reaches it when the mesh runs without authentication).
    late_readers: Callable[[bytes], bool] | None = None

    def transfer_auth(self) -> TransferAuth | None:
        """Its credentials for page servers, and its own page server's (None: no auth)."""
        if self.keypair is None:
            return None
        return TransferAuth(self.keypair, frozenset(), self.secret, self.encrypt_pages)


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


def engine_namespace(
    model: str, kv_format: str, secret: bytes, cache_salt: str | None, adapter: str = ""
) -> Namespace:
    """The namespace of an engine's request.

    Args:
        model: the served model's name (engines that serve one model under one name share).
        kv_format: the engine's page format (`StoreLayout.kv_format`).
        secret: the mesh secret: the salt is an HMAC of the request's `cache_salt` under
            it, never the raw value, so a client that knows another's cache_salt still
            cannot name its namespace in the index without the secret.
        cache_salt: vLLM's per-request `cache_salt` (None: the default tenant's).
        adapter: the LoRA adapter's name ("" without one).

    Raises:
        ValueError: an empty or unencodable cache_salt.
    """
    tenant = DEFAULT_TENANT if cache_salt is None else f"cache_salt:{cache_salt}"
    if cache_salt == "":
        raise ValueError("cache_salt must be a non-empty string or None")
    return Namespace(f"{model}|{kv_format}", adapter, tenant_salt(secret, tenant))


def join_mesh(
    worker_id: str, ray_address: str = "auto", node_ip_address: str | None = None
) -> Enrollment:
    """Join the mesh of the Ray cluster at `ray_address` as worker `worker_id`.

    Args:
        node_ip_address: the address of this machine's Ray node, where several Ray nodes
            share the machine (Ray otherwise attaches a driver to the head node among
            them); None lets Ray pick this machine's node.

    Raises:
        RuntimeError: no mesh runs in that cluster, the service refused the id, or the
            Ray node joined is not on this machine (its shared memory is not ours).
    """
    import ray

    from cache_service.actor import RAY_NAMESPACE, enrolled_publics, get_service, resolve_host

    if not ray.is_initialized():
        ray.init(
            address=ray_address,
            namespace=RAY_NAMESPACE,
            log_to_driver=False,
            logging_level=logging.WARNING,
            _node_ip_address=node_ip_address,
        )
    _check_local_node(ray.util.get_node_ip_address())
    try:
        service = get_service()
    except ValueError:
        raise RuntimeError(
            f"no kvmesh mesh runs in the Ray cluster at {ray_address!r}: start one with `kvmesh up`"
        ) from None
    try:
        data = ray.get(service.enroll.remote(worker_id), timeout=30)
    except ray.exceptions.RayTaskError as exc:
        raise RuntimeError(f"the mesh refused engine {worker_id!r}: {exc.cause}") from None
    pages = data.get("pages") or {}  # the launcher's page-server settings, if any
    keypair = None if data["keypair"] is None else KeyPair(*data["keypair"])
    return Enrollment(
        worker_id,
        keypair,
        data["secret"],
        ray_resolver(),
        ray.get_runtime_context().get_node_id(),
        data["page_tokens"],
        resolve_host(pages.get("host", "loopback")),
        bool(pages.get("encrypt", ENCRYPT_PAGES_DEFAULT)),
        None if keypair is None else LateKeys(enrolled_publics),
    )


def _check_local_node(address: str) -> None:
    """An engine's node must be this machine: its peers on the node read its store's
    shared memory, and it binds its page server to the node's address.

    Raises:
        RuntimeError: `address` is not an address of this machine.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            raise RuntimeError(
                f"the Ray node this engine joined ({address}) is not on this machine: set "
                f"node_ip_address in kv_connector_extra_config to this machine's Ray node "
                f"address"
            ) from None


def layer_order(names: Sequence[str]) -> list[str]:
    """Layer names in model order (by the layer number in each name, e.g.
    "model.layers.12.self_attn.attn")."""

    def number(name: str) -> int:
        found = re.findall(r"\d+", name)
        if not found:
            raise ValueError(f"no layer number in KV cache name {name!r}")
        return int(found[0])

    return sorted(names, key=number)


def engine_layout(
    layers: Sequence[torch.Tensor], block_size: int, page_tokens: int, num_blocks: int
) -> StoreLayout:
    """The page layout for an engine's per-layer KV caches: pages of the index's
    `page_tokens`, room for `num_blocks` blocks.

    Raises:
        ValueError: caches not of vLLM's CPU shape `(num_blocks, kv_heads, block_size,
            2 * head_dim)`, of different shapes or dtypes, or a block size that is not a
            multiple of page_tokens.
    """
    first = layers[0]
    for layer in layers:
        if layer.shape != first.shape or layer.dtype != first.dtype:
            raise ValueError(
                f"KV caches of different shapes: {tuple(layer.shape)} {layer.dtype} and "
                f"{tuple(first.shape)} {first.dtype}"
            )
    if first.dim() != 4 or first.shape[2] != block_size or first.shape[3] % 2:
        raise ValueError(
            f"a KV cache of shape {tuple(first.shape)}: expected (num_blocks, kv_heads, "
            f"{block_size}, 2 * head_dim)"
        )
    if block_size % page_tokens:
        raise ValueError(
            f"vLLM's block of {block_size} tokens is not a whole number of the mesh's "
            f"pages of {page_tokens}"
        )
    dtype = str(first.dtype).removeprefix("torch.")
    pages = num_blocks * (block_size // page_tokens)
    return StoreLayout(pages, len(layers), first.shape[1], page_tokens, first.shape[3] // 2, dtype)


def blocks_to_pages(
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    page_tokens: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather blocks into pages, `(len(block_ids) * k, num_layers, 2, kv_heads, page_tokens,
    head_dim)` with k = block_size / page_tokens, in token order (into `out` when given:
    at least that many pages; the rest is left alone)."""
    index = torch.tensor(block_ids, dtype=torch.long)
    n, (_, heads, block, width) = len(block_ids), layers[0].shape
    k, head_dim = block // page_tokens, width // 2
    if out is None:
        out = torch.empty(
            (n * k, len(layers), 2, heads, page_tokens, head_dim), dtype=layers[0].dtype
        )
    out = out[: n * k]
    for i, layer in enumerate(layers):
        src = layer.index_select(0, index).view(n, heads, k, page_tokens, width)
        src = src.permute(0, 2, 1, 3, 4).reshape(n * k, heads, page_tokens, width)
        out[:, i, 0] = src[..., :head_dim]
        out[:, i, 1] = src[..., head_dim:]
    return out


def pages_to_blocks(
    pages: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: Sequence[int]
) -> None:
    """Scatter pages `(n * k, num_layers, 2, kv_heads, page_tokens, head_dim)`, in token
    order, into n vLLM blocks: two strided copies a layer (K and V), no temporaries (on the
    request's critical path, a temporary's first-touch page faults cost more than the
    copy)."""
    index = torch.tensor(block_ids, dtype=torch.long)
    n, (num_blocks, heads, block, width) = len(block_ids), layers[0].shape
    page_tokens = pages.shape[4]
    k, head_dim = block // page_tokens, width // 2
    for i, layer in enumerate(layers):
        dst = layer.view(num_blocks, heads, k, page_tokens, width)
        src = pages[:, i].view(n, k, 2, heads, page_tokens, head_dim)
        # (n, k, heads, p, hd) -> (n, heads, k, p, hd): the block's token order
        dst[..., :head_dim].index_copy_(0, index, src[:, :, 0].permute(0, 2, 1, 3, 4))
        dst[..., head_dim:].index_copy_(0, index, src[:, :, 1].permute(0, 2, 1, 3, 4))


class EngineCache:
    """The engine's side of the mesh, in its worker process: a page store in shared
    memory that holds copies of vLLM's blocks, its prefix cache (eviction, reference
    counts), the publisher that tells the service, and the copy-in from holders.

    Args:
        enrollment: who the engine is in the mesh (`join_mesh`).
        layout: the store's layout (`engine_layout`).
        block_size: vLLM's tokens per block (a multiple of the layout's page_tokens).
        publish_interval_s: how often the publisher heartbeats and sends events.
    """

    def __init__(
        self,
        enrollment: Enrollment,
        layout: StoreLayout,
        block_size: int,
        publish_interval_s: float = 0.5,
    ):
        self.enrollment = enrollment
        self.worker_id = enrollment.worker_id
        reclaim_dead_segments()
        self.store = SharedPageStore.create(layout, tag=worker_tag(self.worker_id))
        self.cache = PrefixCache(self.store, PrefixCacheConfig(page_tokens=layout.page_tokens))
        self.figures = WorkerFigures()
        auth = enrollment.transfer_auth()
        try:
            # For engines on other nodes; same-node ones read the store's shared memory.
            self.page_server = PageServer(
                self.store,
                host=enrollment.page_host,
                auth=auth,
                late_readers=enrollment.late_readers,
            )
        except BaseException:
            self.store.unlink()
            self.store.close()
            raise
        keys = enrollment.keypair
        self.client = ServiceClient(
            enrollment.endpoint,
            timeout_s=1.0,
            retries=0,
            client_keys=keys,
            backoff_s=SERVICE_BACKOFF_S,
            probe=False,
        )
        self.publisher = EventPublisher(
            ServiceClient(
                enrollment.endpoint,
                timeout_s=2.0,
                retries=1,
                client_keys=keys,
                backoff_s=SERVICE_BACKOFF_S,
            ),
            self.cache,
            self.worker_id,
            enrollment.node_id,
            address=self.page_server.address,
            shm_name=self.store.name,
            page_key=None if keys is None else keys.public,
            report=lambda: self.figures.report(self.cache.stats()),
            on_new_service=self.client.reconnect,
        )
        self.sources = Sources(enrollment.node_id, auth)
        self.copier = CopyExecutor()
        self.links = measure_links(layout.page_bytes, encrypted=auth is not None and auth.encrypt)
        self._lock = threading.Lock()
        self.pages_per_block = block_size // layout.page_tokens
        self._staging: torch.Tensor | None = None  # see `_staged`
        self.loaded_blocks = 0
        self.refused_pages = 0
        self.saved_pages = 0
        self.publisher.sync()
        self.publisher.start(publish_interval_s, tick=self._housekeeping)

    def save(self, spec: SaveSpec, layers: Sequence[torch.Tensor]) -> int:
        """Keep a request's full prompt blocks as pages and publish them; returns the
        pages written (those the store did not hold). A full store keeps nothing."""
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
                    pages = blocks_to_pages(layers, blocks, p, self._staged(len(blocks) * k))
                    for i in range(have, len(spec.block_ids) * k):
                        self.store.write_page(allocation.pages[i], pages[i - first_block * k])
                        written += 1
                allocation.publish(len(spec.tokens))
            finally:
                allocation.release()
            self.saved_pages += written
        self.publisher.nudge()
        return written

    def load(self, spec: LoadSpec, layers: Sequence[torch.Tensor]) -> set[int]:
        """Copy a request's blocks [first, end) into vLLM's blocks: from this store where it
        holds them, else from the holders, each page validated. Returns the vLLM block ids
        that could not be filled (vLLM recomputes from the first of them): a block with a
        page that failed fails, and so does every block after it, since KV past a gap is
        never used."""
        p, k = self.store.layout.page_tokens, self.pages_per_block
        start = time.perf_counter()
        with self._lock:
            allocation = self._acquire(spec)
            if allocation is None:
                return set(spec.block_ids[spec.first :])
            try:
                end = self._copy_in(allocation, spec) // k  # whole blocks only
                if end > spec.first:
                    staged = self._staged((end - spec.first) * k)
                    pages = self.store.read_pages(
                        allocation.pages[spec.first * k : end * k], staged
                    )
                    pages_to_blocks(pages, layers, spec.block_ids[spec.first : end])
                allocation.publish(end * k * p)
            finally:
                allocation.release()
            self.loaded_blocks += max(0, end - spec.first)
        seconds = time.perf_counter() - start
        self.figures.copy_took(seconds)
        log.info(
            "engine %s loaded %d of %d blocks in %.1f ms",
            self.worker_id,
            max(0, end - spec.first),
            spec.end - spec.first,
            1000 * seconds,
        )
        self.publisher.nudge()
        return set(spec.block_ids[max(end, spec.first) :])

    def _staged(self, pages: int) -> torch.Tensor:
        """A staging buffer of `pages` pages, between vLLM's blocks and the store. Kept
        across calls (grown in whole blocks): a fresh tensor of a load's size (23 MB for
        1,024 SmolLM2 tokens) costs more in first-touch page faults than the copies
        themselves, and a load is on the request's time to first token."""
        if self._staging is None or self._staging.shape[0] < pages:
            k = self.pages_per_block
            size = -(-pages // k) * k
            self._staging = None
            self._staging = torch.zeros(
                (size, *self.store.layout.page_shape), dtype=self.store.layout.torch_dtype
            )
        return self._staging[:pages]

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
        peers = {peer.worker_id: peer for peer in spec.peers if peer.worker_id != self.worker_id}
        remote = {w: peer.node_id != self.enrollment.node_id for w, peer in peers.items()}
        links = {w: self.links.link(w, remote[w]) for w in peers}
        spans = [s for s in spec.spans if s.worker_id in peers]
        tasks = plan_copy(spans, have, end, links, self.store.layout.page_bytes)
        if not tasks:
            return have
        plan = CopyPlan(tasks, have, tasks[-1].end, 0.0, 0.0)
        tokens = spec.tokens[: plan.end * p]
        expected = page_digests(spec.namespace, self.store.kv_format, tokens, p)
        sources = {t.holder: self.sources.get(peers[t.holder]) for t in tasks}
        outcome = self.copier.run(plan, sources, self.store, allocation.pages, expected)
        page_bytes = self.store.layout.page_bytes
        for result in outcome.results:
            holder = result.task.holder
            self.refused_pages += result.valid.count(False)
            self.figures.copied(len(result.valid) * page_bytes, remote[holder])
            if remote[holder] and all(result.valid):
                self.links.observe(holder, True, len(result.valid) * page_bytes, result.seconds)
        return outcome.end

    def _housekeeping(self) -> None:
        if self.publisher.up and self.client.circuit_open:
            self.client.reconnect()
        self.sources.detach_dead()
        self.page_server.ensure_running()

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
        self.cache.check_integrity()
        self.store.check_integrity()
        self.page_server.check_integrity()

    def close(self) -> None:
        """Say BYE, stop publishing and serving, and remove the store (peers' copies then
        miss)."""
        self.publisher.stop(bye=True)
        self.page_server.stop()
        self.copier.close()
        self.sources.close()
        self.client.close()
        self.store.unlink()
        self.store.close()


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
        self.peer_ttl_s = peer_ttl_s
        self.client = ServiceClient(
            enrollment.endpoint,
            timeout_s=1.0,
            retries=0,
            client_keys=enrollment.keypair,
            backoff_s=SERVICE_BACKOFF_S,
        )
        self._peers: dict[str, tuple[float, PeerInfo]] = {}  # worker id -> (when, entry)

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
            peer = None if span.worker_id == me else self._peer(span.worker_id)
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

    def _peer(self, worker_id: str) -> PeerInfo | None:
        # An entry is kept for peer_ttl_s: a holder that restarted meanwhile has a new
        # store and page server, and copies from the old ones are misses (recomputed)
        # until its entry is asked for again. A holder not found is asked again next time.
        now = time.monotonic()
        held = self._peers.get(worker_id)
        if held is not None and now - held[0] < self.peer_ttl_s:
            return held[1]
        entry = _peer(self.client, worker_id)
        if entry is None:
            self._peers.pop(worker_id, None)
        else:
            self._peers[worker_id] = (now, entry)
        return entry

    def close(self) -> None:
        self.client.close()


def _peer(client: ServiceClient, worker_id: str) -> PeerInfo | None:
    try:
        entry = client.peer(worker_id)
    except (ServiceError, ServiceUnavailable) as exc:
        log.info("no registry entry for %s: %s", worker_id, exc)
        return None
    if entry is None:
        return None
    return PeerInfo(worker_id, entry.node_id, entry.shm_name, entry.address, entry.page_key)


def kv_layers(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's per-layer caches in model order."""
    return [kv_caches[name] for name in layer_order(list(kv_caches))]
