"""The errors the front door, the launcher and the placement raise for the user to act on
(those a request ends with are `workers.errors`', re-exported here)."""

from workers.errors import (
    DeadlineExceeded,
    KvmeshError,
    RequestCancelled,
    RequestEnded,
    ServingStopped,
)

__all__ = [
    "DeadlineExceeded",
    "KvmeshError",
    "LaunchError",
    "MeshError",
    "PlacementError",
    "RequestCancelled",
    "RequestEnded",
    "ServingStopped",
]


class PlacementError(KvmeshError):
    """The workers cannot be placed on this cluster; the message says what is missing."""


class MeshError(KvmeshError):
    """The mesh in a Ray cluster cannot be used as it is (e.g. a worker is missing)."""


class LaunchError(KvmeshError):
    """`kvmesh up`, `down`, `status` or `top` cannot do what was asked."""
