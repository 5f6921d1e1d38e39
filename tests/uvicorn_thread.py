"""An ASGI app served by uvicorn, with kvrt's HTTP guards, in a daemon thread on a free loopback
port: the tests' way to drive a node's or the router's HTTP layer over real sockets."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator

import uvicorn

from kvrt.runtime.http.connections import uvicorn_config


@contextlib.contextmanager
def serving(app, host: str = "127.0.0.1", **guard) -> Iterator[str]:
    """`app` on (host, a free port) with the guarded protocol (`guard`: its limits); yields its
    base URL once it listens, and stops it on exit."""
    with serving_server(app, host, **guard) as (url, _):
        yield url


@contextlib.contextmanager
def serving_server(app, host: str = "127.0.0.1", **guard) -> Iterator[tuple[str, uvicorn.Server]]:
    """`serving`, also yielding the uvicorn server, whose state holds each connection's protocol."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn_config(app, host, sock.getsockname()[1], **guard))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-uvicorn", daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert t.is_alive() and time.monotonic() < deadline, "uvicorn did not start within 10 s"
        time.sleep(0.01)  # waiting for another thread to bind
    try:
        yield f"http://{host}:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        t.join(10)
        sock.close()
