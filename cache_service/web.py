"""The service's HTTP port: `/metrics` for Prometheus and a live hit-rate dashboard.

Routes (GET only; anything else is 404):

    /                      302 to /dashboard, the query string kept
    /dashboard             the page (cache_service/dashboard/index.html)
    /static/<file>         its script and style sheet, and plotly.js from the plotly package
    /api/dashboard         what the `dashboard` callable returns, as JSON (404 without one)
    /metrics               the Prometheus exposition of `registry`

It listens on loopback unless told otherwise; beyond loopback it demands an access token,
compared in constant time. Prometheus sends it as `Authorization: Bearer <token>` (a scrape
config's `authorization: {credentials: ...}`); a browser brings it once as `?token=` on
/dashboard, and the reply stores it in an HttpOnly cookie that admits the page's own
requests after that. Requests are served by a thread each (ThreadingHTTPServer), never by
the service's loop thread, and read only what the loop published (see
cache_service.metrics).
"""

from __future__ import annotations

import functools
import hmac
import importlib.resources
import ipaddress
import json
import logging
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from cache_service.addresses import check_bind_host

log = logging.getLogger(__name__)

COOKIE = "kvmesh_token"

# The page runs no inline script, so scripts may come from this port alone. plotly.js
# needs no eval for the 2-D charts the page draws (only its WebGL traces compile code);
# it does set inline styles, and draws some images as data: URLs.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

# Files of cache_service/dashboard served under /static/, with their content types.
STATIC_FILES = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}

# plotly.js as the PyPI package ships it, so the page needs no CDN (it works offline).
PLOTLY_PACKAGE = "plotly"
PLOTLY_MAX_AGE_S = 3600


