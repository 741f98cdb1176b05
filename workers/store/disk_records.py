"""The disk tier's bytes: one data file of fixed-size slots, each slot one keyed page record.

Nothing here touches a file; `disk_file` does the I/O, `disk_adopt` and `disk_tier` decide.

Data file (`pages.kv`, little-endian), version 1:

    offset 0                 file header (FILE_HEADER_BYTES): magic b"KVMDISK1", version,
                             slot geometry (header_bytes, slot_bytes), page_bytes,
                             page_tokens, blake2b-128 of the kv_format, crc32 of all that
    offset 4096 + i * S      slot i, S = slot_bytes:
        +0                   record header (header_bytes, a multiple of 4096)
        +header_bytes        the page body (page_bytes, zero-padded to a multiple of 4096)

Record header:

    magic 8s b"KVMDREC1" | version u32 | generation u64 | format 16s (blake2b of kv_format)
    | page_bytes u64 | page_tokens u32 | depth u32 | parent 16s | digest 16s | body_crc u32
    | model_len u16 | adapter_len u16 | salt_len u16
    model, adapter, salt      UTF-8, at most NAME_LIMIT bytes each
    tokens                    page_tokens x int32 LE
    mac 16s                   blake2b(key, person "kvmesh-disk-v1") of everything above
    crc u32                   crc32 of everything above, mac included

A free slot's magic is zeros. The writer zeroes the magic, writes the body, then writes the
whole header, so a process killed at any point leaves either the old record, a free slot,
or a header whose body checksum (under the MAC) does not match its body: never a record
that verifies with the wrong bytes.

Two checksums over the header tell damage from a stranger: a header whose crc fails was
damaged ("corrupt"); one whose crc holds but whose MAC fails was written by a holder of
another key, another mesh's secret ("foreign").
"""

from __future__ import annotations

import struct
import zlib
from hashlib import blake2b
from typing import NamedTuple

from cache_service.events import Namespace
from cache_service.tokens import TOKEN_BYTES
from workers.store.digests import DIGEST_BYTES, next_digest, root_digest
from workers.store.layout import StoreLayout

FILE_MAGIC = b"KVMDISK1"
RECORD_MAGIC = b"KVMDREC1"
FREE_MAGIC = bytes(len(RECORD_MAGIC))
FORMAT_VERSION = 1
ALIGN = 4096  # slots and bodies start on a page boundary (O_DIRECT, DMA later)
FILE_HEADER_BYTES = 4096
NAME_LIMIT = 255  # bytes of UTF-8 per namespace field: keeps the header area fixed
MAC_BYTES = 16
MAX_KEY_BYTES = 64  # blake2b's key limit; a longer secret is hashed down to it

# Why a record was not adopted at open (Counter keys of `DiskTier.dropped`).
DROP_REASONS = ("corrupt", "truncated", "foreign", "format", "orphan", "duplicate", "capacity")

# magic, version, generation, format, page_bytes, page_tokens, depth, parent, digest,
# body_crc, model_len, adapter_len, salt_len
_FIXED = struct.Struct(f"<8sIQ{DIGEST_BYTES}sQII{DIGEST_BYTES}s{DIGEST_BYTES}sIHHH")
_TAIL = struct.Struct(f"<{MAC_BYTES}sI")  # mac, crc
# magic, version, header_bytes, slot_bytes, page_bytes, page_tokens, format; then crc u32
_FILE = struct.Struct(f"<8sIIQQI{DIGEST_BYTES}s")
_CRC = struct.Struct("<I")
_MAC_PERSON = b"kvmesh-disk-v1"


class DiskTierError(Exception):
    """The disk tier cannot be opened or used as asked (directory locked, unusable files)."""


class DiskRecord(NamedTuple):
    """A verified record's header: one page held on disk."""

    slot: int
    generation: int  # bumped every time the slot is (re)written or freed
    digest: bytes  # the page's chain digest (workers.store.digests)
    parent: bytes  # the previous page's digest; for depth 1 the namespace's root digest
    namespace: Namespace
    depth: int  # pages from the namespace root, 1 = first page
    tokens: bytes  # this page's token ids, packed int32 LE (page_tokens * 4 bytes)


