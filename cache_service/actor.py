"""The service as a named, detached, restartable Ray actor.

Ray is used to place and find the service, never to carry its traffic: a worker asks
the actor once for its ZMQ endpoint (`endpoint()`), then talks ZMQ + msgpack. When the
actor dies Ray restarts it; the new incarnation binds a fresh socket and starts a new
epoch with an empty index, and workers, whose requests now time out, ask the actor for
the new endpoint, register again and resync their holdings.
"""

from __future__ import annotations

import dataclasses
import hmac
import re
import time
from typing import Any, NamedTuple

import msgpack
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cache_service import enroll_tokens
from cache_service.auth import KeyPair, MeshKeys, tenant_salt
from cache_service.malloc import keep_large_blocks_mapped
from cache_service.quarantine import Quarantine
from cache_service.server import ServerConfig, make_server

SERVICE_NAME = "kvmesh-service"
MAX_ENROLLED = 256  # engines a mesh admits beyond its own workers (bounded state)
_WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
RAY_NAMESPACE = "kvmesh"


class Enrolled(NamedTuple):
    """An engine that joined: its key pair, and the digest of the token it spent."""

    keypair: KeyPair
    token: bytes  # `enroll_tokens.check`'s digest: the same engine may enroll again with it


class ServiceActor:
    """Plain class run as a Ray actor by `start_service` (testable without Ray).

    Args:
        config: ServerConfig fields (host may be "loopback" or "node").
        keys: the mesh's keys (`MeshKeys.to_dict()`), made by the launcher: a restarted
            actor gets the same ones, so workers and front doors keep talking to it.
        auth: serve with CurveZMQ and identities (else in plain text, to anyone).
        mesh: what the launcher started around the service (its configuration, worker
            names, placement group, who launched it), for front doors that attach.
        enroll_key: the key the operator's enrollment tokens are issued under (see
            `cache_service.enroll_tokens`); None: no engine may enroll.
    """

    def __init__(
        self,
        config: dict[str, Any],
        keys: dict[str, Any],
        auth: bool = True,
        mesh: dict[str, Any] | None = None,
        enroll_key: bytes | None = None,
    ):
        config = dict(config)
        config["host"] = resolve_host(config.get("host", "loopback"))
        if config.get("metrics_host") is not None:
            config["metrics_host"] = resolve_host(config["metrics_host"])
        self.config = ServerConfig(**config)
        self.keys = MeshKeys.from_dict(keys)
        self.auth = auth
        self.mesh = dict(mesh or {})
        self._enroll_key = enroll_key  # never handed out: `credentials` is not it
        keep_large_blocks_mapped()  # this process is the service's: the index's memory
        # Members in quarantine stay there across restarts of this actor (Ray's key-value
        # store keeps them, as it keeps the enrolled engines).
        quarantine = Quarantine(on_change=_keep_quarantine)
        saved = _kept(_QUARANTINE_KEY)
        if saved is not None:
            quarantine.restore(saved)
        self.server = make_server(
            self.config, self.keys.server_keys() if auth else None, quarantine=quarantine
        )
        self.server.start()
        self.started = time.time()
        # Where it serves now, in Ray's key-value store: engines, which leave Ray once
        # enrolled, read it there without a Ray driver (`workers.engines.mesh_directory`).
        _keep(ENDPOINT_KEY, msgpack.packb(self.endpoint()))
        # Engines that joined since (`enroll`, each with a token), kept in Ray's key-value
        # store (the GCS, which holds the mesh's keys as this actor's arguments already):
        # a restarted actor admits them again, so a running engine reconnects like any
        # worker.
        self.enrolled: dict[str, Enrolled] = _enrolled()
        if auth:
            for worker_id, engine in self.enrolled.items():
                self.server.admit_worker(worker_id, engine.keypair.public)

    def endpoint(self) -> dict[str, Any]:
        """Where workers reach the service: address, epoch, CurveZMQ public key or None."""
        return {
            "address": self.server.address,
            "epoch": self.server.epoch,
            "server_key": self.keys.service.public if self.auth else None,
            "metrics_url": self.server.metrics_url,
            "dashboard_url": self.server.dashboard_url,
        }

    def credentials(self) -> dict[str, Any]:
        """The mesh's keys and secret, for a front door that attaches (through Ray only),
        and the index's tokens per page."""
        return {
            "keys": self.keys.to_dict(),
            "auth": self.auth,
            "page_tokens": self.config.page_tokens,
        }

    def enroll(self, worker_id: str, token: str | None = None) -> dict[str, Any]:
        """Make `worker_id` a worker of this mesh: an engine (a vLLM process with kvmesh's
        connector) that joined through Ray with an enrollment token the operator issued
        (`kvmesh up` prints one, `kvmesh enroll-token` more). The first enrollment spends
        the token and binds it to `worker_id`; the same engine enrolling again with it (its
        scheduler and worker processes both enroll; so does a restarted engine) gets the
        same key pair. Returns its key pair and what it needs to talk to the service: the
        endpoint and the mesh secret (tenant salts, signed page reads), the index's tokens
        per page, and how the mesh's page servers listen (`pages`: the launcher's
        `workers.host` and `security.encrypt_pages`; None when the service was started
        alone). A refused enrollment changes nothing and takes no engine's place.

        Raises:
            ValueError: `worker_id` is not a plain name or is one of the launcher's
                workers; the token is not one this mesh issued, was spent by another
                engine, or `worker_id` enrolled with another; or the mesh already holds
                MAX_ENROLLED engines.
        """
        if not isinstance(worker_id, str) or not _WORKER_ID.fullmatch(worker_id):
            raise ValueError(
                f"an engine's worker id is 1-64 of a-z, A-Z, 0-9, '-', '_', '.', got {worker_id!r}"
            )
        if worker_id in self.keys.workers:
            raise ValueError(f"{worker_id!r} is one of the mesh's own workers: pick another id")
        if self.server.in_quarantine(worker_id):
            raise ValueError(
                f"{worker_id!r} is in quarantine (its pages failed a spot check): an operator "
                "clears it with `kvmesh quarantine --clear`"
            )
        if self._enroll_key is None:
            raise ValueError("this mesh issues no enrollment tokens: no engine may enroll")
        if token is None:
            raise ValueError(f"engine {worker_id!r} came without an enrollment token")
        spent, engines = enroll_tokens.check(self._enroll_key, token)
        engine = self.enrolled.get(worker_id)
        if engine is not None and not hmac.compare_digest(engine.token, spent):
            raise ValueError(f"engine {worker_id!r} enrolled with another token")
        if engine is None:
            bound = sum(hmac.compare_digest(e.token, spent) for e in self.enrolled.values())
            if bound >= engines:
                raise ValueError(
                    "this enrollment token was spent by another engine"
                    if engines == 1
                    else f"this enrollment token's {engines} engines have all enrolled"
                )
            if len(self.enrolled) >= MAX_ENROLLED:
                raise ValueError(f"the mesh already holds {MAX_ENROLLED} engines")
            engine = Enrolled(KeyPair.generate(), spent)
            if self.auth:
                self.server.admit_worker(worker_id, engine.keypair.public)
            self.enrolled[worker_id] = engine
            _keep_enrolled(self.enrolled)
        pair = engine.keypair
        return {
            "worker_id": worker_id,
            "keypair": tuple(pair) if self.auth else None,
            "secret": self.keys.secret,
            "endpoint": self.endpoint(),
            "page_tokens": self.config.page_tokens,  # the index's: every worker's pages
            "pages": self._page_settings(),
        }

    def _page_settings(self) -> dict[str, Any] | None:
        config = self.mesh.get("config")
        if not config:
            return None
        return {"host": config["workers"]["host"], "encrypt": config["security"]["encrypt_pages"]}

    def describe(self) -> dict[str, Any]:
        """The mesh around this service, as its launcher described it (empty when the
        service was started alone)."""
        return self.mesh

    def tenant_salt(self, tenant: str) -> str:
        """The namespace salt of `tenant` in this mesh."""
        return tenant_salt(self.keys.secret, tenant)

    def stats(self) -> dict[str, Any]:
        """The index's statistics (the same figures the `stats` request returns), read by
        the server's loop thread, which owns the index."""
        return self.server.stats()

    def check_integrity(self) -> None:
        """Check the index's invariants, on the server's loop thread."""
        self.server.check_integrity()

    def quarantined(self) -> list[dict[str, Any]]:
        """The members in quarantine (`cache_service.quarantine`): holder, reporter,
        since, evidence."""
        return self.server.quarantined()

    def clear_quarantine(self, worker_id: str) -> bool:
        """The operator lets `worker_id` register (and, an engine, enroll) again; False
        when it was not in quarantine."""
        return self.server.clear_quarantine(worker_id)

    def stop(self) -> None:
        self.server.stop()


