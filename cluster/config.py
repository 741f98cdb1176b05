"""Typed kvmesh configuration: frozen dataclasses loaded from YAML.

Every section is a frozen dataclass that validates itself in `__post_init__`; the loader
maps YAML keys onto fields and rejects any key it does not know, naming it with its path
(`cache.page_tokn`), so a typo never silently falls back to a default.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cache_service.addresses import check_bind_host
from cache_service.routing import DEFAULT_POLICY
from cache_service.routing import POLICIES as ROUTING_POLICIES
from cache_service.server import ServerConfig
from workers.api import DEFAULT_TIMEOUT_S, check_timeout
from workers.cache.device_settings import DeviceSettings
from workers.cache.disk_settings import POLICIES as DISK_POLICIES
from workers.cache.disk_settings import DiskSettings
from workers.cache.prefix_cache import PrefixCacheConfig
from workers.serving.compaction.config import CompactionConfig
from workers.serving.config import SchedulerConfig
from workers.serving.models import DTYPES, model_shape
from workers.store.layout import StoreLayout
from workers.transfer.costs import POLICIES
from workers.transfer.page_wire import ENCRYPT_PAGES_DEFAULT
from workers.transfer.spot_check import SPOT_CHECK_RATE


class ConfigError(ValueError):
    """A configuration file or mapping that cannot be used; the message names the key."""


def _check_host(host: str, key: str) -> None:
    try:
        check_bind_host(host, key)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class ModelConfig:
    """The model whose KV the pages hold. Its shape (layers, KV heads, head dim) is the
    model's own (`workers.serving.models.KNOWN_MODELS`), never configured: it fixes the page
    layout, and the page store takes the model's dtype."""

    name: str = "smollm2-135m"
    # fp32 on CPU: the correctness checks compare logits at 1e-4; bfloat16 halves the
    # pages (and the bytes a copy moves) at the cost of that agreement.
    dtype: str = "float32"

    def __post_init__(self) -> None:
        try:
            model_shape(self.name)
        except ValueError as exc:
            raise ConfigError(f"model.name: {exc}") from None
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}: {self.dtype!r}")


# Records a disk tier holds at most, whatever its bytes allow: its pages count in the
# index like host pages (a worker registers both), and a restarted worker verifies every
# slot. 16 GiB of SmolLM2 pages is 23,000.
MAX_DISK_PAGES = 1 << 17


