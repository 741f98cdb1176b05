"""Copying a request's cached pages in from the workers that hold them.

Where pages come from (`PageSource`): a same-node holder's shared memory, attached by name
(`SharedMemorySource`), or another node's page server (`PageServerSource`); a holder's
disk records from its data file on the same node (`PeerDiskSource`), else from its page
server too. `Sources` keeps one per peer (and one per peer's disk), so stores stay
attached and connections open between requests, and lets a forgotten or dead peer's go.

Which holder gives which pages (`plan_copy`). The service's match lists holders, each with
prompt pages 0 .. reach-1. Pages [first, end) are cut where holders' reaches end; every
page some usable holder has is planned (a same-node holder that stops short leaves the rest
to remote holders, not to a recompute); a holder may start past page 0 (`starts`: a peer's
disk part gives only the pages after its host ones). Within a range, pages go one by one
to the holder that would finish it soonest (its latency once, then page_bytes / rate a
page), so holders finish together and a fast same-node memcpy takes most; a slow holder
gets pages only when even one page of its own finishes before the faster holders would.
The deepest range goes first, since fewer holders cover it; shallower ranges then fill
the idle holders:

    prompt pages   first                  r1                   end
    holder A (r1)  |======================|
    holder B (end) |======================|=====================|
    plan           |  A ......  | B .......| B (only B reaches) |

How (`CopyExecutor`): one thread per holder, its tasks in order; each task's validity
list and its start and end times come back. Tasks land in distinct target pages, so the
concurrent writes never overlap. The usable prefix ends at the first invalid page in
prompt order, even when later tasks succeeded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import NamedTuple, Protocol

from cache_service.messages import HolderSpan
from workers.store.layout import CudaIpcError, PageStoreError
from workers.store.page_store import SharedPageStore
from workers.store.segment_names import owner_alive
from workers.transfer.costs import Link
from workers.transfer.page_client import PageClient
from workers.transfer.page_wire import TransferAuth
from workers.transfer.peer_disk import DISK_HOLDER, PeerDisks, PeerDiskSource, peer_data_path
from workers.transfer.peers import PeerInfo
from workers.transfer.shm_copy import copy_from_peer

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- sources


class PageSource(Protocol):
    """Where one holder's pages come from.

    `fetch` copies `pages` (the holder's page ids, advertised at `gens`) into `targets` of
    `store` and returns one bool per page: True only if the page was unchanged during the
    copy and its holder recorded the expected digest for it. It never raises for a vanished
    page, a dead holder or a silent peer: those are misses (False). `close` releases what
    the source holds (a mapping, a socket); a closed source is not used again.
    """

    worker_id: str
    node_id: str
    remote: bool

    def fetch(
        self,
        pages: Sequence[int],
        gens: Sequence[int],
        digests: Sequence[bytes],
        targets: Sequence[int],
        store: SharedPageStore,
    ) -> list[bool]: ...

    def close(self) -> None: ...


class SharedMemorySource:
    """A same-node holder: its page store opened by shared-memory name (on first use),
    its device pages, if that is where it keeps them, through the CUDA IPC handle it left
    in its segment (`SharedPageStore.open_peer`).

    A failed attach or copy is all misses, logged; the mapping is dropped so the next
    fetch attaches afresh. Device pages that cannot be opened here (no handle, or CUDA
    refuses: no GPU in this process, expandable segments, another container) are read
    through the holder's page server from then on (`fallback`), with one log line. A
    device holder's host-tier pages (ids past its device store's) come through its page
    server too, which serves them as records of the tier below.
    """

    remote = False

    def __init__(
        self,
        worker_id: str,
        node_id: str,
        shm_name: str,
        fallback: Callable[[], PageSource] | None = None,
    ):
        self.worker_id = worker_id
        self.node_id = node_id
        self.shm_name = shm_name
        self.pages_copied = 0  # valid pages this source delivered
        self._store: SharedPageStore | None = None
        self._make_server = fallback
        self._server: PageSource | None = None  # its page server, made when first needed
        self.fallback = False  # its device pages could not be opened: all by page server
        self._described: tuple[int, bool] | None = None
        self._lock = threading.Lock()

    @property
    def attached(self) -> bool:
        return self._store is not None

    def id_base(self) -> int | None:
        """The holder's page count: its first disk page id (None: it cannot be attached)."""
        described = self._describe()
        return None if described is None else described[0]

    def pages_in_segment(self) -> bool | None:
        """Whether the holder keeps its pages in shared memory (None: it cannot be
        attached); False: on a device, its lower tiers after its host memory's pages."""
        described = self._describe()
        return None if described is None else described[1]

    def _describe(self) -> tuple[int, bool] | None:
        """(its page count, whether its pages are in its segment), read once from the
        segment's header (a fresh source is made for a new incarnation)."""
        with self._lock:
            if self._described is None:
                try:
                    with SharedPageStore.attach(self.shm_name) as store:
                        self._described = (store.num_pages, store.pages_in_segment)
                except (PageStoreError, FileNotFoundError, ValueError) as exc:
                    log.warning("cannot attach %s: %s", self.worker_id, exc)
            return self._described

    def fetch(self, pages, gens, digests, targets, store) -> list[bool]:
        n = len(pages)
        with self._lock:
            mapped = self._mapped(pages)  # which pages to copy here: None, all misses
            if mapped is None:
                return [False] * n
            here = [i for i in range(n) if mapped[i]]
            there = [i for i in range(n) if not mapped[i]]
            server = self._page_server() if there else None
            valid = [False] * n
            if here:
                try:
                    assert self._store is not None
                    got = copy_from_peer(
                        self._store,
                        [pages[i] for i in here],
                        [gens[i] for i in here],
                        store,
                        [targets[i] for i in here],
                        digests=None if digests is None else [digests[i] for i in here],
                    )
                except (PageStoreError, FileNotFoundError, ValueError) as exc:
                    log.warning("copy from %s failed: %s", self.worker_id, exc)
                    self._detach()
                    return valid
                for i, ok in zip(here, got, strict=True):
                    valid[i] = ok
                self.pages_copied += got.count(True)
        if server is not None:
            got = server.fetch(
                [pages[i] for i in there],
                [gens[i] for i in there],
                None if digests is None else [digests[i] for i in there],
                [targets[i] for i in there],
                store,
            )
            for i, ok in zip(there, got, strict=True):
                valid[i] = ok
        return valid

    def _mapped(self, pages: Sequence[int]) -> list[bool] | None:
        """Per page, whether it is copied out of the mapping here (else by page server);
        None when the holder cannot be read at all. Holds _lock."""
        if not self.fallback:
            try:
                if self._store is None:
                    self._store = SharedPageStore.open_peer(self.shm_name)
            except CudaIpcError as exc:
                if self._make_server is None:
                    log.warning("copy from %s failed: %s", self.worker_id, exc)
                    return None
                log.warning(
                    "%s keeps its pages on a device this process cannot open (%s): reading "
                    "them through its page server",
                    self.worker_id,
                    exc,
                )
                self.fallback = True
            except (PageStoreError, FileNotFoundError, ValueError) as exc:
                log.warning("copy from %s failed: %s", self.worker_id, exc)
                self._detach()
                return None
        store = self._store
        if self.fallback or store is None:
            return [False] * len(pages)
        if store.pages_in_segment or self._make_server is None:
            return [True] * len(pages)
        return [page < store.num_pages for page in pages]

    def _page_server(self) -> PageSource | None:
        if self._server is None and self._make_server is not None:
            self._server = self._make_server()
        return self._server

    def owner_alive(self) -> bool:
        return owner_alive(self.shm_name)

    def close(self) -> None:
        with self._lock:
            self._detach()
            if self._server is not None:
                self._server.close()
                self._server = None

    def _detach(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


class PageServerSource:
    """A holder on another node, read through its page server (one client, kept open)."""

    remote = True

    def __init__(
        self,
        worker_id: str,
        node_id: str,
        address: str,
        auth: TransferAuth | None = None,
        server_key: bytes | None = None,
    ):
        self.worker_id = worker_id
        self.node_id = node_id
        self.address = address
        self.client = PageClient(address, auth=auth, server_key=server_key)

    def fetch(self, pages, gens, digests, targets, store) -> list[bool]:
        return self.client.fetch(pages, gens, store, targets, digests=digests)

    def close(self) -> None:
        self.client.close()


class Sources:
    """One `PageSource` per peer, made on first use: same node attaches the store, other
    nodes open a page client. Thread-safe.

    Args:
        node_id: our node (who counts as same-node).
        auth: our page-transfer credentials (None: authentication off).
    """

    def __init__(
        self,
        node_id: str,
        auth: TransferAuth | None,
        disks: PeerDisks | None = None,
    ):
        self.node_id = node_id
        self.auth = auth
        self.disks = disks  # None: same-node peers' disk records come by page server
        self._sources: dict[str, tuple[PeerInfo, SharedMemorySource | PageServerSource]] = {}
        self._disks: dict[str, tuple[PeerInfo, PeerDiskSource]] = {}
        self._lock = threading.Lock()

    def get(self, peer: PeerInfo) -> PageSource:
        """The source for `peer`; a peer whose info changed gets a fresh one."""
        with self._lock:
            held = self._sources.get(peer.worker_id)
            if held is not None and held[0] == peer:
                return held[1]
            if held is not None:
                held[1].close()
            server = partial(
                PageServerSource,
                peer.worker_id,
                peer.node_id,
                peer.page_address,
                self.auth,
                peer.page_key,
            )
            # A peer that names no segment (an engine without a store) is read through
            # its page server, on this node too.
            if peer.node_id == self.node_id and peer.shm_name:
                source = SharedMemorySource(peer.worker_id, peer.node_id, peer.shm_name, server)
            else:
                source = server()
            self._sources[peer.worker_id] = (peer, source)
            return source

    def get_disk(self, peer: PeerInfo) -> PageSource:
        """The source of `peer`'s disk records: its data file on the same node, else its
        page server (the source of its host pages). A holder with a device tier serves its
        disk records, whose ids follow its host memory's, through its page server too."""
        if peer.node_id != self.node_id or self.disks is None or not peer.shm_name:
            return self.get(peer)
        shm = self.get(peer)
        assert isinstance(shm, SharedMemorySource)
        if shm.pages_in_segment() is False:
            return shm
        with self._lock:
            held = self._disks.get(peer.worker_id)
            if held is not None and held[0] == peer:
                return held[1]
            if held is not None:
                held[1].close()
            path = peer_data_path(self.disks, peer.worker_id)
            key = DISK_HOLDER.format(peer.worker_id)
            source = PeerDiskSource(key, peer.node_id, path, self.disks, shm.id_base)
            self._disks[peer.worker_id] = (peer, source)
            return source

    def forget(self, worker_id: str) -> None:
        """Close a peer's sources (it left, or its info changed)."""
        with self._lock:
            held = [self._sources.pop(worker_id, None), self._disks.pop(worker_id, None)]
        for each in held:
            if each is not None:
                each[1].close()

    def detach_dead(self) -> list[str]:
        """Detach same-node stores whose owners died (the mapping would keep their memory
        alive); returns their names. The source stays and attaches again if asked."""
        with self._lock:
            shm = [s for _, s in self._sources.values() if isinstance(s, SharedMemorySource)]
        dead = [s for s in shm if s.attached and not s.owner_alive()]
        for source in dead:
            source.close()
        return [s.shm_name for s in dead]

    def through_page_servers(self) -> list[str]:
        """Same-node peers read through their page servers: their device pages could not
        be opened here."""
        with self._lock:
            held = [s for _, s in self._sources.values() if isinstance(s, SharedMemorySource)]
        return sorted(s.worker_id for s in held if s.fallback)

    def attached(self) -> list[str]:
        """Names of the peers' stores mapped here now."""
        with self._lock:
            return sorted(
                s.shm_name
                for _, s in self._sources.values()
                if isinstance(s, SharedMemorySource) and s.attached
            )

    def close(self) -> None:
        with self._lock:
            held = [*self._sources.values(), *self._disks.values()]
            self._sources, self._disks = {}, {}
        for _, source in held:
            source.close()


# ---------------------------------------------------------------------------- planning


class CopyTask(NamedTuple):
    """Prompt pages [first, end) from one holder: its page ids and their generations."""

    holder: str
    page_ids: tuple[int, ...]
    generations: tuple[int, ...]
    first: int
    end: int


class CopyPlan(NamedTuple):
    """The tasks to run (in prompt order, covering [first, end) without gaps) and the
    estimates the decision to run them was taken on."""

    tasks: tuple[CopyTask, ...]
    first: int
    end: int
    copy_s: float  # the concurrent copy and the prefill after it
    recompute_s: float  # the prefill of everything after the local prefix instead


def plan_copy(
    spans: Sequence[HolderSpan],
    first: int,
    end: int,
    links: Mapping[str, Link],
    page_bytes: int,
    starts: Mapping[str, int] | None = None,
) -> tuple[CopyTask, ...]:
    """Split prompt pages [first, end) among the holders that have them (see the module
    docstring for the rule). Holders not in `links` (unknown peers) are skipped; a holder
    in `starts` gives no page before its start.

    Returns:
        Tasks in prompt order, contiguous from `first`; empty when no usable holder has
        page `first`. They end where the usable holders stop covering the prompt without
        a gap, if before `end`.
    """
    starts = starts or {}

    def start(s: HolderSpan) -> int:
        return max(first, starts.get(s.worker_id, 0))

    usable = [s for s in spans if s.worker_id in links and len(s.page_ids) > start(s)]
    reach = first  # how far holders cover the prompt from `first` without a gap
    while more := [len(s.page_ids) for s in usable if start(s) <= reach < len(s.page_ids)]:
        reach = max(more)
    end = min(end, reach)
    if end <= first:
        return ()
    # Range boundaries: where some holder's pages start or end.
    bounds = {len(s.page_ids) for s in usable} | {start(s) for s in usable}
    cuts = sorted({first, end} | {b for b in bounds if first < b < end})
    busy = {s.worker_id: 0.0 for s in usable}  # seconds planned per holder so far
    tasks: list[CopyTask] = []
    for lo, hi in reversed(list(zip(cuts, cuts[1:], strict=False))):
        covering = [s for s in usable if start(s) <= lo and len(s.page_ids) >= hi]
        counts = _share(hi - lo, [links[s.worker_id] for s in covering], covering, busy, page_bytes)
        # Earlier pages to the faster holders: a failure there costs the most prefix.
        order = sorted(
            range(len(covering)),
            key=lambda i: (-links[covering[i].worker_id].bytes_per_s, covering[i].worker_id),
        )
        page = lo
        for i in order:
            if counts[i]:
                span = covering[i]
                upto = page + counts[i]
                tasks.append(
                    CopyTask(
                        span.worker_id,
                        tuple(span.page_ids[page:upto]),
                        tuple(span.generations[page:upto]),
                        page,
                        upto,
                    )
                )
                page = upto
        assert page == hi, (lo, hi, counts)
    return tuple(sorted(tasks, key=lambda t: t.first))


def _share(
    n: int,
    links: Sequence[Link],
    spans: Sequence[HolderSpan],
    busy: dict[str, float],
    page_bytes: int,
) -> list[int]:
    """Give `n` pages one by one to the holder that would finish it soonest (ties: the
    earlier in `spans`); `busy` grows by what each is given. One more fetch per range
    costs its latency once."""
    counts = [0] * len(spans)
    for _ in range(n):

        def finish(i: int) -> float:
            extra = links[i].latency_s if counts[i] == 0 else 0.0
            return busy[spans[i].worker_id] + extra + page_bytes / links[i].bytes_per_s

        best = min(range(len(spans)), key=finish)
        busy[spans[best].worker_id] = finish(best)
        counts[best] += 1
    return counts


# ---------------------------------------------------------------------------- running


class TaskResult(NamedTuple):
    task: CopyTask
    valid: tuple[bool, ...]
    start_s: float  # time.perf_counter() when the fetch began
    end_s: float  # and when it returned

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


class CopyOutcome(NamedTuple):
    results: tuple[TaskResult, ...]  # one per task, in prompt order
    end: int  # the first prompt page not usable: the copied prefix is [first, end)


class CopyExecutor:
    """Runs a plan's holders concurrently on a small thread pool of its own.

    Args:
        max_threads: holders fetched at once (more wait for a thread).
    """

    def __init__(self, max_threads: int = 4):
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="kvmesh-copy")

    def run(
        self,
        plan: CopyPlan,
        sources: Mapping[str, PageSource],
        store: SharedPageStore,
        targets: Sequence[int],
        digests: Sequence[bytes],
    ) -> CopyOutcome:
        """Copy every task of `plan` into `store`.

        Args:
            sources: the source of each holder in the plan.
            targets: our page for each prompt page (indexed by prompt page).
            digests: the digest each prompt page must hold (indexed by prompt page).
        Returns:
            Per task its validity and timing, and where the usable prefix ends.
        """
        by_holder: dict[str, list[CopyTask]] = {}
        for task in plan.tasks:
            by_holder.setdefault(task.holder, []).append(task)

        def run_holder(tasks: list[CopyTask]) -> list[TaskResult]:
            return [_run_task(t, sources[t.holder], store, targets, digests) for t in tasks]

        groups = list(by_holder.values())
        if len(groups) == 1:
            done = run_holder(groups[0])  # one holder: no thread hop
        else:
            futures = [self._pool.submit(run_holder, g) for g in groups]
            done = [r for f in futures for r in f.result()]
        results = tuple(sorted(done, key=lambda r: r.task.first))
        end = plan.first
        for result in results:
            good = next((i for i, ok in enumerate(result.valid) if not ok), len(result.valid))
            end = result.task.first + good
            if good < len(result.valid):
                break  # a changed or foreign page ends the usable prefix
        return CopyOutcome(results, end)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _run_task(
    task: CopyTask,
    source: PageSource,
    store: SharedPageStore,
    targets: Sequence[int],
    digests: Sequence[bytes],
) -> TaskResult:
    start = time.perf_counter()
    try:
        valid = source.fetch(
            task.page_ids,
            task.generations,
            digests[task.first : task.end],
            targets[task.first : task.end],
            store,
        )
    except Exception:  # a source must not raise; if one does, its pages are misses
        log.exception("copy from %s raised", task.holder)
        valid = [False] * len(task.page_ids)
    return TaskResult(task, tuple(valid), start, time.perf_counter())