class RecordHeader(NamedTuple):
    """A record header that passed its checksum, MAC and format checks (body not yet read)."""

    record: DiskRecord
    body_crc: int


class Rejected(NamedTuple):
    """A slot whose header is not a record this tier trusts, and why (a DROP_REASONS key)."""

    reason: str


class SlotGeometry(NamedTuple):
    """Where things are in the data file, in bytes."""

    header_bytes: int  # record header area at the start of each slot
    page_bytes: int  # the body as read and written (the layout's page_bytes)
    slot_bytes: int  # header area plus the body padded to ALIGN

    def slot_offset(self, slot: int) -> int:
        return FILE_HEADER_BYTES + slot * self.slot_bytes

    def body_offset(self, slot: int) -> int:
        return self.slot_offset(slot) + self.header_bytes

    def file_bytes(self, capacity: int) -> int:
        return FILE_HEADER_BYTES + capacity * self.slot_bytes


class FileCheck(NamedTuple):
    """What the data file's own header says: "ok", "new" (empty file), "truncated",
    "corrupt" (bad magic or checksum) or "format" (another layout or version; `old` is its
    slot geometry when the header gives a usable one, so its records can be counted)."""

    status: str
    old: SlotGeometry | None = None


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def slot_geometry(layout: StoreLayout) -> SlotGeometry:
    """The slot geometry of a data file holding `layout`'s pages."""
    used = _FIXED.size + 3 * NAME_LIMIT + layout.page_tokens * TOKEN_BYTES + _TAIL.size
    header_bytes = _align(used)
    return SlotGeometry(header_bytes, layout.page_bytes, header_bytes + _align(layout.page_bytes))


def format_digest(kv_format: str) -> bytes:
    """16 bytes that stand for a layout's `kv_format` in headers."""
    return blake2b(kv_format.encode(), digest_size=DIGEST_BYTES, person=b"kvmesh-fmt-v1").digest()


def pack_file_header(layout: StoreLayout) -> bytes:
    """The data file's header for `layout`, crc included (shorter than FILE_HEADER_BYTES)."""
    geometry = slot_geometry(layout)
    fields = _FILE.pack(
        FILE_MAGIC,
        FORMAT_VERSION,
        geometry.header_bytes,
        geometry.slot_bytes,
        layout.page_bytes,
        layout.page_tokens,
        format_digest(layout.kv_format),
    )
    return fields + _CRC.pack(zlib.crc32(fields))


def check_file_header(raw: bytes, layout: StoreLayout) -> FileCheck:
    """Whether a data file whose first bytes are `raw` was made for `layout`."""
    if not raw:
        return FileCheck("new")
    if len(raw) < _FILE.size + _CRC.size:
        return FileCheck("truncated")
    fields = raw[: _FILE.size]
    (crc,) = _CRC.unpack_from(raw, _FILE.size)
    magic, version, header_bytes, slot_bytes, *_ = _FILE.unpack(fields)
    if magic != FILE_MAGIC or crc != zlib.crc32(fields):
        return FileCheck("corrupt")
    if fields == pack_file_header(layout)[: _FILE.size]:
        return FileCheck("ok")
    usable = header_bytes % ALIGN == 0 and slot_bytes > header_bytes and slot_bytes % ALIGN == 0
    old = SlotGeometry(header_bytes, slot_bytes - header_bytes, slot_bytes) if usable else None
    return FileCheck("format", old)


def mac_key(key: bytes) -> bytes:
    """The MAC key for a mesh secret of any length.

    Raises:
        ValueError: an empty key (every record would be forgeable).
    """
    if not isinstance(key, bytes | bytearray) or not key:
        raise ValueError("the disk tier needs a non-empty bytes key (the mesh's secret)")
    key = bytes(key)
    return key if len(key) <= MAX_KEY_BYTES else blake2b(key, person=_MAC_PERSON).digest()


