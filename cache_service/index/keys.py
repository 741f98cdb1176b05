"""Chained prefix keys: one 64-bit key per page, naming its whole prefix.

    key(page i of a prompt) = root key + sum(coefficient[t] * token[t] for t < (i + 1) * P)

(mod 2**64, with secret random coefficients per token position and a root key per
namespace). A page's key is its parent's key plus its own page's terms, so the keys of a
chain come in one pass over its tokens, and a prompt's keys can be computed without
walking the trie. A key only names candidates: a page counts as matched only once its
stored tokens equal the prompt's and its parent is the previous matched node, so a hash
collision can cost time, never make a hit. The coefficients are secret, so no client can
aim collisions at the key table. The sums run in compiled code (`csrc/chain_keys.hpp`).
"""

from __future__ import annotations

import os

import numpy as np

from cache_service.events import Namespace
from cache_service.index._compiled import ChainKeys


def _root_key(secret: int, namespace: Namespace) -> int:
    """The key of a namespace's root: odd, and the same whenever the root is re-created
    (keys computed before a root was pruned stay valid)."""
    return hash((secret, namespace)) | 1


def _chain_keys(page_tokens: int, secret: int) -> ChainKeys:
    """The compiled keys of one index: even coefficients drawn from `secret`."""
    return ChainKeys(page_tokens, secret)


class PrefixKeys:
    """The secret coefficients of one index, and the keys they give.

    Args:
        page_tokens: tokens per page.

    Attributes (the compiled call, bound):
        chain_keys(start, depth, data): the int64 keys of the full pages of packed tokens
            `data`, hung below a node of key `start` at page depth `depth`.
        It raises ValueError for a prompt longer than any key reaches (2**26 tokens).
    """

    def __init__(self, page_tokens: int):
        self.page_tokens = page_tokens
        self._secret = int.from_bytes(os.urandom(8), "little")
        compiled = _chain_keys(page_tokens, self._secret)
        self.chain_keys = compiled.chain_keys
        self.compiled = compiled

    def root_key(self, namespace: Namespace) -> int:
        """The key of `namespace`'s root."""
        return _root_key(self._secret, namespace)

    @property
    def nbytes(self) -> int:
        """Bytes of the compiled coefficients."""
        return self.compiled.nbytes

    def coefficients(self, count: int) -> np.ndarray:
        """The first `count` coefficients, one per token position (int64; for checks)."""
        return self.compiled.coefficients(count)
