"""The worker: one per GPU or CPU slot, serving generations over its own and its peers' KV.

A worker is a mesh member (`workers.member`: its pages, cache, page server, links to the
service and peers) plus a model and the serving loop that runs it. A request's path
through a worker (see also docs/structure.md): it is queued in the scheduler
(`workers.serving.scheduler`), and the serving thread (`workers.serving.loop`) runs it in
batched forward passes with the other requests in flight; on admission:

1. tokens -> `PrefixCache.acquire` (`acquire_batch` for requests sent together): the
   longest prefix this worker holds, pinned; pages for the rest.
2. If more of the prompt is cached elsewhere, ask the service (`match`) and copy it in
   (`MeshMember.copy_in`) when that beats recomputing it (`workers.transfer.costs`, on
   this machine's prefill curve and the holders' measured links): straight out of a
   holder's shared memory on the same node, from its page server across nodes, several
   holders at once. Each copied page is validated; the first page that fails ends the
   copied prefix, and everything after it is recomputed.
3. The model computes the rest (in the batch's passes) and decodes; `publish` makes the
   new full pages shareable (prompt pages as soon as they are computed), `release`
   unpins, and the publisher's thread tells the service a moment later (never on the
   request path: a failure to publish never fails a request).

The class is plain Python (tested without Ray); `workers.actor` runs it as a Ray actor,
and the values it takes and returns are those of `workers.api`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from cache_service.events import Namespace
from workers.api import (
    DeadlineExceeded,
    GenerateOutput,
    GenerateRequest,
    RequestCancelled,
    RequestStats,
    ServingHealth,
    StreamItem,
    WorkerInfo,
    WorkerSettings,
    WorkerStats,
)
from workers.member import Membership, MeshMember
from workers.service.client import ServiceEndpoint, ray_resolver
from workers.serving import models
from workers.serving.batch_runner import BatchRunner
from workers.serving.compaction import Compactor
from workers.serving.device import on_device
from workers.serving.loop import ServingLoop
from workers.serving.model_loader import (
    default_cache_dir,
    eos_token_ids,
    full_prefill_logits,
    store_layout_for,
)
from workers.serving.requests import check_max_new_tokens, check_tokens, prompt_tokens
from workers.serving.sampling import Sampler
from workers.serving.scheduler import CacheFull, Scheduler, Step
from workers.serving.sequence import Phase
from workers.serving.sequence import Sequence as Seq
from workers.transfer.costs import (
    PROFILE_FILE,
    CopyCosts,
    Decision,
    PrefillProfile,
    machine_key,
    policy,
    timed_prefill,
)

__all__ = ["CacheFull", "Worker", "WorkerSettings"]

log = logging.getLogger(__name__)

# How long past a request's deadline its caller waits for the serving loop to end it (it
# does at its next step) before ending it itself: a pass that hangs holds up the loop.
DEADLINE_GRACE_S = 0.25


class _Checked(NamedTuple):
    """A request checked against this worker's model: what a sequence is made of."""

    tokens: list[int]
    namespace: Namespace
    stops: frozenset[int]  # stop tokens: the model's EOS (unless ignored) and the caller's


def membership(settings: WorkerSettings) -> Membership:
    """Who a worker is in the mesh, from its settings."""
    endpoint = (
        ServiceEndpoint(settings.service_address, settings.service_key)
        if settings.service_address
        else ray_resolver()
    )
    return Membership(
        worker_id=settings.worker_id,
        node_id=settings.node_id,
        endpoint=endpoint,
        keypair=settings.keypair,
        secret=settings.mesh_secret,
        page_host=settings.host,
        encrypt_pages=settings.encrypt_pages,
        page_readers=settings.page_peers,
        publish_interval_s=settings.publish_interval_s,
        spot_check_rate=settings.spot_check_rate,
        disk=settings.disk,
        device=settings.device,
    )


