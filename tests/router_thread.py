"""A ZeroMQ ROUTER on a random loopback port, served in a daemon thread: the base of the tests'
scripted nodes, which play the engine's side of runtime/client/api.py over real sockets."""
from __future__ import annotations

import threading

import zmq

from kvrt.runtime.client.api import API


class RouterThread:
    """Subclasses set their own fields, then call `_start()`; `_serve()` runs until the context
    exits (it checks `_stop`), and `_send` answers one client by its identity."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.received: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def _serve(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)
        self.ctx.term()

    def _send(self, ident: bytes, msg) -> None:
        self.sock.send_multipart([ident, API.encode(msg)])