class WebServer:
    """Serves `registry` at /metrics, and `dashboard` at /dashboard, on (host, port) from a
    daemon thread.

    Args:
        registry: what /metrics exposes.
        host: an address of this node or loopback (never a wildcard).
        port: 0 for any free port.
        token: required from every client when set; it must be set when `host` is not
            loopback.
        dashboard: what /api/dashboard serves: a callable with no arguments returning a
            JSON-serialisable dict (see cache_service/dashboard/dashboard.js for the
            fields), called on the HTTP thread, so it must only read published data.
            None: /api/dashboard is 404 and the page shows that it has no data.
    Raises:
        ValueError: a wildcard host, or no token for a host beyond loopback.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int = 0,
        token: str = "",
        dashboard: Callable[[], dict[str, Any]] | None = None,
    ):
        check_bind_host(host, "metrics host")
        if not token and not _is_loopback(host):
            raise ValueError(
                f"the metrics port on {host} is reachable beyond this machine: give it an "
                "access token (service.metrics_token)"
            )
        self.registry = registry
        self.token = token
        self.dashboard = dashboard
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

    def admits(self, authorization: str | None, cookie: str | None = None, query: str = "") -> bool:
        """Whether a request may be served: always when no token is set, else when it brings
        the token as `Authorization: Bearer <token>`, as the kvmesh_token cookie, or as
        `?token=<token>`.

        Args:
            authorization: the Authorization header, if any.
            cookie: the Cookie header, if any.
            query: the query string of the request's URL (without the "?").
        """
        if not self.token:
            return True
        bearer = f"Bearer {self.token}".encode()
        by_header = hmac.compare_digest((authorization or "").encode(), bearer)
        return by_header or self._token_in_cookie(cookie or "") or self.token_in_query(query)

    def token_in_query(self, query: str) -> bool:
        """Whether `query` (a URL's query string) holds `token=<the token>`."""
        if not self.token:
            return False
        expected = self.token.encode()
        values = urllib.parse.parse_qs(query).get("token", [])
        return any(hmac.compare_digest(value.encode(), expected) for value in values)

    def cookie_value(self) -> str:
        """The token as the cookie carries it: percent-encoded, since a token may hold
        characters (";", spaces, quotes) that would end a cookie's value."""
        return urllib.parse.quote(self.token, safe="")

    def _token_in_cookie(self, header: str) -> bool:
        expected = self.cookie_value().encode()
        values = _cookie_values(header, COOKIE)
        return any(hmac.compare_digest(value.encode(), expected) for value in values)


# Requests served at once; more are closed unanswered. A client that sends nothing is
# dropped after REQUEST_TIMEOUT_S, so no one holds a slot for long.
MAX_CONNECTIONS = 16
REQUEST_TIMEOUT_S = 5.0

# Replies are written in pieces this large: the socket's timeout bounds each write, so a
# slow link gets REQUEST_TIMEOUT_S per piece, not for all of plotly.js (about 5 MB).
WRITE_CHUNK = 256 * 1024


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
            path, _, query = self.path.partition("?")
            admitted = server.admits(
                self.headers.get("Authorization"), self.headers.get("Cookie"), query
            )
            if not admitted:
                self._reply(401, b"an access token is required\n", "text/plain")
            elif path == "/metrics":
                self._reply(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
            elif path == "/":
                self._redirect("/dashboard" + (f"?{query}" if query else ""))
            elif path == "/dashboard":
                self._page(set_cookie=server.token_in_query(query))
            elif path == "/api/dashboard":
                self._api()
            elif path == "/static/plotly.min.js":
                self._plotly()
            elif path.startswith("/static/") and path[len("/static/") :] in STATIC_FILES:
                self._static(path[len("/static/") :])
            else:
                self._reply(404, b"not found\n", "text/plain")

        def _page(self, set_cookie: bool) -> None:
            headers = {
                "Content-Security-Policy": CONTENT_SECURITY_POLICY,
                "Cache-Control": "no-cache",
                "Referrer-Policy": "no-referrer",  # the page's URL may carry the token
            }
            if set_cookie:
                headers["Set-Cookie"] = (
                    f"{COOKIE}={server.cookie_value()}; HttpOnly; SameSite=Strict; Path=/"
                )
            body = _dashboard_file("index.html")
            self._reply(200, body, "text/html; charset=utf-8", headers)

        def _static(self, name: str) -> None:
            body = _dashboard_file(name)
            self._reply(200, body, STATIC_FILES[name], {"Cache-Control": "no-cache"})

        def _api(self) -> None:
            if server.dashboard is None:
                self._reply(404, b"this service publishes no dashboard data\n", "text/plain")
                return
            try:
                # NaN or Infinity would make the reply unreadable to JSON.parse: refuse here,
                # where the message can say so.
                body = json.dumps(server.dashboard(), allow_nan=False).encode()
            except Exception as error:  # the page shows the message; the service goes on
                log.exception("the dashboard data could not be served")
                message = f"the dashboard data could not be served: {error!r}\n"
                self._reply(500, message.encode(), "text/plain")
                return
            self._reply(200, body, "application/json", {"Cache-Control": "no-store"})

        def _plotly(self) -> None:
            try:
                body = _plotly_bundle(PLOTLY_PACKAGE)
            except (ModuleNotFoundError, FileNotFoundError) as error:
                message = (
                    f"the dashboard's charts need plotly.js from the Python package "
                    f"{PLOTLY_PACKAGE!r} (pip install {PLOTLY_PACKAGE}): {error}\n"
                )
                self._reply(500, message.encode(), "text/plain")
                return
            headers = {"Cache-Control": f"max-age={PLOTLY_MAX_AGE_S}"}
            self._reply(200, body, "text/javascript; charset=utf-8", headers)

        def _redirect(self, location: str) -> None:
            self._reply(302, b"see /dashboard\n", "text/plain", {"Location": location})

        def _reply(
            self,
            status: int,
            body: bytes,
            content_type: str,
            headers: dict[str, str] | None = None,
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("X-Content-Type-Options", "nosniff")
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.end_headers()
            view = memoryview(body)
            for start in range(0, len(body), WRITE_CHUNK):
                self.wfile.write(view[start : start + WRITE_CHUNK])

        def log_message(self, format: str, *args) -> None:  # noqa: A002
            pass  # scrapes every few seconds would flood the actor's log

    return Handler


def _dashboard_file(name: str) -> bytes:
    # Read on every request (they are a few kB): an edited page shows on reload.
    return (importlib.resources.files("cache_service") / "dashboard" / name).read_bytes()


@functools.cache
def _plotly_bundle(package: str) -> bytes:
    """plotly.js from `package`, read once (it is about 5 MB and never changes).

    Raises:
        ModuleNotFoundError: `package` is not installed.
        FileNotFoundError: it ships no bundle where plotly 5 to 7 keep it.
    """
    return (importlib.resources.files(package) / "package_data" / "plotly.min.js").read_bytes()


def _cookie_values(header: str, name: str) -> list[str]:
    """The values of cookie `name` in a Cookie header (a browser may send a name twice,
    for cookies of different paths)."""
    values = []
    for pair in header.split(";"):
        key, equals, value = pair.strip().partition("=")
        if equals and key == name:
            values.append(value.strip().strip('"'))
    return values


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: where it resolves is not ours to assume
