"""A peer that registers again (a restarted engine: a new store, a new page server) is
copied from at its new store, not attached at its old one.

Finding covered: a re-registered engine's old peer entry was kept by a worker, which went
on attaching the old store (every copy refused: misses until the entry aged out, and on
an engine's worker side, refreshed by its scheduler, longer). A refused copy now forgets
the looked-up entry, an entry of an older registration never replaces a newer one, and
the old store's mapping and page client are closed.
"""

from __future__ import annotations

import torch

from cache_service.events import Namespace
from workers.cache.prefix_cache import PrefixCacheConfig
from workers.member import Membership, MeshMember
from workers.store.layout import StoreLayout

LAYOUT = StoreLayout(num_pages=16, num_layers=2, num_kv_heads=2, page_tokens=4, head_dim=8)
NS = Namespace("tiny", "", "salt-a")
TOKENS = list(range(13))  # three full pages


def _member(rig, worker_id: str, node_id: str) -> MeshMember:
    keys, secret, readers = None, b"", frozenset()
    if rig.auth:
        keys, secret = rig.keys.workers[worker_id], rig.keys.secret
        readers = frozenset(pair.public for pair in rig.keys.workers.values())
    membership = Membership(worker_id, node_id, rig.endpoint, keys, secret, page_readers=readers)
    member = MeshMember(membership, LAYOUT, PrefixCacheConfig(page_tokens=4))
    member.publisher.sync()
    return member


def _holding(rig, worker_id: str, fill: float) -> MeshMember:
    member = _member(rig, worker_id, "node-1")
    allocation = member.cache.acquire(TOKENS, NS)
    for page in allocation.pages:
        member.store.write_page(page, torch.full(LAYOUT.page_shape, fill))
    allocation.publish(len(TOKENS))
    allocation.release()
    assert member.flush()
    return member


def _copy(requester: MeshMember) -> tuple[int, list[float]]:
    matched, spans = requester.match(NS, TOKENS)
    allocation = requester.cache.acquire(TOKENS, NS)
    try:
        end = requester.copy_in(allocation, TOKENS, NS, spans, matched // 4)
        return end, [float(requester.store.page(p)[0, 0, 0, 0, 0]) for p in allocation.pages[:end]]
    finally:
        allocation.release()


def test_a_peer_registered_again_is_copied_from_its_new_store(rig):
    old = _holding(rig, "w0", 1.0)
    # On another node: it copies through the holder's page server, whose address a
    # restart changes.
    requester = _member(rig, "w1", "node-2")
    # Entries kept a minute, as an engine's worker side kept the ones its scheduler
    # side sent it: only a refused copy may make it ask again in time.
    requester.peers.ttl_s = 60.0
    new = None
    try:
        assert _copy(requester) == (3, [1.0, 1.0, 1.0])
        old_entry = requester.peers.get("w0")
        old.close()  # BYE: the engine restarts, with a new store and page server
        new = _holding(rig, "w0", 2.0)
        assert new.page_server.address != old_entry.page_address
        # The first copy after the restart may still try the old entry (it is refused:
        # a miss); the next one uses the new registration.
        end, _ = _copy(requester)
        if end == 0:
            end, _ = _copy(requester)
        assert (end, _copy(requester)[1]) == (3, [2.0, 2.0, 2.0])
        # An entry of the older registration, learned late, does not replace the newer.
        current = requester.peers.get("w0")
        assert current.epoch > old_entry.epoch
        assert requester.peers.learn([old_entry]) == []
        assert requester.peers.get("w0") == current
        requester.check_integrity()
        new.check_integrity()
    finally:
        requester.close()
        if new is not None:
            new.close()
