"""A ZMQ proxy between workers and the service that loses, repeats and reorders event
batches: the transport faults of the reliability tests.

    client DEALER --> [ROUTER  proxy  DEALER per client identity] --> service ROUTER
                  <--                                              <--

Each client identity the proxy's ROUTER sees gets a DEALER of its own towards the service,
so the service's reply comes back on that DEALER and goes out to the identity that asked.
Request frames whose envelope type is "events" meet a fault, drawn per worker from a
seeded `random.Random`:

- drop: the frame never reaches the service;
- duplicate: it reaches the service twice, back to back;
- reorder: it is held back and sent after the worker's next events frame.

Every other frame, and every reply, passes untouched. The proxy reads a frame's envelope
with plain msgpack (its type "t", and for events the body's worker id), never with the
service's codec: it must not share the code it puts to the test.

A worker's client waits for each reply (Lazy Pirate), so its next events frame after a
held one is the retry of the same batch, sent after a timeout from a fresh socket (a new
identity here). Faults are therefore drawn and held per worker, not per identity: one
draw per events frame of that worker, in the order they arrive, so a seed replays the same
faults for the same traffic. The held frame goes out on its old identity's route, and its
reply is lost with that socket, as a late frame's would be.

The service must run without CurveZMQ keys behind this proxy: CURVE would make the
frames opaque to it (and bind each connection to its key). The faults are the
transport's; what the tests check is how the index repairs them, which does not depend
on the encryption of the link.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from typing import NamedTuple

import msgpack
import zmq

DROP = "drop"
DUPLICATE = "duplicate"
REORDER = "reorder"
FORWARD = "forward"

POLL_MS = 20  # how often the loop looks at its controls (pass through, stop)
# A route (a client identity's DEALER) idle this long with nothing awaiting a reply is
# closed: every Lazy Pirate retry brings a new identity, and the dead ones would pile up.
IDLE_ROUTE_S = 2.0


class FaultCounts(NamedTuple):
    """What the proxy did to the events frames it saw while faults were on."""

    forwarded: int  # passed on once, at once
    dropped: int
    duplicated: int
    reordered: int  # held back, then sent after the worker's next events frame


class _Route:
    """One client identity's DEALER to the service."""

    __slots__ = ("identity", "socket", "last_used", "awaiting")

    def __init__(self, identity: bytes, socket: zmq.Socket):
        self.identity = identity
        self.socket = socket
        self.last_used = time.monotonic()
        self.awaiting = 0  # frames sent to the service whose reply has not come back