_ENROLLED_KEY = b"kvmesh-enrolled-engines"
# What an engine's page server reads (through the GCS, without Ray): the enrolled engines'
# public keys alone, kept beside the full records (which hold their secret keys).
ENROLLED_PUBLICS_KEY = b"kvmesh-enrolled-publics"
ENDPOINT_KEY = b"kvmesh-service-endpoint"  # the service's `endpoint()`, at each (re)start
_QUARANTINE_KEY = b"kvmesh-quarantine"


def _enrolled() -> dict[str, Enrolled]:
    """The engines enrolled by earlier incarnations of the service actor (none outside
    Ray, as in the tests that build the actor class directly)."""
    raw = _kept(_ENROLLED_KEY)
    if raw is None:
        return {}
    return {
        worker_id: Enrolled(KeyPair(public, secret), token)
        for worker_id, (public, secret, token) in msgpack.unpackb(raw).items()
    }


def enrolled_publics() -> frozenset[bytes]:
    """The public keys of the engines enrolled in the mesh of this Ray cluster (asked
    through this process's Ray connection): who may read an engine's pages."""
    return publics_from(_kept(ENROLLED_PUBLICS_KEY))


def publics_from(raw: bytes | None) -> frozenset[bytes]:
    """The enrolled engines' public keys, from what ENROLLED_PUBLICS_KEY holds."""
    return frozenset() if raw is None else frozenset(msgpack.unpackb(raw))


