"""A request body as the router reads it: bounded in size and in time as a node bounds its own
(runtime/http/body_limit.py, whose limits and shared budget of large bodies these are).

Why here and not a middleware: the router's server is aiohttp's (runtime/router/server.py), whose
handler reads the body itself, piece by piece as it streams in; counting there costs nothing on
the common request, a small body already whole when its headers are parsed.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from aiohttp import web

from kvrt.runtime.http.body_limit import BODIES_AT_ONCE, SMALL_BODY, Budget


@dataclass
class Refused(Exception):
    """Why a body is not read: the answer's status, reason, message and error code."""

    status: int
    reason: str
    message: str
    code: str


async def read_body(request: web.BaseRequest, limit: int, body_s: float, budget: Budget) -> bytes:
    """The whole body: a `content-length` over `limit` is refused before any of it is read (a
    client that asked to be told, `expect: 100-continue`, is told to go on only below it), a
    body that passes it while streaming in as soon as it does (413), one not whole within
    `body_s` of its headers is a 408, and one past SMALL_BODY waits for room in the shared
    `budget` (a 503 when none frees before that deadline)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        raise _too_large(limit)
    content = request.content
    if request.headers.get("expect", "").lower() == "100-continue" and not content.is_eof():
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # the client waits for it to send the body
    if content.is_eof():  # whole already (the common case: a small body in the headers' read)
        raw = await content.read()
        if len(raw) > limit:
            raise _too_large(limit)
        return raw
    deadline = time.monotonic() + body_s
    parts: list[bytes] = []
    held = 0

    async def pieces() -> None:
        nonlocal held
        seen = 0
        while chunk := await content.readany():
            seen += len(chunk)
            if seen > limit:
                raise _too_large(limit)
            if seen > SMALL_BODY and not held:  # room for the whole body at once (parts taken could deadlock)
                n = declared if declared is not None else limit
                if not await budget.take(n, BODIES_AT_ONCE * limit, deadline):
                    raise Refused(503, "Service Unavailable", "over capacity: the server is reading other large "
                                  "request bodies; retry later", "over_capacity")
                held = n
            parts.append(chunk)

    try:
        await asyncio.wait_for(pieces(), max(deadline - time.monotonic(), 0.0))
    except asyncio.TimeoutError:
        raise Refused(408, "Request Timeout", f"the request body did not arrive within {body_s:g} s of its headers",
                      "body_timeout") from None
    finally:
        await budget.give(held)
    return b"".join(parts)


def _too_large(limit: int) -> Refused:
    return Refused(413, "Content Too Large", f"a request body takes at most {limit} bytes", "body_too_large")
