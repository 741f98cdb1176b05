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

Who sees what. With a token set, only its holders are served, and they see everything.
Without one (loopback only), any user of this machine can connect: by default such a
client sees the tenant-free summary, the mesh's and each worker's figures with every
figure by tenant summed over tenants (/metrics loses its `tenant` label, /api/dashboard's
"tenants" is empty), so no tenant's name or traffic shows; `show_tenants`
(service.metrics_show_tenants) shows them the tenant rows too.

Every client is served within bounded time, whatever others do (a slowloris sending a
header line a second on 16 connections once made every scrape fail): a connection has
HEADER_DEADLINE_S for its request line and headers, then it is dropped; at most
MAX_CONNECTIONS_PER_CLIENT connections per client address and MAX_CONNECTIONS in all are
open, and a connection past either limit drops the oldest connection still sending its
headers (of its own address, or of the address holding the most), so slow clients make
room for whoever sends a request at once, as a scraper does. It is refused only when
every connection is already being answered.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hmac
import importlib.resources
import ipaddress
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

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
        show_tenants: whether clients are shown figures by tenant when no token is set
            (with a token, its holders always are).
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
        show_tenants: bool = False,
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
        # Admitted with a token set means holding it.
        self.shows_tenants = bool(token) or show_tenants
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


# Connections open at once, in all and per client address. 32 threads are cheap; one
# address (a Prometheus, a browser's few parallel fetches) needs a handful, and on loopback
# every local client shares 127.0.0.1, so the per-address limit is where slow clients are
# dropped to make room, not a quota that shuts a scraper out.
MAX_CONNECTIONS = 32
MAX_CONNECTIONS_PER_CLIENT = 16
# The request line and headers must arrive within this (a scraper sends them in one
# packet; a browser in a few): a slowloris holds a connection this long at most.
HEADER_DEADLINE_S = 3.0
# Each write of a reply must finish within this.
REQUEST_TIMEOUT_S = 5.0

# Replies are written in pieces this large: the socket's timeout bounds each write, so a
# slow link gets REQUEST_TIMEOUT_S per piece, not for all of plotly.js (about 5 MB).
WRITE_CHUNK = 256 * 1024


class _Connection:
    """One open connection: whose, since when, and whether it is still sending headers."""

    __slots__ = ("sock", "client", "opened", "reading", "dropped")

    def __init__(self, sock: socket.socket, client: str) -> None:
        self.sock = sock
        self.client = client
        self.opened = time.monotonic()
        self.reading = True
        self.dropped = False

    def drop(self) -> None:
        """End it from another thread: its reads return at once, and fail."""
        self.dropped = True
        with contextlib.suppress(OSError):  # already closed by its peer
            self.sock.shutdown(socket.SHUT_RDWR)


class _BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most MAX_CONNECTIONS of them, MAX_CONNECTIONS_PER_CLIENT
    per client address; slow senders of headers make room (see the module docstring)."""

    daemon_threads = True
    # The listen backlog: socketserver's 5 overflows when a burst of clients connects
    # faster than the loop accepts, and the kernel makes the rest retry a second later.
    request_queue_size = 2 * MAX_CONNECTIONS

    def __init__(self, address, handler) -> None:
        super().__init__(address, handler)
        self._lock = threading.Lock()
        self._open: dict[socket.socket, _Connection] = {}

    def process_request(self, request, client_address) -> None:
        connection = _Connection(request, client_address[0])
        with self._lock:
            admitted = self._make_room(connection.client)
            if admitted:
                self._open[request] = connection
        if not admitted:
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._open.pop(request, None)

    def handle_error(self, request, client_address) -> None:
        # A client that went, or was dropped, mid-reply: nothing to print for every one.
        log.debug("the metrics port lost a client %s", client_address, exc_info=True)

    def connection(self, request) -> _Connection:
        with self._lock:
            return self._open[request]

    def headers_read(self, connection: _Connection) -> None:
        with self._lock:
            connection.reading = False

    def _make_room(self, client: str) -> bool:
        """Drop what a new connection of `client` needs dropped; whether it may open.

        Over the per-address limit, the oldest of `client`'s connections still sending
        headers goes; over the total, the oldest such of the address holding the most."""
        live = [c for c in self._open.values() if not c.dropped]
        mine = [c for c in live if c.client == client]
        if len(mine) >= MAX_CONNECTIONS_PER_CLIENT:
            return self._drop_first(mine, key=lambda c: c.opened)
        if len(live) < MAX_CONNECTIONS:
            return True
        counts = collections.Counter(c.client for c in live)
        return self._drop_first(live, key=lambda c: (-counts[c.client], c.opened))

    @staticmethod
    def _drop_first(connections: list[_Connection], key) -> bool:
        """Drop the first by `key` of `connections` still sending headers; whether one was
        (none is when all are being answered)."""
        reading = [c for c in connections if c.reading]
        if not reading:
            return False
        min(reading, key=key).drop()
        return True


class _DeadlineReader:
    """A request's input, refusing to wait past its deadline for the request line and the
    headers: each read may take what is left of it, and a dropped connection reads
    nothing more."""

    def __init__(self, raw, connection: _Connection, deadline: float) -> None:
        self._raw = raw
        self._connection = connection
        self._deadline = deadline

    def readline(self, limit: int = -1) -> bytes:
        left = self._deadline - time.monotonic()
        if left <= 0 or self._connection.dropped:
            raise TimeoutError(f"no request line and headers within {HEADER_DEADLINE_S}s")
        self._connection.sock.settimeout(left)
        line = self._raw.readline(limit)
        if self._connection.dropped:
            raise TimeoutError("dropped to make room for other clients")
        return line

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class _TenantFree:
    """A registry's metrics with every sample labelled by tenant summed over tenants."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            if not any("tenant" in sample.labels for sample in family.samples):
                yield family
                continue
            sums: dict[tuple, float] = {}
            for sample in family.samples:
                labels = tuple((k, v) for k, v in sample.labels.items() if k != "tenant")
                key = (sample.name, labels)
                sums[key] = sums.get(key, 0.0) + sample.value
            summed = Metric(family.name, family.documentation, family.type, family.unit)
            summed.samples = [
                Sample(name, dict(labels), value) for (name, labels), value in sums.items()
            ]
            yield summed


def _handler(server: WebServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S

        def setup(self) -> None:
            super().setup()
            self._connection = self.server.connection(self.request)
            deadline = self._connection.opened + HEADER_DEADLINE_S
            self.rfile = _DeadlineReader(self.rfile, self._connection, deadline)

        def parse_request(self) -> bool:
            parsed = super().parse_request()
            self.server.headers_read(self._connection)
            if self._connection.dropped:  # dropped just before: its socket is shut
                raise TimeoutError("dropped to make room for other clients")
            self.connection.settimeout(REQUEST_TIMEOUT_S)  # now for the reply's writes
            return parsed

        def do_GET(self) -> None:  # noqa: N802 (the http.server name)
            path, _, query = self.path.partition("?")
            admitted = server.admits(
                self.headers.get("Authorization"), self.headers.get("Cookie"), query
            )
            if not admitted:
                self._reply(401, b"an access token is required\n", "text/plain")
            elif path == "/metrics":
                registry = server.registry if server.shows_tenants else _TenantFree(server.registry)
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
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
                data = server.dashboard()
                if not server.shows_tenants:
                    data = {**data, "tenants": []}
                body = json.dumps(data, allow_nan=False).encode()
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
