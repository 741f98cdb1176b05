"""Waiting in tests for what the system does in the background."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str) -> T:
    """Poll `predicate` until it answers something true, and return that answer.

    Raises:
        AssertionError: still false after `timeout_s`, naming `what` was awaited.
    """
    deadline = time.monotonic() + timeout_s
    while not (answer := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return answer
