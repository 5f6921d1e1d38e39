"""Answers written as they are made, to a client that must keep reading them.

Why: an answer streamed to a client that stops reading fills the socket's buffers; the server's
writes then wait (back-pressure), so the answer is no longer built, but its engine requests would
go on holding their seats and blocks, for as long as the client likes (a client can open hundreds
of such streams). A write that cannot go out for STALL_S seconds (`kvrt launch
--http-stall-timeout`) cuts the answer: its generator is closed (which cancels its engine
requests: runtime/http/app.py's streams cancel in their `finally`), and the connection is
dropped at once, its unsent bytes with it (a close would wait for a client that does not read). The client sees a connection reset, never a whole answer.
"""
from __future__ import annotations

import asyncio
import logging

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvrt.ipc.log_limit import limit_logs
from kvrt.runtime.http.connections import ABORT

log = logging.getLogger(__name__)
limit_logs(log)

STALL_S = 10.0   # the longest a write of an answer may wait for its client to read


class CutWhenStalled(StreamingResponse):
    """A StreamingResponse whose every write must go out within `stall_s` seconds (a timer
    looks every quarter of it: a write costs two stores, not a timeout of its own)."""

    def __init__(self, content, stall_s: float = STALL_S, **kw) -> None:
        super().__init__(content, **kw)
        self.stall_s = stall_s
        self._scope: Scope = {}
        self._writing_since: float | None = None
        self._cut = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._scope = scope
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        writer = asyncio.current_task()
        timer = loop.call_later(self.stall_s / 4, self._watch, loop, writer)
        body = self.body_iterator
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in body:
                if not isinstance(chunk, (bytes, memoryview)):
                    chunk = chunk.encode(self.charset)
                self._writing_since = loop.time()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                self._writing_since = None
                if self._cut:
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            timer.cancel()
            if hasattr(body, "aclose"):
                await body.aclose()  # (its requests are cancelled now, not when the connection goes)

    def _watch(self, loop: asyncio.AbstractEventLoop, writer: asyncio.Task | None) -> None:
        since = self._writing_since
        if since is None or loop.time() - since < self.stall_s:
            loop.call_later(self.stall_s / 4, self._watch, loop, writer)
            return
        self._cut = True
        client = self._scope.get("client") or ("?", 0)
        log.warning("an answer to %s was cut: its client read nothing for %g s", client[0], self.stall_s)
        abort = self._scope.get(ABORT)
        if abort is not None:
            abort()  # (the write waiting returns once the connection is seen lost)
        elif writer is not None:
            writer.cancel()  # a server without the hook: the write is given up
