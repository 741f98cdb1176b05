"""Launching kvmesh on Ray, the typed configuration and the `kvmesh` command line.

`cluster.connect(...)` is the Python front door (see `cluster/mesh.py`); it is imported
on first use so that `kvmesh --help` does not pay for Ray and torch.
"""

from typing import Any

__all__ = [
    "connect",
    "Mesh",
    "GenerateResult",
    "MeshError",
    "DeadlineExceeded",
    "RequestCancelled",
    "StreamChunk",
    "TokenStream",
]


def __getattr__(name: str) -> Any:
    if name in ("DeadlineExceeded", "RequestCancelled"):
        from cluster import errors

        return getattr(errors, name)
    if name in ("StreamChunk", "TokenStream"):
        from cluster import streams

        return getattr(streams, name)
    if name in __all__:
        from cluster import mesh

        return getattr(mesh, name)
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
