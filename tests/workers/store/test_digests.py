"""Tests for workers/store/digests.py: what a page digest covers, and what it leaves out."""

from __future__ import annotations

import hashlib
import random
import struct
from hashlib import blake2b

import numpy as np
import pytest

from cache_service import _native
from cache_service.events import Namespace
from cache_service.tokens import pack_tokens
from workers.store import digests as digests_module
from workers.store.digests import (
    DIGEST_BYTES,
    EMPTY_DIGEST,
    chain_digests,
    extend_chain,
    next_digest,
    page_digests,
    root_digest,
)

NS = Namespace("model", "adapter", "salt")
FORMAT = "kv1:layers=2:kv_heads=3:head_dim=5:page_tokens=4:dtype=float32"
TOKENS = list(range(12))  # three pages of 4


def test_the_format_is_the_one_documented():
    # Rebuilt from the module docstring with hashlib alone: a change to the format must
    # be deliberate (every worker of a mesh has to compute the same digests).
    fields = b"".join(
        struct.pack("<I", len(raw)) + raw
        for raw in (b"model", b"adapter", b"salt", FORMAT.encode())
    )
    root = blake2b(fields, digest_size=16, person=b"kvmesh-root-v1").digest()
    assert root_digest(NS, FORMAT) == root
    page0 = pack_tokens(TOKENS[:4])
    first = blake2b(root + page0, digest_size=16, person=b"kvmesh-page-v1").digest()
    assert page_digests(NS, FORMAT, TOKENS, 4)[0] == first
    assert page_digests(Namespace("m", "a", "s"), "kv1:x", list(range(8)), 4) == [
        bytes.fromhex("1f90e4b6c0586f87eb8fabc2d66b427f"),
        bytes.fromhex("9a4795942f15c457c1f3f95094f1ae80"),
    ]


def test_digests_are_deterministic_16_bytes_and_never_empty():
    digests = page_digests(NS, FORMAT, TOKENS, 4)
    assert digests == page_digests(NS, FORMAT, list(TOKENS), 4)
    assert len(digests) == 3 and len(set(digests)) == 3
    assert all(len(d) == DIGEST_BYTES and d != EMPTY_DIGEST for d in digests)
    assert bytes(16) == EMPTY_DIGEST and DIGEST_BYTES == 16


@pytest.mark.parametrize(
    "other",
    [
        Namespace("model2", "adapter", "salt"),
        Namespace("model", "adapter2", "salt"),
        Namespace("model", "adapter", "salt2"),
        # Characters shifted from one field into the next: length prefixes tell them apart.
        Namespace("modela", "dapter", "salt"),
        Namespace("model", "adaptersalt", ""),
    ],
)
def test_every_namespace_field_enters_the_root(other):
    assert root_digest(other, FORMAT) != root_digest(NS, FORMAT)
    assert page_digests(other, FORMAT, TOKENS, 4)[0] != page_digests(NS, FORMAT, TOKENS, 4)[0]


def test_the_kv_format_enters_the_root():
    assert root_digest(NS, FORMAT.replace("float32", "float16")) != root_digest(NS, FORMAT)
    # The salt's end and the format's start cannot trade characters either.
    assert root_digest(Namespace("model", "adapter", "saltk"), "v1") != root_digest(
        Namespace("model", "adapter", "salt"), "kv1"
    )


def test_a_token_changes_its_page_and_every_page_after_it():
    digests = page_digests(NS, FORMAT, TOKENS, 4)
    changed = list(TOKENS)
    changed[5] = 99  # in page 1
    after = page_digests(NS, FORMAT, changed, 4)
    assert after[0] == digests[0]
    assert after[1] != digests[1] and after[2] != digests[2]


def test_a_partial_page_is_ignored():
    digests = page_digests(NS, FORMAT, TOKENS, 4)
    assert page_digests(NS, FORMAT, TOKENS + [7, 8, 9], 4) == digests
    assert page_digests(NS, FORMAT, TOKENS[:11], 4) == digests[:2]
    assert page_digests(NS, FORMAT, TOKENS[:3], 4) == []
    assert page_digests(NS, FORMAT, [], 4) == []


def test_packed_tokens_and_ids_give_the_same_digests():
    digests = page_digests(NS, FORMAT, TOKENS, 4)
    assert page_digests(NS, FORMAT, pack_tokens(TOKENS), 4) == digests
    assert page_digests(NS, FORMAT, np.arange(12, dtype=np.int64), 4) == digests
    assert page_digests(NS, FORMAT, bytearray(pack_tokens(TOKENS)), 4) == digests


def test_the_chain_helpers_agree():
    root = root_digest(NS, FORMAT)
    packed = pack_tokens(TOKENS)
    digests = chain_digests(root, packed, 4)
    assert digests == page_digests(NS, FORMAT, TOKENS, 4)
    pages = [packed[i : i + 16] for i in range(0, 48, 16)]
    assert extend_chain(root, pages) == digests
    assert extend_chain(digests[0], pages[1:]) == digests[1:]  # a second publish goes on
    assert next_digest(digests[1], pages[2]) == digests[2]
    assert extend_chain(root, []) == []
    # Other page sizes cut other pages: nothing in common past the root.
    assert chain_digests(root, packed, 2)[1] != digests[0]


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="page_tokens must be >= 1, got 0"):
        page_digests(NS, FORMAT, TOKENS, 0)
    with pytest.raises(ValueError, match="root digest must be 16 bytes, got 3"):
        chain_digests(b"abc", pack_tokens(TOKENS), 4)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        page_digests(NS, FORMAT, b"\x00" * 6, 4)
    with pytest.raises(ValueError, match="outside int32"):
        page_digests(NS, FORMAT, [2**31], 4)


def test_a_root_hash_of_all_zeros_is_never_recorded_as_empty(monkeypatch):
    # (The page hash, compiled, applies the same rule in page_digest in native.cpp; no
    # input is known to reach it.)
    class ZeroHash:
        def copy(self):
            return self

        def update(self, data):
            pass

        def digest(self):
            return bytes(16)

    monkeypatch.setattr(digests_module, "_ROOT", ZeroHash())
    assert root_digest(NS, FORMAT) == b"\x01" + bytes(15)


@pytest.mark.parametrize("person", [b"kvmesh-page-v1", b"", b"0123456789abcdef"])
@pytest.mark.parametrize("size", [1, 16, 32, 64])
def test_the_compiled_blake2b_is_hashlibs(size, person):
    """Every length up to past three blocks (128 bytes each), and some longer."""
    rng = random.Random(size)
    for length in [*range(0, 400), 1000, 4096, 10_000]:
        data = rng.randbytes(length)
        expected = hashlib.blake2b(data, digest_size=size, person=person).digest()
        assert _native.blake2b(data, size, person) == expected, length


def test_page_digests_are_the_page_hash_chained():
    rng = random.Random(7)
    root = rng.randbytes(16)
    pages = [rng.randbytes(64) for _ in range(40)]
    expected, parent = [], root
    for page in pages:
        parent = hashlib.blake2b(parent + page, digest_size=16, person=b"kvmesh-page-v1").digest()
        expected.append(parent)
    assert chain_digests(root, b"".join(pages) + b"\x01" * 12, 16) == expected  # tail: no page
    assert extend_chain(root, pages) == expected
    assert next_digest(root, pages[0]) == expected[0]
