"""Bounded request bodies on an HTTP port (a node's and `kvrt route`'s): at most a size, read
within a time, both checked while the body streams in.

Why a middleware that counts: FastAPI reads a body whole before the handler runs, so without a
limit an untrusted client makes the server hold any amount of memory; a body sent with chunked
encoding declares no length, so it is counted as its pieces arrive and refused (413) as soon as
it passes the limit, and one that declares a length over the limit is refused before any of it
is read. A body that trickles in (a slowloris on the body) is cut with a 408 once BODY_S have
passed since its headers. Either answer closes the connection (the rest of the body is never
read) and the app sees the client as gone.

The limit follows from the model's length: the client API's largest message (runtime/client/api.py
max_message_bytes, the longest prompt as int32) times JSON_FACTOR, room for a batch of long
prompts as JSON token ids or escaped text.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from kvrt.runtime.client.api import max_message_bytes
from kvrt.runtime.http.connections import refusal

BODY_S = 30.0         # a request's whole body must arrive within this long of its headers
JSON_FACTOR = 64      # HTTP body bytes per client-API message byte: a batch of prompts, tokens as escaped JSON text
DEFAULT_MODEL_LEN = 32768  # the limit's model length until the served one is known


def max_body_bytes(max_model_len: int) -> int:
    """The largest request body an HTTP server in front of a model of this length reads."""
    return JSON_FACTOR * max_message_bytes(max_model_len)


class BodyLimit:
    """ASGI middleware: a body over `limit()` bytes is a 413 and one not whole within `body_s`
    a 408, answered as soon as known; the app then reads a disconnect and its own answer is
    dropped. `limit` is a callable so that a server learns its model's length after it starts."""

    def __init__(self, app, limit: Callable[[], int] = lambda: max_body_bytes(DEFAULT_MODEL_LEN),
                 body_s: float = BODY_S) -> None:
        self.app = app
        self.limit = limit
        self.body_s = body_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit()
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _answer(send, 413, "Content Too Large", f"a request body takes at most {limit} bytes",
                                 "body_too_large")
        deadline = time.monotonic() + self.body_s
        seen, whole, answered = 0, False, False

        async def counted():
            nonlocal seen, whole, answered
            if answered:
                return {"type": "http.disconnect"}
            if whole:  # the body is in: what comes now is the client leaving
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                answered = True
                await _answer(send, 408, "Request Timeout", f"the request body did not arrive within "
                              f"{self.body_s:g} s of its headers", "body_timeout")
                return {"type": "http.disconnect"}
            seen += len(msg.get("body", b""))
            whole = not msg.get("more_body", False)
            if seen > limit:
                answered = True
                await _answer(send, 413, "Content Too Large", f"a request body takes at most {limit} bytes",
                              "body_too_large")
                return {"type": "http.disconnect"}
            return msg

        async def guarded_send(msg) -> None:
            if not answered:  # after a refusal the app's own answer goes nowhere
                await send(msg)

        try:
            await self.app(scope, counted, guarded_send)
        except Exception:  # noqa: BLE001 - what the app made of the disconnect it read (ClientDisconnect)
            if not answered:
                raise


async def _answer(send, status: int, reason: str, message: str, code: str) -> None:
    """A refusal that closes the connection (its body is the OpenAI error shape)."""
    raw = refusal(status, reason, message, code)
    head, body = raw.split(b"\r\n\r\n", 1)
    headers = [tuple(line.split(b": ", 1)) for line in head.split(b"\r\n")[1:]]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
