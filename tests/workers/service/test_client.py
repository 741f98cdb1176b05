"""The service client's circuit breaker, against a real server on loopback.

The breaker runs on a fake clock moved by hand, so no test sleeps through a backoff; the
tries' own timeouts are real and short. Time is asserted only loosely (a skip costs far
less than one try); the counters (`reconnects`, `skipped`, `probes`, `outages`) pin what
touched the network.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from cache_service.events import Namespace
from cache_service.server import ServerConfig, ServiceServer, make_server
from workers.service.client import (
    ServiceClient,
    ServiceEndpoint,
    ServiceError,
    ServiceSkipped,
    ServiceUnavailable,
)

NS = Namespace("m", salt="t1")
TIMEOUT = 0.1  # one try; a failed call with retries=1 costs two of these


class FakeClock:
    """The breaker's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Rig:
    """Servers and clients made by one test, all stopped and closed at its end."""

    def __init__(self) -> None:
        self.servers: list[ServiceServer] = []
        self.clients: list[ServiceClient] = []

    def server(self, port: int = 0) -> ServiceServer:
        """A started server; at a given port, retrying briefly while the old one lets go."""
        config = ServerConfig(page_tokens=4, port=port, metrics_host=None)
        deadline = time.monotonic() + 2.0
        while True:
            server = make_server(config)
            try:
                server.start()
                break
            except zmq.ZMQError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.servers.append(server)
        return server

    def client(self, endpoint, **kw) -> ServiceClient:
        kw.setdefault("timeout_s", TIMEOUT)
        kw.setdefault("retries", 1)
        if isinstance(endpoint, str):
            endpoint = ServiceEndpoint(endpoint)
        client = ServiceClient(endpoint, **kw)
        self.clients.append(client)
        return client

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for server in self.servers:
            server.stop()


@pytest.fixture
def rig() -> Iterator[Rig]:
    rig = Rig()
    yield rig
    rig.close()


def _port(server: ServiceServer) -> int:
    return int(server.address.rsplit(":", 1)[1])


def _skips(client: ServiceClient, calls: int) -> float:
    """Make `calls` calls that must all be skipped; the seconds they took together."""
    start = time.monotonic()
    for _ in range(calls):
        with pytest.raises(ServiceSkipped):
            client.match(NS, [1, 2, 3, 4])
    return time.monotonic() - start


def test_an_outage_skips_calls_then_probes_with_a_doubling_capped_backoff(rig):
    server = rig.server()
    clock = FakeClock()
    client = rig.client(server.address, backoff_s=1.0, max_backoff_s=3.0, clock=clock)
    client.stats()
    assert (client.circuit_open, client.outages, client.reconnects) == (False, 0, 0)
    server.stop()

    # The first call pays the timeouts (it is not a skip) and opens the breaker.
    with pytest.raises(ServiceUnavailable, match="after 2 tries of 0.1s") as info:
        client.stats()
    assert not isinstance(info.value, ServiceSkipped)
    assert (client.circuit_open, client.outages, client.reconnects) == (True, 1, 2)
    assert client.current_backoff_s == 1.0

    # Within the backoff: refused at once, no socket touched.
    assert _skips(client, 5) < TIMEOUT
    assert (client.skipped, client.reconnects, client.probes) == (5, 2, 0)
    clock.advance(0.6)
    with pytest.raises(ServiceSkipped) as info:
        client.heartbeat("w0", 1)
    message = str(info.value)
    assert message.startswith("service skipped for 0.4s more after no reply from tcp://127.0.0.1:")
    assert message.endswith("('stats' after 2 tries of 0.1s)")
    assert info.value.retry_in_s == pytest.approx(0.4)
    assert client.skipped == 6

    # The backoff has passed: the next call is a probe of one try; it fails and the
    # breaker opens again for twice as long.
    clock.advance(0.4)
    assert not client.circuit_open
    with pytest.raises(ServiceUnavailable, match="after 1 try of 0.1s") as info:
        client.match(NS, [1, 2, 3, 4])
    assert not isinstance(info.value, ServiceSkipped)
    assert (client.probes, client.reconnects, client.outages) == (1, 3, 1)
    assert client.circuit_open and client.current_backoff_s == 2.0

    clock.advance(1.9)
    assert _skips(client, 1) < TIMEOUT
    clock.advance(0.1)
    with pytest.raises(ServiceUnavailable):
        client.stats()
    assert client.current_backoff_s == 3.0  # 4.0, capped at max_backoff_s
    clock.advance(3.0)
    with pytest.raises(ServiceUnavailable):
        client.stats()
    assert client.current_backoff_s == 3.0
    assert (client.probes, client.reconnects, client.outages, client.skipped) == (3, 5, 1, 7)


