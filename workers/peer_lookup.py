"""A peer's entry in the service's registry, for the peer lookups of a mesh member (a
holder named by a match that the member has not met yet)."""

from __future__ import annotations

import logging

from workers.service.client import ServiceClient, ServiceError, ServiceUnavailable
from workers.transfer.peers import PeerInfo

log = logging.getLogger(__name__)


def look_up_peer(client: ServiceClient, worker_id: str) -> PeerInfo | None:
    """A holder's entry in the service's registry (what its REGISTER carried); None when
    the registry does not know it (gone since the match) or the service did not answer."""
    try:
        entry = client.peer(worker_id)
    except (ServiceError, ServiceUnavailable) as exc:
        log.info("no registry entry for %s: %s", worker_id, exc)
        return None
    if entry is None:
        return None
    log.info("found peer %s in the service's registry", worker_id)
    return PeerInfo(
        worker_id, entry.node_id, entry.shm_name, entry.address, entry.page_key, entry.epoch
    )
