"""A backend that answers at once: `kvrt bench route --cost-only --cost-backend instant` puts the
routers in front of it instead of a node.

Why: a node's own time for a one-token request (10-20 ms here) varies from one request to the
next by more than a router's whole cost, so a router's cost measured over a node is a small
difference of two noisy numbers. Over a backend that answers every completion with the same
small body, without computing anything, what a router adds is most of what is measured. It
answers `/health` (200), `/kvrt/cache` (404: no cache to describe, so `kvrt route` has no
events to follow) and every POST with one completion.

`python -m kvrt.bench.instant_backend PORT` serves on 127.0.0.1:PORT until SIGINT or SIGTERM.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import sys

from aiohttp import web

COMPLETION = json.dumps({"id": "cmpl-instant", "object": "text_completion", "created": 0, "model": "kvrt-reference",
                         "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()


async def _answer(request: web.BaseRequest) -> web.Response:
    if request.method == "POST":
        await request.read()
        return web.Response(body=COMPLETION, content_type="application/json")
    if request.path == "/health":
        return web.Response(body=b'{"status": "ok"}', content_type="application/json")
    return web.Response(status=404)


async def serve(port: int) -> None:
    """Serve on 127.0.0.1:`port` until SIGINT or SIGTERM."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = web.Server(_answer)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    listening = await loop.create_server(lambda: web.RequestHandler(server, loop=loop, access_log=None), sock=sock)
    await stop.wait()
    listening.close()
    await server.shutdown(1.0)


if __name__ == "__main__":
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)  # SGLang's router tries HTTP/2 first: a 400 each
    asyncio.run(serve(int(sys.argv[1])))
