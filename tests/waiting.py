"""Waiting in tests for what the system does in the background."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

CALL_TIMEOUT_S = 30.0  # a call to a worker in process still running after this is a hang


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


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a thread of its own, failing the test if it runs past
    CALL_TIMEOUT_S (a hang)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(fn, *args, **kwargs)
    try:
        return future.result(timeout=CALL_TIMEOUT_S)
    except concurrent.futures.TimeoutError:
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not end in {CALL_TIMEOUT_S:g}s")
    finally:
        pool.shutdown(wait=False)  # a hung call's thread is left behind (the leak check sees it)
