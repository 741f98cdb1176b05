"""The values a front door and a worker exchange, and nothing else.

What crosses the Ray seam between `cluster` (the front door) and a worker actor, one typed
value per direction, as `cache_service.messages` is for the service's wire:

    front door -> worker    WorkerSettings        the actor's constructor argument
                            GenerateRequest       generate_batch / stream
                            request ids           cancel (a stream its caller left)
                            WorkerInfo            set_peers (the mesh's members)
    worker -> front door    GenerateOutput        a request's tokens, text and RequestStats
                            StreamItem            each sampled token, then the output
                            WorkerInfo            info: how peers reach its pages
                            WorkerStats           stats
                            ServingHealth         health: whether its serving loop runs

Every default lives here once: the worker's convenience `generate(prompt, ...)` and the
front door build the same `GenerateRequest`, so neither keeps a table of its own. The
actor's Ray name and concurrency are here too, so a front door that only finds and calls
workers (`kvmesh status`, `down`, an attached client) never imports the worker itself,
nor torch with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from cache_service.auth import KeyPair
from workers.cache.device_settings import DeviceSettings
from workers.cache.disk_settings import DiskSettings
from workers.cache.prefix_cache import PrefixCacheConfig
from workers.errors import DeadlineExceeded, RequestCancelled, RequestEnded, ServingStopped
from workers.serving.compaction.config import CompactionConfig
from workers.serving.config import SamplingParams, SchedulerConfig
from workers.serving.health import ServingHealth
from workers.transfer.page_wire import ENCRYPT_PAGES_DEFAULT
from workers.transfer.peers import PeerInfo
from workers.transfer.spot_check import SPOT_CHECK_RATE

# How peers reach a worker's pages: what `info` answers and `set_peers` takes.
WorkerInfo = PeerInfo

FINISH_REASONS = ("stop", "length", "out_of_pages")

# How long a request may take, from the call to its last token, unless its caller says
# (`requests.timeout_s`): a generous bound, there so that no request can wait forever.
DEFAULT_TIMEOUT_S = 600.0

# Calls a worker actor runs at once: its requests in flight (queued in its scheduler) and
# the front door's stats, pings and peer updates beside them.
WORKER_CONCURRENCY = 256


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DeadlineExceeded",
    "RequestCancelled",
    "RequestEnded",
    "FINISH_REASONS",
    "WORKER_CONCURRENCY",
    "GenerateOutput",
    "GenerateRequest",
    "RequestStats",
    "ServingHealth",
    "ServingStopped",
    "StreamItem",
    "WorkerInfo",
    "WorkerSettings",
    "WorkerStats",
    "check_timeout",
    "worker_actor_name",
]


def worker_actor_name(worker_id: str) -> str:
    """The Ray name of a worker's actor (in RAY_NAMESPACE), by which front doors find it."""
    return f"kvmesh-worker-{worker_id}"


@dataclass(frozen=True)
class WorkerSettings:
    """What one worker needs to start (built by `cluster` from the config).

    `node_id` and `host` are filled in by the actor where it lands: its Ray node, and the
    page server's address there (`host` may name a policy such as "node" until then).
    """

    worker_id: str
    node_id: str
    host: str  # this node's address, for the page server
    model: str  # a name of workers.serving.models.KNOWN_MODELS ("tiny": random weights)
    num_pages: int
    cache: PrefixCacheConfig
    threads: int = 1
    publish_interval_s: float = 0.5
    # The service's endpoint; None: resolve it through the Ray actor at every reconnect.
    service_address: str | None = None
    service_key: bytes | None = None  # its CurveZMQ public key, with service_address
    # This worker's key pair in the mesh (None: authentication off). It speaks to the
    # service as this worker, and its page server serves `page_peers` only.
    keypair: KeyPair | None = None
    page_peers: frozenset[bytes] = frozenset()
    mesh_secret: bytes = b""
    encrypt_pages: bool = ENCRYPT_PAGES_DEFAULT
    dtype: str = "float32"  # the model's weights and KV pages (workers.serving.models.DTYPES)
    # Copy or recompute a request's pages cached on peers (`workers.transfer.costs`):
    # "measured" weighs both by this machine's measurements; "always" / "never" force one.
    copy_policy: str = "measured"
    # Of copies from holders checked before, the share whose sample page is recomputed and
    # compared (`workers.transfer.spot_check`); a holder's first copy is always checked.
    spot_check_rate: float = SPOT_CHECK_RATE
    # False: it never looks a prompt up at the service nor copies from a peer (its own
    # tiers only: a worker without the mesh, for comparisons).
    share: bool = True
    # How the worker batches the requests it serves at once.
    scheduler: SchedulerConfig = SchedulerConfig()
    # Compaction of running sequences under memory pressure (off by default).
    compaction: CompactionConfig = CompactionConfig()
    # Its disk tier below host memory (None: none).
    disk: DiskSettings | None = None
    # Its device tier above host memory, where its model runs too (None: none; the host
    # store is then its page store and the model runs on the CPU).
    device: DeviceSettings | None = None


