"""Pages a peer holds on its disk tier: planned as a holder of their own, read verified.

A holder's span in a match may run on past its host pages onto records on its disk
(`HolderSpan.tiers`): its host memory holds a prefix, its disk tier what continues it.
`split_tiers` makes two holders of it for the copy plan, each with its own link:

    prompt pages    0            h                r
    span of w       | host ..... | disk ........ |
    holder "w"      |============|                  shared memory or page server
    holder "w/disk" .............|==============|   its data file or its page server

The disk part starts at h (`PlannedSpans.starts`): a host page is never read from disk.
Its link starts from a prior, a disk read (this worker's own disk tier's measured rate, or
a plain SSD's without one) behind the holder's link when across nodes, and follows the
real fetches from then on (`LinkRates`), so the copy decision loads a disk page only when
that beats recomputing it.

Where the bytes come from:

- another node: the holder's page server, which reads and verifies each record when it
  sends it (`ServedDisk`, implemented by `workers.disk_link.DiskLink`);
- the same node: the holder's data file, opened read-only here (`PeerDiskSource`): the
  holder keeps its exclusive lock and its writes; a reader reads the slot's header before
  and after the body, checks its checksum and MAC under the mesh's key, the body's crc,
  and that the record is the one planned (generation) holding what the prompt expects
  (digest). The file's path is derived here from the mesh secret and the holder's worker
  id, the way the holder derives its own default directory, and only under this node's
  mesh directory; no path is ever taken from the network. A holder whose tier lives
  elsewhere (a directory of its own in its config) is not found: its disk pages are
  misses, recomputed.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import torch

from cache_service.messages import HolderSpan
from workers.store.disk_file import DATA_NAME, SlotReader
from workers.store.disk_rate import DEFAULT_BYTES_PER_S, DEFAULT_LATENCY_S
from workers.store.disk_records import DiskTierError, RecordCodec
from workers.store.layout import StoreLayout
from workers.store.staging import reused_rows, row_bytes
from workers.transfer.costs import Link

log = logging.getLogger(__name__)

DISK_HOLDER = "{}/disk"  # a peer's disk part in copy plans and link rates
# Worker ids that name a directory: one path component, no dot first (never "." or "..").
_SAFE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


class PeerDisks(NamedTuple):
    """How a worker finds and checks its same-node peers' disk records."""

    layout: StoreLayout  # the mesh's pages
    key: bytes  # the key the mesh's records are made under (`disk_settings.mesh_key`)
    # A worker id's default disk directory, derived on this node from the mesh secret
    # (`disk_settings.default_directory`).
    directory_of: Callable[[str], Path]


class ServedDisk(Protocol):
    """A worker's tiers of records as its page server serves them to peers (its disk, or
    host memory under a device and the disk below that): ids `id_base` .. `id_end` - 1,
    as the index knows them."""

    id_base: int
    id_end: int

    def read_page(self, page: int, generation: int, out: bytearray) -> bytes | None:
        """Read disk page `page` into `out` if its slot still holds the record of
        `generation` and it reads back verified; its digest then, else None. Never raises
        for a page that is gone, changed or corrupt."""
        ...


# ---------------------------------------------------------------------------- planning


class PlannedSpans(NamedTuple):
    """The holders of a match as the copy plan sees them: a peer's host part under its
    worker id, its disk part under `DISK_HOLDER`."""

    spans: list[HolderSpan]  # worker_id: the holder's key in the plan
    starts: dict[str, int]  # disk parts: the first prompt page each may give
    owners: dict[str, str]  # every key: the worker that holds the pages
    disk: frozenset[str]  # the keys that are disk parts


def split_tiers(spans: Sequence[HolderSpan]) -> PlannedSpans:
    """Each span cut into the pages its holder's page store and host memory keep (from page
    0: device pages, then host pages, of a holder with a device tier; host pages of one
    without) and the disk pages that continue them; pages of any other tier, and what
    follows them, are left out. A holder's own pages come from one source: its shared
    memory, or its page server, which serves its device pages and host records alike."""
    out, starts, owners, disk = [], {}, {}, set()
    taken = {s.worker_id for s in spans}
    for span in spans:
        n = len(span.page_ids)
        h = next((i for i in range(n) if span.tier_of(i) not in ("device", "host")), n)
        r = next((i for i in range(h, n) if span.tier_of(i) != "disk"), n)
        tiers = span.tiers[:h] if span.tiers else b""
        host = span._replace(
            tier="host", page_ids=span.page_ids[:h], generations=span.generations[:h], tiers=tiers
        )
        out.append(host)
        owners[span.worker_id] = span.worker_id
        key = DISK_HOLDER.format(span.worker_id)
        if r > h and key not in taken:
            # Pages before h are never given from here (`starts`): their ids stand in.
            ids = (0,) * h + span.page_ids[h:r]
            gens = (0,) * h + span.generations[h:r]
            out.append(HolderSpan(key, "disk", ids, gens))
            starts[key], owners[key] = h, span.worker_id
            disk.add(key)
    return PlannedSpans(out, starts, owners, frozenset(disk))