class Worker:
    """A mesh member with a model, its scheduler and one serving thread. Thread-safe:
    concurrent `generate_batch` calls queue in the scheduler and are batched together.

    Raises:
        ValueError: an unknown copy policy or model (before anything is created).
    """

    def __init__(self, settings: WorkerSettings, model: Any = None, tokenizer: Any = None):
        self.settings = settings
        self.worker_id = settings.worker_id
        self.copy_policy = policy(settings.copy_policy)  # an unknown name raises here
        torch.set_num_threads(settings.threads)
        if model is None:
            model, tokenizer = models.load(settings.model, settings.dtype)
        self.model_name = settings.model
        self.tokenizer = tokenizer
        self.context_tokens = models.model_shape(settings.model).context_tokens
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self._lock = threading.Lock()
        self.active = 0  # requests queued or running now
        self.requests = 0
        self._private = itertools.count(1)
        self.copy_in_failures = 0  # copy-ins that raised: each a miss, recomputed
        self._seq_ids = itertools.count()
        self._by_id: dict[str, Seq] = {}  # requests in flight by their callers' ids
        layout = store_layout_for(model, settings.num_pages, settings.cache.page_tokens)
        cache = settings.cache
        if not settings.share:  # it copies nothing back: another's copy spares it nothing
            cache = dataclasses.replace(cache, cluster_eviction=False)
        self.member = MeshMember(
            membership(settings), layout, cache, load=self._load_figures, active=self.load
        )
        self.store, self.cache = self.member.store, self.member.cache
        try:
            pages_on = self.store.device
            if pages_on is not None and pages_on.type != "cpu":
                # A device tier: the model, its passes and the sampler run where the pages
                # are (in the dtype it was loaded in: `model.dtype`).
                model = on_device(model, pages_on)
            # A store that cannot hold the model's KV fails here, before anything starts.
            self.batch_runner = BatchRunner(model, self.store)
            self.vocab_size = model.config.vocab_size
            self.profile = self._prefill_profile()
            self.step_s = 0.0  # a decode pass's time, averaged (0: none ran yet)
            # Requests queue in the scheduler; one serving thread runs the model on batches.
            self.scheduler = Scheduler(
                self.cache,
                settings.scheduler,
                copy_in=self._copy_in,
                on_admit=self._admitted,
                on_finish=self._finished,
                compactor=Compactor(self.store, settings.compaction),
            )
            self.serving = ServingLoop(
                self.batch_runner,
                self.scheduler,
                name=f"kvmesh-serving-{settings.worker_id}",
                on_pass=self._pass_done,
            )
        except BaseException:
            self.member.close()
            raise
        self.member.start()

    # ------------------------------------------------------------------ requests

    def request(
        self, prompt: str | Sequence[int], max_new_tokens: int = 16, **options: Any
    ) -> GenerateRequest:
        """A GenerateRequest for `prompt` (text is tokenized with the model's tokenizer);
        `options` are GenerateRequest's other fields.

        Raises:
            ValueError: a prompt that is neither text nor token ids, or bad options.
        """
        return GenerateRequest(tuple(self._tokenize(prompt)), max_new_tokens, **options)

    def generate(
        self, prompt: str | Sequence[int], max_new_tokens: int = 16, **options: Any
    ) -> GenerateOutput:
        """Generate from `prompt`, reusing every cached prefix it can (`request` builds
        the request; see GenerateRequest for the options).

        Raises:
            As `generate_batch`.
        """
        return self.generate_batch([self.request(prompt, max_new_tokens, **options)])[0]

    def generate_batch(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        """Generate for requests that arrive together: they are queued at once, so a
        prefix they share and nobody has cached is computed once (the scheduler's batch
        plan), and they run in the same forward passes.

        Returns:
            One output per request, in order.
        Raises:
            ValueError: an empty prompt, token ids outside the vocabulary, bad
                max_new_tokens, or more tokens than the model's context (nothing of the
                batch is queued then).
            CacheFull: a request that cannot fit in this worker's pages even alone.
        """
        sequences = [self._sequence(request, None) for request in requests]
        return self._run(sequences)

    def stream(self, request: GenerateRequest) -> Iterator[StreamItem]:
        """`generate_batch` of one request, yielding each token as it is sampled, then the
        whole output. A Ray actor method that yields streams each item as it comes.

        Raises:
            As `generate_batch`, before the first item.
        """
        sampled: queue.SimpleQueue = queue.SimpleQueue()
        seq = self._sequence(request, sampled.put)
        outcome: dict[str, Any] = {}
        # A consumer that leaves (the generator closed or collected) cancels the request.

        def serve() -> None:
            try:
                outcome["output"] = self._run([seq])[0]
            except BaseException as exc:  # re-raised in the caller's thread
                outcome["error"] = exc
            finally:
                sampled.put(None)

        thread = threading.Thread(target=serve, name=f"kvmesh-stream-{self.worker_id}")
        thread.start()
        read_all = False
        try:
            while (token := sampled.get()) is not None:
                yield StreamItem(token_id=token)
            read_all = True
        finally:
            if not read_all:  # the consumer left before the end
                seq.end(RequestCancelled("the stream's consumer left"))
                self.serving.scheduler.wake()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        yield StreamItem(output=outcome["output"])

    def cancel(self, request_ids: Iterable[str]) -> int:
        """End the requests in flight with these ids (their callers left): each fails
        with RequestCancelled within a pass or two, its pages released. Ids not in
        flight (ended already, or never here) are ignored. Returns how many were found."""
        found = 0
        for request_id in request_ids:
            with self._lock:
                seq = self._by_id.get(request_id)
            if seq is not None:
                seq.end(RequestCancelled(f"request {request_id!r} was cancelled by its caller"))
                found += 1
        if found:
            self.serving.scheduler.wake()
        return found

    def _check(self, request: GenerateRequest) -> _Checked:
        """Check a request against this worker's model before anything is held."""
        vocab = self.vocab_size
        tokens = check_tokens(list(request.tokens), vocab)
        if not tokens:
            raise ValueError("empty prompt")
        check_max_new_tokens(request.max_new_tokens, len(tokens), self.context_tokens)
        stops = set(check_tokens(list(request.stop_token_ids), vocab, "stop token"))
        if not request.ignore_eos:
            stops |= self.eos_token_ids
        namespace = Namespace(self.model_name, request.adapter, request.salt)
        if not request.reuse:
            # A namespace of its own matches nothing, and its pages, never published,
            # leave with the request.
            private = f"{request.adapter}(no reuse {next(self._private)})"
            namespace = namespace._replace(adapter=private)
        return _Checked(tokens, namespace, frozenset(stops))

    def _sequence(self, request: GenerateRequest, on_token) -> Seq:
        checked = self._check(request)
        return Seq(
            next(self._seq_ids),
            checked.tokens,
            checked.namespace,
            request.max_new_tokens,
            Sampler(request.sampling),
            checked.stops,
            request.reuse,
            on_token,
            request.return_logits,
            request.timeout_s,
            request_id=request.request_id,
            route_estimate_s=request.route_estimate_s,
        )

    def _run(self, sequences: list[Seq]) -> list[GenerateOutput]:
        """Queue sequences together and wait for all of them, each until its deadline
        (the serving loop ends it there; past a grace, its caller ends it here)."""
        named = {seq.request_id: seq for seq in sequences if seq.request_id}
        with self._lock:
            self.active += len(sequences)
            self._by_id.update(named)
        try:
            self.serving.submit(sequences)
            for seq in sequences:
                self._wait(seq)
        finally:
            with self._lock:
                self.active -= len(sequences)
                self.requests += len(sequences)
                for request_id in named:
                    self._by_id.pop(request_id, None)
        self.member.publisher.nudge()  # the new pages go to the service off the request path
        for seq in sequences:
            if seq.error is not None:
                raise seq.error
        return [self._output(seq) for seq in sequences]

    def _wait(self, seq: Seq) -> None:
        """Wait for a sequence until its deadline and a grace; a serving loop that did not
        end it by then is held up (a pass that hangs): it ends here, and the loop
        releases its pages when it comes back."""
        wait_s = seq.deadline + DEADLINE_GRACE_S - time.perf_counter()
        if seq.done.wait(max(0.0, wait_s)):
            return
        now = time.perf_counter()
        error = DeadlineExceeded(seq.timeout_s, seq.current_phase, seq.spent(now))
        seq.end(error)
        if not seq.done.is_set():
            seq.error = error
            seq.done.set()

    def _output(self, seq: Seq) -> GenerateOutput:
        local, remote, disk = self._hits(seq)
        text = (
            self.tokenizer.decode(seq.output, skip_special_tokens=True)
            if self.tokenizer is not None
            else ""
        )
        stats = RequestStats(
            local_hit_tokens=local,
            remote_hit_tokens=remote,
            computed_tokens=len(seq.prompt) - local - remote,
            prompt_tokens=len(seq.prompt),
            batch_shared_tokens=seq.batch_shared,
            recomputed_tokens=seq.recomputed,
            preemptions=seq.preemptions,
            compacted_pages_freed=seq.compacted_pages_freed,
            ttft_s=seq.first_token_at - seq.arrived,
            queue_s=seq.admitted_at - seq.arrived,
            prefill_forward_s=seq.prefill_s,
            copy_s=seq.copy_s,
            total_s=time.perf_counter() - seq.arrived,
            worker=self.worker_id,
            disk_hit_tokens=disk,
        )
        logits = None if seq.logits is None else tuple(seq.logits.tolist())
        return GenerateOutput(tuple(seq.output), text, seq.finish_reason, stats, logits)

    # -- the scheduler's callbacks (on the serving thread) -----------------------------

    def _copy_in(self, seq: Seq) -> int:
        """Copy what peers hold beyond our own prefix when that beats computing it;
        returns where computing starts."""
        allocation, tokens = seq.allocation, seq.tokens
        local, p = allocation.cached_tokens, self.cache.page_tokens
        if local >= len(tokens) - 1:
            return local
        try:
            if self.settings.share:
                matched, spans = self.member.match(seq.namespace, tokens)
            else:  # without the mesh: its own tiers only
                matched, spans = local, []
            # Its own tier below may hold more than the mesh's match: every full page but
            # the last token's is worth planning; the plan stops where holders stop.
            reach = len(tokens) if self.member.below is not None else matched
            end = min(reach, len(tokens) - 1) // p
            seq.checks = []  # run in its first pass (`Scheduler._check`)
            tally: Counter[str] = Counter()
            copied = self.member.copy_in(
                allocation, tokens, seq.namespace, spans, end, self._decide, seq.checks, tally
            )
            # The member counts its own tiers' pages in prompt order: top down.
            seq.own_tokens = {name: pages * p for name, pages in tally.items()}
        except Exception:
            # Whatever went wrong, the request computes what it could not copy: a copy
            # never fails a request, nor the serving loop that runs it. Pages half copied
            # past `local` are computed over.
            log.exception("%s: a copy-in failed; the request recomputes", self.worker_id)
            with self._lock:
                self.copy_in_failures += 1
            return local
        return max(local, min(copied * p, len(tokens) - 1))

    def _decide(self, costs: CopyCosts) -> Decision:
        return self.copy_policy(costs, self.profile)

    def _admitted(self, seq: Seq) -> None:
        """A request's first admission: its hits are known now (copies validated)."""
        local, remote, _ = self._hits(seq)
        figures = self.member.figures
        figures.admitted(seq.namespace.salt, local, remote, len(seq.prompt) - local - remote)
        hits = seq.own_hits()
        for tier in self.member.tiers.chain():
            if hits.get(tier.name):
                tier.hit(hits[tier.name])
        if remote:
            figures.copy_took(seq.copy_s)

    @staticmethod
    def _hits(seq: Seq) -> tuple[int, int, int]:
        """(local, copied from peers, of the local: loaded from its disk) prompt tokens.
        Pages loaded back from its own tier below (disk, or host memory under a device)
        are its own hits, not copies."""
        local, copied = seq.hits
        own = seq.own_hits()
        loaded = sum(own.values())
        return local + loaded, copied - loaded, own.get("disk", 0)

    def _finished(self, seq: Seq) -> None:
        if seq.first_token_at is not None and seq.error is None:
            local, remote = seq.hits
            reused = local + remote > 0
            ttft = seq.first_token_at - seq.arrived
            self.member.figures.first_token(ttft, reused=reused)
            if seq.route_estimate_s:
                self.member.figures.routed(ttft, seq.route_estimate_s)

    def _pass_done(self, step: Step, seconds: float) -> None:
        """A forward pass ran: charge its time to the prefills in it; a lone prefill
        refines the prefill curve the copy decisions use, a pass of decodes alone the
        decode pass time routing weighs (a moving average: it follows the batch's size)."""
        prefills = [(seq, chunk) for seq, chunk in step.pairs() if seq.phase is Phase.PREFILL]
        for seq, _ in prefills:
            seq.prefill_s += seconds
        if len(step.chunks) == 1 and prefills:
            ((_, chunk),) = prefills
            self.profile.observe(len(chunk.tokens), chunk.start, seconds)
        elif step.chunks and not prefills:
            self.step_s = seconds if not self.step_s else 0.8 * self.step_s + 0.2 * seconds

    def _load_figures(self) -> dict[str, int]:
        """The load and measured costs the heartbeat carries (for routing): nanoseconds
        to compute a prompt token (this machine's prefill curve, 512 tokens after 512),
        to copy one token's KV (its measured links to holders on its node and on others,
        the probes' before its first copy of a kind) and to run a pass of decodes, with the
        most tokens a pass and a prompt's chunk take; and its health (for the metrics)."""
        token_bytes = self.store.layout.page_bytes / self.cache.page_tokens
        prefill_s = self.profile.seconds(512, 512) / 512
        links = self.member.links
        figures = {
            **self.scheduler.load(),
            "prefill_ns": 1e9 * prefill_s,
            "copy_ns_same_node": 1e9 * token_bytes / links.measured(False).bytes_per_s,
            "copy_ns_remote": 1e9 * token_bytes / links.measured(True).bytes_per_s,
            "step_ns": 1e9 * self.step_s,
            "pass_tokens": self.settings.scheduler.max_batch_tokens,
            "chunk_tokens": self.settings.scheduler.prefill_chunk_tokens,
        }
        figures = {name: max(1, round(value)) if value else 0 for name, value in figures.items()}
        health = self.serving.health()
        return {
            **figures,
            "serving": int(health.serving),
            "loop_restarts": health.restarts,
            "deadline_exceeded": self.scheduler.ended_by["deadline"],
            "cancelled": self.scheduler.ended_by["cancelled"],
        }

    # ------------------------------------------------------------------ the mesh

    def info(self) -> WorkerInfo:
        """How peers reach this worker's pages."""
        return self.member.info()

    def set_peers(self, peers: Iterable[WorkerInfo]) -> None:
        """The mesh's workers (as their `info` gave them); one left out is forgotten."""
        self.member.set_peers(peers)

    def clear_cache(self) -> int:
        """Drop every cached page no request holds (a cache reset); the service hears of
        it at once (AllCleared when nothing shareable is left). Returns the pages dropped."""
        dropped = self.cache.clear()
        self.member.publisher.nudge()
        return dropped

    def flush(self) -> bool:
        """Publish this worker's pending events and its load now; True when the service is
        up to date with its cache (False: the service did not answer or refused; a resync
        follows)."""
        return self.member.flush()

    def health(self) -> ServingHealth:
        """Whether this worker serves requests now (the front door's watchdog asks)."""
        return self.serving.health()

    def load(self) -> float:
        """Requests running now (what routing weighs against cached tokens)."""
        return float(self.active)

    def stats(self) -> WorkerStats:
        member = self.member.stats()
        return WorkerStats(
            worker=self.worker_id,
            node=self.settings.node_id,
            address=member["address"],
            requests=self.requests,
            prompt_tokens=member["prompt_tokens"],
            copy_bytes=member["copy_bytes"],
            cache=member["cache"],
            publisher=member["publisher"],
            pages_served=member["pages_served"],
            copies_refused=member["copies_refused"],
            scheduler={
                **self.scheduler.load(),
                "steps": self.scheduler.steps,
                "preemptions": self.scheduler.preemptions,
                "ended_early": dict(self.scheduler.ended_by),
                "compaction_policy": self.settings.compaction.policy,
                "compactions": self.scheduler.compactions,
                "compacted_pages_freed": self.scheduler.compacted_pages_freed,
                "forward_calls": self.batch_runner.calls,
                "forward_tokens": self.batch_runner.tokens_run,
            },
            page_server=member["page_server"],
            attached=tuple(member["attached"]),
            copy={
                "policy": self.settings.copy_policy,
                "decisions": member["copy_decisions"],
                "last": member["last_decision"],
                "link_rates": member["link_rates"],
                "prefill_profile": [list(p) for p in self.profile.points],
                "failures": self.copy_in_failures,
            },
            serving=dataclasses.asdict(self.health()),
            trust={
                **member["spot_checks"],
                "quarantined": member["quarantined"],
                "dropped_pages": member["dropped_pages"],
            },
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        self.member.check_integrity()
        self.profile.check_integrity()

    def shutdown(self) -> None:
        """Stop serving (requests still queued fail), leave the service, stop serving
        pages, unlink the page store (idempotent)."""
        self.serving.stop()
        self.member.close()

    # ------------------------------------------------------------------ internals

    def _prefill_profile(self) -> PrefillProfile:
        """This model's prefill curve on this machine: measured once (at most 1024 tokens,
        or what the model takes) and kept under the model's cache directory; the tiny test
        model's (random weights) only in this process."""
        key = machine_key(self.model_name, torch.get_num_threads())
        path = None
        if self.model_name != "tiny":
            path = default_cache_dir().parent / self.model_name / PROFILE_FILE
        model = self.batch_runner.model
        limit = getattr(model.config, "max_position_embeddings", None)
        prefill = timed_prefill(lambda tokens: full_prefill_logits(model, tokens), self.vocab_size)
        return PrefillProfile.cached(path, key, prefill, max_tokens=limit)

    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this worker's model has no tokenizer: pass token ids")
            return list(self.tokenizer.encode(prompt))
        return prompt_tokens(prompt)
