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
import threading
from collections.abc import Collection

import zmq
from zmq.auth.thread import ThreadAuthenticator

_lock = threading.Lock()
_handlers: dict[int, tuple[ThreadAuthenticator, set[str]]] = {}  # id(context) -> ...
_context_of: dict[str, int] = {}  # domain -> id(context)
_names = itertools.count()


class _Admit:
    """A credentials provider: admits the listed z85 public keys."""

    def __init__(self, keys: Collection[bytes]):
        self.keys = set(keys)  # grows when an engine enrolls (`admit`), never shrinks

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def open_domain(keys: Collection[bytes], context: zmq.Context) -> str:
    """A new ZAP domain of `context` that admits `keys` (z85 public keys).

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
        handler.configure_curve_callback(domain=domain, credentials_provider=_Admit(keys))
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
