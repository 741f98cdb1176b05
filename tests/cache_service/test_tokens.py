"""Token packing (`cache_service.tokens`): little-endian int32 bytes, the form prompts take on
the wire and as page keys.

Round trips at the int32 bounds, every input form packing to the same bytes, rejection
(plain ValueError, naming the offending id) of what is not int32, packed bytes taken as
they are, the split into full pages, and `PackedTokens` standing for the tuple of its ids.
"""

from __future__ import annotations

import pickle
import struct
from array import array

import numpy as np
import pytest

from cache_service.protocol import ProtocolError
from cache_service.tokens import (
    PackedTokens,
    as_packed,
    pack_tokens,
    split_pages,
    token_tuple,
    unpack_tokens,
)

INT32_BOUNDS = [-(2**31), -1, 0, 1, 2**31 - 1]


def make_tokens(count: int, start: int = 0) -> list[int]:
    return list(range(start, start + count))


def assert_plain_value_error(info: pytest.ExceptionInfo) -> None:
    """Token packing sits below the codec: it raises ValueError, never a ProtocolError."""
    assert not isinstance(info.value, ProtocolError), info.value


def test_tokens_round_trip_at_int32_bounds():
    ids = INT32_BOUNDS
    packed = pack_tokens(ids)
    assert packed == struct.pack("<5i", *ids)
    assert unpack_tokens(packed).tolist() == ids
    assert unpack_tokens(packed).dtype == np.dtype("<i4")
    assert pack_tokens([]) == b"" and unpack_tokens(b"").tolist() == []


# Factories, so that a one-shot iterator is made afresh each time the test runs.
INPUT_FORMS = {
    "list": list,
    "tuple": tuple,
    "int64": lambda ids: np.array(ids, dtype=np.int64),
    "int32": lambda ids: np.array(ids, dtype=np.int32),
    ">i4": lambda ids: np.array(ids, dtype=">i4"),  # big-endian: swapped to little-endian
    "array('i')": lambda ids: array("i", ids),
    "iterator": iter,
}


@pytest.mark.parametrize("form", sorted(INPUT_FORMS))
def test_every_input_form_packs_to_the_same_bytes(form):
    assert pack_tokens(INPUT_FORMS[form](INT32_BOUNDS)) == struct.pack("<5i", *INT32_BOUNDS)
    assert pack_tokens(INPUT_FORMS[form]([])) == b""


def test_unsigned_and_narrow_arrays_pack_their_values():
    assert pack_tokens(np.array([0, 2**31 - 1], dtype=np.uint64)) == struct.pack(
        "<2i", 0, 2**31 - 1
    )
    assert pack_tokens(np.array([-5, 7], dtype=np.int8)) == struct.pack("<2i", -5, 7)
    assert pack_tokens(range(3)) == struct.pack("<3i", 0, 1, 2)


@pytest.mark.parametrize(
    "ids",
    [
        [2**31],
        [0, -(2**31) - 1],
        np.array([2**40], dtype=np.int64),
        np.array([2**32], dtype=np.uint64),
        [2**70],
        [1.5],
        np.array([True]),
        [[1, 2]],
        ["1"],
        [None],
        b"\x00\x00\x00\x00",  # packed bytes are as_packed's, not token ids
        bytearray(4),
        memoryview(b"\x00" * 4),
        "abc",
        5,
        None,
        np.zeros((2, 2), dtype=np.int32),
        np.array([1.0]),
    ],
)
def test_pack_tokens_rejects_what_is_not_int32(ids):
    with pytest.raises(ValueError) as info:
        pack_tokens(ids)
    assert_plain_value_error(info)


@pytest.mark.parametrize("ids", [[True], [0, False], (True,), {1, 2}, {1: 2}])
def test_pack_tokens_rejects_bools_and_unordered_collections(ids):
    with pytest.raises(ValueError, match="bool at index|ordered sequence"):
        pack_tokens(ids)


