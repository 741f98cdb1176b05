"""The key table: prefix key -> node id, a multimap in two numpy arrays.

Open addressing with linear probing. A Python dict of int -> int costs about 100 bytes an
entry (two int objects and the entry); this table costs 12 bytes a slot at a load between
1/8 and 1/2, and it looks up all keys of a prompt in a dozen numpy operations.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

_MASK64 = 2**64 - 1

_TABLE_MIN_BITS = 10
_TABLE_PAD = 64  # slots past the last home slot: probes run on into them, never wrap around
_WINDOW = np.arange(8, dtype=np.intp)  # slots a vectorised lookup reads per key


class KeyTable:
    """Prefix key -> node ids (see the module docstring). Keys are odd, so 0 marks an empty
    slot. Equal keys may repeat (two different prefixes whose keys collide): lookups return
    candidates, and the caller compares tokens and parents exactly. Probing never wraps
    around: the arrays run on past the last home slot, and the last slot is always empty, so
    every probe ends at an empty slot.
    """

    __slots__ = ("size", "_bits", "_shift", "_keys", "_nodes", "_keys_arr", "_nodes_arr")

    def __init__(self) -> None:
        self.size = 0
        self._place(_TABLE_MIN_BITS, np.zeros(0, np.int64), np.zeros(0, np.int32))

    def insert(self, key: int, node: int) -> None:
        if 2 * (self.size + 1) > 1 << self._bits:
            self._place_all(self._bits + 1)
        keys = self._keys
        slot = self._home(key)
        while keys[slot]:
            slot += 1
        if slot == len(keys) - 1:  # keep the last slot empty: lay the table out afresh
            self._place_all(self._bits)
            self.insert(key, node)
            return
        keys[slot] = key
        self._nodes[slot] = node
        self.size += 1

    def remove(self, key: int, node: int) -> None:
        keys, nodes = self._keys, self._nodes
        slot = self._home(key)
        while keys[slot] != key or nodes[slot] != node:
            assert keys[slot], f"node {node} is not in the key table under {key}"
            slot += 1
        # Backward-shift deletion: pull later entries of the run into the hole when their
        # home allows, so no tombstones are needed and every probe still ends at a gap.
        hole, slot = slot, slot + 1
        while moved := keys[slot]:
            if self._home(moved) <= hole:
                keys[hole], nodes[hole] = moved, nodes[slot]
                hole = slot
            slot += 1
        keys[hole] = 0
        self.size -= 1
        if self._bits > _TABLE_MIN_BITS and 8 * self.size < 1 << self._bits:
            self._place_all(self._bits - 1)

    def candidates(self, key: int) -> Iterator[int]:
        """The nodes stored under `key`, in probe order."""
        keys, nodes = self._keys, self._nodes
        slot = self._home(key)
        while found := keys[slot]:
            if found == key:
                yield nodes[slot]
            slot += 1

    def find_run(self, keys: np.ndarray) -> np.ndarray:
        """For the longest leading run of `keys` present in the table, each one's first node.

        Args:
            keys: int64 keys, in prompt order.

        Returns:
            The node ids (intp), possibly shorter than `keys`; candidates to verify.
        """
        home = (keys.view(np.uint64) >> np.uint64(self._shift)).view(np.intp)
        window = self._keys_arr.take(home[:, None] + _WINDOW)  # (pages, 8)
        found = window == keys[:, None]
        slots = home + found.argmax(1)
        hit = found.any(1)
        run = 0
        while not hit[run:].all():
            run += int(hit[run:].argmin())
            if not window[run].all():  # an empty slot in the window: the key is absent
                break
            slot = self._probe(int(keys[run]), int(home[run]) + len(_WINDOW))
            if slot is None:
                break
            slots[run] = slot
            run += 1
        else:
            run = len(keys)
        return self._nodes_arr.take(slots[:run]).astype(np.intp)

    def check(self) -> tuple[np.ndarray, np.ndarray]:
        """Check the layout; the (keys, nodes) of the occupied slots."""
        keys = self._keys_arr
        occupied = np.flatnonzero(keys)
        assert len(occupied) == self.size, f"{len(occupied)} keys stored, size {self.size}"
        assert keys[-1] == 0, "the key table's last slot is occupied"
        assert len(keys) >= (1 << self._bits) + len(_WINDOW), "the key table lost its padding"
        home = (keys[occupied].view(np.uint64) >> np.uint64(self._shift)).astype(np.intp)
        assert (home <= occupied).all(), "a key sits before its home slot"
        # No empty slot between a key's home and the key: else probes would stop short.
        empty_through = np.cumsum(keys == 0)
        gapless = (keys[home] != 0) & (empty_through[occupied] == empty_through[home])
        assert gapless.all(), "a probe run has a gap"
        assert (keys[occupied] & 1).all(), "an even key"
        return keys[occupied], self._nodes_arr[occupied].astype(np.intp)

    def _home(self, key: int) -> int:
        return (key & _MASK64) >> self._shift

    def _probe(self, key: int, slot: int) -> int | None:
        keys = self._keys
        while found := keys[slot]:
            if found == key:
                return slot
            slot += 1
        return None

    def _place_all(self, bits: int) -> None:
        occupied = np.flatnonzero(self._keys_arr)
        self._place(bits, self._keys_arr[occupied], self._nodes_arr[occupied])

    def _place(self, bits: int, keys: np.ndarray, nodes: np.ndarray) -> None:
        """Lay out the entries afresh in a table of 2**bits home slots, vectorised.

        Inserting entries in order of home slot puts entry i at max(home[i], slot[i-1] + 1),
        which is i + the running maximum of home[i] - i.
        """
        shift = 64 - bits
        home = (keys.view(np.uint64) >> np.uint64(shift)).astype(np.intp)
        order = np.argsort(home, kind="stable")
        ranks = np.arange(len(order))
        slots = np.maximum.accumulate(home[order] - ranks) + ranks
        last = int(slots[-1]) + 1 if len(slots) else 0
        self._keys_arr = np.zeros(max(1 << bits, last) + _TABLE_PAD, np.int64)
        self._nodes_arr = np.zeros(len(self._keys_arr), np.int32)
        self._keys_arr[slots] = keys[order]
        self._nodes_arr[slots] = nodes[order]
        self._keys, self._nodes = memoryview(self._keys_arr), memoryview(self._nodes_arr)
        self._bits, self._shift = bits, shift
