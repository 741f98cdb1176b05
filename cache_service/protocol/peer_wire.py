"""The wire form of a list of peer entries (the answer to GetPeers).

Each entry travels as a list in PeerEntry's field order, each value checked as the same
field of a GetPeer reply is:

    [worker_id, epoch, node_id, tier, address, shm_name, page_key (32 bytes or b"")]
"""

from __future__ import annotations

from typing import Any

from cache_service.messages import PeerEntry
from cache_service.protocol import fields as f
from cache_service.protocol.errors import Limits

_tuple_new = tuple.__new__

# PeerEntry's fields in order, each with its check.
ENTRY_CHECKS: tuple[tuple[str, f.Checker], ...] = (
    ("worker_id", f.check_id),
    ("epoch", f.check_count),
    ("node_id", f.check_id),
    ("tier", f.check_id),
    ("address", f.check_address),
    ("shm_name", f.check_shm_name),
    ("page_key", f.check_page_key),
)
assert tuple(name for name, _ in ENTRY_CHECKS) == PeerEntry._fields


def check_peers(value: Any, path: str, limits: Limits) -> tuple[PeerEntry, ...]:
    """A list of peer entries, each a list of PeerEntry's fields."""
    peers = f.check_list(value, path, limits)
    checked = []
    for index, entry in enumerate(peers):
        where = f"{path}[{index}]"
        if type(entry) is not list or len(entry) != len(ENTRY_CHECKS):
            raise f.bad(where, f"[{', '.join(PeerEntry._fields)}]", entry)
        values = [
            check(item, f"{where}.{name}", limits)
            for (name, check), item in zip(ENTRY_CHECKS, entry, strict=True)
        ]
        checked.append(_tuple_new(PeerEntry, values))
    return tuple(checked)


def peers_wire(value: Any) -> Any:
    """Peer entries (PeerEntry or plain sequences) -> lists, their keys 32 raw bytes."""
    if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
        return value  # the check names what is wrong
    wire = []
    for entry in value:
        if isinstance(entry, tuple | list) and len(entry) == len(ENTRY_CHECKS):
            *rest, key = entry
            wire.append([*rest, f.page_key_wire(key)])
        else:
            wire.append(entry)
    return wire
