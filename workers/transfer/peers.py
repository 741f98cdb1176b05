"""Who holds pages where: the peers a member copies from, and how each is reached.

A member learns its peers two ways. The front door tells a worker the mesh's workers at
start and again when one dies or comes back (`tell`): that list is authoritative, and a
peer left out of it is forgotten. A holder the member was never told of (one that joined
or restarted since, or any holder of a vLLM engine, which no front door tells) is looked
up in the service's registry when a match names it (`get`), and that entry is kept for
`ttl_s` only: a holder that restarts gets a new store and page server, and copies from
the old ones would be misses until its entry is asked for again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

# How long a holder's registry entry is used before it is asked for again: one GetPeer
# (~0.3 ms) per holder this often, against a restarted holder's pages missed for that long.
PEER_TTL_S = 5.0


class PeerInfo(NamedTuple):
    """How to reach one member's pages (what its REGISTER carried)."""

    worker_id: str
    node_id: str
    shm_name: str  # its page store's shared-memory segment (peers on its node attach it)
    page_address: str  # its page server (peers on other nodes fetch from it)
    page_key: bytes | None  # its page server's CurveZMQ public key (None: no auth)
    # The registration it came from (the service's epoch for that incarnation; 0: told
    # by the front door, which tells every change itself). A newer one replaces it.
    epoch: int = 0


class Peers:
    """The peers one member knows, by worker id. Thread-safe.

    Args:
        me: this member's worker id (never a peer of itself).
        lookup: asks the service's registry for a worker's entry (None: unknown, or
            the service did not answer).
        ttl_s: how long a looked-up entry is used.
    """

    def __init__(
        self,
        me: str,
        lookup: Callable[[str], PeerInfo | None],
        ttl_s: float = PEER_TTL_S,
    ):
        self.me = me
        self.ttl_s = ttl_s
        self._lookup = lookup
        self._told: dict[str, PeerInfo] = {}
        self._found: dict[str, tuple[float, PeerInfo]] = {}  # worker id -> (when, entry)
        self._lock = threading.Lock()

    def tell(self, peers: Iterable[PeerInfo]) -> list[PeerInfo]:
        """The mesh's current members (this one among them, or not). Returns the entries
        that no longer hold: peers left out or changed, whose sources must go."""
        new = {p.worker_id: p for p in peers if p.worker_id != self.me}
        with self._lock:
            gone = [p for w, p in self._told.items() if new.get(w) != p]
            gone += [p for w, (_, p) in self._found.items() if new.get(w, p) != p]
            for worker_id in new:
                self._found.pop(worker_id, None)
            self._told = new
        return gone

    def learn(self, peers: Iterable[PeerInfo]) -> list[PeerInfo]:
        """Entries someone else looked up (a vLLM engine's scheduler side): kept as a
        lookup's are, for ttl_s; one older than the entry held (a lower epoch: the peer
        registered again since) is ignored. Returns the entries replaced by another
        registration's, whose sources must go."""
        now = time.monotonic()
        replaced = []
        with self._lock:
            for peer in peers:
                if peer.worker_id == self.me or peer.worker_id in self._told:
                    continue
                held = self._found.get(peer.worker_id)
                if held is not None and held[1].epoch > peer.epoch:
                    continue
                if held is not None and held[1] != peer:
                    replaced.append(held[1])
                self._found[peer.worker_id] = (now, peer)
        return replaced

    def stale(self, worker_id: str) -> PeerInfo | None:
        """Forget a looked-up entry now (copies from it were refused: the peer may have
        registered again, with another store); the next `get` asks the registry. Returns
        the entry forgotten."""
        with self._lock:
            found = self._found.pop(worker_id, None)
        return None if found is None else found[1]

    def get(self, worker_id: str) -> PeerInfo | None:
        """The entry of `worker_id`: as told, as looked up within ttl_s, or looked up now
        (None: this member itself, or a worker the registry does not know)."""
        if worker_id == self.me:
            return None
        now = time.monotonic()
        with self._lock:
            told = self._told.get(worker_id)
            if told is not None:
                return told
            found = self._found.get(worker_id)
        if found is not None and now - found[0] < self.ttl_s:
            return found[1]
        entry = self._lookup(worker_id)
        with self._lock:
            if entry is None:
                self._found.pop(worker_id, None)
            elif worker_id not in self._told:
                self._found[worker_id] = (now, entry)
        return entry

    def known(self) -> list[str]:
        """The peers known now (told or looked up), by id."""
        with self._lock:
            return sorted({*self._told, *self._found})
