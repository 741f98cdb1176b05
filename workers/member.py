"""One member of the mesh: what a worker and a vLLM engine both are, built and wired once.

A member holds KV pages and shares them. It is, in the order it is built:

    store       SharedPageStore      its pages: in a named shared-memory segment, or on its
    below       TierLink             device over host memory; the tiers below (`tier_setup`)
    cache       PrefixCache          which pages hold which prompts (the local trie)
    page_server PageServer           peers on other nodes read its pages here
    client      ServiceClient        matches and registry lookups, on the request path
    publisher   EventPublisher       registration, events and heartbeats, off it
    peers       Peers                who holds pages where, and how to reach them
    sources     Sources              one page source per peer (shared memory or page client)
    copier      CopyExecutor         copies from several holders at once
    links       LinkRates            each holder's measured link, for copy decisions

and it does one thing with them that is the mesh's: `copy_in`, the validated copy of a
prompt's pages that other members hold. A worker adds a model and its serving loop
(`workers.worker`); an engine adds vLLM's blocks (`workers.engines.engine`). Neither
builds any of the above itself, so a fix to copy-in, peer lookup, housekeeping, the
integrity check or shutdown is made here once.

Copy-in, for prompt pages [first, end) that the service's match says others hold:

    peers      each holder's entry (told by the front door, or looked up: `Peers`)
    split      each holder's host pages and the disk pages after them, two holders
               with links of their own (`workers.transfer.peer_disk`)
    plan       which holder gives which pages (`plan_copy`: by measured link rates)
    decide     copy or recompute (a worker weighs its prefill curve; an engine copies)
    copy       every holder at once, each page validated: generation before and after,
               and the digest its holder recorded equal to the one this prompt's tokens
               give (`page_digests`); the first page that fails ends the copied prefix
    learn      each holder's link rate from the copy's real time
    check      a sample of the copied tokens, recomputed in the request's first pass by
               the caller's model and compared (`workers.transfer.spot_check`); a copy
               that fails is dropped, its holder reported and its other copies dropped
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from cache_service.auth import KeyPair
from cache_service.events import Namespace
from cache_service.messages import HolderSpan, WorkerReport
from workers.cache.device_settings import DeviceSettings
from workers.cache.disk_settings import default_directory, mesh_key
from workers.cache.prefix_cache import Allocation, PrefixCache, PrefixCacheConfig
from workers.disk_link import DiskLink, DiskSettings
from workers.peer_lookup import look_up_peer
from workers.service.client import (
    SERVICE_BACKOFF_S,
    ServiceClient,
    ServiceEndpoint,
    ServiceError,
    ServiceUnavailable,
)
from workers.service.figures import WorkerFigures
from workers.service.publisher import EventPublisher
from workers.store.digests import EMPTY_DIGEST, page_digests
from workers.store.layout import StoreLayout
from workers.store.segment_names import reclaim_dead_segments
from workers.tier_link import TierLink
from workers.tier_setup import close_tiers, open_tiers
from workers.transfer.copy_in import CopyExecutor, CopyPlan, Sources, plan_copy
from workers.transfer.costs import CopyCosts, Decision, Share, measure_links
from workers.transfer.page_server import PageServer
from workers.transfer.page_wire import ENCRYPT_PAGES_DEFAULT, TransferAuth
from workers.transfer.peer_disk import DISK_HOLDER, PeerDisks, disk_prior, split_tiers
from workers.transfer.peers import PEER_TTL_S, PeerInfo, Peers
from workers.transfer.spot_check import (
    SPOT_CHECK_RATE,
    Provenance,
    SpotCheck,
    SpotChecks,
    Verdict,
    kv_error,
    tolerance,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Membership:
    """Who a member is in the mesh and how it reaches the rest of it.

    Attributes:
        worker_id: its id in the mesh (the service's registry, the index, the metrics).
        node_id: its Ray node: peers with the same node read its shared memory.
        endpoint: the service's address, or a resolver that asks the service actor (a
            restarted service is then found at its new port).
        keypair: its CurveZMQ key pair in the mesh (None: authentication off).
        secret: the mesh secret (signs page requests when pages are not encrypted).
        page_host: where its page server listens (an address, already resolved).
        encrypt_pages: page bytes under CurveZMQ, or only signed.
        page_readers: the public keys its page server admits.
        late_readers: admits keys that enroll after it started (vLLM engines).
        publish_interval_s: how often the publisher heartbeats and sends events.
        service_backoff_s: how long its clients skip a service that did not answer.
        spot_check_rate: of copies from holders checked before, the share spot-checked
            (`workers.transfer.spot_check`; copies from others are always checked).
        disk: its disk tier below host memory (None: none).
        device: its device tier above host memory (None: none; `tier_setup`).
    """

    worker_id: str
    node_id: str
    endpoint: ServiceEndpoint | Callable[[], ServiceEndpoint]
    keypair: KeyPair | None = None
    secret: bytes = b""
    page_host: str = "127.0.0.1"
    encrypt_pages: bool = ENCRYPT_PAGES_DEFAULT
    page_readers: frozenset[bytes] = frozenset()
    late_readers: Callable[[bytes], bool] | None = None
    publish_interval_s: float = 0.5
    service_backoff_s: float = SERVICE_BACKOFF_S
    spot_check_rate: float = SPOT_CHECK_RATE
    disk: DiskSettings | None = None
    device: DeviceSettings | None = None

    def transfer_auth(self) -> TransferAuth | None:
        """Its credentials for page servers, and its own page server's (None: no auth)."""
        if self.keypair is None:
            return None
        return TransferAuth(self.keypair, self.page_readers, self.secret, self.encrypt_pages)


