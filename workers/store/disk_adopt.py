"""Adopting a disk tier's data file at open: every slot verified before it is trusted.

A worker restarted on the same node finds the pages its previous life wrote. Each record
must pass, in this order:

    header      record magic (else the slot is free), header crc ("corrupt"), MAC under
                this mesh's key ("foreign"), version and layout fields ("format")
    body        read in full; its crc32 equals the one under the MAC ("corrupt")
    chain       digest == next_digest(parent, tokens), and a first page's parent is its
                namespace's root digest ("corrupt"); a digest already adopted from another
                slot ("duplicate")
    prefix      its parent is adopted too, one page shallower ("orphan"), so the adopted
                records are prefix-closed, as the tier keeps them

Whole-file cases: a data file made for another layout is dropped whole (each record in it
counted "format") and recreated; one whose own header is damaged counts once as "corrupt"
and its slots are still checked one by one (each carries its own format fields); a slot
cut short by the end of the file is "truncated"; records in slots at or beyond a smaller
new capacity are dropped ("capacity"). Every dropped slot is marked free on disk, so it is
neither counted nor trusted again.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import Counter
from typing import NamedTuple

from workers.store.disk_file import DataFile
from workers.store.disk_records import (
    FILE_HEADER_BYTES,
    RECORD_MAGIC,
    DiskRecord,
    RecordCodec,
    RecordHeader,
    Rejected,
    SlotGeometry,
    check_file_header,
    pack_file_header,
)

log = logging.getLogger(__name__)

PROGRESS_S = 5.0  # a long verification logs where it is this often


class Adoption(NamedTuple):
    """What `adopt` found."""

    records: list[DiskRecord]  # parents before children
    dropped: Counter[str]  # by reason (disk_records.DROP_REASONS)
    generations: list[int]  # per slot: the adopted record's generation, else 0


def adopt(file: DataFile, codec: RecordCodec, capacity: int) -> Adoption:
    """Verify every slot of `file`, free the ones that fail, and size it to `capacity`.

    Raises:
        OSError: the file cannot be read or written.
    """
    geometry = codec.geometry
    dropped: Counter[str] = Counter()
    size = _prepare_header(file, codec, dropped)
    whole, tail = divmod(max(size - FILE_HEADER_BYTES, 0), geometry.slot_bytes)
    cut = whole if tail and _holds_magic(file, geometry, whole) else None
    if cut is not None:
        dropped["capacity" if cut >= capacity else "truncated"] += 1
    dropped["capacity"] += sum(_holds_magic(file, geometry, s) for s in range(capacity, whole))
    candidates, generations = _verified_slots(file, codec, min(whole, capacity), dropped)
    records = _prefix_closed(candidates, dropped)
    for record in set(candidates.values()) - set(records):
        file.invalidate(record.slot)
        generations[record.slot] = 0
    file.resize(geometry.file_bytes(capacity))
    if cut is not None and cut < capacity:
        file.invalidate(cut)  # the cut slot's leftover bytes stay after the extension
    generations.extend([0] * (capacity - len(generations)))
    dropped = +dropped  # no zero counts
    if dropped:
        log.warning("disk tier %s: dropped records %s", file.directory, dict(dropped))
    log.info("disk tier %s: adopted %d records", file.directory, len(records))
    return Adoption(records, dropped, generations)


def _prepare_header(file: DataFile, codec: RecordCodec, dropped: Counter[str]) -> int:
    """Check the file's own header, recreate the file if it is of another layout, write a
    fresh header where needed; returns the file's size before any slot is touched."""
    size = file.size()
    check = check_file_header(file.read_at(FILE_HEADER_BYTES, 0), codec.layout)
    if check.status == "format":
        if check.old is not None:
            old_slots = max(size - FILE_HEADER_BYTES, 0) // check.old.slot_bytes
            dropped["format"] += sum(_holds_magic(file, check.old, s) for s in range(old_slots))
        else:
            dropped["format"] += 1
        file.resize(0)
        size = 0
    elif check.status in ("corrupt", "truncated"):
        dropped[check.status] += 1
    if check.status != "ok":
        file.write_file_header(pack_file_header(codec.layout))
    return size


def _holds_magic(file: DataFile, geometry: SlotGeometry, slot: int) -> bool:
    return file.read_at(len(RECORD_MAGIC), geometry.slot_offset(slot)) == RECORD_MAGIC


def _verified_slots(
    file: DataFile, codec: RecordCodec, slots: int, dropped: Counter[str]
) -> tuple[dict[bytes, DiskRecord], list[int]]:
    """Records whose header, body and chain verify, by digest; and every slot's generation
    so far (0 where none). Slots that fail are freed on disk and counted."""
    body = memoryview(bytearray(codec.geometry.page_bytes))
    candidates: dict[bytes, DiskRecord] = {}
    generations = [0] * slots
    last_log = time.monotonic()
    for slot in range(slots):
        reason = None
        decoded = codec.decode(file.read_head(slot), slot)
        if decoded is None:
            continue
        if isinstance(decoded, Rejected):
            reason = decoded.reason
        else:
            reason = _check_record(file, codec, decoded, body, candidates)
        if reason is None:
            candidates[decoded.record.digest] = decoded.record
            generations[slot] = decoded.record.generation
        else:
            dropped[reason] += 1
            file.invalidate(slot)
        if time.monotonic() - last_log > PROGRESS_S:
            last_log = time.monotonic()
            log.info("disk tier %s: verified %d of %d slots", file.directory, slot + 1, slots)
    return candidates, generations


def _check_record(
    file: DataFile,
    codec: RecordCodec,
    decoded: RecordHeader,
    body: memoryview,
    held: dict[bytes, DiskRecord],
) -> str | None:
    """Why a record whose header verified is still not trusted; None if it is."""
    record = decoded.record
    got = file.read_body(record.slot, body)
    if got < len(body):
        return "truncated"
    if zlib.crc32(body) != decoded.body_crc or not codec.chain_ok(record):
        return "corrupt"
    if record.digest in held:
        return "duplicate"
    return None


def _prefix_closed(candidates: dict[bytes, DiskRecord], dropped: Counter[str]) -> list[DiskRecord]:
    """The candidates reachable from their namespace roots, parents first; the rest are
    counted "orphan"."""
    children: dict[bytes, list[DiskRecord]] = {}
    for record in candidates.values():
        if record.depth > 1:
            children.setdefault(record.parent, []).append(record)
    order = [record for record in candidates.values() if record.depth == 1]
    for record in order:  # grows while it is walked: a breadth-first walk
        for child in children.get(record.digest, ()):
            if child.depth == record.depth + 1:
                order.append(child)
    dropped["orphan"] += len(candidates) - len(order)
    return order