@dataclass(frozen=True)
class GenerateRequest:
    """One generation, as the front door sends it (token ids, already checked there; the
    worker checks them again against its model, since it is an API of its own).

    Attributes:
        tokens: the prompt's token ids.
        max_new_tokens: tokens to generate at most (an int >= 1).
        salt: the tenant's salt, set by the front door (never by the end user).
        adapter: the adapter version the KV was computed with.
        reuse: False computes the whole prompt, reusing and publishing nothing (what
            serving would cost without kvmesh, for comparisons).
        sampling: temperature, top_p, top_k, seed (greedy by default).
        stop_token_ids: more tokens that end generation (returned with it).
        ignore_eos: do not stop at the model's end-of-sequence tokens.
        return_logits: also return the last prompt position's logits.
        timeout_s: its deadline, in seconds from its arrival at the worker (the front door
            sends what is left of the caller's); past it, it ends with DeadlineExceeded.
        request_id: the caller's name for it, by which `cancel` ends it ("": none).
        route_estimate_s: the router's estimate of its time to first token (0: none);
            the worker reports how far its first token came from it.
    """

    tokens: tuple[int, ...]
    max_new_tokens: int = 16
    salt: str = ""
    adapter: str = ""
    reuse: bool = True
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_logits: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    request_id: str = ""
    route_estimate_s: float = 0.0

    def __post_init__(self) -> None:
        check_timeout(self.timeout_s)
        estimate = self.route_estimate_s
        if isinstance(estimate, bool) or not isinstance(estimate, int | float):
            raise ValueError(f"route_estimate_s must be a number, got {estimate!r}")
        if not 0 <= estimate < float("inf"):
            raise ValueError(f"route_estimate_s must be finite and >= 0, got {estimate!r}")
        for name in ("reuse", "ignore_eos", "return_logits"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("salt", "adapter", "request_id"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a str, got {getattr(self, name)!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be SamplingParams, got {self.sampling!r}")
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


def check_timeout(timeout_s: Any) -> float:
    """A request's timeout as given (a positive, finite number of seconds).

    Raises:
        ValueError: anything else.
    """
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not 0 < timeout_s < float("inf")
    ):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    return float(timeout_s)


@dataclass(frozen=True)
class RequestStats:
    """Where a request's prompt came from and what it cost, on its worker."""

    local_hit_tokens: int  # reused from this worker's own cache
    remote_hit_tokens: int  # copied from peers
    computed_tokens: int
    prompt_tokens: int
    batch_shared_tokens: int  # computed once by another request of the same batch
    recomputed_tokens: int  # recomputed after a preemption (never counted as hits)
    preemptions: int
    compacted_pages_freed: int
    ttft_s: float  # from its arrival at this worker: time queued included
    queue_s: float  # waiting to be admitted
    prefill_forward_s: float  # forward passes its prefill took part in
    copy_s: float  # its copy-in
    total_s: float
    worker: str
    disk_hit_tokens: int = 0  # of the local hits, loaded back from this worker's disk tier

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GenerateOutput:
    """A request's result as its worker returns it."""

    token_ids: tuple[int, ...]
    text: str  # the decoded tokens, special tokens (the end of sequence) left out
    # "stop": an end-of-sequence or stop token ended it (the last token); "length":
    # max_new_tokens reached; "out_of_pages": the worker's store could not grow it.
    finish_reason: str
    stats: RequestStats
    logits: tuple[float, ...] | None = None  # the last prompt position's, when asked for

    def __post_init__(self) -> None:
        assert self.finish_reason in FINISH_REASONS, self.finish_reason


@dataclass(frozen=True)
class StreamItem:
    """One item of a worker's stream: a sampled token, or (last) the whole output."""

    token_id: int | None = None
    output: GenerateOutput | None = None

    def __post_init__(self) -> None:
        assert (self.token_id is None) != (self.output is None), self

    @property
    def last(self) -> bool:
        return self.output is not None


@dataclass(frozen=True)
class WorkerStats:
    """A worker's figures (`kvmesh status --json` shows them as `as_dict` gives them).

    The sections are plain mappings of counters: they go to JSON and to the terminal
    as they are, and their keys are documented where they are counted (`cache`:
    `workers.cache`'s CacheStats; `scheduler`: the Scheduler; `copy`: the copy-in's
    decisions and link rates; `page_server`: its health).
    """

    worker: str
    node: str
    address: str  # its page server, where peers on other nodes fetch pages
    requests: int
    prompt_tokens: Mapping[str, int]  # by source: local_hit, remote_hit, computed
    copy_bytes: Mapping[str, int]  # by kind: same_node, remote
    cache: Mapping[str, Any]
    publisher: Mapping[str, int]
    pages_served: int
    copies_refused: int
    scheduler: Mapping[str, Any]
    page_server: Mapping[str, Any]
    attached: tuple[str, ...]  # peers' stores mapped here, by name
    copy: Mapping[str, Any] = field(default_factory=dict)
    serving: Mapping[str, Any] = field(default_factory=dict)  # ServingHealth's fields
    # Spot checks of copies (checks, failures, ...), the holders in quarantine as this
    # worker follows the list, and its copies of their pages dropped.
    trust: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}


def _plain(value: Any) -> Any:
    """Mappings and tuples as the dicts and lists JSON takes."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value
