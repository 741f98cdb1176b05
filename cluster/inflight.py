"""What the front door knows of its own requests in flight, for routing the next ones.

The service's index knows the pages workers have published; the workers' heartbeats
bring their queues a moment late. The front door knows, at once, every request it has
sent and not yet had back: the prompt tokens each computes there (the worker's queue
grows by them, `loads` of a ROUTE) and the prompts themselves, so that a prefix being
computed right now for one request counts as held by the worker computing it when the
next request for it is routed (`pending`): concurrent requests for one prefix then join
that worker's batch instead of each computing it somewhere else.

A request stays in flight until its answer comes back, long after its prompt was
computed (its decode steps), and the door cannot see when that was. The worker's own
report can: it counts the prompt tokens still to compute. So the door hands the service
only what the reports cannot count yet, its requests sent within the last `within_s`
(a heartbeat interval and a margin: `loads(workers, within_s)`), and the service adds
them to the worker's report; without the service, the door weighs all of them.

    route(prompt) -> service.route(prompt, loads=InFlight.loads(live, within_s), pending=...)
    add(worker, prompt, tokens it computes)      ... the request runs ...      remove
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from cache_service.events import Namespace
from cache_service.tokens import pack_tokens

# At most this many requests in flight per worker are compared with a prompt for a
# pending prefix (the newest ones): a bound on the routing's own work.
MAX_COMPARED = 64


class _Entry(NamedTuple):
    worker_id: str
    namespace: Namespace
    packed: bytes  # the prompt as int32 bytes
    tokens: int  # prompt tokens it computes (what the worker has yet to do for it)
    sent_at: float  # when it was added (the in-flight clock's seconds)


class InFlight:
    """The requests this front door has in flight, by worker. Thread-safe.

    Args:
        page_tokens: the index's page size: a pending prefix counts in whole pages, as
            the index will hold it.
        clock: monotonic seconds (when requests were sent, for `loads`' `within_s`).
    """

    def __init__(self, page_tokens: int, clock: Callable[[], float] = time.monotonic):
        self.page_tokens = page_tokens
        self._clock = clock
        self._entries: dict[int, _Entry] = {}
        self._issued = 0  # handles handed out so far (the next one's value)
        self._lock = threading.Lock()

    def add(self, worker_id: str, namespace: Namespace, prompt: Sequence[int], tokens: int) -> int:
        """A request sent to `worker_id`, computing `tokens` of `prompt`; returns its
        handle for `remove`."""
        packed = pack_tokens(list(prompt))
        entry = _Entry(worker_id, namespace, packed, max(0, tokens), self._clock())
        with self._lock:
            handle, self._issued = self._issued, self._issued + 1
            self._entries[handle] = entry
        return handle

    def remove(self, handle: int) -> None:
        with self._lock:
            self._entries.pop(handle, None)

    def loads(self, workers: Sequence[str], within_s: float | None = None) -> dict[str, float]:
        """worker id -> prompt tokens of this front door's requests in flight there: all
        of them, or with `within_s` those sent within the last `within_s` seconds."""
        out = dict.fromkeys(workers, 0.0)
        since = -float("inf") if within_s is None else self._clock() - within_s
        with self._lock:
            for entry in self._entries.values():
                if entry.worker_id in out and entry.sent_at >= since:
                    out[entry.worker_id] += entry.tokens
        return out

    def pending(self, namespace: Namespace, prompt: Sequence[int]) -> dict[str, float]:
        """worker id -> the whole pages of `prompt` a request in flight there shares with
        it from the start (its prefix is being computed, or was just computed, there)."""
        packed = pack_tokens(list(prompt))
        step = 4 * self.page_tokens  # bytes of one page of int32 tokens
        with self._lock:
            entries = [e for e in self._entries.values() if e.namespace == namespace]
        out: dict[str, float] = {}
        for entry in entries[-MAX_COMPARED:]:
            shared = _common_bytes(entry.packed, packed) // step * self.page_tokens
            if shared > out.get(entry.worker_id, 0):
                out[entry.worker_id] = float(shared)
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def check_integrity(self) -> None:
        """Every entry's handle was handed out, its tokens are not negative and its prompt
        is whole int32 tokens (raises AssertionError)."""
        with self._lock:
            entries, issued = dict(self._entries), self._issued
        for handle, entry in entries.items():
            assert 0 <= handle < issued, f"in-flight handle {handle} never handed out"
            assert entry.tokens >= 0, f"in-flight request {handle}: {entry.tokens} tokens"
            assert len(entry.packed) % 4 == 0, f"in-flight request {handle}: torn prompt"


def _common_bytes(a: bytes, b: bytes) -> int:
    """The length of the longest common prefix of two byte strings (by halving: each
    comparison is a C-speed slice compare)."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while low < high:  # a[:low] == b[:low] holds; a[:high] != b[:high]
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