class MeshMember:
    """A member's pages, cache and links (see the module docstring). Thread-safe.

    Args:
        membership: who it is.
        layout: its page store's layout.
        cache: how its prefix cache matches and keeps pages.
        load: its load and measured costs for the heartbeat (the report's running,
            waiting, queued_tokens and *_ns fields), for routing; a worker's own.
        active: requests running now, sent with each heartbeat.

    Raises:
        Whatever creating the store or binding the page server raises; nothing is left
        behind then.
    """

    def __init__(
        self,
        membership: Membership,
        layout: StoreLayout,
        cache: PrefixCacheConfig,
        load: Callable[[], Mapping[str, int]] = dict,
        active: Callable[[], float] = lambda: 0.0,
    ):
        self.membership = membership
        self.worker_id = membership.worker_id
        self.node_id = membership.node_id
        # A restarted member's predecessor (or any dead member on this node) could not
        # unlink its store: that memory comes back before ours is taken.
        reclaim_dead_segments()
        self.tiers = open_tiers(
            self.worker_id, layout, membership.device, membership.disk, membership.secret
        )
        self.store, self.below = self.tiers.store, self.tiers.below
        self.disk = self.below if isinstance(self.below, DiskLink) else None
        try:
            self.cache = PrefixCache(self.store, cache, self.below, self.tiers.store_tier)
            self.figures = WorkerFigures()  # prompt tokens, copies, TTFT: in every heartbeat
            self.auth = membership.transfer_auth()
            self.page_server = PageServer(
                self.store,
                host=membership.page_host,
                auth=self.auth,
                late_readers=membership.late_readers,
                disk=self.below,
            )
        except BaseException:
            close_tiers(self.tiers)
            raise
        keys, backoff = membership.keypair, membership.service_backoff_s
        # On the request path: one short try, then skip the service for a while (a
        # request whose service is down runs on the local cache at once); the publisher's
        # heartbeats see the service come back.
        self.client = ServiceClient(
            membership.endpoint,
            timeout_s=1.0,
            retries=0,
            client_keys=keys,
            backoff_s=backoff,
            probe=False,
        )
        self.publisher = EventPublisher(
            ServiceClient(
                membership.endpoint, timeout_s=2.0, retries=1, client_keys=keys, backoff_s=backoff
            ),
            self.cache,
            self.worker_id,
            self.node_id,
            address=self.page_server.address,
            shm_name=self.store.name,  # a device store's too: its IPC handle is there
            page_key=None if keys is None else keys.public,
            load=active,
            report=self._report,
            on_new_service=self.client.reconnect,
            # Every tier's pages are its own in the index: all its tiers together.
            capacity=self.tiers.capacity,
        )
        self._load = load
        self.peers = Peers(self.worker_id, lambda w: look_up_peer(self.client, w), PEER_TTL_S)
        secret = membership.secret
        disks = PeerDisks(layout, mesh_key(secret), partial(default_directory, secret))
        self.sources = Sources(self.node_id, self.auth, disks)
        self.copier = CopyExecutor()
        encrypted = self.auth is not None and self.auth.encrypt
        self.links = measure_links(layout.page_bytes, encrypted)
        self._lock = threading.Lock()
        self.spot_checks = SpotChecks(membership.spot_check_rate, tolerance(layout.dtype))
        self.provenance = Provenance()  # which copied page came from which holder
        self.quarantined: set[str] = set()  # holders not copied from (the service's list)
        self._quarantine_seen = 0  # the version of that list applied here
        self._drop_later: dict[int, bytes] = {}  # copies to drop once no request holds them
        self.dropped_pages = 0  # copies dropped for coming from quarantined holders
        self.copies_refused = 0  # copied pages that failed validation (changed, or not ours)
        self.copy_decisions: Counter[str] = Counter()  # by Decision.reason
        self.last_decision: Decision | None = None

    def start(self, tick: Callable[[], None] | None = None) -> None:
        """Register with the service (once now), then publish and heartbeat every
        publish_interval_s; `tick`, the owner's own housekeeping, runs each round too."""
        self.publisher.sync()

        def housekeeping() -> None:
            self.housekeeping()
            if tick is not None:
                tick()

        self.publisher.start(self.membership.publish_interval_s, tick=housekeeping)

    # -- peers -------------------------------------------------------------------------

    def info(self) -> PeerInfo:
        """How peers reach this member's pages."""
        keys = self.membership.keypair
        return PeerInfo(
            self.worker_id,
            self.node_id,
            self.store.name,
            self.page_server.address,
            None if keys is None else keys.public,
        )

    def set_peers(self, peers: Iterable[PeerInfo]) -> None:
        """The mesh's members as the front door knows them. A peer left out (dead, or
        gone) is forgotten: its store is detached, its page client closed."""
        for peer in self.peers.tell(peers):
            self.forget_peer(peer)

    def learn_peers(self, peers: Iterable[PeerInfo]) -> None:
        """Entries looked up elsewhere (an engine's scheduler side); a peer registered
        again since the entry held here has its old store detached, its client closed."""
        for peer in self.peers.learn(peers):
            self.forget_peer(peer)

    def forget_peer(self, peer: PeerInfo | None) -> None:
        """Detach `peer`'s store and close its page client (the next copy opens new ones
        from its current entry)."""
        if peer is not None:
            self.sources.forget(peer.worker_id)
            self.links.forget(peer.worker_id)
            self.links.forget(DISK_HOLDER.format(peer.worker_id))

    # -- copy-in -----------------------------------------------------------------------

    def match(self, namespace: Namespace, tokens: Sequence[int]) -> tuple[int, list[HolderSpan]]:
        """Which prefix of `tokens` the mesh holds, and where: (matched tokens, spans). A
        service that does not answer, or refuses, is a miss: (0, [])."""
        try:
            matched, spans = self.client.match(namespace, tokens, requester=self.worker_id)
        except (ServiceUnavailable, ServiceError) as exc:
            log.info("%s: no match from the service (%s)", self.worker_id, exc)
            return 0, []
        return matched, list(spans)

    def copy_in(
        self,
        allocation: Allocation,
        tokens: Sequence[int],
        namespace: Namespace,
        spans: Sequence[HolderSpan],
        end: int,
        decide: Callable[[CopyCosts], Decision] | None = None,
        checks: list[SpotCheck] | None = None,
        tally: Counter[str] | None = None,
    ) -> int:
        """Copy prompt pages from where the allocation's own prefix ends up to `end` out of
        the holders in `spans`, each page validated; returns where the usable prefix ends,
        in pages (at least where the allocation's own cached pages end).

        Args:
            allocation: the request's pages; its cached tokens are in place already.
            tokens: the prompt (at least `end` pages of it).
            namespace: the prompt's namespace (every digest starts from it).
            spans: the holders the service's match named.
            end: the first prompt page not to copy.
            decide: copy or recompute, given the plan's costs (None: copy everything
                planned, as an engine does: vLLM already chose to load).
            checks: where to put the spot checks of this copy
                (`workers.transfer.spot_check.SpotCheck`), for a caller with a model that
                runs each one's token in its next pass and then judges it (None: no
                checks, as an engine, which has no model of its own).
            tally: where to count the pages loaded from its own tier below, by its name
                (["disk"] or ["host"]): hits of its own, not copies.
        """
        p = self.store.layout.page_tokens
        first = allocation.cached_tokens // p
        self.sources.detach_dead()
        spans = [s for s in spans if s.worker_id not in self.quarantined]
        peers = {s.worker_id: self.peers.get(s.worker_id) for s in spans}
        peers = {w: peer for w, peer in peers.items() if peer is not None}
        held = split_tiers([s for s in spans if s.worker_id in peers])
        spans, owner = held.spans, held.owners
        links = {w: self.links.link(w, peer.node_id != self.node_id) for w, peer in peers.items()}
        own_disk = None if self.disk is None else self.disk.link()
        for key in held.disk:  # a peer's disk: a disk read (behind its link, across nodes)
            prior = disk_prior(links[owner[key]], own_disk)
            links[key] = self.links.link(key, prior.remote, prior)
        # What each page must hold: a copy is used only if its holder recorded the same
        # digest (namespace, KV format, token chain) when it published the page. Hashed
        # here only when the own disk is looked up by them; else once a plan exists.
        expected: list[bytes] | None = None
        sources: dict[str, Any] = {}
        own: dict[str, TierLink] = {}  # its own tiers below that continue the prompt
        starts = dict(held.starts)
        if self.below is not None:
            expected = page_digests(namespace, self.store.kv_format, tokens[: end * p], p)
            for span, tier, start in self.tiers.continuing(expected, first):
                spans = [span, *spans]
                links[span.worker_id] = tier.link()
                sources[span.worker_id] = tier.source()
                own[span.worker_id], starts[span.worker_id] = tier, start
        page_bytes = self.store.layout.page_bytes
        tasks = plan_copy(spans, first, end, links, page_bytes, starts)
        if not tasks:
            return first
        copy_s = recompute_s = 0.0
        if decide is not None:
            shares = tuple(Share(t.holder, len(t.page_ids)) for t in tasks)
            costs = CopyCosts(shares, links, page_bytes, p, len(tokens), allocation.cached_tokens)
            decision = decide(costs)
            with self._lock:
                self.copy_decisions[decision.reason] += 1
                self.last_decision = decision
            if not decision.copy:
                return first
            tasks = tasks[: decision.tasks]
            copy_s, recompute_s = decision.copy_s, decision.recompute_s
        plan = CopyPlan(tasks, first, tasks[-1].end, copy_s, recompute_s)
        if expected is None:
            expected = page_digests(namespace, self.store.kv_format, tokens[: plan.end * p], p)
        for t in tasks:
            if t.holder in held.disk:
                sources[t.holder] = self.sources.get_disk(peers[owner[t.holder]])
            elif t.holder not in sources:
                sources[t.holder] = self.sources.get(peers[t.holder])
        outcome = self.copier.run(plan, sources, self.store, allocation.pages, expected)
        end = outcome.end
        for result in outcome.results:
            tier = own.get(result.task.holder)
            if tier is not None:
                loaded = max(min(result.task.end, end) - result.task.first, 0)
                tier.loaded(loaded, result.seconds, result.valid.count(False))
                if tally is not None:
                    tally[tier.name] += loaded
                continue  # its own pages: verified records, no link, no spot check
            remote = sources[result.task.holder].remote
            nbytes = len(result.valid) * page_bytes
            self.figures.copied(nbytes, remote)
            refused = result.valid.count(False)
            if refused:
                with self._lock:
                    self.copies_refused += refused
                self.forget_peer(self.peers.stale(owner[result.task.holder]))
            elif result.valid:  # a refused page may never have moved: no rate from it
                self.links.observe(result.task.holder, remote, nbytes, result.seconds)
        ranges = [
            (owner[r.task.holder], r.task.first, min(r.task.end, end))
            for r in outcome.results
            if r.task.holder not in own
        ]
        ranges = [r for r in ranges if r[1] < r[2]]
        for holder, lo, hi in ranges:
            self.provenance.record(allocation.pages[lo:hi], holder, expected[lo:hi])
        if checks is not None and ranges:
            checks.extend(self._spot_checks(allocation, ranges, expected, first, end))
        return end

    # -- spot checks and quarantine ----------------------------------------------------

    def _spot_checks(
        self,
        allocation: Allocation,
        ranges: list[tuple[str, int, int]],
        expected: Sequence[bytes],
        first: int,
        end: int,
    ) -> list[SpotCheck]:
        """The tokens the spot checks pick among the copied ones, each with its judge: the
        copied slot is kept now, and compared once the caller recomputed it."""
        p = self.store.layout.page_tokens
        checks = []
        for sample in self.spot_checks.pick(ranges, p):
            slot = self.store.page(allocation.pages[sample.page])[:, :, :, sample.slot]
            copied = slot.clone()  # (num_layers, 2, num_kv_heads, head_dim)

            def judge(sample=sample, slot=slot, copied=copied) -> bool:
                verdict = self.spot_checks.judged(sample, kv_error(copied, slot))
                if not verdict.passed:
                    # Its request computes these pages: they are no copies (and are not
                    # dropped with the holder's), whose digests the report still names.
                    self.provenance.forget(allocation.pages[first:end])
                    self._failed_check(verdict, ranges, expected)
                return verdict.passed

            checks.append(SpotCheck(sample.page * p + sample.slot, judge))
        return checks

    def _failed_check(
        self, verdict: Verdict, ranges: list[tuple[str, int, int]], expected: Sequence[bytes]
    ) -> None:
        """A copied token did not hold what its holder claimed: report the holder (when
        its context was its own or trusted holders'), else check every holder again."""
        sample, p = verdict.sample, self.store.layout.page_tokens
        pos = sample.page * p + sample.slot
        log.warning(
            "%s: prompt token %d copied from %s failed its spot check (error %.3g > %g)",
            self.worker_id, pos, sample.holder, verdict.error, self.spot_checks.limit,
        )  # fmt: skip
        if not sample.attributable:
            self.spot_checks.distrust(h for h, _, _ in ranges)
            return
        lo, hi = next((lo, hi) for h, lo, hi in ranges if h == sample.holder)
        evidence = (
            f"the KV of prompt token {pos} (page {sample.page}) differed from its "
            f"recomputation by {verdict.error:.3g} of its magnitude "
            f"(tolerance {self.spot_checks.limit})"
        )
        self._quarantine_locally(sample.holder, expected[lo:hi], evidence)

    def _quarantine_locally(self, holder: str, digests: Sequence[bytes], evidence: str) -> None:
        """Stop copying from `holder`, report it with the digests of the pages this
        member copied from it (those of the failed copy, and earlier ones), and drop
        those copies."""
        with self._lock:
            self.quarantined.add(holder)
        self.sources.forget(holder)
        self.links.forget(holder)
        earlier = self.provenance.from_holder(holder)
        self._drop_later.update(earlier)
        reported = list(dict.fromkeys([*digests, *earlier.values()]))
        self._report_holder(holder, reported, evidence)
        self._drop_pending()

    def _report_holder(self, holder: str, digests: Sequence[bytes], evidence: str) -> None:
        try:
            self.client.report_holder(
                self.worker_id, self.publisher.epoch, holder, digests, evidence
            )
        except (ServiceUnavailable, ServiceError) as exc:
            log.warning("%s: could not report %s (%s)", self.worker_id, holder, exc)

    def follow_quarantine(self) -> None:
        """Apply the service's quarantine list when it changed: stop copying from the
        holders in it, report and drop this member's copies of their pages, and drop its
        copies (from anyone) of pages the list names by digest."""
        version = self.publisher.quarantine_version
        if version != self._quarantine_seen:
            try:
                holders, tainted = self.client.quarantine()
            except (ServiceUnavailable, ServiceError) as exc:
                log.info("%s: no quarantine list (%s)", self.worker_id, exc)
                return
            with self._lock:
                new = set(holders) - self.quarantined
                self.quarantined = set(holders)
            for holder in sorted(new):
                self.sources.forget(holder)
                self.links.forget(holder)
                mine = self.provenance.from_holder(holder)
                if mine:
                    self._report_holder(holder, list(mine.values()), "copies of its pages")
                self._drop_later.update(mine)
            self._drop_later.update(self.provenance.with_digests(set(tainted)))
            self._quarantine_seen = version
        self._drop_pending()

    def _drop_pending(self) -> None:
        """Drop the pages waiting to go that still hold what they held when copied;
        those requests hold stay for the next round."""
        with self._lock:
            pending, self._drop_later = self._drop_later, {}
        if not pending:
            return
        pages = list(pending)
        now = dict(zip(pages, self.store.digests(pages), strict=True))
        self.provenance.prune(now)
        still = [p for p in pages if now[p] == pending[p]]
        dropped, held = self.cache.drop(still)
        if dropped:
            log.warning(
                "%s dropped %d copied pages of quarantined holders", self.worker_id, dropped
            )
            self.dropped_pages += dropped
        # Pages a request holds, or has not published yet (its copy landed before the
        # list changed), are tried again next round; a freed one until it is reused.
        later = [p for p in pages if now[p] == EMPTY_DIGEST or (held and now[p] == pending[p])]
        if later:
            with self._lock:
                self._drop_later.update({p: pending[p] for p in later})

    # -- upkeep ------------------------------------------------------------------------

    def housekeeping(self) -> None:
        """Each publisher round: keep the page server up, let requests ask the service
        again once the heartbeat reached it, detach the stores of dead peers (the mapping
        would keep their memory), and unlink the segments of dead members on this node
        (theirs to unlink, but a killed process cannot)."""
        self.page_server.ensure_running()
        if self.publisher.up and self.client.circuit_open:
            self.client.reconnect()  # the heartbeat got through: requests may ask again
        self.sources.detach_dead()
        self.follow_quarantine()
        for name in reclaim_dead_segments():
            log.info("%s reclaimed the segment %s of a dead member", self.worker_id, name)

    def flush(self) -> bool:
        """Publish pending events and the load now; True when the service is up to date
        with the cache (False: it did not answer or refused; a resync follows)."""
        return self.publisher.heartbeat()

    def _report(self) -> WorkerReport:
        checks = self.spot_checks.figures()
        load = {
            **self._load(),
            "spot_checks": checks["checks"],
            "spot_check_failures": checks["failures"],
        }
        stats = self.cache.stats()
        return self.figures.report(stats, load, self.tiers.figures(stats))

    def stats(self) -> dict[str, Any]:
        """The member's own figures (a worker's stats add its serving's)."""
        return {
            "address": self.page_server.address,  # where peers on other nodes fetch pages
            "prompt_tokens": self.figures.prompt_tokens(),
            "copy_bytes": self.figures.copy_bytes_now(),
            "cache": self.cache.stats(),
            "publisher": {
                "resyncs": self.publisher.resyncs,
                "batches": self.publisher.batches,
                "held_elsewhere": self.publisher.held_elsewhere,  # pages marked, as told
            },
            "pages_served": self.page_server.pages_sent,
            "copies_refused": self.copies_refused,
            "page_server": self.page_server.health(),
            "attached": self.sources.attached(),  # peers' stores mapped here, by name
            # Same-node peers whose device pages could not be opened here.
            "through_page_servers": self.sources.through_page_servers(),
            "copy_decisions": dict(self.copy_decisions),  # by reason
            "last_decision": None if self.last_decision is None else self.last_decision._asdict(),
            "link_rates": self.links.snapshot(),
            "spot_checks": self.spot_checks.figures(),
            "quarantined": sorted(self.quarantined),
            "dropped_pages": self.dropped_pages,
            "disk": None if self.disk is None else self.disk.stats(),
            "host_tier": None if self.tiers.host is None else self.below.stats(),
        }

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        self.figures.check_integrity()
        self.store.check_integrity()
        self.page_server.check_integrity()
        self.links.check_integrity()
        self.provenance.check(self.store.layout.num_pages)
        self.spot_checks.check()
        self.tiers.check_integrity()

    def close(self) -> None:
        """Say BYE, stop publishing and serving pages, close every source and client, and
        unlink the store (peers' copies from it then miss). Idempotent."""
        self.publisher.stop(bye=True)
        self.page_server.stop()
        self.copier.close()
        self.sources.close()
        self.client.close()
        close_tiers(self.tiers)
