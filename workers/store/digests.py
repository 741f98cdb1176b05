"""Page digests: what a page's KV was computed from, in 16 bytes.

A copied page is trusted only if it holds what the requester asked for. Its holder records,
at publish, a digest of the namespace, the KV format and the whole token chain up to and
including the page; the requester computes the same digest for its own prompt and compares
(the generation check proves only that the page did not change during the copy).

    root  = blake2b_root(len|model, len|adapter, len|salt, len|kv_format)
    d_0   = blake2b_page(root || tokens of page 0)
    d_i   = blake2b_page(d_{i-1} || tokens of page i)

Tokens are the packed little-endian int32 bytes of `cache_service.tokens`; only full pages
have digests (a partial page is never shared). The two hashes use distinct personalisation
tags, so a root can never be confused with a page digest.

The page hash is compiled (`cache_service._native`, BLAKE2b as RFC 7693 defines it, held
to hashlib's by the tests): publishing hashes every new page, a chain at a time
(`chain_digests`). The root is hashed once per namespace, with hashlib.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from hashlib import blake2b

from cache_service import _native
from cache_service.events import Namespace
from cache_service.tokens import TOKEN_BYTES, TokenInput, as_packed

DIGEST_BYTES = 16
EMPTY_DIGEST = bytes(DIGEST_BYTES)  # what an unpublished or freed page records

_ROOT = blake2b(digest_size=DIGEST_BYTES, person=b"kvmesh-root-v1")
# Pages hash as blake2b(digest_size=16, person=b"kvmesh-page-v1"), compiled
# (csrc/native.cpp), and an all-zero digest gets its first byte set (see _never_empty).
_LENGTH = struct.Struct("<I")


def root_digest(namespace: Namespace, kv_format: str) -> bytes:
    """The digest the chain of a namespace starts from.

    Each field is length-prefixed, so no two (namespace, format) pairs hash the same bytes
    by shifting characters from one field into the next.

    Args:
        namespace: model, adapter and tenant salt.
        kv_format: what the KV bytes mean (`StoreLayout.kv_format`).

    Returns:
        16 bytes, never `EMPTY_DIGEST`.
    """
    h = _ROOT.copy()
    for text in (namespace.model, namespace.adapter, namespace.salt, kv_format):
        raw = text.encode()
        h.update(_LENGTH.pack(len(raw)))
        h.update(raw)
    return _never_empty(h.digest())


def next_digest(parent: bytes, page: bytes) -> bytes:
    """The digest of one full page under the digest of the page before it (or the root).

    Args:
        parent: the previous page's digest, or the root digest for the first page.
        page: the page's tokens, packed (`page_tokens * 4` bytes).
    """
    return _native.next_digest(parent, page)


def extend_chain(parent: bytes, pages: Iterable[bytes]) -> list[bytes]:
    """The digests of consecutive pages under `parent`: `next_digest` folded along them.

    Args:
        parent: the digest of the page before the first (or the root digest).
        pages: each page's tokens, packed.
    """
    digests = []
    for page in pages:
        parent = _native.next_digest(parent, page)
        digests.append(parent)
    return digests


def chain_digests(root: bytes, packed: bytes, page_tokens: int) -> list[bytes]:
    """One digest per full page of `packed`; a trailing partial page is ignored.

    Args:
        root: `root_digest` of the namespace and KV format.
        packed: tokens as little-endian int32 bytes.
        page_tokens: tokens per page.

    Raises:
        ValueError: page_tokens below 1, or a root that is not 16 bytes.
    """
    if page_tokens < 1:
        raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
    if len(root) != DIGEST_BYTES:
        raise ValueError(f"root digest must be {DIGEST_BYTES} bytes, got {len(root)}")
    return _native.chain_digests(root, packed, page_tokens * TOKEN_BYTES)


def page_digests(
    namespace: Namespace, kv_format: str, tokens: TokenInput, page_tokens: int
) -> list[bytes]:
    """The digests of the full pages of a prompt, as its holder records them at publish.

    Args:
        namespace: model, adapter and tenant salt.
        kv_format: what the KV bytes mean (`StoreLayout.kv_format`).
        tokens: token ids, or the same packed as int32 bytes.
        page_tokens: tokens per page.

    Raises:
        ValueError: bad tokens (see `as_packed`) or page_tokens below 1.
    """
    return chain_digests(root_digest(namespace, kv_format), as_packed(tokens), page_tokens)


def _never_empty(digest: bytes) -> bytes:
    # EMPTY_DIGEST means "nothing published here": a real page must never record it, or a
    # freed page would match a requester's expectation. A hash of all zeros has chance
    # 2**-128, but the sentinel has to be unambiguous, so such a digest gets one bit flipped.
    if digest == EMPTY_DIGEST:
        return b"\x01" + digest[1:]
    return digest