def test_a_service_back_at_the_same_port_is_found_by_the_probe(rig):
    server = rig.server()
    port = _port(server)
    clock = FakeClock()
    client = rig.client(server.address, backoff_s=1.0, clock=clock)
    assert client.max_backoff_s == 8.0
    client.stats()
    server.stop()
    with pytest.raises(ServiceUnavailable):
        client.stats()
    clock.advance(1.0)
    with pytest.raises(ServiceUnavailable):
        client.stats()  # a failed probe: the next skip lasts 2s
    assert client.current_backoff_s == 2.0

    rig.server(port=port)
    assert _skips(client, 2) < TIMEOUT  # still in its backoff: the new server is not asked
    clock.advance(2.0)
    assert client.match(NS, [1, 2, 3, 4]).matched_tokens == 0  # the probe: answered
    assert not client.circuit_open
    assert client.current_backoff_s == 1.0
    assert (client.probes, client.outages, client.skipped, client.reconnects) == (2, 1, 2, 3)
    client.stats()  # closed: calls go through as before
    assert client.reconnects == 3


def test_the_probe_follows_a_resolver_and_an_error_reply_closes_the_breaker(rig):
    current = {"server": rig.server()}
    clock = FakeClock()
    client = rig.client(
        lambda: ServiceEndpoint(current["server"].address), backoff_s=0.5, clock=clock
    )
    # An error reply is an answer: the breaker stays closed.
    with pytest.raises(ServiceError) as info:
        client.heartbeat("ghost", 1)
    assert info.value.code == "unknown_worker"
    assert (client.circuit_open, client.outages) == (False, 0)

    current["server"].stop()
    with pytest.raises(ServiceUnavailable):
        client.stats()
    assert client.circuit_open
    current["server"] = rig.server()  # restarted elsewhere: a new port
    clock.advance(0.5)
    with pytest.raises(ServiceError) as info:
        client.heartbeat("ghost", 1)  # the probe reaches the new address: answered
    assert info.value.code == "unknown_worker"
    assert not client.circuit_open
    assert (client.probes, client.outages, client.current_backoff_s) == (1, 1, 0.5)

    # A later outage opens it anew, with the first backoff again.
    current["server"].stop()
    with pytest.raises(ServiceUnavailable):
        client.stats()
    assert (client.circuit_open, client.outages, client.current_backoff_s) == (True, 2, 0.5)


def test_without_backoff_every_call_tries(rig):
    server = rig.server()
    client = rig.client(server.address, retries=0)
    client.stats()
    server.stop()
    for _ in range(3):
        with pytest.raises(ServiceUnavailable) as info:
            client.stats()
        assert not isinstance(info.value, ServiceSkipped)
    assert client.reconnects == 3
    assert (client.circuit_open, client.skipped, client.outages, client.probes) == (
        False,
        0,
        0,
        0,
    )


@pytest.mark.parametrize(
    ("kw", "numbers"),
    [
        ({"backoff_s": -1.0}, "-1.0"),
        ({"backoff_s": float("nan")}, "nan"),
        ({"backoff_s": float("inf")}, "inf"),
        ({"backoff_s": 1.0, "max_backoff_s": 0.5}, r"backoff_s \(1.0\), got 0.5"),
        ({"backoff_s": 1.0, "max_backoff_s": float("inf")}, r"\(1.0\), got inf"),
    ],
)
def test_bad_breaker_arguments_are_refused_with_their_numbers(kw, numbers):
    with pytest.raises(ValueError, match=numbers):
        ServiceClient(ServiceEndpoint("tcp://127.0.0.1:1"), **kw)