class RecordCodec:
    """Record headers of one layout under one key: encode, decode, and check the chain."""

    def __init__(self, layout: StoreLayout, key: bytes):
        """Raises ValueError for an empty key (see `mac_key`)."""
        self.layout = layout
        self.geometry = slot_geometry(layout)
        self._format = format_digest(layout.kv_format)
        self._mac = blake2b(key=mac_key(key), digest_size=MAC_BYTES, person=_MAC_PERSON)
        self._roots: dict[Namespace, bytes] = {}

    def fits(self, namespace: Namespace) -> bool:
        """Whether a namespace's fields are short enough to be recorded."""
        return all(len(field.encode()) <= NAME_LIMIT for field in namespace)

    def root(self, namespace: Namespace) -> bytes:
        """The namespace's root digest under this layout (cached: a few namespaces a mesh)."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = root_digest(namespace, self.layout.kv_format)
        return root

    def chain_ok(self, record: DiskRecord) -> bool:
        """Whether the record's digest follows from its parent and tokens, and a first
        page's parent is its namespace's root."""
        if record.digest != next_digest(record.parent, record.tokens):
            return False
        return record.depth > 1 or record.parent == self.root(record.namespace)

    def encode(self, record: DiskRecord, body_crc: int) -> bytes:
        """The header bytes of `record` (the used part of the header area)."""
        names = [field.encode() for field in record.namespace]
        assert all(len(name) <= NAME_LIMIT for name in names), "check fits() first"
        assert len(record.tokens) == self.layout.page_tokens * TOKEN_BYTES
        head = _FIXED.pack(
            RECORD_MAGIC,
            FORMAT_VERSION,
            record.generation,
            self._format,
            self.layout.page_bytes,
            self.layout.page_tokens,
            record.depth,
            record.parent,
            record.digest,
            body_crc,
            *(len(name) for name in names),
        )
        signed = b"".join([head, *names, record.tokens])
        mac = self._mac_of(signed)
        return signed + _TAIL.pack(mac, zlib.crc32(mac, zlib.crc32(signed)))

    def decode(self, raw: bytes, slot: int) -> RecordHeader | Rejected | None:
        """The record in a slot's header area `raw`.

        Returns:
            None for a free slot (no record magic), `Rejected` with the reason for a header
            that must not be trusted, else the record and its body's crc32.
        """
        if len(raw) < len(RECORD_MAGIC) or raw[: len(RECORD_MAGIC)] != RECORD_MAGIC:
            return None
        if len(raw) < _FIXED.size:
            return Rejected("truncated")
        fields = _FIXED.unpack_from(raw)
        _, version, generation, fmt, page_bytes, page_tokens, depth, parent, digest = fields[:9]
        body_crc, lengths = fields[9], fields[10:]
        if version != FORMAT_VERSION:
            return Rejected("format")
        end = _FIXED.size + sum(lengths) + page_tokens * TOKEN_BYTES
        if max(lengths) > NAME_LIMIT or end + _TAIL.size > len(raw):
            return Rejected("corrupt")
        mac, crc = _TAIL.unpack_from(raw, end)
        if zlib.crc32(raw[: end + MAC_BYTES]) != crc:
            return Rejected("corrupt")
        if mac != self._mac_of(raw[:end]):
            return Rejected("foreign")
        layout = self.layout
        if fmt != self._format or (page_bytes, page_tokens) != (
            layout.page_bytes,
            layout.page_tokens,
        ):
            return Rejected("format")
        names, at = [], _FIXED.size
        for length in lengths:
            names.append(raw[at : at + length])
            at += length
        try:
            namespace = Namespace(*(name.decode() for name in names))
        except UnicodeDecodeError:
            return Rejected("corrupt")
        if depth < 1:
            return Rejected("corrupt")
        tokens = bytes(raw[at:end])
        record = DiskRecord(slot, generation, digest, parent, namespace, depth, tokens)
        return RecordHeader(record, body_crc)

    def _mac_of(self, data: bytes) -> bytes:
        h = self._mac.copy()
        h.update(data)
        return h.digest()
