"""The metrics port answers every scraper in bounded time, and shows tokenless local
users no tenant.

Findings covered: 16 connections each sending one header line a second made 15 of 15
scrapes fail over 30 s, no token needed; on loopback without a token the port served
tenant names to any user of the machine.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cache_service.web import HEADER_DEADLINE_S, WebServer

TOKEN = "t0ken"
SLOW_CLIENTS = 20  # more than the 16 that took every slot
ATTACK_S = HEADER_DEADLINE_S + 1.5  # every slow connection is dropped at least once


class Tenants:
    """A collector with figures by worker and by tenant, as the service's has."""

    def collect(self):
        live = GaugeMetricFamily("kvmesh_workers_live", "Workers alive.", value=2)
        hits = CounterMetricFamily("kvmesh_hit_tokens", "Hit tokens.", labels=["worker", "tenant"])
        hits.add_metric(["w0", "acme"], 30)
        hits.add_metric(["w0", "globex"], 12)
        hits.add_metric(["w1", "acme"], 5)
        yield from (live, hits)


def dashboard() -> dict:
    return {"workers": [{"worker": "w0"}], "tenants": [{"tenant": "acme", "requests": 3}]}


def web_server(token: str = "", **kwargs) -> WebServer:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Tenants())
    server = WebServer(registry, "127.0.0.1", token=token, dashboard=dashboard, **kwargs)
    server.start()
    return server


def get(url: str, token: str = "", timeout_s: float = 5.0) -> str:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        return reply.read().decode()


class Slowloris:
    """Connections that each send a request line, then one header line a second, never
    ending their headers; one dropped by the server is opened again at once."""

    def __init__(self, address: tuple[str, int], n: int) -> None:
        self.address = address
        self.sockets = [self._open() for _ in range(n)]
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _open(self) -> socket.socket:
        sock = socket.create_connection(self.address)
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        return sock

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for i, sock in enumerate(self.sockets):
                try:
                    sock.sendall(b"X-Slow: 1\r\n")
                except OSError:  # dropped by the server
                    sock.close()
                    self.sockets[i] = self._open()
                    self.reopened += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self.sockets:
            sock.close()


@pytest.mark.parametrize("token", ["", TOKEN], ids=["no-token", "token"])
def test_scrapes_answer_during_a_slowloris(token):
    server = web_server(token)
    host, port = server.url.removeprefix("http://").split(":")
    attack = Slowloris((host, int(port)), SLOW_CLIENTS)
    try:
        time.sleep(0.5)  # every slow connection is open and sending
        scrapes, slowest = 0, 0.0
        end = time.monotonic() + ATTACK_S
        while time.monotonic() < end:
            start = time.monotonic()
            assert "kvmesh_workers_live 2.0" in get(server.url + "/metrics", token)
            slowest = max(slowest, time.monotonic() - start)
            scrapes += 1
            time.sleep(0.2)
        assert scrapes >= 10 and slowest < 2.0, (scrapes, slowest)
        assert attack.reopened >= SLOW_CLIENTS // 2  # the slow ones were dropped, not served
    finally:
        attack.stop()
        server.stop()


def test_a_tokenless_local_client_sees_no_tenant_by_default():
    server = web_server()
    try:
        metrics = get(server.url + "/metrics")
        assert "acme" not in metrics and "globex" not in metrics
        # The figures are all there, summed over tenants.
        assert 'kvmesh_hit_tokens_total{worker="w0"} 42.0' in metrics
        assert 'kvmesh_hit_tokens_total{worker="w1"} 5.0' in metrics
        assert "kvmesh_workers_live 2.0" in metrics
        data = json.loads(get(server.url + "/api/dashboard"))
        assert data == {"workers": [{"worker": "w0"}], "tenants": []}
    finally:
        server.stop()


@pytest.mark.parametrize("how", ["switch", "token"])
def test_tenant_rows_show_to_token_holders_or_when_allowed(how):
    token = TOKEN if how == "token" else ""
    server = web_server(token, show_tenants=how == "switch")
    try:
        metrics = get(server.url + "/metrics", token)
        assert 'kvmesh_hit_tokens_total{tenant="acme",worker="w0"} 30.0' in metrics
        assert json.loads(get(server.url + "/api/dashboard", token)) == dashboard()
    finally:
        server.stop()
