"""The worker as a Ray actor, beside the worker it wraps (as `cache_service.actor` is beside
the server): its settings arrive as the typed `WorkerSettings`, and the node it lands on
(where its placement-group bundle put it) fills in `node_id` and the page server's
`host`. Every other method is the worker's own, with the values of `workers.api` (which
also holds the actor's Ray name and concurrency, for front doors that never import this)."""

from __future__ import annotations

import dataclasses
import os

import ray

from cache_service.actor import resolve_host
from workers.api import WorkerSettings
from workers.worker import Worker


class WorkerActor(Worker):
    """A Worker in a Ray actor's process."""

    def __init__(self, settings: WorkerSettings):
        placed = dataclasses.replace(
            settings,
            node_id=ray.get_runtime_context().get_node_id(),
            host=resolve_host(settings.host),
        )
        super().__init__(placed)

    def process(self) -> tuple[str, int]:
        """(node id, pid) of this worker's process."""
        return self.settings.node_id, os.getpid()