def _keep_enrolled(enrolled: dict[str, Enrolled]) -> None:
    raw = msgpack.packb({worker_id: (*e.keypair, e.token) for worker_id, e in enrolled.items()})
    _keep(_ENROLLED_KEY, raw)
    _keep(ENROLLED_PUBLICS_KEY, msgpack.packb(sorted(e.keypair.public for e in enrolled.values())))


def _forget_mesh() -> None:
    """Drop what an earlier mesh kept in this Ray cluster."""
    from ray.experimental import internal_kv

    if ray.is_initialized() and internal_kv._internal_kv_initialized():
        for key in (_ENROLLED_KEY, ENROLLED_PUBLICS_KEY, ENDPOINT_KEY, _QUARANTINE_KEY):
            internal_kv._internal_kv_del(key, namespace=RAY_NAMESPACE)


def _keep(key: bytes, raw: bytes) -> None:
    """Keep `raw` under `key` in Ray's key-value store (nothing outside Ray)."""
    from ray.experimental import internal_kv

    if ray.is_initialized() and internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_put(key, raw, overwrite=True, namespace=RAY_NAMESPACE)


def _kept(key: bytes) -> bytes | None:
    """What an earlier incarnation of the actor kept under `key` (None outside Ray)."""
    from ray.experimental import internal_kv

    if not ray.is_initialized() or not internal_kv._internal_kv_initialized():
        return None
    return internal_kv._internal_kv_get(key, namespace=RAY_NAMESPACE)


def _keep_quarantine(quarantine: Quarantine) -> None:
    _keep(_QUARANTINE_KEY, quarantine.saved())


def resolve_host(host: str) -> str:
    """ "loopback" -> 127.0.0.1; "node" -> this node's address as Ray knows it; else as is.

    Every node of a simulated cluster (and an embedded Ray) is this machine, so
    "loopback" is right there; a real multi-node cluster needs "node".
    """
    if host == "loopback":
        return "127.0.0.1"
    if host == "node":
        return ray.util.get_node_ip_address()
    return host


def start_service(
    config: ServerConfig | None = None,
    keys: MeshKeys | None = None,
    auth: bool = True,
    mesh: dict[str, Any] | None = None,
    node_id: str | None = None,
    enroll_key: bytes | None = None,
) -> Any:
    """Start the service actor (or return the running one) and wait until it serves.

    Args:
        config: where and how it serves.
        keys: the mesh's keys (fresh ones for a mesh of no workers when None).
        auth: serve with CurveZMQ and identities.
        mesh: the launcher's description of the mesh (`ServiceActor.describe`).
        node_id: the node it must run on (the head node, in a launched mesh).
        enroll_key: the key of the operator's enrollment tokens (`enroll_tokens`); None:
            no engine may enroll.

    Returns:
        The actor handle, named SERVICE_NAME in namespace RAY_NAMESPACE.
    """
    config = config or ServerConfig(host="loopback")
    keys = keys or MeshKeys.generate(())
    try:
        get_service()
    except ValueError:
        _forget_mesh()  # a new mesh: engines of an earlier one in this cluster are strangers
    actor_cls = ray.remote(ServiceActor)
    handle = actor_cls.options(
        name=SERVICE_NAME,
        namespace=RAY_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=-1,
        num_cpus=0,
        scheduling_strategy=(
            None if node_id is None else NodeAffinitySchedulingStrategy(node_id, soft=False)
        ),
    ).remote(dataclasses.asdict(config), keys.to_dict(), auth, mesh, enroll_key)
    ray.get(handle.endpoint.remote())
    return handle


def get_service() -> Any:
    """The running service actor's handle.

    Raises:
        ValueError: no service is running in this Ray cluster.
    """
    return ray.get_actor(SERVICE_NAME, namespace=RAY_NAMESPACE)


def stop_service() -> None:
    """Kill the service actor for good (no restart); no-op if none runs."""
    try:
        handle = get_service()
    except ValueError:
        return
    ray.kill(handle, no_restart=True)
    _forget_mesh()
