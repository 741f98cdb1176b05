"""A worker's disk tier as its config names it, and where its files go by default.

Light on purpose: the config and the worker's settings import it, which must not load
torch (`workers.disk_link` is the tier itself).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

POLICIES = ("write_back", "write_through")
DIR_ENV = "KVMESH_DISK_DIR"  # where default disk tiers go (default ~/.cache/kvmesh/disk)


@dataclass(frozen=True)
class DiskSettings:
    """A worker's disk tier, as its config names it.

    Attributes:
        directory: its directory ("" : `default_directory` of the mesh and worker).
        pages: records it holds at most.
        policy: when pages are written down (POLICIES).
        keep: leave the files when the worker shuts down (a restarted worker of the same
            mesh adopts them either way; a worker that is shut down removes them unless
            this is set).
    """

    directory: str = ""
    pages: int = 4096
    policy: str = "write_back"
    keep: bool = False

    def __post_init__(self) -> None:
        if self.pages < 1:
            raise ValueError(f"store.disk.pages must be positive, got {self.pages}")
        if self.policy not in POLICIES:
            raise ValueError(f"store.disk.policy {self.policy!r}: one of {', '.join(POLICIES)}")


def mesh_key(secret: bytes) -> bytes:
    """The key a mesh's disk records are made under: from the mesh secret, so a record of
    another mesh (another secret) never verifies here."""
    return hashlib.blake2b(secret, digest_size=32, person=b"kvmesh-disk-v1").digest()


def default_directory(secret: bytes, worker_id: str) -> Path:
    """`$KVMESH_DISK_DIR/<mesh>/<worker>` (default root ~/.cache/kvmesh/disk): one per mesh
    (named by a digest of its secret, never the secret) and worker id, so a worker restarted
    in the same mesh finds its own and no other mesh's."""
    root = os.environ.get(DIR_ENV) or Path.home() / ".cache" / "kvmesh" / "disk"
    mesh = hashlib.blake2b(secret, digest_size=8, person=b"kvmesh-mesh-id").hexdigest()
    return Path(root) / mesh / worker_id
