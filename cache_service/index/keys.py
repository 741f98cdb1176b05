"""Chained prefix keys: one 64-bit key per page, naming its whole prefix.

    key(page i of a prompt) = root key + sum(coefficient[t] * token[t] for t < (i + 1) * P)

(mod 2**64, with secret random coefficients per token position and a root key per
namespace). A page's key is its parent's key plus its own page's terms, so the keys of a
chain come from one multiply and one cumulative sum, and a prompt's keys can be computed
without walking the trie. A key only names candidates: a page counts as matched only once
its stored tokens equal the prompt's and its parent is the previous matched node, so a
hash collision can cost time, never make a hit. The coefficients are secret, so no client
can aim collisions at the key table.
"""

from __future__ import annotations

import os
import struct
from operator import mul

import numpy as np

from cache_service.events import Namespace
from cache_service.tokens import TOKEN_DTYPE

_MASK64 = 2**64 - 1
# Depths whose coefficients are kept as Python ints for single-page keys (about 700 bytes
# each); deeper runs start rarely and convert theirs each time.
_CACHED_DEPTHS = 256


def _draw_coefficients(rng: np.random.Generator, count: int) -> np.ndarray:
    """`count` random even int64 coefficients, one per token position.

    Even coefficients and odd root keys keep every key odd, so 0 can mark an empty slot of
    the key table.
    """
    drawn = rng.integers(-(2**63), 2**63 - 1, size=count, dtype=np.int64, endpoint=True)
    return drawn & np.int64(-2)


def _root_key(secret: int, namespace: Namespace) -> int:
    """The key of a namespace's root: odd, and the same whenever the root is re-created
    (keys computed before a root was pruned stay valid)."""
    return hash((secret, namespace)) | 1


class PrefixKeys:
    """The secret coefficients of one index, and the keys they give.

    Args:
        page_tokens: tokens per page.
    """

    def __init__(self, page_tokens: int):
        self.page_tokens = page_tokens
        self._page_bytes = 4 * page_tokens
        self._secret = int.from_bytes(os.urandom(8), "little")
        self._rng = np.random.default_rng(self._secret)
        self.coefficients = np.zeros(0, np.int64)  # one per token position, grown on demand
        # The same as Python ints, per depth, for keys of single pages (runs start at the
        # first page and where chains branch).
        self._depth_coefficients: dict[int, tuple[int, ...]] = {}
        self._page_struct = struct.Struct(f"<{page_tokens}i")

    def root_key(self, namespace: Namespace) -> int:
        """The key of `namespace`'s root."""
        return _root_key(self._secret, namespace)

    def chain_keys(self, start: int, depth: int, data: bytes) -> np.ndarray:
        """The keys of the pages of `data`, hung below a node of key `start` at `depth`.

        key of page i = start + sum of coefficient * token over token positions from
        depth * page_tokens to the end of page i, wrapping mod 2**64 (int64 arithmetic).

        Returns:
            int64 keys, one per full page of `data`.
        """
        size = self.page_tokens
        count = len(data) // self._page_bytes * size
        first = depth * size
        if len(self.coefficients) < first + count:
            grown = max(first + count, 2 * len(self.coefficients), 4096)
            extra = _draw_coefficients(self._rng, grown - len(self.coefficients))
            self.coefficients = np.concatenate([self.coefficients, extra])
        prefix = np.frombuffer(data, TOKEN_DTYPE, count) * self.coefficients[first : first + count]
        prefix[:1] += start
        prefix.cumsum(out=prefix)
        return prefix[size - 1 :: size]

    def page_key(self, parent_key: int, depth: int, data: bytes) -> int:
        """The key of prompt page `depth` of `data` as a child of a node of `parent_key`.

        In Python ints (one page is too small for numpy to pay off), wrapped to int64 at the
        end, which gives what numpy's wrapping int64 arithmetic gives. Only for depths some
        stored chain reached (their coefficients exist).
        """
        coefficients = self._depth_coefficients.get(depth)
        if coefficients is None:
            size = self.page_tokens
            coefficients = tuple(self.coefficients[depth * size : (depth + 1) * size].tolist())
            if depth < _CACHED_DEPTHS:
                self._depth_coefficients[depth] = coefficients
        tokens = self._page_struct.unpack_from(data, depth * self._page_bytes)
        key = parent_key + sum(map(mul, tokens, coefficients))
        return ((key + 2**63) & _MASK64) - 2**63
