"""One ZAP handler for the shared ZMQ context, serving each CURVE server through its own domain.

ZMQ asks a ZAP handler (at inproc://zeromq.zap.01 of the socket's context) whether to
admit each new CURVE client. Only one handler can bind that endpoint per context, and
every service server of a process uses `zmq.Context.instance()`, so each server takes a
ZAP domain of its own here, with the set of public keys it admits. The handler runs while
at least one domain is open. (Page servers keep a private context and handler each: see
`workers.page_server`.) A client the handler does not admit never gets a
message through; an admitted one's messages carry its public key (z85) as their
"User-Id" property, which is how the service tells identities apart.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Collection

import zmq
from zmq.auth.thread import ThreadAuthenticator

_lock = threading.Lock()
_authenticator: ThreadAuthenticator | None = None
_domains: set[str] = set()
_names = itertools.count()


class _Admit:
    """A credentials provider: admits the listed z85 public keys."""

    def __init__(self, keys: Collection[bytes]):
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def open_domain(keys: Collection[bytes], socket: zmq.Socket) -> str:
    """Admit `keys` (z85 public keys) to CURVE server `socket` through a new ZAP domain.

    Call before the socket binds. Returns the domain, for `close_domain`.
    """
    global _authenticator
    with _lock:
        if _authenticator is None:
            _authenticator = ThreadAuthenticator(zmq.Context.instance())
            _authenticator.start()
        domain = f"kvmesh-{next(_names)}"
        _authenticator.configure_curve_callback(domain=domain, credentials_provider=_Admit(keys))
        _domains.add(domain)
    socket.zap_domain = domain.encode()
    return domain


def close_domain(domain: str) -> None:
    """Admit nobody more through `domain`; the handler stops with the last domain."""
    global _authenticator
    with _lock:
        if domain not in _domains:
            return
        _domains.discard(domain)
        if _authenticator is not None:
            _authenticator.credentials_providers.pop(domain, None)
            if not _domains:
                _authenticator.stop()
                _authenticator = None
