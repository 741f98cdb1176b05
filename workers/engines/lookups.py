"""Lookups that never hold up vLLM's scheduler.

vLLM's scheduler asks the connector, request by request, how many tokens the mesh holds
(`get_num_new_matched_tokens`), on the thread that schedules every running request. A
lookup is a round trip to the service (and, for a holder not yet known, one more for its
registry entry): under a loaded or silent service that is milliseconds to a second. So
lookups run on a thread of their own, one at a time (the engine's service client is
one socket): the scheduler waits a few milliseconds for the answer, and when it is not
there yet answers "not yet" (`None`: vLLM tries the request again at its next step); a
lookup not answered within its deadline is a miss.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

WAIT_S = 0.003  # how long the scheduler waits on a lookup before answering "not yet"
DEADLINE_S = 2.0  # a lookup still unanswered this long after it was asked is a miss


@dataclass
class _Asked:
    """One request's lookup: what it asked, when, and its answer once there."""

    question: Hashable
    at: float
    done: threading.Event = field(default_factory=threading.Event)
    answer: Any = None


class Lookups:
    """Runs `lookup(*question)` on a thread of its own, one request's at a time.

    Args:
        lookup: the blocking call (`EngineIndex.lookup`); it must not raise for a service
            that is down (a miss is an answer).
        miss: the answer given for a lookup past its deadline, or one that raised.
        name: the thread's name.
        wait_s: how long `ask` waits for an answer before returning None.
        deadline_s: how long a lookup may take before it counts as a miss.
    """

    def __init__(
        self,
        lookup: Callable[..., Any],
        miss: Any,
        name: str,
        wait_s: float = WAIT_S,
        deadline_s: float = DEADLINE_S,
    ):
        self._lookup = lookup
        self._miss = miss
        self._wait_s = wait_s
        self._deadline_s = deadline_s
        self._asked: dict[str, _Asked] = {}
        self._queue: queue.SimpleQueue[tuple[str, _Asked] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def ask(self, key: str, *question: Any) -> Any:
        """The answer for request `key`'s question, or None while it is being looked up.

        The first call for a question starts its lookup; an answer is handed out once and
        then forgotten (a later call asks again). A call with another question for the
        same key drops the old one.
        """
        now = time.monotonic()
        asked = self._asked.get(key)
        if asked is None or asked.question != question:
            asked = _Asked(question, now)
            self._asked[key] = asked
            self._queue.put((key, asked))
        # Each ask waits a little (never more than wait_s): vLLM asks again at once when
        # it has nothing else to run, and a loop that asked without waiting would keep the
        # GIL from the thread that reads the service's answer.
        if asked.done.wait(self._wait_s):
            del self._asked[key]
            return asked.answer
        if now - asked.at >= self._deadline_s:
            del self._asked[key]  # its thread may still answer: nobody reads it
            return self._miss
        return None

    def forget(self, key: str) -> None:
        """Drop request `key`'s lookup (it finished, or was aborted, before its answer)."""
        self._asked.pop(key, None)

    @property
    def in_flight(self) -> int:
        return len(self._asked)

    def close(self, timeout_s: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def check_integrity(self) -> None:
        """Every lookup kept is one asked and not yet handed out."""
        for key, asked in self._asked.items():
            if not isinstance(key, str) or asked.at > time.monotonic():
                raise AssertionError(f"lookup {key!r} asked in the future")

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            key, asked = item
            if self._asked.get(key) is not asked:
                continue  # dropped before its turn (finished, aborted, or asked anew)
            if time.monotonic() - asked.at >= self._deadline_s:
                asked.answer = self._miss
            else:
                try:
                    asked.answer = self._lookup(*asked.question)
                except Exception:  # a lookup that failed is a miss, and said in the log
                    log.exception("kvmesh lookup for request %s failed", key)
                    asked.answer = self._miss
            asked.done.set()
