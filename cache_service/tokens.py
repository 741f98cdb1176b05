"""Token ids as they travel and as tries compare them: little-endian int32, back to back.

The one token packer of the project. The wire carries prompts packed, the global index
and the local prefix cache key their pages by the packed bytes (so a page matches only
on an exact comparison), and nothing on the hot path unpacks them again.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

import numpy as np

from cache_service import _native

TOKEN_BYTES = 4
TOKEN_DTYPE = np.dtype("<i4")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

TokenIds = Sequence[int] | np.ndarray | Iterable[int]
TokenInput = TokenIds | bytes | bytearray | memoryview

_BIG_ENDIAN = sys.byteorder == "big"
assert array("i").itemsize == TOKEN_BYTES, "array('i') must be 32-bit to pack int32 tokens"
assert array("I").itemsize == TOKEN_BYTES, "array('I') must be 32-bit to pack int32 tokens"


def pack_tokens(ids: TokenIds) -> bytes:
    """Token ids in the wire format, 4 bytes each.

    Lists and tuples go through array('I') (a C loop, the fastest way from Python ints),
    then two numpy reductions check them; numpy arrays are range-checked and cast at once.

    Args:
        ids: a sequence, array('i'), numpy array or other iterable of integer token ids.

    Returns:
        The packed bytes.

    Raises:
        ValueError: not a flat sequence of integers, or an id outside int32 (the message
            names the first offending id and its index).
    """
    if type(ids) is list or type(ids) is tuple:
        packed = _native.pack_int32(ids)  # one compiled pass over exact ints in int32
        if packed is not None:
            return packed
    if type(ids) is not list:  # lists, the common case, need none of these checks
        if type(ids) is PackedTokens:
            return ids.packed
        if isinstance(ids, str | bytes | bytearray | memoryview):
            raise ValueError(f"pack_tokens takes token ids, not {type(ids).__name__}")
        if isinstance(ids, np.ndarray):
            return _pack_array(ids)
        if isinstance(ids, array) and ids.typecode == "i" and not _BIG_ENDIAN:
            return ids.tobytes()
        if isinstance(ids, AbstractSet | Mapping):
            raise ValueError(f"token ids must be an ordered sequence, not a {type(ids).__name__}")
        if not isinstance(ids, list | tuple):
            try:
                ids = list(ids)
            except TypeError:
                raise ValueError(
                    f"token ids must be a sequence of ints, got {type(ids).__name__}"
                ) from None
    try:
        # Unsigned first: array('I') converts each int with one C call, array('i') goes
        # through the argument parser at about twice the cost (2,048 ids: 17 us against
        # 43). Negative ids (valid int32, if odd) fail here and take the signed way.
        packed = array("I", ids)
    except (OverflowError, TypeError):
        packed = None
    if packed is None:
        try:
            packed = array("i", ids)
        except (OverflowError, TypeError):
            raise ValueError(_first_bad_id(ids)) from None
        # array takes bools (an int subclass); a bool among token ids is a caller's bug.
        if bool in set(map(type, ids)):
            raise ValueError(_first_bad_id(ids))
        if _BIG_ENDIAN:
            packed.byteswap()
        return packed.tobytes()
    if _BIG_ENDIAN:
        packed.byteswap()
    raw = packed.tobytes()
    # One numpy reduction checks what array('I') let through: ids past int32, which read
    # as negative int32, and bools (an int subclass, taken as 1 and 0; a bool among token
    # ids is a caller's bug), for which only ids below 2 are looked at. Read as int32,
    # both are below 2, so a prompt with neither costs a single min().
    view = np.frombuffer(raw, dtype=TOKEN_DTYPE)
    if len(view) and view.min() < 2:
        if view.view(np.dtype("<u4")).max() > INT32_MAX:
            raise ValueError(_first_bad_id(ids))
        if any(type(ids[i]) is bool for i in np.flatnonzero(view < 2).tolist()):
            raise ValueError(_first_bad_id(ids))
    return raw


def as_packed(tokens: TokenInput) -> bytes:
    """`tokens` packed: bytes-like input is taken as already packed (and checked), anything
    else is packed with `pack_tokens`.

    Raises:
        ValueError: packed bytes not a whole number of tokens, or what `pack_tokens` raises.
    """
    if type(tokens) is bytes:  # the hot path: a prompt as the codec decoded it
        if len(tokens) % TOKEN_BYTES:
            raise ValueError(f"packed tokens are {len(tokens)} bytes, not a multiple of 4")
        return tokens
    if isinstance(tokens, bytes | bytearray | memoryview):
        return as_packed(bytes(tokens))
    return pack_tokens(tokens)


def unpack_tokens(packed: bytes | bytearray | memoryview) -> np.ndarray:
    """Token ids from packed bytes: a read-only int32 numpy view, no copy.

    Raises:
        ValueError: the length is not a whole number of tokens.
    """
    if len(packed) % TOKEN_BYTES:
        raise ValueError(f"packed tokens are {len(packed)} bytes, not a multiple of 4")
    return np.frombuffer(packed, dtype=TOKEN_DTYPE)


def token_tuple(packed: bytes | bytearray | memoryview) -> tuple[int, ...]:
    """Packed tokens as a tuple of Python ints (one C conversion, by struct).

    Raises:
        ValueError: the length is not a whole number of tokens.
    """
    if len(packed) % TOKEN_BYTES:
        raise ValueError(f"packed tokens are {len(packed)} bytes, not a multiple of 4")
    return struct.unpack(f"<{len(packed) // TOKEN_BYTES}i", packed)


class PackedTokens(Sequence[int]):
    """Token ids held as their packed bytes: a read-only sequence of ints that compares,
    hashes and prints as the tuple of the same ids.

    What a KV event carries: the prefix cache has a chain's tokens packed already and the
    wire sends those bytes as they are, so the ids are unpacked (a 512-token tuple costs
    about as much as a publish's trie work) only if a reader indexes or iterates them.

    Raises:
        ValueError: the bytes are not a whole number of tokens.
    """

    __slots__ = ("packed", "_ids")

    def __init__(self, packed: bytes):
        if len(packed) % TOKEN_BYTES:
            raise ValueError(f"packed tokens are {len(packed)} bytes, not a multiple of 4")
        self.packed = packed
        self._ids: tuple[int, ...] | None = None

    def ids(self) -> tuple[int, ...]:
        """The token ids as a tuple (unpacked once, then kept)."""
        if self._ids is None:
            self._ids = token_tuple(self.packed)
        return self._ids

    def __len__(self) -> int:
        return len(self.packed) // TOKEN_BYTES

    def __getitem__(self, index):
        return self.ids()[index]

    def __iter__(self):
        return iter(self.ids())

    def __eq__(self, other: object) -> bool:
        if type(other) is PackedTokens:
            return self.packed == other.packed
        if isinstance(other, tuple):
            return self.ids() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.ids())

    def __repr__(self) -> str:
        return repr(self.ids())

    def __reduce__(self) -> tuple:
        return (PackedTokens, (self.packed,))


def split_pages(packed: bytes, page_tokens: int) -> list[bytes]:
    """The full pages of packed tokens, each as its own bytes (the tries' page keys).

    A trailing partial page is left out: only full pages are shared.

    Raises:
        ValueError: page_tokens below 1.
    """
    if page_tokens < 1:
        raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
    step = TOKEN_BYTES * page_tokens
    return [packed[start : start + step] for start in range(0, len(packed) - step + 1, step)]


def _pack_array(ids: np.ndarray) -> bytes:
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(
            f"token ids must be a flat sequence of int32, got shape {ids.shape} "
            f"of dtype {ids.dtype}"
        )
    if ids.dtype != TOKEN_DTYPE and ids.size:
        low, high = ids.min(), ids.max()
        if low < INT32_MIN or high > INT32_MAX:
            bad = low if low < INT32_MIN else high
            raise ValueError(_out_of_range(int(bad), int(np.argmax(ids == bad))))
    return ids.astype(TOKEN_DTYPE, copy=False).tobytes()


def _first_bad_id(ids: Sequence) -> str:
    """Why array('i') refused `ids`, naming the first offending item."""
    for index, token in enumerate(ids):
        if type(token) is bool or not isinstance(token, int | np.integer):
            return f"token ids must be ints: {type(token).__name__} at index {index}"
        if not INT32_MIN <= token <= INT32_MAX:
            return _out_of_range(int(token), index)
    return "token ids must be int32"


def _out_of_range(token: int, index: int) -> str:
    return f"token id {token} at index {index} is outside int32 [{INT32_MIN}, {INT32_MAX}]"
