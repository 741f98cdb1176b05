"""ZAP handlers: each CURVE server admits its own set of public keys, through a domain.

ZMQ asks a ZAP handler (at inproc://zeromq.zap.01 of the socket's context) whether to
admit each new CURVE client. Only one handler can bind that endpoint per context, so this
module keeps one handler per context, started with the context's first domain and stopped
with its last, and each server takes a ZAP domain of its own with the keys it admits: the
service servers of a process share `zmq.Context.instance()`, each page server has a
context of its own. A client the handler does not admit never gets a message through; an
admitted one's messages carry its public key (z85) as their "User-Id" property, which is
how the service tells identities apart.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable

import zmq
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

_lock = threading.Lock()
_handlers: dict[int, tuple[ThreadAuthenticator, set[str]]] = {}  # id(context) -> ...
_context_of: dict[str, int] = {}  # domain -> id(context)
_names = itertools.count()


class _Admit:
    """A credentials provider: admits the listed z85 public keys, and those `lookup`
    admits."""

    def __init__(self, keys: Collection[bytes], lookup: Callable[[bytes], bool] | None = None):
        self.keys = set(keys)  # grows when an engine enrolls (`admit`), never shrinks
        self.lookup = lookup

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        return self.lookup is not None and self.lookup(key)


class LateKeys:
    """Admits keys that joined after a server started, which the server cannot be told of
    (a vLLM engine's page server, outside any Ray actor, learns of the engines enrolled
    after it): `fetch()` lists the keys admitted now, and is asked again only when a key
    it did not list knocks, at most once every `interval_s`, so a stranger retrying its
    handshake costs one `fetch` a interval, never one per attempt. Refused meanwhile, a
    newcomer's client retries its handshake (ZMQ reconnects) and gets in after the next
    fetch.

    Args:
        fetch: the keys to admit (z85 public keys); an exception is logged as a refusal.
        interval_s: the least time between two fetches.
    """

    def __init__(
        self,
        fetch: Callable[[], Iterable[bytes]],
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._fetch = fetch
        self.interval_s = interval_s
        self._clock = clock
        self._keys: frozenset[bytes] = frozenset()
        self._fetched_at = -float("inf")
        self.fetches = 0
        self._lock = threading.Lock()

    def __call__(self, key: bytes) -> bool:
        with self._lock:
            if key in self._keys:
                return True
            now = self._clock()
            if now - self._fetched_at < self.interval_s:
                return False
            self._fetched_at = now
            self.fetches += 1
            try:
                self._keys = frozenset(self._fetch())
            except Exception:  # noqa: BLE001 - a lookup that fails admits nobody new
                log.exception("could not list the keys that joined later")
            return key in self._keys


def open_domain(
    keys: Collection[bytes],
    context: zmq.Context,
    lookup: Callable[[bytes], bool] | None = None,
) -> str:
    """A new ZAP domain of `context` that admits `keys` (z85 public keys), and any key
    `lookup` admits (asked, on the handler's thread, only for keys not in `keys`).

    Set it as `socket.zap_domain` of a CURVE server socket before it binds; close it with
    `close_domain`.
    """
    with _lock:
        handler, domains = _handlers.get(id(context), (None, set()))
        if handler is None:
            handler = ThreadAuthenticator(context)
            handler.start()
            handler.thread.name = "kvmesh-zap"
            _handlers[id(context)] = (handler, domains)
        domain = f"kvmesh-{next(_names)}"
        handler.configure_curve_callback(domain=domain, credentials_provider=_Admit(keys, lookup))
        domains.add(domain)
        _context_of[domain] = id(context)
    return domain


def admit(domain: str, key: bytes) -> None:
    """Admit one more z85 public key through `domain` (an engine that joined the mesh).

    Raises:
        KeyError: `domain` is not open.
    """
    with _lock:
        handler, _ = _handlers[_context_of[domain]]
        handler.credentials_providers[domain].keys.add(key)


def close_domain(domain: str) -> None:
    """Admit nobody more through `domain`; its context's handler stops with its last one."""
    with _lock:
        key = _context_of.pop(domain, None)
        if key is None:
            return
        handler, domains = _handlers[key]
        domains.discard(domain)
        handler.credentials_providers.pop(domain, None)
        if not domains:
            handler.stop()
            del _handlers[key]