@pytest.mark.parametrize(
    "ids, message",
    [
        ([0, 1, 2**31, 3], "token id 2147483648 at index 2 is outside int32"),
        ([0, -(2**31) - 1], "token id -2147483649 at index 1 is outside int32"),
        (np.array([0, 1, 2**31, 3], dtype=np.int64), "token id 2147483648 at index 2 is outside"),
        (np.array([5, 2**32], dtype=np.uint64), "token id 4294967296 at index 1 is outside"),
        ((7, 2**40), "token id 1099511627776 at index 1 is outside int32"),
        ([0, "1"], "token ids must be ints: str at index 1"),
    ],
)
def test_out_of_range_token_is_named(ids, message):
    with pytest.raises(ValueError, match=message) as info:
        pack_tokens(ids)
    assert_plain_value_error(info)
    with pytest.raises(ValueError, match=message):
        pack_tokens(iter(ids))  # an iterator names the same id and index


def test_out_of_range_message_names_the_int32_range():
    with pytest.raises(ValueError) as info:
        pack_tokens([0, 1, 2**31, 3])
    assert str(info.value) == (
        "token id 2147483648 at index 2 is outside int32 [-2147483648, 2147483647]"
    )


def test_unpack_tokens_needs_whole_int32():
    with pytest.raises(ValueError, match="packed tokens are 7 bytes, not a multiple of 4") as info:
        unpack_tokens(b"\x00" * 7)
    assert_plain_value_error(info)


def test_unpack_tokens_is_a_read_only_view():
    packed = pack_tokens(make_tokens(4))
    view = unpack_tokens(packed)
    assert not view.flags.writeable
    assert unpack_tokens(bytearray(packed)).tolist() == make_tokens(4)
    assert unpack_tokens(memoryview(packed)).tolist() == make_tokens(4)


def test_token_tuple_gives_python_ints():
    ids = token_tuple(pack_tokens(INT32_BOUNDS))
    assert ids == tuple(INT32_BOUNDS) and all(type(token) is int for token in ids)
    assert token_tuple(b"") == ()
    with pytest.raises(ValueError, match="not a multiple of 4"):
        token_tuple(b"\x00" * 5)


def test_as_packed_takes_packed_bytes_as_they_are():
    packed = pack_tokens(make_tokens(6))
    assert as_packed(packed) is packed  # the hot path: no copy
    for buffer in (bytearray(packed), memoryview(packed)):
        got = as_packed(buffer)
        assert type(got) is bytes and got == packed
    assert as_packed(b"") == b""
    assert as_packed(make_tokens(6)) == packed
    assert as_packed(np.arange(6)) == packed


@pytest.mark.parametrize("tokens", [b"\x00" * 7, bytearray(7), memoryview(b"\x00" * 7)])
def test_as_packed_needs_whole_int32(tokens):
    with pytest.raises(ValueError, match="packed tokens are 7 bytes, not a multiple of 4") as info:
        as_packed(tokens)
    assert_plain_value_error(info)


@pytest.mark.parametrize("tokens", [[2**31], "abc", [1.5], None])
def test_as_packed_rejects_what_pack_tokens_rejects(tokens):
    with pytest.raises(ValueError) as info:
        as_packed(tokens)
    assert_plain_value_error(info)


def test_split_pages_keeps_full_pages_as_bytes():
    packed = pack_tokens(make_tokens(10))
    assert split_pages(packed, 4) == [pack_tokens([0, 1, 2, 3]), pack_tokens([4, 5, 6, 7])]
    assert all(type(page) is bytes for page in split_pages(packed, 4))
    assert split_pages(packed, 11) == []
    assert split_pages(packed, 10) == [packed]
    assert split_pages(b"", 4) == []
    for page_tokens in (0, -1):
        with pytest.raises(ValueError, match="page_tokens must be >= 1"):
            split_pages(packed, page_tokens)


def test_packed_tokens_is_the_tuple_of_its_ids():
    ids = (-(2**31), 0, 7, 2**31 - 1)
    held = PackedTokens(pack_tokens(ids))
    assert held == ids and ids == held and (held != ids) is False
    assert held != list(ids)  # as a tuple is not a list
    assert held != ids[:3] and held != PackedTokens(pack_tokens(ids[:3]))
    assert held == PackedTokens(pack_tokens(ids))
    assert hash(held) == hash(ids) and {held: 1}[ids] == 1
    assert len(held) == 4 and held[2] == 7 and held[1:3] == (0, 7) and list(held) == list(ids)
    assert repr(held) == repr(ids)
    assert pickle.loads(pickle.dumps(held)) == ids
    assert pack_tokens(held) is held.packed and as_packed(held) is held.packed
    with pytest.raises(ValueError, match="not a multiple of 4"):
        PackedTokens(b"abc")