class LossyProxy:
    """Forwards clients' frames to `server_address`, with faults on events frames.

    Args:
        server_address: the service's endpoint, e.g. "tcp://127.0.0.1:40123".
        seed: the faults' seed; each worker's draws come from Random(f"{seed}/{worker}").
        drop, duplicate, reorder: each fault's probability per events frame (10% in all
            by default).
        host: the address the proxy binds (loopback).

    Raises:
        ValueError: a probability outside [0, 1], or their sum above 1.
    """

    def __init__(
        self,
        server_address: str,
        seed: int,
        drop: float = 0.04,
        duplicate: float = 0.03,
        reorder: float = 0.03,
        host: str = "127.0.0.1",
    ):
        for name, p in (("drop", drop), ("duplicate", duplicate), ("reorder", reorder)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{name} probability must be in [0, 1], got {p}")
        if drop + duplicate + reorder > 1.0:
            raise ValueError(f"fault probabilities sum to {drop + duplicate + reorder} > 1")
        self.server_address = server_address
        self.seed = seed
        self.host = host
        self._thresholds = ((drop, DROP), (drop + duplicate, DUPLICATE))
        self._reorder_below = drop + duplicate + reorder
        self._context = zmq.Context.instance()
        self._front: zmq.Socket | None = None
        self._address = ""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None  # what stopped the loop, raised by close()
        # Shared with callers' threads: the counters, the fault log, the controls.
        self._lock = threading.Lock()
        self._counts = {FORWARD: 0, DROP: 0, DUPLICATE: 0, REORDER: 0}
        self._log: dict[str, list[tuple[int, str]]] = {}
        self._faults_on = True
        self._passthrough_done = threading.Event()
        self._in_flight = 0  # frames sent to the service and not answered yet
        self._holding = 0  # frames held back
        # The loop's own state.
        self._rngs: dict[str, random.Random] = {}
        self._routes: dict[bytes, _Route] = {}
        self._by_socket: dict[zmq.Socket, _Route] = {}
        self._held: dict[str, tuple[bytes, list[bytes]]] = {}  # worker -> (identity, frames)
        self._poller = zmq.Poller()

    @property
    def address(self) -> str:
        """Where clients connect, e.g. "tcp://127.0.0.1:40124" ("" before start)."""
        return self._address

    def start(self) -> str:
        """Bind and start forwarding in a daemon thread; returns the proxy's address."""
        if self._thread is not None:
            raise RuntimeError("proxy already started")
        front = self._context.socket(zmq.ROUTER)
        front.linger = 0
        port = front.bind_to_random_port(f"tcp://{self.host}")
        self._front, self._address = front, f"tcp://{self.host}:{port}"
        self._poller.register(front, zmq.POLLIN)
        # The socket moves to the loop thread here and is used by no other from now on.
        self._thread = threading.Thread(
            target=self._loop, name="kvmesh-test-lossy-proxy", daemon=True
        )
        self._thread.start()
        return self._address

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the loop and close every socket (idempotent).

        Raises:
            RuntimeError: the loop had failed (with its error as the cause).
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            assert not self._thread.is_alive(), "the lossy proxy's thread did not stop"
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("the lossy proxy's loop failed") from error

    # ------------------------------------------------------------------ controls

    def pass_through(self, timeout_s: float = 5.0) -> None:
        """Stop making faults: from now on every frame passes once, in order, and the
        frames still held back are sent now (before this returns)."""
        with self._lock:
            self._faults_on = False
        if not self._passthrough_done.wait(timeout_s):
            raise TimeoutError(f"the proxy did not release its held frames in {timeout_s}s")

    def settle(self, timeout_s: float = 5.0) -> None:
        """Wait until every frame sent to the service has been answered, so none is still
        on its way to the index.

        Raises:
            TimeoutError: frames still unanswered after `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                waiting = self._in_flight + self._holding
            if waiting == 0:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{waiting} frames still unanswered after {timeout_s}s")
            time.sleep(0.01)

    @property
    def counts(self) -> FaultCounts:
        """The faults made so far."""
        with self._lock:
            c = self._counts
            return FaultCounts(c[FORWARD], c[DROP], c[DUPLICATE], c[REORDER])

    def fault_log(self) -> dict[str, list[tuple[int, str]]]:
        """Per worker, (batch seq, fault) of each events frame met while faults were on."""
        with self._lock:
            return {worker: list(entries) for worker, entries in self._log.items()}

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        front = self._front
        try:
            while not self._stop.is_set():
                ready = dict(self._poller.poll(POLL_MS))
                if front in ready:
                    self._drain_clients(front)
                for socket in [s for s in ready if s is not front]:
                    self._drain_replies(front, socket)
                with self._lock:
                    faults_on = self._faults_on
                if not faults_on and not self._passthrough_done.is_set():
                    for worker in sorted(self._held):
                        self._release(worker)
                    self._passthrough_done.set()
                self._prune_routes()
        except BaseException as exc:  # handed to close(): the test must not pass on it
            self._error = exc
        finally:
            for route in self._routes.values():
                route.socket.close(linger=0)
            self._routes.clear()
            self._by_socket.clear()
            front.close(linger=0)

    def _drain_clients(self, front: zmq.Socket) -> None:
        while True:
            try:
                identity, *frames = front.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._from_client(identity, frames)

    def _drain_replies(self, front: zmq.Socket, socket: zmq.Socket) -> None:
        route = self._by_socket.get(socket)
        while route is not None:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            route.awaiting -= 1
            with self._lock:
                self._in_flight -= 1
            # To an identity that is gone (a client that gave up), the reply is lost.
            with contextlib.suppress(zmq.Again):
                front.send_multipart([route.identity, *frames], zmq.NOBLOCK)

    def _from_client(self, identity: bytes, frames: list[bytes]) -> None:
        worker, seq = _events_of(frames)
        with self._lock:
            faults_on = self._faults_on
        if worker is None or not faults_on:
            self._send(identity, frames)
            return
        fault = self._draw(worker)
        held = self._held.pop(worker, None)
        if fault == REORDER and held is None:
            self._held[worker] = (identity, frames)
        elif fault == DROP:
            pass
        elif fault == DUPLICATE:
            self._send(identity, frames)
            self._send(identity, frames)
        else:
            fault = FORWARD  # a reorder while one frame is held already: this one passes
            self._send(identity, frames)
        with self._lock:
            self._counts[fault] += 1
            self._log.setdefault(worker, []).append((seq, fault))
            self._holding = len(self._held)
        if held is not None:  # after the worker's next frame, the one held back
            self._send(*held)

    def _draw(self, worker: str) -> str:
        rng = self._rngs.get(worker)
        if rng is None:
            rng = self._rngs[worker] = random.Random(f"{self.seed}/{worker}")
        x = rng.random()
        for below, fault in self._thresholds:
            if x < below:
                return fault
        return REORDER if x < self._reorder_below else FORWARD

    def _release(self, worker: str) -> None:
        held = self._held.pop(worker, None)
        if held is not None:
            self._send(*held)
        with self._lock:
            self._holding = len(self._held)

    def _send(self, identity: bytes, frames: list[bytes]) -> None:
        route = self._routes.get(identity)
        if route is None:
            socket = self._context.socket(zmq.DEALER)
            socket.linger = 0
            socket.connect(self.server_address)
            route = self._routes[identity] = _Route(identity, socket)
            self._by_socket[socket] = route
            self._poller.register(socket, zmq.POLLIN)
        route.socket.send_multipart(frames)
        route.awaiting += 1
        route.last_used = time.monotonic()
        with self._lock:
            self._in_flight += 1

    def _prune_routes(self) -> None:
        now = time.monotonic()
        idle = [
            route
            for route in self._routes.values()
            if route.awaiting == 0 and now - route.last_used > IDLE_ROUTE_S
        ]
        for route in idle:
            self._poller.unregister(route.socket)
            del self._routes[route.identity], self._by_socket[route.socket]
            route.socket.close(linger=0)


def _events_of(frames: list[bytes]) -> tuple[str | None, int]:
    """(worker id, batch seq) of an events request frame; (None, 0) for any other frame."""
    if len(frames) != 1:
        return None, 0
    try:
        envelope = msgpack.unpackb(frames[0], raw=False)
    except Exception:  # not msgpack: not the proxy's business, the service answers it
        return None, 0
    if not isinstance(envelope, dict) or envelope.get("t") != "events":
        return None, 0
    body = envelope.get("b")
    worker = body.get("worker_id") if isinstance(body, dict) else None
    if not isinstance(worker, str):
        return None, 0
    seq = body.get("seq")
    return worker, seq if isinstance(seq, int) else 0
