"""The service's HTTP port: `/metrics` for Prometheus.

It listens on loopback unless told otherwise; beyond loopback it demands a bearer token
(`Authorization: Bearer <token>`, what Prometheus sends for a scrape config's
`authorization: {credentials: ...}`), compared in constant time. Requests are served by
a thread each (ThreadingHTTPServer), never by the service's loop thread, and read only
what the loop published (see cache_service.metrics).
"""

from __future__ import annotations

import hmac
import ipaddress
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from cache_service.addresses import check_bind_host


class WebServer:
    """Serves `registry` at /metrics on (host, port) from a daemon thread.

    Args:
        registry: what /metrics exposes.
        host: an address of this node or loopback (never a wildcard).
        port: 0 for any free port.
        token: required from every client when `host` is not loopback.
    Raises:
        ValueError: a wildcard host, or no token for a host beyond loopback.
    """

    def __init__(self, registry: CollectorRegistry, host: str, port: int = 0, token: str = ""):
        check_bind_host(host, "metrics host")
        if not token and not _is_loopback(host):
            raise ValueError(
                f"the metrics port on {host} is reachable beyond this machine: give it an "
                "access token (service.metrics_token)"
            )
        self.registry = registry
        self.token = token
        self._httpd = _BoundedHTTPServer((host, port), _handler(self))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> str:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="kvmesh-web", daemon=True
        )
        self._thread.start()
        return self.url

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(5.0)
            self._thread = None
        self._httpd.server_close()

    def admits(self, authorization: str | None) -> bool:
        if not self.token:
            return True
        expected = f"Bearer {self.token}".encode()
        return hmac.compare_digest((authorization or "").encode(), expected)


# Requests served at once; more are closed unanswered. A client that sends nothing is
# dropped after REQUEST_TIMEOUT_S, so no one holds a slot for long.
MAX_CONNECTIONS = 16
REQUEST_TIMEOUT_S = 5.0


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per request, at most MAX_CONNECTIONS of them."""

    daemon_threads = True

    def __init__(self, address, handler) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def _handler(server: WebServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S

        def do_GET(self) -> None:  # noqa: N802 (the http.server name)
            if not server.admits(self.headers.get("Authorization")):
                self._reply(401, b"an access token is required\n", "text/plain")
                return
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
            else:
                self._reply(404, b"not found\n", "text/plain")

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            if status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002
            pass  # scrapes every few seconds would flood the actor's log

    return Handler


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: where it resolves is not ours to assume
