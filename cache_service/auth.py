"""Who is who in a mesh: CurveZMQ key pairs bound to identities and roles.

The launcher (`cluster.connect`) makes one key pair for the service, one for the front
door and one per worker, and a mesh secret, and hands them to the actors it creates
through Ray (actor arguments, so a restarted actor gets the same ones). The service maps
each client's public key to an `Identity`:

- a worker (role "worker", bound to one worker id) may register, heartbeat, publish
  events, resync and say BYE only for that id, and may match (as itself), route and
  look up its peers' entries;
- the front door (role "front_door") may match, route, read stats, name tenants, look
  up workers' entries and report a worker dead, and never publish;
- an unknown key is refused before any of its messages is read (ZAP).

Page servers admit the workers of the same mesh only (see `workers.transfer`). The mesh
secret derives tenant salts, so every front door of a mesh derives the same ones.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import zmq

from cache_service.messages import (
    Bye,
    GetPeer,
    GetPeers,
    GetQuarantine,
    GetStats,
    Heartbeat,
    Match,
    NameTenant,
    PublishEvents,
    Register,
    ReportDead,
    ReportHolder,
    Request,
    Resync,
    Route,
)

WORKER = "worker"
FRONT_DOOR = "front_door"
ROLES = (WORKER, FRONT_DOOR)
SECRET_BYTES = 32


class KeyPair(NamedTuple):
    """A CurveZMQ key pair, z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


class Identity(NamedTuple):
    """What a key may speak as: a role, and for a worker the id it is bound to."""

    role: str
    worker_id: str = ""


def tenant_salt(secret: bytes, tenant: str) -> str:
    """The namespace salt of a tenant in the mesh of `secret` (the same on every front door).

    Raises:
        ValueError: a tenant name that is empty or not encodable as UTF-8.
    """
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"a tenant is a non-empty name, got {tenant!r}")
    try:
        name = tenant.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"tenant name {tenant!r} is not valid UTF-8: {exc.reason}") from None
    return hmac.new(secret, b"tenant:" + name, hashlib.sha256).hexdigest()[:32]


# What each role may send at all; `allowed` adds whom it may speak for.
_WORKER_REQUESTS = (
    Register,
    Heartbeat,
    PublishEvents,
    Resync,
    Bye,
    Match,
    Route,
    GetPeer,
    GetPeers,
    ReportHolder,
    GetQuarantine,
)
_FRONT_DOOR_REQUESTS = (
    Match,
    Route,
    GetStats,
    ReportDead,
    NameTenant,
    GetPeer,
    GetPeers,
    GetQuarantine,
)
# Reads that a worker may make about any worker: routing, how to reach its peers, and
# whom not to copy from.
_WORKER_READS = (Route, GetPeer, GetPeers, GetQuarantine)


def allowed(speaker: Identity, request: Request) -> bool:
    """Whether `speaker` may send `request`.

    A worker may register, heartbeat, publish, resync and say BYE only for the worker id
    its key is bound to, match as itself (or anonymously), route and look up peers; the
    front door may match (anonymously) and route, read stats, name tenants, look up
    workers and report a worker dead.
    """
    if speaker.role == WORKER and isinstance(request, _WORKER_REQUESTS):
        if isinstance(request, _WORKER_READS):
            return True
        if isinstance(request, Match):
            return request.requester in (None, speaker.worker_id)
        return request.worker_id == speaker.worker_id
    if speaker.role == FRONT_DOOR and isinstance(request, _FRONT_DOOR_REQUESTS):
        return not isinstance(request, Match) or request.requester is None
    return False


@dataclass(frozen=True)
class ServerKeys:
    """A CURVE server's key pair and the clients it admits, each bound to an identity."""

    keypair: KeyPair
    clients: Mapping[bytes, Identity]


@dataclass(frozen=True)
class MeshKeys:
    """Every key of one mesh, and its secret.

    Attributes:
        service: the service's key pair (workers and front doors know its public key).
        front_door: the key pair every front door of the mesh uses.
        workers: worker id -> its key pair (also its page server's key).
        secret: the mesh secret: tenant salts, and the signatures of page requests when
            page bytes travel unencrypted.
    """

    service: KeyPair
    front_door: KeyPair
    workers: Mapping[str, KeyPair]
    secret: bytes

    def __post_init__(self) -> None:
        if len(self.secret) != SECRET_BYTES:
            raise ValueError(f"the mesh secret is {SECRET_BYTES} bytes, got {len(self.secret)}")
        publics = [self.service.public, self.front_door.public]
        publics += [pair.public for pair in self.workers.values()]
        if len(set(publics)) != len(publics):
            raise ValueError("two identities of the mesh share a key")

    @classmethod
    def generate(cls, worker_ids: Iterable[str]) -> MeshKeys:
        """Fresh keys for a mesh of these workers."""
        workers = {worker_id: KeyPair.generate() for worker_id in worker_ids}
        return cls(KeyPair.generate(), KeyPair.generate(), workers, os.urandom(SECRET_BYTES))

    def server_keys(self) -> ServerKeys:
        """The service's CURVE keys and the identities of every key it admits."""
        clients = {self.front_door.public: Identity(FRONT_DOOR)}
        for worker_id, pair in self.workers.items():
            clients[pair.public] = Identity(WORKER, worker_id)
        return ServerKeys(self.service, clients)

    def worker_publics(self) -> frozenset[bytes]:
        """The public keys of the mesh's workers (who may read each other's pages)."""
        return frozenset(pair.public for pair in self.workers.values())

    def to_dict(self) -> dict[str, Any]:
        """Plain data, to hand to an actor through Ray."""
        return {
            "service": tuple(self.service),
            "front_door": tuple(self.front_door),
            "workers": {worker_id: tuple(pair) for worker_id, pair in self.workers.items()},
            "secret": self.secret,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeshKeys:
        return cls(
            KeyPair(*data["service"]),
            KeyPair(*data["front_door"]),
            {worker_id: KeyPair(*pair) for worker_id, pair in data["workers"].items()},
            data["secret"],
        )
