"""A TCP relay in front of one page server that kills the server's process in the middle of
a reply.

The copier is pointed at the relay instead of the page server. The relay passes bytes both
ways until `kill_after` bytes of the server's reply have reached the copier; then it
SIGKILLs the server's process and drops the copier's connection, as the copier would see a
holder that died while sending. What the dying server had already written past that point
is read and counted (`withheld`), never passed on: the copier holds a reply cut at exactly
`kill_after` bytes. Only the first connection is relayed; later ones are closed at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie counts: it runs no more)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


class KillingRelay:
    def __init__(self, target: str, pid: int, kill_after: int):
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host, int(port))
        self._pid = pid
        self.kill_after = kill_after
        self.forwarded = 0  # reply bytes passed to the copier
        self.withheld = 0  # reply bytes the server sent after the cut, never passed on
        self.requested = 0  # bytes from the copier to the server
        self.killed_at: float | None = None  # time.monotonic() of the SIGKILL
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, name="killing-relay")]
        self._threads[0].start()

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            if self.connections > 1:
                client.close()
                continue
            upstream = socket.create_connection(self._target, timeout=10)
            upstream.settimeout(None)
            requests = threading.Thread(target=self._requests, args=(client, upstream))
            requests.start()
            self._threads.append(requests)
            self._replies(upstream, client)

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(1 << 16):
                self.requested += len(data)
                upstream.sendall(data)

    def _replies(self, upstream: socket.socket, client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := upstream.recv(1 << 16):
                room = self.kill_after - self.forwarded
                if room > 0:
                    client.sendall(data[:room])
                    self.forwarded += min(room, len(data))
                if len(data) > room:
                    self.withheld += len(data) - max(room, 0)
                    if self.killed_at is None:
                        self._kill()
                        # The copier's connection breaks here (shutdown: the requests
                        # thread still reads this socket; a bare close would wait for it).
                        client.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            client.close()
        upstream.close()

    def _kill(self) -> None:
        os.kill(self._pid, signal.SIGKILL)
        self.killed_at = time.monotonic()
        deadline = self.killed_at + 10
        while not _gone(self._pid) and time.monotonic() < deadline:
            time.sleep(0.01)
