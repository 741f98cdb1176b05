"""A bare ZMQ bulk transfer: the baseline a page server is measured against, and the probe
of a link's rate before any copy was timed (`costs.measure_links`)."""

from __future__ import annotations

import threading

import torch
import zmq

from cache_service.auth import KeyPair


class RawZmqPipe:
    """A bare ZMQ bulk transfer over loopback TCP: the baseline for the page server.

    The same frames as a page fetch, sent zero-copy out of one buffer and received with
    `recv_into` another; sockets and buffers are set up once, outside any timing. The
    sender has a context (an I/O thread) of its own, as a page server does.

    Args:
        curve: CurveZMQ on both ends (the sender is the CURVE server, as a page server
            is), to compare with an encrypting page server.
    """

    def __init__(self, nbytes: int, frame_bytes: int, curve: bool = False):
        self._context = zmq.Context()
        self._push = self._context.socket(zmq.PUSH)
        self._pull = zmq.Context.instance().socket(zmq.PULL)
        self._push.linger = self._pull.linger = 0
        if curve:
            server, client = KeyPair.generate(), KeyPair.generate()
            self._push.curve_secretkey, self._push.curve_publickey = server.secret, server.public
            self._push.curve_server = True  # no ZAP handler in this context: any client
            self._pull.curve_secretkey, self._pull.curve_publickey = client.secret, client.public
            self._pull.curve_serverkey = server.public
        port = self._push.bind_to_random_port("tcp://127.0.0.1")
        self._pull.connect(f"tcp://127.0.0.1:{port}")
        self.frames = max(1, nbytes // frame_bytes)
        self.frame_bytes = frame_bytes
        self._src = torch.ones(self.frames * frame_bytes, dtype=torch.uint8)
        self._dst = torch.zeros_like(self._src)

    def transfer(self) -> None:
        """Move every frame once, sender in a thread, receiver here."""
        src, dst, size = (
            memoryview(self._src.numpy()),
            memoryview(self._dst.numpy()),
            self.frame_bytes,
        )

        def send() -> None:
            for i in range(self.frames):
                more = zmq.SNDMORE if i + 1 < self.frames else 0
                self._push.send(src[i * size : (i + 1) * size], more, copy=False)

        thread = threading.Thread(target=send, name="kvmesh-rawpipe")
        thread.start()
        for i in range(self.frames):
            self._pull.recv_into(dst[i * size : (i + 1) * size])
        thread.join()

    def close(self) -> None:
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._context.term()
