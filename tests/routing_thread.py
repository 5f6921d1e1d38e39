"""The router's request handler served by its own server (runtime/router/server.py), with its
connection limits, in a daemon thread on a free loopback port: the tests' way to drive the
router's HTTP layer over real sockets."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from typing import Iterator

from kvrt.runtime.http.body_limit import BODY_S
from kvrt.runtime.router.app import Router, create_handler
from kvrt.runtime.router.server import Limits, serve


@contextlib.contextmanager
def serving_router(router: Router, body_s: float = BODY_S, host: str = "127.0.0.1", **limits) -> Iterator[str]:
    """`router` on (host, a free port) (`limits`: fields of Limits); yields its base URL once it
    listens, and stops it (closing its upstream connections) on exit."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    listening = threading.Event()
    held: dict = {}

    async def run() -> None:
        held["loop"], held["stop"] = asyncio.get_running_loop(), asyncio.Event()
        try:
            await serve(create_handler(router, body_s), sock, held["stop"], Limits(**limits), listening.set)
        finally:
            await router.aclose()

    t = threading.Thread(target=asyncio.run, args=(run(),), name="test-router", daemon=True)
    t.start()
    assert listening.wait(10), "the router's server did not listen within 10 s"
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        held["loop"].call_soon_threadsafe(held["stop"].set)
        t.join(10)
        sock.close()