def test_a_skip_survives_pickling():
    skipped = ServiceSkipped("service skipped for 0.5s more after no reply from x", 0.5)
    copy = pickle.loads(pickle.dumps(skipped))
    assert isinstance(copy, ServiceUnavailable)
    assert (str(copy), copy.retry_in_s) == (str(skipped), 0.5)


def _open_breaker(rig: Rig, **kw) -> tuple[ServiceClient, FakeClock]:
    server = rig.server()
    clock = FakeClock()
    client = rig.client(server.address, backoff_s=1.0, clock=clock, **kw)
    client.stats()
    server.stop()
    with pytest.raises(ServiceUnavailable):
        client.stats()
    assert client.circuit_open
    return client, clock


def _run_threads(target, count: int) -> None:
    threads = [
        threading.Thread(target=target, name=f"test-caller-{i}", daemon=True) for i in range(count)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5.0)
    assert not any(thread.is_alive() for thread in threads), "a caller is stuck"


def test_many_threads_are_all_skipped_while_open(rig):
    client, _ = _open_breaker(rig)
    reconnects = client.reconnects
    outcomes: list[type] = []
    outcomes_lock = threading.Lock()

    def caller() -> None:
        for _ in range(25):
            try:
                client.match(NS, [1, 2, 3, 4])
                kind: type = object
            except Exception as exc:  # every outcome is recorded, the wrong ones too
                kind = type(exc)
            with outcomes_lock:
                outcomes.append(kind)

    _run_threads(caller, 16)
    assert outcomes == [ServiceSkipped] * 400
    assert (client.skipped, client.reconnects, client.probes) == (400, reconnects, 0)


def test_while_a_probe_is_in_flight_the_other_callers_are_skipped_at_once(rig):
    client, clock = _open_breaker(rig, timeout_s=0.5, retries=0)
    clock.advance(1.0)
    probe_outcome: list[BaseException] = []

    def probe() -> None:
        try:
            client.stats()
        except ServiceUnavailable as exc:
            probe_outcome.append(exc)

    prober = threading.Thread(target=probe, name="test-prober", daemon=True)
    prober.start()
    deadline = time.monotonic() + 2.0
    while not client.circuit_open and time.monotonic() < deadline:
        time.sleep(0.001)  # until the probe has claimed its try
    start = time.monotonic()
    with pytest.raises(ServiceSkipped, match="while a probe runs"):
        client.match(NS, [1, 2, 3, 4])
    assert time.monotonic() - start < 0.25  # it did not wait for the probe's 0.5s try
    prober.join(5.0)
    assert not prober.is_alive()
    assert len(probe_outcome) == 1 and not isinstance(probe_outcome[0], ServiceSkipped)
    assert (client.probes, client.skipped, client.current_backoff_s) == (1, 1, 2.0)


def test_without_probes_calls_are_skipped_until_the_owner_reconnects(rig):
    """A request-path client never probes: something off the request path (the worker's
    heartbeat, the front door's watchdog) sees the service answer and reconnects it."""
    server = rig.server()
    port = _port(server)
    clock = FakeClock()
    client = rig.client(server.address, backoff_s=1.0, retries=0, clock=clock, probe=False)
    client.stats()
    server.stop()
    with pytest.raises(ServiceUnavailable) as info:
        client.stats()
    assert not isinstance(info.value, ServiceSkipped)
    clock.advance(60.0)  # long past any backoff: still no probe from a request
    with pytest.raises(ServiceSkipped, match="until it is seen answering again"):
        client.stats()
    assert client.circuit_open and client.probes == 0 and client.reconnects == 1
    rig.server(port=port)
    assert client.circuit_open  # the service is back, but no request found out by waiting
    client.reconnect()
    assert not client.circuit_open
    assert client.stats()["pages"] == 0
