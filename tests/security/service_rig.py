"""A real ServiceServer and its clients, for the trust tests."""

from __future__ import annotations

from cache_service.auth import KeyPair, MeshKeys
from cache_service.events import Namespace, PagesStored
from cache_service.protocol import DEFAULT_LIMITS, Limits
from cache_service.server import ServerConfig, make_server
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.service.client import ServiceClient, ServiceEndpoint
from workers.service.publisher import EventPublisher
from workers.store.page_pool import PagePool

P = 4
NS = Namespace("m", salt="salt-of-tenant-a")
WORKERS = ("w0", "w1", "w2")


class ServiceRig:
    """A started server; `client(...)` speaks as a worker of the mesh, its front door, a
    stranger's key, or (with authentication off) as anyone."""

    def __init__(self, auth: bool, limits: Limits = DEFAULT_LIMITS, **config):
        self.auth = auth
        self.keys = MeshKeys.generate(WORKERS) if auth else None
        config.setdefault("liveness_timeout_s", 30.0)
        self.server = make_server(
            ServerConfig(page_tokens=P, **config),
            keys=self.keys.server_keys() if auth else None,
            limits=limits,
        )
        self.server.start()
        self._clients: list[ServiceClient] = []

    @property
    def endpoint(self) -> ServiceEndpoint:
        key = self.keys.service.public if self.auth else None
        return ServiceEndpoint(self.server.address, key)

    def client(
        self, speaker: str | KeyPair = "front_door", timeout_s: float = 1.0, retries: int = 0
    ) -> ServiceClient:
        """A client with the keys of `speaker`: a worker id, "front_door", or a KeyPair."""
        if not self.auth:
            keys = None
        elif isinstance(speaker, KeyPair):
            keys = speaker
        elif speaker == "front_door":
            keys = self.keys.front_door
        else:
            keys = self.keys.workers[speaker]
        client = ServiceClient(
            self.endpoint, timeout_s=timeout_s, retries=retries, client_keys=keys
        )
        return self.track(client)

    def track(self, client: ServiceClient) -> ServiceClient:
        """Close `client` with the rig."""
        self._clients.append(client)
        return client

    def worker(self, worker_id: str, pages: int = 64) -> tuple[PrefixCache, EventPublisher]:
        """A worker's cache and publisher, registered."""
        cache = PrefixCache(PagePool(pages), PrefixCacheConfig(page_tokens=P))
        publisher = EventPublisher(self.client(worker_id), cache, worker_id, node_id="node-1")
        assert publisher.sync()
        return cache, publisher

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self.server.check_integrity()
        self.server.stop()


def serve(cache: PrefixCache, tokens: list[int], namespace: Namespace = NS) -> None:
    """What a worker does with a computed prompt: publish its pages, release them."""
    allocation = cache.acquire(tokens, namespace)
    allocation.publish(len(tokens))
    allocation.release()


def forged_chain(
    namespace: Namespace, page_ids: tuple[int, ...], generations: tuple[int, ...], tokens: list
) -> PagesStored:
    """A PagesStored claiming that `page_ids` hold `tokens` under `namespace`."""
    return PagesStored(namespace, None, page_ids, generations, tuple(tokens))
