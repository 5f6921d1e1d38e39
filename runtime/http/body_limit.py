"""Bounded request bodies on an HTTP port (a node's and `kvrt route`'s): at most a size, read
within a time, both checked while the body streams in.

Why a middleware that counts: FastAPI reads a body whole before the handler runs, so without a
limit an untrusted client makes the server hold any amount of memory; a body sent with chunked
encoding declares no length, so it is counted as its pieces arrive and refused (413) as soon as
it passes the limit, and one that declares a length over the limit is refused before any of it
is read. A body that trickles in (a slowloris on the body) is cut with a 408 once BODY_S have
passed since its headers. Either answer closes the connection (the rest of the body is never
read) and the app sees the client as gone.

Large bodies coming in at once are bounded together too: each connection's body is held whole
before it is parsed, so many connections each sending a body just under the limit would hold
that many limits. Bodies past SMALL_BODY share one budget of BODIES_AT_ONCE times the limit: such
a body takes room for all of itself (its declared length, else the limit; room taken piecemeal
could deadlock) and is not read further until it has it (the client waits, TCP holds its bytes);
the room is free again once the body is in, and a body that finds none before its deadline gets
a 503 "over capacity". One body alone always fits, and small bodies never wait.

A body nested deeper than a JSON parser may safely follow (ipc/json_bounds.py MAX_DEPTH) is a
400 once it is whole, before the app parses it: the parser's RecursionError was a 500 here, and
the same text deeper down the handler's code. A body with no more brackets than the limit cannot
be that deep and is not scanned; a large one is scanned in a thread, off the event loop.

The limit follows from the model's length: the client API's largest message (runtime/client/api.py
max_message_bytes, the longest prompt as int32) times JSON_FACTOR, room for a batch of long
prompts as JSON token ids or escaped text.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from kvrt.ipc import json_bounds
from kvrt.runtime.client.api import max_message_bytes
from kvrt.runtime.http.connections import refusal

BODY_S = 30.0         # a request's whole body must arrive within this long of its headers
SMALL_BODY = 64 << 10  # bodies up to this many bytes never wait for the shared budget
BODIES_AT_ONCE = 4    # the shared budget of large bodies' bytes, in body limits
JSON_FACTOR = 64      # HTTP body bytes per client-API message byte: a batch of prompts, tokens as escaped JSON text
DEFAULT_MODEL_LEN = 32768  # the limit's model length until the served one is known


def max_body_bytes(max_model_len: int) -> int:
    """The largest request body an HTTP server in front of a model of this length reads."""
    return JSON_FACTOR * max_message_bytes(max_model_len)


class Budget:
    """Bytes of large bodies the server holds, against a cap: `take` waits for room until a
    deadline, `give` frees room. Whoever holds nothing may take past the cap (one body alone
    always fits)."""

    def __init__(self) -> None:
        self.held = 0
        self._freed: asyncio.Condition | None = None  # made in the server's loop, on first use

    async def take(self, n: int, cap: int, deadline: float) -> bool:
        if self._freed is None:
            self._freed = asyncio.Condition()
        async with self._freed:
            while self.held + n > cap and self.held > 0:
                try:
                    await asyncio.wait_for(self._freed.wait(), max(deadline - time.monotonic(), 0.0))
                except asyncio.TimeoutError:
                    return False
            self.held += n
            return True

    async def give(self, n: int) -> None:
        if n and self._freed is not None:
            async with self._freed:
                self.held -= n
                self._freed.notify_all()


class BodyLimit:
    """ASGI middleware: a body over `limit()` bytes is a 413 and one not whole within `body_s`
    a 408, answered as soon as known; the app then reads a disconnect and its own answer is
    dropped. `limit` is a callable so that a server learns its model's length after it starts."""

    def __init__(self, app, limit: Callable[[], int] = lambda: max_body_bytes(DEFAULT_MODEL_LEN),
                 body_s: float = BODY_S) -> None:
        self.app = app
        self.limit = limit
        self.body_s = body_s
        self.budget = Budget()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit()
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await _answer(send, 413, "Content Too Large", f"a request body takes at most {limit} bytes",
                                 "body_too_large")
        deadline = time.monotonic() + self.body_s
        seen, whole, answered, mine = 0, False, False, 0
        parts: list[bytes] = []  # the body so far (the app holds the same bytes objects)
        brackets = 0

        async def counted():
            nonlocal seen, whole, answered, mine, brackets
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
            piece = msg.get("body", b"")
            seen += len(piece)
            parts.append(piece)
            brackets += piece.count(b"[") + piece.count(b"{")
            whole = not msg.get("more_body", False)
            if seen > limit:
                answered = True
                await _answer(send, 413, "Content Too Large", f"a request body takes at most {limit} bytes",
                              "body_too_large")
                return {"type": "http.disconnect"}
            if seen > SMALL_BODY and not mine:  # room for the whole body at once (parts taken could deadlock)
                n = int(declared) if declared is not None else limit
                if not await self.budget.take(n, BODIES_AT_ONCE * limit, deadline):
                    answered = True
                    await _answer(send, 503, "Service Unavailable", "over capacity: the server is reading other "
                                  "large request bodies; retry later", "over_capacity")
                    return {"type": "http.disconnect"}
                mine += n
            if whole:  # in: the app parses it now (on this thread, one body at a time)
                await self.budget.give(mine)
                mine = 0
                if brackets > json_bounds.MAX_DEPTH and await _too_deep(parts, seen):
                    answered = True
                    await _answer(send, 400, "Bad Request", f"the request body nests arrays and objects more than "
                                  f"{json_bounds.MAX_DEPTH} levels deep", "body_too_deep")
                    return {"type": "http.disconnect"}
                parts.clear()
            return msg

        async def guarded_send(msg) -> None:
            if not answered:  # after a refusal the app's own answer goes nowhere
                await send(msg)

        try:
            await self.app(scope, counted, guarded_send)
        except Exception:  # noqa: BLE001 - what the app made of the disconnect it read (ClientDisconnect)
            if not answered:
                raise
        finally:
            await self.budget.give(mine)


async def _too_deep(parts: list[bytes], size: int) -> bool:
    """Whether the body made of `parts` nests deeper than json_bounds.MAX_DEPTH (counted in a
    thread when it is large: a few ms a MiB)."""
    def deeper() -> bool:
        return json_bounds.depth(b"".join(parts)) > json_bounds.MAX_DEPTH

    return await asyncio.to_thread(deeper) if size > SMALL_BODY else deeper()


async def _answer(send, status: int, reason: str, message: str, code: str) -> None:
    """A refusal that closes the connection (its body is the OpenAI error shape)."""
    raw = refusal(status, reason, message, code)
    head, body = raw.split(b"\r\n\r\n", 1)
    headers = [tuple(line.split(b": ", 1)) for line in head.split(b"\r\n")[1:]]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
