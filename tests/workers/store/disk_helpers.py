"""Helpers for disk tier tests: a tiny layout, page chains with real digests, page bytes
that are a function of the digest (so any record can be checked without bookkeeping)."""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from cache_service.events import Namespace
from cache_service.tokens import pack_tokens
from workers.store.digests import next_digest, root_digest
from workers.store.disk_tier import DiskRecord, DiskTier
from workers.store.layout import StoreLayout

KEY = b"the mesh's secret"
OTHER_KEY = b"another mesh's secret"
NS = Namespace("tiny-model")


def tiny_layout(**overrides: object) -> StoreLayout:
    """512-byte pages: 2 layers x [k,v] x 1 head x 4 tokens x 8 dims x float32."""
    fields = dict(num_pages=1, num_layers=2, num_kv_heads=1, page_tokens=4, head_dim=8)
    fields.update(overrides)
    return StoreLayout(**fields)


class PageSpec(NamedTuple):
    """One page of a chain, as `DiskTier.write` takes it (less the bytes)."""

    digest: bytes
    parent: bytes
    namespace: Namespace
    depth: int
    tokens: bytes


def make_chain(
    layout: StoreLayout,
    seed: int,
    length: int,
    namespace: Namespace = NS,
    below: PageSpec | None = None,
) -> list[PageSpec]:
    """`length` consecutive pages of token ids drawn from `seed`, from the namespace root
    or continuing after page `below`."""
    parent = below.digest if below else root_digest(namespace, layout.kv_format)
    depth = below.depth if below else 0
    pages = []
    for i in range(length):
        tokens = pack_tokens(
            [(seed * 7919 + i * 104729 + t) % 50000 for t in range(layout.page_tokens)]
        )
        digest = next_digest(parent, tokens)
        depth += 1
        pages.append(PageSpec(digest, parent, namespace, depth, tokens))
        parent = digest
    return pages


def page_for(digest: bytes, nbytes: int) -> bytes:
    """A page's bytes as a function of its digest."""
    return hashlib.shake_128(digest).digest(nbytes)


def write_page(tier: DiskTier, spec: PageSpec) -> DiskRecord | None:
    page = memoryview(page_for(spec.digest, tier.layout.page_bytes))
    return tier.write(page, spec.digest, spec.parent, spec.namespace, spec.depth, spec.tokens)


def write_chain(tier: DiskTier, specs: list[PageSpec]) -> list[DiskRecord | None]:
    return [write_page(tier, spec) for spec in specs]


def read_back(tier: DiskTier, record: DiskRecord) -> bytes | None:
    """The record's page as read by the tier, or None if the read failed."""
    out = bytearray(tier.layout.page_bytes)
    return bytes(out) if tier.read(record, memoryview(out)) else None


def reads_true(tier: DiskTier, record: DiskRecord) -> bool:
    """Whether the record reads back as the bytes written for its digest."""
    return read_back(tier, record) == page_for(record.digest, tier.layout.page_bytes)
