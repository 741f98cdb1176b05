"""One thread owns an index: calls from any other are refused, so nothing in it locks.

The owner is the thread that made the index, until it hands it off (`hand_off`); the next
thread to call it then owns it. The service's server hands its index to its loop thread
at start, and the loop hands it back when it stops, so while the service runs every call
from another thread (a Ray actor method, a metrics exporter, a test) is refused with
`OwnerError` instead of racing the loop: such callers go through the loop
(`ServiceServer.stats`, `ServiceServer.check_integrity`).
"""

from __future__ import annotations

import threading

_get_ident = threading.get_ident


class OwnerError(RuntimeError):
    """A GlobalIndex was called from a thread other than the one that owns it."""


class ThreadOwned:
    """What one thread at a time may call: every public method starts with `self._own()`.

    A hot method may compare `threading.get_ident()` with `self._owner` itself and call
    `_own` only when they differ: one comparison instead of a call.
    """

    def __init__(self) -> None:
        self._owner: int | None = _get_ident()
        self._owner_name = threading.current_thread().name

    def hand_off(self) -> None:
        """Give up ownership: the next thread to call the index owns it.

        Raises:
            OwnerError: another thread owns the index.
        """
        self._own()
        self._owner = None

    def _own(self) -> None:
        """Make sure the calling thread owns the index: it does, or it takes it from nobody.

        Raises:
            OwnerError: another thread owns the index.
        """
        ident = _get_ident()
        if ident == self._owner:
            return
        if self._owner is not None:
            raise OwnerError(
                f"the index is owned by thread {self._owner_name!r}; "
                f"{threading.current_thread().name!r} may not call it (go through its owner)"
            )
        self._owner, self._owner_name = ident, threading.current_thread().name
