"""The worker: one per GPU or CPU slot, serving generations over its own and its peers' KV.

A request's path through a worker (see also docs/structure.md):

1. tokens -> `PrefixCache.acquire`: the longest prefix this worker holds, pinned; pages
   for the rest.
2. If more of the prompt is cached elsewhere, ask the service (`match`), and copy those
   pages in when the cost model says copying beats recomputing: straight out of the
   holder's shared memory on the same node, from its page server across nodes; several
   holders share the work. Each copied page is validated; the first page that fails
   ends the copied prefix, and everything after it is recomputed.
3. The model computes the rest and decodes; `publish` makes the new full pages
   shareable, `release` unpins, and the publisher's thread tells the service a moment
   later (never on the request path: a failure to publish never fails a request).

The class is plain Python (tested without Ray); `cluster` runs it as a Ray actor.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from cache_service.auth import KeyPair
from cache_service.events import Namespace
from workers.client import ServiceClient, ServiceEndpoint, ServiceUnavailable
from workers.digests import page_digests
from workers.figures import WorkerFigures
from workers.model_runner import ModelRunner, load_smollm2, store_layout_for, tiny_llama
from workers.page_store import (
    PageStoreError,
    SharedPageStore,
    owner_alive,
    reclaim_dead_segments,
)
from workers.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.publisher import EventPublisher
from workers.transfer import (
    ENCRYPT_PAGES_DEFAULT,
    PageClient,
    PageServer,
    RawZmqPipe,
    TransferAuth,
    copy_from_peer,
)

log = logging.getLogger(__name__)


# After the service failed to answer, its clients skip it for this long (doubling while it
# stays down, up to 8 times as long); the publisher's heartbeats probe for its return.
SERVICE_BACKOFF_S = 1.0


class CacheFull(RuntimeError):
    """The worker's page store cannot hold this request even after evicting everything
    unreferenced."""


@dataclass(frozen=True)
class WorkerSettings:
    """What one worker needs to start (built by `cluster` from the config)."""

    worker_id: str
    node_id: str
    host: str  # this node's address, for the page server
    model: str  # "smollm2-135m", or "tiny" (random weights, for tests)
    num_pages: int
    cache: PrefixCacheConfig
    threads: int = 1
    publish_interval_s: float = 0.5
    # The service's endpoint; None: resolve it through the Ray actor at every reconnect.
    service_address: str | None = None
    service_key: bytes | None = None  # its CurveZMQ public key, with service_address
    # This worker's key pair in the mesh (None: authentication off). It speaks to the
    # service as this worker, and its page server serves `page_peers` only.
    keypair: KeyPair | None = None
    page_peers: frozenset[bytes] = frozenset()
    mesh_secret: bytes = b""
    encrypt_pages: bool = ENCRYPT_PAGES_DEFAULT


class PeerInfo(NamedTuple):
    worker_id: str
    node_id: str
    shm_name: str
    page_address: str
    page_key: bytes | None  # its page server's CurveZMQ public key (None: no auth)


class CostModel(NamedTuple):
    """Measured at start: is copying a page in cheaper than recomputing its tokens?"""

    prefill_tokens_per_s: float
    shm_bytes_per_s: float
    remote_bytes_per_s: float

    def copy_pays(self, pages: int, page_bytes: int, page_tokens: int, remote: bool) -> bool:
        rate = self.remote_bytes_per_s if remote else self.shm_bytes_per_s
        return pages * page_bytes / rate < pages * page_tokens / self.prefill_tokens_per_s


class Worker:
    """Holds a page store, the local prefix cache, a page server, the service client and
    publisher, and the model runner. Thread-safe for concurrent `generate` calls (the
    model runs one call at a time)."""

    def __init__(self, settings: WorkerSettings, model: Any = None, tokenizer: Any = None):
        self.settings = settings
        self.worker_id = settings.worker_id
        torch.set_num_threads(settings.threads)
        if model is None:
            model, tokenizer = self._load_model(settings.model)
        self.model_name = settings.model
        self.tokenizer = tokenizer
        page_tokens = settings.cache.page_tokens
        layout = store_layout_for(model, settings.num_pages, page_tokens)
        # A restarted worker's predecessor (or any dead worker on this node) could not
        # unlink its store: that memory comes back before ours is taken.
        reclaim_dead_segments()
        self.store = SharedPageStore.create(layout, tag=_tag(settings.worker_id))
        self.cache = PrefixCache(self.store, settings.cache)
        self.runner = ModelRunner(model, self.store)
        self.transfer_auth = (
            None
            if settings.keypair is None
            else TransferAuth(
                settings.keypair, settings.page_peers, settings.mesh_secret, settings.encrypt_pages
            )
        )
        self.page_server = PageServer(self.store, host=settings.host, auth=self.transfer_auth)
        endpoint = (
            ServiceEndpoint(settings.service_address, settings.service_key)
            if settings.service_address
            else _ray_resolver()
        )
        keys = settings.keypair
        # On the request path: one short try, then skip the service for a while (a
        # request on a worker whose service is down runs on its local cache at once).
        self.client = ServiceClient(
            endpoint,
            timeout_s=1.0,
            retries=0,
            client_keys=keys,
            backoff_s=SERVICE_BACKOFF_S,
            probe=False,  # the publisher's heartbeats see the service come back
        )
        self.active = 0
        # Prompt tokens by source and tenant, copies, TTFT: sent with every heartbeat.
        self.figures = WorkerFigures()
        self.publisher = EventPublisher(
            ServiceClient(
                endpoint, timeout_s=2.0, retries=1, client_keys=keys, backoff_s=SERVICE_BACKOFF_S
            ),
            self.cache,
            settings.worker_id,
            settings.node_id,
            address=self.page_server.address,
            shm_name=self.store.name,
            page_key=None if keys is None else keys.public,
            load=self.load,
            report=lambda: self.figures.report(self.cache.stats()),
            on_new_service=self.client.reconnect,
        )
        self.publisher.sync()
        self.publisher.start(settings.publish_interval_s, tick=self._housekeeping)
        self.peers: dict[str, PeerInfo] = {}
        self._attached: dict[str, SharedPageStore] = {}
        self._page_clients: dict[str, PageClient] = {}
        self._lock = threading.Lock()
        self._private = itertools.count(1)
        self.requests = 0
        self.copies_refused = 0  # copied pages that failed validation (changed, or not ours)
        self.cost = self._measure_costs()

    # ------------------------------------------------------------------ public

    def info(self) -> dict[str, Any]:
        """How peers reach this worker's pages."""
        key = None if self.settings.keypair is None else self.settings.keypair.public
        return PeerInfo(
            self.worker_id, self.settings.node_id, self.store.name, self.page_server.address, key
        )._asdict()

    def set_peers(self, peers: Sequence[dict[str, Any]]) -> None:
        """The other workers of the cluster (as returned by their `info`). A peer left out
        (dead, or gone) is forgotten: its store is detached, its page client closed."""
        new = {p["worker_id"]: PeerInfo(**p) for p in peers if p["worker_id"] != self.worker_id}
        for worker_id, peer in self.peers.items():
            if new.get(worker_id) != peer:
                self._forget(peer)
        self.peers = new

    def _forget(self, peer: PeerInfo) -> None:
        store = self._attached.pop(peer.shm_name, None)
        if store is not None:
            store.close()
        client = self._page_clients.pop(peer.page_address, None)
        if client is not None:
            client.close()

    def _detach_dead_owners(self) -> None:
        """Close attached stores whose owners died (the mapping would keep their memory)."""
        for name in [n for n in self._attached if not owner_alive(n)]:
            self._attached.pop(name).close()

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 16,
        salt: str = "",
        adapter: str = "",
        return_logits: bool = False,
        reuse: bool = True,
    ) -> dict[str, Any]:
        """Generate greedily from `prompt`, reusing every cached prefix it can.

        Args:
            prompt: text (tokenized with the model's tokenizer) or token ids.
            max_new_tokens: tokens to generate.
            salt: the tenant's salt, set by the front door (never by the end user).
            adapter: the adapter version the KV was computed with.
            return_logits: also return the last prompt position's logits (as "logits",
                a list of floats), for correctness checks.
            reuse: False computes the whole prompt, reusing and publishing nothing (what
                serving would cost without kvmesh, for comparisons).
        Returns:
            {"token_ids", "text", "stats": {local_hit_tokens, remote_hit_tokens,
            computed_tokens, prompt_tokens, ttft_s, total_s, worker}}.
        Raises:
            ValueError: an empty prompt or bad max_new_tokens.
            CacheFull: the request does not fit in this worker's pages.
        """
        start = time.perf_counter()
        tokens = self._tokenize(prompt)
        if not tokens:
            raise ValueError("empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        namespace = Namespace(self.model_name, adapter, salt)
        if not reuse:
            # A namespace of its own matches nothing, and its pages, never published,
            # leave with the request.
            namespace = namespace._replace(adapter=f"{adapter}(no reuse {next(self._private)})")
        with self._lock:
            self.active += 1
        try:
            allocation = self.cache.acquire(tokens, namespace, extra_token_slots=max_new_tokens)
            if allocation is None:
                raise CacheFull(
                    f"{len(tokens)} + {max_new_tokens} tokens do not fit in "
                    f"{self.store.num_pages} pages of {self.cache.page_tokens}"
                )
            try:
                local = allocation.cached_tokens
                copy_start = time.perf_counter()
                computed_from = self._copy_in(allocation, tokens, namespace) if reuse else local
                copy_s = time.perf_counter() - copy_start
                # Admitted: hits are known now (copies validated); the rest is computed.
                self.figures.admitted(
                    salt, local, computed_from - local, len(tokens) - computed_from
                )
                if computed_from > local:
                    self.figures.copy_took(copy_s)
                result = self.runner.generate(
                    allocation, max_new_tokens, computed_from=computed_from
                )
                ttft = time.perf_counter() - start - result.decode_s
                self.figures.first_token(ttft, reused=computed_from > 0)
                if reuse:
                    allocation.publish(allocation.num_tokens)
            finally:
                allocation.release()
            self.publisher.nudge()  # the new pages go to the service off the request path
        finally:
            with self._lock:
                self.active -= 1
                self.requests += 1
        text = self.tokenizer.decode(result.token_ids) if self.tokenizer is not None else ""
        extra = {"logits": result.prefill.logits.tolist()} if return_logits else {}
        return {
            **extra,
            "token_ids": list(result.token_ids),
            "text": text,
            "stats": {
                "local_hit_tokens": local,
                "remote_hit_tokens": computed_from - local,
                "computed_tokens": len(tokens) - computed_from,
                "prompt_tokens": len(tokens),
                "ttft_s": ttft,
                "prefill_forward_s": result.prefill.forward_s,
                "copy_s": copy_s,
                "total_s": time.perf_counter() - start,
                "worker": self.worker_id,
            },
        }

    def clear_cache(self) -> int:
        """Drop every cached page no request holds (a cache reset); the service hears of
        it at once (AllCleared when nothing shareable is left). Returns the pages dropped."""
        dropped = self.cache.clear()
        self.publisher.nudge()
        return dropped

    def flush(self) -> bool:
        """Publish this worker's pending events now; True when the service is up to date
        with its cache (False: the service did not answer or refused; a resync follows)."""
        return self.publisher.sync()

    def load(self) -> float:
        """Requests running now (what routing weighs against cached tokens)."""
        return float(self.active)

    def stats(self) -> dict[str, Any]:
        return {
            "worker": self.worker_id,
            "node": self.settings.node_id,
            "address": self.page_server.address,  # where peers on other nodes fetch pages
            "requests": self.requests,
            "prompt_tokens": self.figures.prompt_tokens(),
            "copy_bytes": self.figures.copy_bytes_now(),
            "cache": self.cache.stats(),
            "publisher": {"resyncs": self.publisher.resyncs, "batches": self.publisher.batches},
            "pages_served": self.page_server.pages_sent,
            "copies_refused": self.copies_refused,
            "page_server": self.page_server.health(),
            "attached": sorted(self._attached),  # peers' stores mapped here, by name
        }

    def _housekeeping(self) -> None:
        """Each publisher round: keep the page server up, let requests ask the service
        again once the heartbeat reached it, and unlink the segments of dead workers on
        this node (theirs to unlink, but a killed process cannot)."""
        self.page_server.ensure_running()
        if self.publisher.up and self.client.circuit_open:
            self.client.reconnect()  # the heartbeat got through: requests may ask again
        for name in reclaim_dead_segments():
            log.info("worker %s reclaimed the segment %s of a dead worker", self.worker_id, name)

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        self.figures.check_integrity()
        self.store.check_integrity()
        self.page_server.check_integrity()

    def shutdown(self) -> None:
        """Leave the service, stop serving pages, unlink the page store (idempotent)."""
        self.publisher.stop(bye=True)
        self.page_server.stop()
        for client in self._page_clients.values():
            client.close()
        for store in self._attached.values():
            store.close()
        self._attached.clear()
        self.client.close()
        self.store.close()

    # ------------------------------------------------------------------ internals

    def _copy_in(self, allocation, tokens: list[int], namespace: Namespace) -> int:
        """Copy what peers hold beyond our own prefix; returns where computing starts."""
        local = allocation.cached_tokens
        p = self.cache.page_tokens
        self._detach_dead_owners()
        if not self.peers or local >= len(tokens) - 1:
            return local
        try:
            matched, spans = self.client.match(namespace, tokens, requester=self.worker_id)
        except ServiceUnavailable:
            return local  # no service: a miss, not an error
        first, end = local // p, min(matched, len(tokens) - 1) // p
        if end <= first:
            return local
        plan = self._plan(spans, first, end)
        if not plan:
            return local
        # What each page must hold: a copy is used only if its holder recorded the same
        # digest (namespace, KV format, token chain) when it published the page.
        expected = page_digests(namespace, self.store.kv_format, tokens[: end * p], p)
        copied_to = first
        for holder, pages, gens, page_range in plan:
            peer = self.peers[holder]
            targets = allocation.pages[page_range[0] : page_range[1]]
            remote = peer.node_id != self.settings.node_id
            if not self.cost.copy_pays(len(pages), self.store.layout.page_bytes, p, remote):
                break
            digests = expected[page_range[0] : page_range[1]]
            valid = self._fetch(peer, pages, gens, digests, targets, remote)
            self.figures.copied(len(pages) * self.store.layout.page_bytes, remote)
            self.copies_refused += valid.count(False)
            good = next((i for i, ok in enumerate(valid) if not ok), len(valid))
            copied_to = page_range[0] + good
            if good < len(valid):
                break  # a changed or foreign page ends the usable prefix: recompute from there
        return max(local, min(copied_to * p, len(tokens) - 1))

    def _plan(self, spans, first: int, end: int) -> list[tuple[str, list, list, tuple]]:
        """Split pages [first, end) among holders: same-node holders first, and the range
        shared evenly between the holders that cover it (several peers at once)."""
        usable = [s for s in spans if s.worker_id in self.peers and len(s.page_ids) > first]
        if not usable:
            return []
        local_node = [s for s in usable if self.peers[s.worker_id].node_id == self.settings.node_id]
        holders = local_node or usable
        reach = max(len(s.page_ids) for s in holders)
        end = min(end, reach)
        plan = []
        page = first
        while page < end:
            covering = [s for s in holders if len(s.page_ids) > page]
            stop = min(end, min(len(s.page_ids) for s in covering))
            share = -(-(stop - page) // len(covering))
            for span in covering:
                if page >= stop:
                    break
                upto = min(stop, page + share)
                plan.append(
                    (
                        span.worker_id,
                        list(span.page_ids[page:upto]),
                        list(span.generations[page:upto]),
                        (page, upto),
                    )
                )
                page = upto
        return plan

    def _fetch(self, peer: PeerInfo, pages, gens, digests, targets, remote: bool) -> list[bool]:
        if remote:
            client = self._page_clients.get(peer.page_address)
            if client is None:
                client = self._page_clients[peer.page_address] = PageClient(
                    peer.page_address, auth=self.transfer_auth, server_key=peer.page_key
                )
            return client.fetch(pages, gens, self.store, targets, digests=digests)
        try:
            store = self._attached.get(peer.shm_name)
            if store is None:
                store = self._attached[peer.shm_name] = SharedPageStore.attach(peer.shm_name)
            return copy_from_peer(store, pages, gens, self.store, targets, digests=digests)
        except (PageStoreError, FileNotFoundError, ValueError) as exc:
            log.warning("copy from %s failed: %s", peer.worker_id, exc)
            self._attached.pop(peer.shm_name, None)
            return [False] * len(pages)

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this worker's model has no tokenizer: pass token ids")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    @staticmethod
    def _load_model(name: str) -> tuple[Any, Any]:
        if name == "tiny":
            return tiny_llama(), None
        if name == "smollm2-135m":
            return load_smollm2()
        raise ValueError(f"unknown model {name!r}; known: smollm2-135m, tiny")

    def _measure_costs(self) -> CostModel:
        """Prefill tokens/s of this model here, page memcpy bytes/s, and loopback ZMQ
        bytes/s for page-sized frames."""
        probe = list(range(1, 33))
        start = time.perf_counter()
        self.runner.full_prefill_logits(probe)
        prefill_tps = len(probe) / (time.perf_counter() - start)
        page = self.store.page(0)
        scratch = torch.empty_like(page)
        start = time.perf_counter()
        for _ in range(4):
            scratch.copy_(page)
        shm_bps = 4 * self.store.layout.page_bytes / (time.perf_counter() - start)
        # A bare ZMQ transfer of a few pages over loopback TCP, encrypted when page copies
        # are: what a page-server fetch costs at best (the page server reaches that rate).
        encrypted = self.transfer_auth is not None and self.transfer_auth.encrypt
        pipe = RawZmqPipe(
            8 * self.store.layout.page_bytes, self.store.layout.page_bytes, curve=encrypted
        )
        try:
            start = time.perf_counter()
            pipe.transfer()
            remote_bps = 8 * self.store.layout.page_bytes / (time.perf_counter() - start)
        finally:
            pipe.close()
        return CostModel(prefill_tps, shm_bps, remote_bps)


def _tag(worker_id: str) -> str:
    tag = re.sub(r"[^a-z0-9_]", "_", worker_id.lower())[:32]
    return tag or "worker"


def _ray_resolver():
    from workers.client import ray_resolver

    return ray_resolver()
