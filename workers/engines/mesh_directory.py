"""What an enrolled engine reads of its mesh once it has left Ray: where the service
listens and which engines are enrolled.

An engine joins Ray only to enroll (`enrollment.join_mesh`), then disconnects: vLLM
processes kept as Ray drivers cost the whole cluster (with two Ray Serve replicas' engines
connected, their worker processes kept Ray's GCS answering about a hundred subscriber polls
a second, at half a core of two; a fiftieth of a core once they disconnect). The service
actor keeps its endpoint and
the enrolled engines' public keys in Ray's key-value store (`cache_service.actor`), and
the engine reads them there with a bare GCS client: one RPC, no driver, no job, no
subscriptions. The engine's service clients ask for the endpoint at each reconnect (a
restarted service is found at its new port); its page server asks for the keys when one
it does not know knocks (`cache_service.zap.LateKeys`).
"""

from __future__ import annotations

import threading
from typing import Any

from workers.service.client import ServiceEndpoint

GCS_TIMEOUT_S = 2.0  # one read of the GCS; a read that fails counts as "service not up"


class MeshDirectory:
    """Reads the service's endpoint and the enrolled engines' keys from Ray's GCS at
    `gcs_address` (host:port), without connecting to Ray. Thread-safe.

    Args:
        server_key: the service's CurveZMQ public key as the engine's enrollment gave it
            (None: the mesh runs without authentication). The endpoint's address comes
            from the GCS, its key never does: a mesh keeps its keys across restarts of
            the service, so a key written there by anyone else is ignored.

    Raises (from each read):
        RuntimeError: the GCS holds no service endpoint (no mesh runs there now).
        Whatever Ray's GCS client raises when the GCS does not answer.
    """

    def __init__(
        self, gcs_address: str, server_key: bytes | None, timeout_s: float = GCS_TIMEOUT_S
    ):
        self.gcs_address = gcs_address
        self.server_key = server_key
        self.timeout_s = timeout_s
        self._client: Any = None
        self._lock = threading.Lock()

    def endpoint(self) -> ServiceEndpoint:
        """Where the service listens now (a `ServiceClient`'s endpoint resolver)."""
        import msgpack

        from cache_service.actor import ENDPOINT_KEY

        raw = self._read(ENDPOINT_KEY)
        if raw is None:
            raise RuntimeError(f"no kvmesh service is kept in the GCS at {self.gcs_address}")
        return ServiceEndpoint(msgpack.unpackb(raw)["address"], self.server_key)

    def enrolled_publics(self) -> frozenset[bytes]:
        """The public keys of the engines enrolled in the mesh (`LateKeys`'s fetch)."""
        from cache_service.actor import ENROLLED_PUBLICS_KEY, publics_from

        return publics_from(self._read(ENROLLED_PUBLICS_KEY))

    def _read(self, key: bytes) -> bytes | None:
        from cache_service.actor import RAY_NAMESPACE  # Ray loads with it: not at import

        with self._lock:
            if self._client is None:
                from ray._raylet import GcsClient  # the client Ray's own daemons use

                self._client = GcsClient(address=self.gcs_address)
            return self._client.internal_kv_get(key, RAY_NAMESPACE.encode(), timeout=self.timeout_s)
