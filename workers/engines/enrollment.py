"""Who a vLLM engine is in the mesh: its enrollment through Ray, and its namespaces.

The engine joins the mesh's Ray cluster (a running `kvmesh up`) and asks the service actor
to enroll it (`ServiceActor.enroll`) with an enrollment token the operator issued (`kvmesh
up` prints one, `kvmesh enroll-token` more), which gives it a CurveZMQ key bound to its
worker id and the mesh secret; then it leaves Ray (unless its process was in Ray before),
and reads what it needs later, the service's endpoint and the enrolled engines' keys,
from Ray's GCS without a driver (`workers.engines.mesh_directory`). It registers like any
worker (its store's shared-memory name, its node), heartbeats and publishes, so it shows
in `kvmesh status`, the dashboard and the metrics. Its page server admits the keys of the
mesh's enrolled engines (who else could hold a page of an engine's namespace), including
those that enroll after it started (`cache_service.zap.LateKeys`).

The KV format (`StoreLayout.kv_format`: layers, heads, head dim, tokens per page, dtype)
is part of the engine's namespace and of every page digest, so an engine's bfloat16 pages
never meet a kvmesh worker's float32 pages.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from collections.abc import Callable
from typing import NamedTuple

from cache_service.auth import KeyPair, tenant_salt
from cache_service.events import Namespace
from cache_service.zap import LateKeys
from workers.engines.mesh_directory import MeshDirectory
from workers.member import Membership
from workers.service.client import ServiceEndpoint
from workers.transfer.page_wire import ENCRYPT_PAGES_DEFAULT

DEFAULT_TENANT = "default"  # the salt of requests without a cache_salt
# An engine's clients skip a service that did not answer for this long: vLLM's loops must
# never wait on the mesh.
SERVICE_BACKOFF_S = 5.0
TOKEN_ENV = "KVMESH_ENROLL_TOKEN"  # where `join_mesh` finds a token it was not given


class Enrollment(NamedTuple):
    """What an engine got from the mesh when it joined."""

    worker_id: str
    keypair: KeyPair | None  # None: the mesh runs without authentication
    secret: bytes
    # Where the service listens: an address, or (joined through Ray) a resolver that reads
    # it from Ray's GCS, so a restarted service is found at its new port.
    endpoint: ServiceEndpoint | Callable[[], ServiceEndpoint]
    node_id: str
    page_tokens: int  # the index's tokens per page
    page_host: str = "127.0.0.1"  # where its page server listens (an address, resolved)
    encrypt_pages: bool = ENCRYPT_PAGES_DEFAULT  # page bytes under CurveZMQ, or signed
    # Who may read its pages through its page server: the engines enrolled now or later
    # (None: nobody; anyone who reaches it when the mesh runs without authentication).
    late_readers: Callable[[bytes], bool] | None = None

    def membership(self, publish_interval_s: float = 0.5) -> Membership:
        """The engine as a member of the mesh."""
        return Membership(
            worker_id=self.worker_id,
            node_id=self.node_id,
            endpoint=self.endpoint,
            keypair=self.keypair,
            secret=self.secret,
            page_host=self.page_host,
            encrypt_pages=self.encrypt_pages,
            late_readers=self.late_readers,
            publish_interval_s=publish_interval_s,
            service_backoff_s=SERVICE_BACKOFF_S,
        )


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
    worker_id: str,
    ray_address: str = "auto",
    node_ip_address: str | None = None,
    token: str | None = None,
) -> Enrollment:
    """Join the mesh of the Ray cluster at `ray_address` as worker `worker_id`.

    Args:
        token: the enrollment token the operator issued for this engine; None: the one
            in $KVMESH_ENROLL_TOKEN. Every process of one engine joins with the same one.
        node_ip_address: the address of this machine's Ray node, where several Ray nodes
            share the machine (Ray otherwise attaches a driver to the head node among
            them); None lets Ray pick this machine's node.

    Raises:
        RuntimeError: no token, no mesh runs in that cluster, the service refused the id
            or the token, or the Ray node joined is not on this machine (its shared memory
            is not ours).
    """
    import ray

    from cache_service.actor import RAY_NAMESPACE, get_service, resolve_host

    joined = not ray.is_initialized()  # a process in Ray already stays in it
    if joined:
        ray.init(
            address=ray_address,
            namespace=RAY_NAMESPACE,
            log_to_driver=False,
            logging_level=logging.WARNING,
            _node_ip_address=node_ip_address,
        )
    try:
        _check_local_node(ray.util.get_node_ip_address())
        token = token or os.environ.get(TOKEN_ENV)
        if not token:
            raise RuntimeError(
                f"engine {worker_id!r} has no enrollment token: set enroll_token in "
                f"kv_connector_extra_config (or {TOKEN_ENV}) to one `kvmesh enroll-token` "
                "printed"
            )
        try:
            service = get_service()
        except ValueError:
            raise RuntimeError(
                f"no kvmesh mesh runs in the Ray cluster at {ray_address!r}: start one with "
                "`kvmesh up`"
            ) from None
        try:
            data = ray.get(service.enroll.remote(worker_id, token), timeout=30)
        except ray.exceptions.RayTaskError as exc:
            raise RuntimeError(f"the mesh refused engine {worker_id!r}: {exc.cause}") from None
        pages = data.get("pages") or {}  # the launcher's page-server settings, if any
        page_host = resolve_host(pages.get("host", "loopback"))
        node_id = ray.get_runtime_context().get_node_id()
        gcs = ray.get_runtime_context().gcs_address
        directory = MeshDirectory(gcs, data["endpoint"]["server_key"])
    finally:
        if joined:
            ray.shutdown()
    keypair = None if data["keypair"] is None else KeyPair(*data["keypair"])
    return Enrollment(
        worker_id,
        keypair,
        data["secret"],
        directory.endpoint,
        node_id,
        data["page_tokens"],
        page_host,
        bool(pages.get("encrypt", ENCRYPT_PAGES_DEFAULT)),
        None if keypair is None else LateKeys(directory.enrolled_publics),
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


def default_engine_id(token: str | None) -> str:
    """An engine's worker id when its configuration names none: the same in each of its
    processes (they share the token), another for each token.

    Raises:
        RuntimeError: no token, in `token` or $KVMESH_ENROLL_TOKEN.
    """
    token = token or os.environ.get(TOKEN_ENV)
    if not token:
        raise RuntimeError(f"no enrollment token: set enroll_token (or {TOKEN_ENV})")
    return f"vllm-{socket.gethostname()[:40]}-{hashlib.sha256(token.encode()).hexdigest()[:8]}"