@dataclass(frozen=True)
class DiskConfig:
    """A worker's disk tier: pages host memory evicts are written down to local files and
    loaded back on a hit when that beats recomputing them."""

    enabled: bool = False  # configs/local.yaml turns it on
    path: str = ""  # "": ~/.cache/kvmesh/disk/<mesh>/<worker id> ($KVMESH_DISK_DIR as root)
    pages: int = 0  # records at most; 0: from `bytes`
    bytes: int = 4 << 30  # when pages is 0: this many bytes of page records at most
    policy: str = "write_back"  # write_back (on eviction) | write_through (on publish)
    keep: bool = False  # leave the files when the mesh shuts down (restarts adopt either way)

    def __post_init__(self) -> None:
        if self.pages > MAX_DISK_PAGES:
            raise ConfigError(f"store.disk.pages is at most {MAX_DISK_PAGES}, got {self.pages}")
        if self.pages < 0 or self.bytes <= 0:
            raise ConfigError(
                f"store.disk.pages must be >= 0 and store.disk.bytes > 0, got "
                f"{self.pages} and {self.bytes}"
            )
        if self.policy not in DISK_POLICIES:
            raise ConfigError(
                f"store.disk.policy {self.policy!r}: one of {', '.join(DISK_POLICIES)}"
            )

    def settings(self, page_bytes: int) -> DiskSettings | None:
        """The worker's disk settings for pages of `page_bytes` (None: off)."""
        if not self.enabled:
            return None
        pages = self.pages or min(max(self.bytes // page_bytes, 1), MAX_DISK_PAGES)
        return DiskSettings(self.path, pages, self.policy, self.keep)


@dataclass(frozen=True)
class StoreConfig:
    """The worker's page store."""

    # 2,048 pages of 16 tokens = 32,768 tokens; for SmolLM2 in fp32 a page is 720 KiB,
    # so the store takes 1.4 GiB of shared memory per worker.
    num_pages: int = 2048
    # Where pages live: "cpu" keeps them in host shared memory (num_pages of them), as on
    # every CPU node. "cuda" (or "cuda:N") puts a device tier of device_pages on the
    # worker's GPU above host memory, which then holds the pages the device evicts;
    # "auto" does that where the worker has a GPU and stays "cpu" elsewhere (a mesh may
    # mix them). The model runs where the pages are.
    device: str = "cpu"
    device_pages: int = 0
    disk: DiskConfig = field(default_factory=DiskConfig)  # the tier below host memory

    def __post_init__(self) -> None:
        if self.num_pages <= 0:
            raise ConfigError(f"store.num_pages must be positive, got {self.num_pages}")
        if self.device == "cpu":
            if self.device_pages:
                raise ConfigError(
                    f"store.device_pages {self.device_pages} needs store.device cuda or auto "
                    "(with cpu, pages live in host shared memory: store.num_pages)"
                )
            return
        try:
            DeviceSettings(self.device, self.device_pages)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.disk.enabled and self.disk.policy != "write_back":
            raise ConfigError(
                f"store.disk.policy {self.disk.policy} under store.device {self.device!r}: "
                "pages reach the disk when host memory evicts them (write_back)"
            )

    def device_settings(self) -> DeviceSettings | None:
        """The worker's device tier (None: none, host shared memory is its page store)."""
        if self.device == "cpu":
            return None
        return DeviceSettings(self.device, self.device_pages)


@dataclass(frozen=True)
class WorkersConfig:
    """How many workers run and how they are placed."""

    count: int = 2
    # Where page servers listen: "loopback" or "node", as service.host.
    host: str = "loopback"
    # torch threads per worker: one CPU slot each; more threads than cores slows
    # every worker down several times over.
    threads: int = 1
    publish_interval_s: float = 0.5
    # Ray resources each worker reserves (a placement-group bundle per worker): one CPU
    # slot, so that two workers fit on a 2-core machine; on a GPU cluster one GPU each
    # (num_gpus None: 1 when the cluster has GPUs, else 0).
    num_cpus: float = 1.0
    num_gpus: float | None = None
    # How long a start waits for resources that exist but are taken by other work.
    placement_timeout_s: float = 60.0
    # Times Ray restarts a worker that died (its process killed, its node lost): each
    # restart is a new incarnation with a fresh, empty store. 0: a dead worker stays dead
    # and the others take its requests.
    max_restarts: int = 0
    # Copy a prefix cached on peers, or recompute it (`workers.transfer.costs.POLICIES`):
    # "measured" weighs both per request from this machine's measured prefill and link
    # speeds; "always" / "never" force one (tests of the copy path use "always": a tiny
    # model computes faster than any copy).
    copy_policy: str = "measured"
    # Of copies from holders checked before, the share spot-checked: one copied token
    # recomputed and compared (`workers.transfer.spot_check`; a holder's first copy always).
    spot_check_rate: float = SPOT_CHECK_RATE
    # Batching (`workers.serving.scheduler`): sequences running at once, tokens one forward pass
    # takes, a prompt's tokens per pass (0: as many as the pass has room for), and
    # whether requests arriving together compute a prefix they share once; copy-ins
    # run at once beside the serving thread.
    max_running: int = 32
    max_batch_tokens: int = 4096
    prefill_chunk_tokens: int = 0
    batch_sharing: bool = True
    copy_threads: int = 2
    # Whether workers share their caches through the mesh: False, each has only its own
    # (no lookup at the service, no copy from a peer; what a team has without kvmesh, for
    # comparisons); they still publish, so routing still knows what each holds.
    share: bool = True

    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig(
            self.max_running,
            self.max_batch_tokens,
            self.prefill_chunk_tokens,
            self.batch_sharing,
            self.copy_threads,
        )

    def __post_init__(self) -> None:
        _check_host(self.host, "workers.host")
        try:
            self.scheduler()
        except ValueError as exc:
            raise ConfigError(f"workers: {exc}") from None
        if self.copy_policy not in POLICIES:
            raise ConfigError(
                f"workers.copy_policy {self.copy_policy!r} unknown; known: "
                f"{', '.join(sorted(POLICIES))}"
            )
        if type(self.spot_check_rate) not in (int, float) or not 0 <= self.spot_check_rate <= 1:
            raise ConfigError(
                f"workers.spot_check_rate must be a number in [0, 1], got {self.spot_check_rate!r}"
            )
        if type(self.share) is not bool:
            raise ConfigError(f"workers.share must be true or false, got {self.share!r}")
        if type(self.max_restarts) is not int or self.max_restarts < -1:
            raise ConfigError(
                f"workers.max_restarts must be an int >= 0 (or -1: always), got "
                f"{self.max_restarts!r}"
            )
        if self.count <= 0:
            raise ConfigError(f"workers.count must be positive, got {self.count}")
        if self.threads <= 0:
            raise ConfigError(f"workers.threads must be positive, got {self.threads}")
        if self.publish_interval_s <= 0:
            raise ConfigError("workers.publish_interval_s must be positive")
        if self.num_cpus < 0:
            raise ConfigError(f"workers.num_cpus must not be negative, got {self.num_cpus}")
        if self.num_gpus is not None and self.num_gpus < 0:
            raise ConfigError(f"workers.num_gpus must not be negative, got {self.num_gpus}")
        if self.num_cpus == 0 and not self.num_gpus:
            raise ConfigError("workers.num_cpus and workers.num_gpus are both 0: reserve one")
        if self.placement_timeout_s <= 0:
            raise ConfigError("workers.placement_timeout_s must be positive")


@dataclass(frozen=True)
class ServiceConfig:
    """The central service."""

    # "loopback" (127.0.0.1: one machine, an embedded Ray or a simulated cluster),
    # "node" (this node's address as Ray knows it: a real multi-node cluster), or an
    # address of this node. Never a wildcard: see cache_service.addresses.
    host: str = "loopback"
    port: int = 0
    liveness_timeout_s: float = 10.0
    # Routing: how much a prompt token queued on a worker counts against it, next to the
    # tokens this prompt would compute there (1: as much; a worker computes its queue first).
    load_weight: float = 1.0
    # What clients can make the service hold: registrations, tenants with figures of
    # their own (the rest summed as "(other)"), holders named per match.
    max_workers: int = 1024
    max_tenants: int = 256
    max_spans: int = 16
    # The Prometheus port (/metrics) on the service: "loopback" by default; "node" or an
    # address of this node only with an access token (sent as a bearer token).
    metrics_host: str = "loopback"
    metrics_port: int = 0
    metrics_token: str = ""
    # Whether clients without the token (there is none to bring when metrics_token is
    # unset, on loopback) see figures by tenant name; off, they see the mesh's and each
    # worker's figures only, so another local user learns no tenant's name or traffic.
    # Token holders always see everything.
    metrics_show_tenants: bool = False

    def __post_init__(self) -> None:
        _check_host(self.host, "service.host")
        if not isinstance(self.metrics_show_tenants, bool):
            raise ConfigError(
                f"service.metrics_show_tenants must be true or false, "
                f"got {self.metrics_show_tenants!r}"
            )
        _check_host(self.metrics_host, "service.metrics_host")
        if self.metrics_host != "loopback" and not self.metrics_token:
            raise ConfigError(
                f"service.metrics_host {self.metrics_host!r} is reachable beyond this machine: "
                "set service.metrics_token"
            )
        if self.liveness_timeout_s <= 0:
            raise ConfigError("service.liveness_timeout_s must be positive")
        for name in ("max_workers", "max_tenants", "max_spans"):
            if getattr(self, name) < 1:
                raise ConfigError(f"service.{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class SecurityConfig:
    """Who may talk to the service and to the page servers."""

    # CurveZMQ on the service and on page servers, keys bound to identities and roles.
    # Off only on a network nobody else can reach (e.g. one machine in a test).
    auth: bool = True
    # Whether page bytes between nodes are encrypted too (CurveZMQ); when not, page
    # requests are still signed with the mesh secret. The default and its cost:
    # workers.transfer.ENCRYPT_PAGES_DEFAULT.
    encrypt_pages: bool = ENCRYPT_PAGES_DEFAULT


@dataclass(frozen=True)
class RoutingConfig:
    """How the front door picks a worker for each request."""

    # A policy of `cache_service.routing.POLICIES`: "kvmesh" (the soonest first token:
    # what each worker holds, would copy and compute, against its queue), "round-robin",
    # "least-loaded", or "prefix-affinity" (SGLang's cache-aware rule).
    policy: str = DEFAULT_POLICY

    def __post_init__(self) -> None:
        if self.policy not in ROUTING_POLICIES:
            raise ConfigError(
                f"routing.policy {self.policy!r} is not a policy; known: "
                f"{', '.join(ROUTING_POLICIES)}"
            )


@dataclass(frozen=True)
class RequestsConfig:
    """What every request the front door sends is held to."""

    # Seconds from the call to the last token; past it a request ends with DeadlineExceeded
    # and releases what it held (a call's `timeout_s=` overrides it). Generous by default:
    # it bounds a wait, it does not shape the service.
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        try:
            check_timeout(self.timeout_s)
        except ValueError as exc:
            raise ConfigError(f"requests.{exc}") from None


@dataclass(frozen=True)
class KvmeshConfig:
    """The whole configuration, one section per component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    compaction: CompactionConfig = field(default_factory=CompactionConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    requests: RequestsConfig = field(default_factory=RequestsConfig)

    def __post_init__(self) -> None:
        per_layer = self.compaction.budget
        layers = model_shape(self.model.name).num_layers
        if isinstance(per_layer, tuple) and len(per_layer) != layers:
            raise ConfigError(
                f"compaction.budget has {len(per_layer)} per-layer values; "
                f"{self.model.name} has {layers} layers"
            )

    def server_config(self) -> ServerConfig:
        """The service's server settings these sections describe (hosts unresolved:
        "loopback" / "node" are resolved where the service runs)."""
        service = self.service
        return ServerConfig(
            host=service.host,
            port=service.port,
            liveness_timeout_s=service.liveness_timeout_s,
            page_tokens=self.cache.page_tokens,
            load_weight=service.load_weight,
            max_workers=service.max_workers,
            max_tenants=service.max_tenants,
            max_spans=service.max_spans,
            metrics_host=service.metrics_host,
            metrics_port=service.metrics_port,
            metrics_token=service.metrics_token,
            metrics_show_tenants=service.metrics_show_tenants,
        )

    def store_layout(self) -> StoreLayout:
        """The page store layout these sections describe (the model's KV shape)."""
        shape = model_shape(self.model.name)
        return StoreLayout(
            num_pages=self.store.num_pages,
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            page_tokens=self.cache.page_tokens,
            head_dim=shape.head_dim,
            dtype=self.model.dtype,
        )


def load_config(path: str | Path) -> KvmeshConfig:
    """Read a YAML file into a KvmeshConfig.

    Raises:
        ConfigError: unreadable YAML, an unknown key, a wrong type or an invalid value;
            the message names the file and the key.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    try:
        return config_from_dict({} if data is None else data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def config_to_dict(cfg: KvmeshConfig) -> dict[str, Any]:
    """The plain mapping `config_from_dict` reads back (what the service hands an
    attaching front door)."""
    return dataclasses.asdict(cfg)


def config_from_dict(data: Any) -> KvmeshConfig:
    """Build a KvmeshConfig from a mapping (e.g. parsed YAML); see `load_config`."""
    return _build(KvmeshConfig, data, "")


# Keys older configs carry, and why they are gone (named when a file still has one).
_SHAPE_KEY = "the model's shape comes from the model itself: drop the key"
_REMOVED = {
    "model.num_layers": _SHAPE_KEY,
    "model.num_kv_heads": _SHAPE_KEY,
    "model.head_dim": _SHAPE_KEY,
    "store.dtype": "the page store takes model.dtype",
}


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        path = f"{where}.{unknown[0]}" if where else str(unknown[0])
        why = f" ({_REMOVED[path]})" if path in _REMOVED else ""
        raise ConfigError(f"unknown key {path!r}{why}; known: {', '.join(sorted(fields))}")
    values = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        values[name] = _convert(hints[name], value, key)
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from exc


def _convert(hint: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for kind in allowed:
        if kind is type(None) and value is None:
            return None
        origin = typing.get_origin(kind)
        if origin in (dict, collections.abc.Mapping) and isinstance(value, dict):
            return dict(value)  # free-form settings (a policy's params): its own checks
        if origin is tuple and isinstance(value, list | tuple):
            item = typing.get_args(kind)[0]
            return tuple(_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value))
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if kind in (int, str, bool) and type(value) is kind:
            return value
    names = " or ".join(getattr(k, "__name__", str(k)) for k in allowed)
    raise ConfigError(f"{key} must be {names}, got {value!r}")
