"""The worker: one per GPU or CPU slot, serving generations over its own and its peers' KV.

A request's path through a worker (see also docs/structure.md). It is queued in the
worker's scheduler (`workers.serving.scheduler`), and the serving thread (`workers.serving.loop`)
runs it in batched forward passes with the other requests in flight; on admission:

1. tokens -> `PrefixCache.acquire` (`acquire_batch` for requests sent together): the
   longest prefix this worker holds, pinned; pages for the rest.
2. If more of the prompt is cached elsewhere, ask the service (`match`), plan which
   holder gives which pages (`workers.transfer.copy_in`), and copy them in when that beats
   recomputing them (`workers.transfer.costs`): straight out of the holder's shared memory on the
   same node, from its page server across nodes; the holders are copied from at once.
   Each copied page is validated; the first page that fails ends the copied prefix, and
   everything after it is recomputed.
3. The model computes the rest (in the batch's passes) and decodes; `publish` makes the
   new full pages shareable (prompt pages as soon as they are computed), `release`
   unpins, and the publisher's thread tells the service a moment later (never on the
   request path: a failure to publish never fails a request).

The class is plain Python (tested without Ray); `cluster` runs it as a Ray actor.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from cache_service.auth import KeyPair
from cache_service.events import Namespace
from workers.cache.prefix_cache import PrefixCache, PrefixCacheConfig
from workers.service.client import ServiceClient, ServiceEndpoint, ServiceError, ServiceUnavailable
from workers.service.figures import WorkerFigures
from workers.service.publisher import EventPublisher
from workers.serving import models
from workers.serving.batch_runner import BatchRunner
from workers.serving.compaction import CompactionConfig, Compactor
from workers.serving.loop import ServingLoop
from workers.serving.model_runner import (
    ModelRunner,
    default_cache_dir,
    eos_token_ids,
    store_layout_for,
)
from workers.serving.requests import check_max_new_tokens, check_tokens, prompt_tokens
from workers.serving.sampling import Sampler, SamplingParams
from workers.serving.scheduler import CacheFull, Scheduler, SchedulerConfig, Step
from workers.serving.sequence import Phase
from workers.serving.sequence import Sequence as Seq
from workers.store.digests import page_digests
from workers.store.page_store import SharedPageStore, reclaim_dead_segments, worker_tag
from workers.transfer import ENCRYPT_PAGES_DEFAULT, PageServer, TransferAuth
from workers.transfer.copy_in import CopyExecutor, CopyPlan, PeerInfo, Sources, plan_copy
from workers.transfer.costs import (
    PROFILE_FILE,
    CopyCosts,
    Decision,
    PrefillProfile,
    Share,
    machine_key,
    measure_links,
    policy,
    timed_prefill,
)

log = logging.getLogger(__name__)


# After the service failed to answer, its clients skip it for this long (doubling while it
# stays down, up to 8 times as long); the publisher's heartbeats probe for its return.
SERVICE_BACKOFF_S = 1.0


__all__ = ["CacheFull", "Worker", "WorkerSettings"]


@dataclass(frozen=True)
class WorkerSettings:
    """What one worker needs to start (built by `cluster` from the config)."""

    worker_id: str
    node_id: str
    host: str  # this node's address, for the page server
    model: str  # a name of workers.serving.models.KNOWN_MODELS ("tiny": random weights, for tests)
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
    # Copy or recompute a request's pages cached on peers (`workers.transfer.costs.POLICIES`):
    # "measured" weighs both by this machine's measurements; "always" / "never" force one.
    copy_policy: str = "measured"
    # How the worker batches the requests it serves at once.
    scheduler: SchedulerConfig = SchedulerConfig()
    # Compaction of running sequences under memory pressure (off by default).
    compaction: CompactionConfig = CompactionConfig()


class _Request(NamedTuple):
    """A generation request, checked: what `_serve` runs."""

    tokens: list[int]
    max_new_tokens: int
    namespace: Namespace
    reuse: bool
    sampling: SamplingParams
    stops: frozenset[int]  # stop tokens: the model's EOS (unless ignored) and the caller's


class Worker:
    """Holds a page store, the local prefix cache, a page server, the service client and
    publisher, and the model with its scheduler. Thread-safe: concurrent `generate` calls
    queue in the scheduler and are batched by one serving thread."""

    def __init__(self, settings: WorkerSettings, model: Any = None, tokenizer: Any = None):
        self.settings = settings
        self.worker_id = settings.worker_id
        torch.set_num_threads(settings.threads)
        if model is None:
            model, tokenizer = models.load(settings.model, settings.dtype)
        self.model_name = settings.model
        self.tokenizer = tokenizer
        page_tokens = settings.cache.page_tokens
        layout = store_layout_for(model, settings.num_pages, page_tokens)
        # A restarted worker's predecessor (or any dead worker on this node) could not
        # unlink its store: that memory comes back before ours is taken.
        reclaim_dead_segments()
        self.store = SharedPageStore.create(layout, tag=worker_tag(settings.worker_id))
        self.cache = PrefixCache(self.store, settings.cache)
        self.runner = ModelRunner(model, self.store)
        self.context_tokens = models.model_shape(settings.model).context_tokens
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self.transfer_auth = (
            None
            if settings.keypair is None
            else TransferAuth(
                settings.keypair, settings.page_peers, settings.mesh_secret, settings.encrypt_pages
            )
        )
        self.page_server = PageServer(self.store, host=settings.host, auth=self.transfer_auth)
        endpoint = (
            ServiceEndpoint(settings.service_address, settings.service_key)
            if settings.service_address
            else _ray_resolver()
        )
        keys = settings.keypair
        # On the request path: one short try, then skip the service for a while (a
        # request on a worker whose service is down runs on its local cache at once).
        self.client = ServiceClient(
            endpoint,
            timeout_s=1.0,
            retries=0,
            client_keys=keys,
            backoff_s=SERVICE_BACKOFF_S,
            probe=False,  # the publisher's heartbeats see the service come back
        )
        self.active = 0
        # Prompt tokens by source and tenant, copies, TTFT: sent with every heartbeat.
        self.figures = WorkerFigures()
        self.publisher = EventPublisher(
            ServiceClient(
                endpoint, timeout_s=2.0, retries=1, client_keys=keys, backoff_s=SERVICE_BACKOFF_S
            ),
            self.cache,
            settings.worker_id,
            settings.node_id,
            address=self.page_server.address,
            shm_name=self.store.name,
            page_key=None if keys is None else keys.public,
            load=self.load,
            report=lambda: self.figures.report(self.cache.stats(), self._load_figures()),
            on_new_service=self.client.reconnect,
        )
        self.publisher.sync()
        self.publisher.start(settings.publish_interval_s, tick=self._housekeeping)
        self.peers: dict[str, PeerInfo] = {}
        self._lock = threading.Lock()
        self._private = itertools.count(1)
        self.requests = 0
        self.copies_refused = 0  # copied pages that failed validation (changed, or not ours)
        # Copy-in: a source per peer, a pool that fetches from several holders at once, and
        # what decides copy or recompute (measured here, refined by every copy and prefill).
        self.copy_policy = policy(settings.copy_policy)  # an unknown name raises here
        self.sources = Sources(settings.node_id, self.transfer_auth)
        self.copier = CopyExecutor()
        encrypted = self.transfer_auth is not None and self.transfer_auth.encrypt
        self.links = measure_links(self.store.layout.page_bytes, encrypted)
        self.profile = self._prefill_profile()
        self.copy_decisions: Counter[str] = Counter()  # by Decision.reason
        self.last_decision: Decision | None = None
        # Requests queue in the scheduler; one serving thread runs the model on batches.
        self.batch_runner = BatchRunner(model, self.store)
        self.compactor = Compactor(self.store, settings.compaction)
        self.scheduler = Scheduler(
            self.cache,
            settings.scheduler,
            copy_in=self._copy_in_sequence,
            on_admit=self._admitted,
            on_finish=self._finished,
            compactor=self.compactor,
        )
        self._seq_ids = itertools.count()
        self.serving = ServingLoop(
            self.batch_runner,
            self.scheduler,
            name=f"kvmesh-serving-{settings.worker_id}",
            on_pass=self._pass_done,
        )

    # ------------------------------------------------------------------ public

    def info(self) -> dict[str, Any]:
        """How peers reach this worker's pages."""
        key = None if self.settings.keypair is None else self.settings.keypair.public
        return PeerInfo(
            self.worker_id, self.settings.node_id, self.store.name, self.page_server.address, key
        )._asdict()

    def set_peers(self, peers: Sequence[dict[str, Any]]) -> None:
        """The other workers of the cluster (as returned by their `info`). A peer left out
        (dead, or gone) is forgotten: its store is detached, its page client closed."""
        new = {p["worker_id"]: PeerInfo(**p) for p in peers if p["worker_id"] != self.worker_id}
        for worker_id, peer in self.peers.items():
            if new.get(worker_id) != peer:
                self._forget(peer)
        self.peers = new

    def _forget(self, peer: PeerInfo) -> None:
        self.sources.forget(peer.worker_id)
        self.links.forget(peer.worker_id)

    def _detach_dead_owners(self) -> None:
        """Close attached stores whose owners died (the mapping would keep their memory)."""
        self.sources.detach_dead()

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 16,
        salt: str = "",
        adapter: str = "",
        return_logits: bool = False,
        reuse: bool = True,
        sampling: dict[str, Any] | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
    ) -> dict[str, Any]:
        """Generate from `prompt`, reusing every cached prefix it can.

        Args:
            prompt: text (tokenized with the model's tokenizer) or token ids.
            max_new_tokens: tokens to generate at most (an int >= 1).
            salt: the tenant's salt, set by the front door (never by the end user).
            adapter: the adapter version the KV was computed with.
            return_logits: also return the last prompt position's logits (as "logits",
                a list of floats), for correctness checks.
            reuse: False computes the whole prompt, reusing and publishing nothing (what
                serving would cost without kvmesh, for comparisons).
            sampling: `SamplingParams.to_dict()` (temperature, top_p, top_k, seed); None
                or temperature 0: greedy.
            stop_token_ids: more tokens that end generation (returned with it).
            ignore_eos: do not stop at the model's end-of-sequence tokens.
        Returns:
            {"token_ids", "text", "finish_reason" ("stop" | "length" | "out_of_pages"),
            "stats": {local_hit_tokens, remote_hit_tokens, computed_tokens,
            prompt_tokens, ttft_s, total_s, worker}}.
        Raises:
            ValueError: an empty prompt, token ids outside the vocabulary, bad
                max_new_tokens or sampling, or more tokens than the model's context.
            CacheFull: the request does not fit in this worker's pages.
        """
        request = self._request(
            prompt, max_new_tokens, salt, adapter, reuse, sampling, stop_token_ids, ignore_eos
        )
        return self._serve(request, return_logits, on_token=None)

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 16,
        salt: str = "",
        adapter: str = "",
        reuse: bool = True,
        sampling: dict[str, Any] | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
    ) -> Iterator[dict[str, Any]]:
        """`generate`, yielding `{"token_id": t}` as each token is sampled, then the whole
        result (as `generate` returns it) as `{"result": ...}`. A Ray actor method that
        yields streams each item to the caller as it comes.

        Raises:
            As `generate`, before the first item.
        """
        request = self._request(
            prompt, max_new_tokens, salt, adapter, reuse, sampling, stop_token_ids, ignore_eos
        )
        sampled: queue.SimpleQueue = queue.SimpleQueue()
        outcome: dict[str, Any] = {}

        def serve() -> None:
            try:
                outcome["result"] = self._serve(request, False, on_token=sampled.put)
            except BaseException as exc:  # re-raised in the caller's thread
                outcome["error"] = exc
            finally:
                sampled.put(None)

        thread = threading.Thread(target=serve, name=f"kvmesh-stream-{self.worker_id}")
        thread.start()
        while (token := sampled.get()) is not None:
            yield {"token_id": token}
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        yield {"result": outcome["result"]}

    def _request(
        self, prompt, max_new_tokens, salt, adapter, reuse, sampling, stop_token_ids, ignore_eos
    ) -> _Request:
        """Check a request's arguments before anything is held."""
        tokens = self._tokenize(prompt)
        if not tokens:
            raise ValueError("empty prompt")
        check_tokens(tokens, self.runner.vocab_size)
        check_max_new_tokens(max_new_tokens, len(tokens), self.context_tokens)
        params = SamplingParams.from_dict(sampling or {})
        stops = set(check_tokens(list(stop_token_ids), self.runner.vocab_size, "stop token"))
        if not ignore_eos:
            stops |= self.eos_token_ids
        namespace = Namespace(self.model_name, adapter, salt)
        if not reuse:
            # A namespace of its own matches nothing, and its pages, never published,
            # leave with the request.
            namespace = namespace._replace(adapter=f"{adapter}(no reuse {next(self._private)})")
        return _Request(tokens, max_new_tokens, namespace, reuse, params, frozenset(stops))

    def generate_batch(self, requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Generate for requests that arrive together: they are queued at once, so a
        prefix they share and nobody has cached is computed once (the scheduler's batch
        plan), and they run in the same forward passes.

        Args:
            requests: each a dict of `generate`'s arguments (`prompt` and the rest).
        Returns:
            One result per request, in order, as `generate` returns it.
        Raises:
            ValueError: a bad request (nothing of the batch is queued then).
            CacheFull: a request that cannot fit even alone.
        """
        checked = []
        for request in requests:
            args = dict(request)
            return_logits = bool(args.pop("return_logits", False))
            checked.append((self._request(**self._request_args(args)), return_logits))
        sequences = [self._sequence(request, logits, None) for request, logits in checked]
        return self._run(sequences)

    def _request_args(self, args: dict[str, Any]) -> dict[str, Any]:
        known = (
            "prompt",
            "max_new_tokens",
            "salt",
            "adapter",
            "reuse",
            "sampling",
            "stop_token_ids",
            "ignore_eos",
        )
        unknown = set(args) - set(known)
        if unknown:
            raise ValueError(f"unknown request arguments {sorted(unknown)}; known: {known}")
        defaults = {
            "max_new_tokens": 16,
            "salt": "",
            "adapter": "",
            "reuse": True,
            "sampling": None,
            "stop_token_ids": (),
            "ignore_eos": False,
        }
        return {**defaults, **args}

    def _serve(self, request: _Request, return_logits: bool, on_token) -> dict[str, Any]:
        return self._run([self._sequence(request, return_logits, on_token)])[0]

    def _sequence(self, request: _Request, return_logits: bool, on_token) -> Seq:
        return Seq(
            next(self._seq_ids),
            request.tokens,
            request.namespace,
            request.max_new_tokens,
            Sampler(request.sampling),
            request.stops,
            request.reuse,
            on_token,
            return_logits,
        )

    def _run(self, sequences: list[Seq]) -> list[dict[str, Any]]:
        """Queue sequences together and wait for all of them."""
        with self._lock:
            self.active += len(sequences)
        try:
            self.serving.submit(sequences)
            for seq in sequences:
                seq.done.wait()
        finally:
            with self._lock:
                self.active -= len(sequences)
                self.requests += len(sequences)
        self.publisher.nudge()  # the new pages go to the service off the request path
        for seq in sequences:
            if seq.error is not None:
                raise seq.error
        return [self._result(seq) for seq in sequences]

    def _result(self, seq: Seq) -> dict[str, Any]:
        local, remote = seq.hits
        text = (
            self.tokenizer.decode(seq.output, skip_special_tokens=True)
            if self.tokenizer is not None
            else ""
        )
        extra = {"logits": seq.logits.tolist()} if seq.logits is not None else {}
        now = time.perf_counter()
        return {
            **extra,
            "token_ids": list(seq.output),
            "text": text,
            "finish_reason": seq.finish_reason,
            "stats": {
                "local_hit_tokens": local,
                "remote_hit_tokens": remote,
                "computed_tokens": len(seq.prompt) - local - remote,
                "prompt_tokens": len(seq.prompt),
                "batch_shared_tokens": seq.batch_shared,
                "recomputed_tokens": seq.recomputed,
                "preemptions": seq.preemptions,
                "compacted_pages_freed": seq.compacted_pages_freed,
                # From arrival at this worker: time queued included.
                "ttft_s": seq.first_token_at - seq.arrived,
                "queue_s": seq.admitted_at - seq.arrived,
                "prefill_forward_s": seq.prefill_s,
                "copy_s": seq.copy_s,
                "total_s": now - seq.arrived,
                "worker": self.worker_id,
            },
        }

    # -- the scheduler's callbacks (on the serving thread) -----------------------------

    def _copy_in_sequence(self, seq: Seq) -> int:
        return self._copy_in(seq.allocation, seq.tokens, seq.namespace)

    def _admitted(self, seq: Seq) -> None:
        """A request's first admission: its hits are known now (copies validated)."""
        local, remote = seq.hits
        self.figures.admitted(seq.namespace.salt, local, remote, len(seq.prompt) - local - remote)
        if remote:
            self.figures.copy_took(seq.copy_s)

    def _finished(self, seq: Seq) -> None:
        if seq.first_token_at is not None and seq.error is None:
            local, remote = seq.hits
            self.figures.first_token(seq.first_token_at - seq.arrived, reused=local + remote > 0)

    def _pass_done(self, step: Step, seconds: float) -> None:
        """A forward pass ran: charge its time to the prefills in it; a lone prefill
        refines the prefill curve the copy decisions use."""
        prefills = [
            (seq, chunk)
            for seq, chunk in zip(step.sequences, step.chunks, strict=True)
            if seq.phase is Phase.PREFILL
        ]
        for seq, _ in prefills:
            seq.prefill_s += seconds
        if len(step.chunks) == 1 and prefills:
            ((_, chunk),) = prefills
            self.profile.observe(len(chunk.tokens), chunk.start, seconds)

    def _load_figures(self) -> dict[str, int]:
        """The load and measured costs the heartbeat carries (for routing): nanoseconds
        to compute a prompt token (this machine's prefill curve, 512 tokens after 512)
        and to copy one token's KV (the links' probes)."""
        if getattr(self, "serving", None) is None:
            return {}  # a heartbeat while the worker is still starting: nothing measured
        token_bytes = self.store.layout.page_bytes / self.cache.page_tokens
        prefill_s = self.profile.seconds(512, 512) / 512
        figures = {
            **self.scheduler.load(),
            "prefill_ns": 1e9 * prefill_s,
            "copy_ns_same_node": 1e9 * token_bytes / self.links.probe[False].bytes_per_s,
            "copy_ns_remote": 1e9 * token_bytes / self.links.probe[True].bytes_per_s,
        }
        return {name: max(1, round(value)) if value else 0 for name, value in figures.items()}

    def clear_cache(self) -> int:
        """Drop every cached page no request holds (a cache reset); the service hears of
        it at once (AllCleared when nothing shareable is left). Returns the pages dropped."""
        dropped = self.cache.clear()
        self.publisher.nudge()
        return dropped

    def flush(self) -> bool:
        """Publish this worker's pending events and its load now; True when the service is
        up to date with its cache (False: the service did not answer or refused; a resync
        follows)."""
        return self.publisher.heartbeat()

    def load(self) -> float:
        """Requests running now (what routing weighs against cached tokens)."""
        return float(self.active)

    def stats(self) -> dict[str, Any]:
        return {
            "worker": self.worker_id,
            "node": self.settings.node_id,
            "address": self.page_server.address,  # where peers on other nodes fetch pages
            "requests": self.requests,
            "prompt_tokens": self.figures.prompt_tokens(),
            "copy_bytes": self.figures.copy_bytes_now(),
            "cache": self.cache.stats(),
            "publisher": {"resyncs": self.publisher.resyncs, "batches": self.publisher.batches},
            "pages_served": self.page_server.pages_sent,
            "copies_refused": self.copies_refused,
            "scheduler": {
                **self.scheduler.load(),
                "steps": self.scheduler.steps,
                "preemptions": self.scheduler.preemptions,
                "compaction_policy": self.settings.compaction.policy,
                "compactions": self.scheduler.compactions,
                "compacted_pages_freed": self.scheduler.compacted_pages_freed,
                "forward_calls": self.batch_runner.calls,
                "forward_tokens": self.batch_runner.tokens_run,
            },
            "page_server": self.page_server.health(),
            "attached": self.sources.attached(),  # peers' stores mapped here, by name
            "copy": {
                "policy": self.settings.copy_policy,
                "decisions": dict(self.copy_decisions),  # by reason
                "last": None if self.last_decision is None else self.last_decision._asdict(),
                "link_rates": self.links.snapshot(),
                "prefill_profile": [list(p) for p in self.profile.points],
            },
        }

    def _housekeeping(self) -> None:
        """Each publisher round: keep the page server up, let requests ask the service
        again once the heartbeat reached it, and unlink the segments of dead workers on
        this node (theirs to unlink, but a killed process cannot)."""
        self.page_server.ensure_running()
        if self.publisher.up and self.client.circuit_open:
            self.client.reconnect()  # the heartbeat got through: requests may ask again
        for name in reclaim_dead_segments():
            log.info("worker %s reclaimed the segment %s of a dead worker", self.worker_id, name)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        self.cache.check_integrity()
        self.figures.check_integrity()
        self.store.check_integrity()
        self.page_server.check_integrity()
        self.links.check_integrity()
        self.profile.check_integrity()

    def shutdown(self) -> None:
        """Stop serving (requests still queued fail), leave the service, stop serving
        pages, unlink the page store (idempotent)."""
        self.serving.stop()
        self.publisher.stop(bye=True)
        self.page_server.stop()
        self.copier.close()
        self.sources.close()
        self.client.close()
        self.store.close()

    # ------------------------------------------------------------------ internals

    def _copy_in(self, allocation, tokens: list[int], namespace: Namespace) -> int:
        """Copy what peers hold beyond our own prefix when that beats computing it;
        returns where computing starts."""
        local = allocation.cached_tokens
        p = self.cache.page_tokens
        self._detach_dead_owners()
        if local >= len(tokens) - 1:
            return local
        try:
            matched, spans = self.client.match(namespace, tokens, requester=self.worker_id)
            for span in spans:
                if span.worker_id not in self.peers and span.worker_id != self.worker_id:
                    self._look_up_peer(span.worker_id)
        except ServiceUnavailable:
            return local  # no service: a miss, not an error
        first, end = local // p, min(matched, len(tokens) - 1) // p
        page_bytes = self.store.layout.page_bytes
        links = {
            s.worker_id: self.links.link(s.worker_id, self._across_nodes(s.worker_id))
            for s in spans
            if s.worker_id in self.peers
        }
        tasks = plan_copy(spans, first, end, links, page_bytes)
        if not tasks:
            return local
        costs = CopyCosts(
            tuple(Share(t.holder, len(t.page_ids)) for t in tasks),
            links,
            page_bytes,
            p,
            len(tokens),
            local,
        )
        decision = self.copy_policy(costs, self.profile)
        with self._lock:
            self.copy_decisions[decision.reason] += 1
            self.last_decision = decision
        if not decision.copy:
            return local
        tasks = tasks[: decision.tasks]
        plan = CopyPlan(tasks, first, tasks[-1].end, decision.copy_s, decision.recompute_s)
        # What each page must hold: a copy is used only if its holder recorded the same
        # digest (namespace, KV format, token chain) when it published the page.
        expected = page_digests(namespace, self.store.kv_format, tokens[: plan.end * p], p)
        sources = {t.holder: self.sources.get(self.peers[t.holder]) for t in tasks}
        outcome = self.copier.run(plan, sources, self.store, allocation.pages, expected)
        for result in outcome.results:
            remote = sources[result.task.holder].remote
            nbytes = len(result.valid) * page_bytes
            self.figures.copied(nbytes, remote)
            self.copies_refused += result.valid.count(False)
            if all(result.valid):  # a refused page may never have moved: no rate from it
                self.links.observe(result.task.holder, remote, nbytes, result.seconds)
        return max(local, min(outcome.end * p, len(tokens) - 1))

    def _look_up_peer(self, worker_id: str) -> None:
        """Learn a holder the front door never named (it joined or restarted since) from
        the service's registry: what its REGISTER carried."""
        try:
            entry = self.client.peer(worker_id)
        except ServiceError as exc:
            log.warning("the service refused the entry of peer %s: %s", worker_id, exc)
            return
        if entry is None:
            return  # gone since the match: its span is skipped
        self.peers[worker_id] = PeerInfo(
            worker_id, entry.node_id, entry.shm_name, entry.address, entry.page_key
        )
        log.info("worker %s found peer %s in the service's registry", self.worker_id, worker_id)

    def _across_nodes(self, worker_id: str) -> bool:
        return self.peers[worker_id].node_id != self.settings.node_id

    def _prefill_profile(self) -> PrefillProfile:
        """This model's prefill curve on this machine: measured once (at most 1024 tokens,
        or what the model takes) and kept under the model's cache directory; the tiny test
        model's (random weights) only in this process."""
        key = machine_key(self.model_name, torch.get_num_threads())
        path = None
        if self.model_name != "tiny":
            path = default_cache_dir().parent / self.model_name / PROFILE_FILE
        limit = getattr(self.runner.model.config, "max_position_embeddings", None)
        prefill = timed_prefill(self.runner.full_prefill_logits, self.runner.vocab_size)
        return PrefillProfile.cached(path, key, prefill, max_tokens=limit)

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this worker's model has no tokenizer: pass token ids")
            return list(self.tokenizer.encode(prompt))
        return prompt_tokens(prompt)


def _ray_resolver():
    from workers.service.client import ray_resolver

    return ray_resolver()