def disk_prior(holder: Link, disk: Link | None) -> Link:
    """The first estimate of a peer's disk link, before any real fetch from it: a disk read
    (`disk`, this worker's own disk tier's measured rate; None: a plain SSD's figures),
    behind the holder's link when it is across nodes (its page server reads, then sends)."""
    if disk is None:
        disk = Link(False, DEFAULT_BYTES_PER_S, DEFAULT_LATENCY_S)
    if not holder.remote:
        return disk._replace(remote=False)
    s_per_byte = 1.0 / holder.bytes_per_s + 1.0 / disk.bytes_per_s
    return Link(True, 1.0 / s_per_byte, holder.latency_s + disk.latency_s)


# ---------------------------------------------------------------------------- same node


def peer_data_path(disks: PeerDisks, worker_id: str) -> Path | None:
    """Where a same-node peer's default disk tier keeps its data file, derived here (the
    holder derives its own the same way); None for a worker id that is no plain name, or a
    path that leads out of this node's mesh directory."""
    if not _SAFE_ID.fullmatch(worker_id):
        return None
    directory = disks.directory_of(worker_id)
    try:
        if not directory.resolve().is_relative_to(directory.parent.resolve()):
            return None
    except OSError:
        return None
    return directory / DATA_NAME


class PeerDiskSource:
    """A same-node holder's disk records, read out of its data file (opened read-only on
    first use, again when the holder's file was replaced). `id_base` gives the holder's
    first disk page id (its host store's page count) or None when it cannot be known.

    A page is valid only if its slot holds a verified record (header before and after the
    body, checksum, MAC, body crc) of the planned generation and the expected digest; the
    usable prefix ends at the first page that is not. Never raises for a missing file or a
    bad record: those are misses.
    """

    remote = False

    def __init__(
        self,
        worker_id: str,
        node_id: str,
        path: Path | None,
        disks: PeerDisks,
        id_base: Callable[[], int | None],
    ):
        self.worker_id = worker_id
        self.node_id = node_id
        self.path = path
        self.pages_read = 0  # valid pages this source delivered
        self._codec = RecordCodec(disks.layout, disks.key)
        self._id_base = id_base
        self._reader: SlotReader | None = None
        self._row: torch.Tensor | None = None  # a device store's landing row, kept
        self._inode: tuple[int, int] | None = None
        self._lock = threading.Lock()

    def fetch(self, pages, gens, digests, targets, store) -> list[bool]:
        valid: list[bool] = []
        # Into our page itself, or (a store outside host memory: a device's) a host row
        # written up once the record verified.
        row = None
        if not store.pages_in_segment:
            row = self._row = reused_rows(self._row, store, 1)
        with self._lock:
            reader, base = self._open(), self._id_base()
            for page, gen, digest, target in zip(pages, gens, digests, targets, strict=True):
                record = None
                if reader is not None and base is not None and page >= base:
                    out = store.page_buffer(target) if row is None else row_bytes(row, 0)
                    record = reader.read_record(self._codec, page - base, out)
                ok = record is not None and record.generation == gen and record.digest == digest
                if ok and row is not None:
                    store.write_pages([target], row)
                valid.append(ok)
                if not ok:
                    break
        self.pages_read += valid.count(True)
        return valid + [False] * (len(pages) - len(valid))

    def _open(self) -> SlotReader | None:
        """The reader on the holder's current data file (None: not there or not usable)."""
        if self.path is None:
            return None
        try:
            info = os.stat(self.path, follow_symlinks=False)
        except OSError:
            self._close()
            return None
        if self._reader is not None and self._inode == (info.st_dev, info.st_ino):
            return self._reader
        self._close()
        try:
            self._reader = SlotReader.open_peer(self.path, self._codec)
        except (OSError, DiskTierError) as exc:
            log.info("no disk records of %s at %s: %s", self.worker_id, self.path, exc)
            return None
        self._inode = (info.st_dev, info.st_ino)
        return self._reader

    def _close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader, self._inode = None, None

    def close(self) -> None:
        with self._lock:
            self._close()
