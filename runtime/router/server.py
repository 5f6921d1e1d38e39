"""The router's HTTP server: aiohttp's, with the connection limits of a node's HTTP port.

Why aiohttp and not uvicorn (a node's server): the router's own cost is paid on every request,
and aiohttp serves with a C parser, sends a whole answer's headers and body in one write, and is
the library the router already uses as its client to the nodes. What uvicorn's guarded protocol
gives a node (runtime/http/connections.py) is given here by a protocol of the same limits: a
connection that sends nothing for IDLE_S is closed; one that does not finish a request's headers
within HEADER_S (of its opening, or of its previous answer) is answered 408 and closed; one
client address may hold PER_ADDRESS connections at once and the server TOTAL, past which a
connection is answered 503 "over capacity" before anything is read. Every refusal is a
lingering close: the answer goes out, the write side is shut, and what the client still sends
is read and dropped for at most LINGER_S, so that no reset reaches the client ahead of the
answer. A client that goes away cancels its request's handler (which closes the request's
connection to the node, which cancels it there). At the stop, a connection waiting for its next
request whose answers the client has all acknowledged closes at once, as a node's does (aiohttp
would otherwise wait SHUTDOWN_S for a request that a pooled client never sends).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvrt.runtime.http.connections import HEADER_S, IDLE_S, LINGER_S, OVER_CAPACITY, PER_ADDRESS, TOTAL, delivered, \
    refusal

log = logging.getLogger(__name__)
Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
SHUTDOWN_S = 2.0   # requests in flight at a stop are given this long
MAX_LINE = 16 << 10  # bytes of a request line or of one header (a node's h11 takes 16 KiB of headers)


@dataclass
class Limits:
    """A server's connection limits, and the connections it holds (by client address)."""

    per_address: int = PER_ADDRESS
    total: int = TOTAL
    idle_s: float = IDLE_S
    header_s: float = HEADER_S
    linger_s: float = LINGER_S
    by_address: Counter = field(default_factory=Counter)
    held: int = 0


class _Guarded(web.RequestHandler):
    """aiohttp's request handler (one per connection) with the limits of `Limits`."""

    def __init__(self, manager: web.Server, limits: Limits, loop: asyncio.AbstractEventLoop, **kw) -> None:
        super().__init__(manager, loop=loop, **kw)
        self._limits = limits
        self._clock = loop
        self._address = ""
        self._timer: asyncio.TimerHandle | None = None
        self._since = 0.0
        self._heard = False      # bytes came since the timer was armed
        self._lingering = False
        self._between = False    # waiting for a request (not in one's handler)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        lim = self._limits
        peer = transport.get_extra_info("peername")
        self._address = peer[0] if peer else ""
        lim.by_address[self._address] += 1
        lim.held += 1
        if lim.by_address[self._address] > lim.per_address:
            self._refuse(503, "Service Unavailable", f"over capacity: this address already holds {lim.per_address} "
                         f"connections to this server; retry later", OVER_CAPACITY)
        elif lim.held > lim.total:
            self._refuse(503, "Service Unavailable", f"over capacity: the server holds its limit of {lim.total} "
                         f"connections; retry later", OVER_CAPACITY)
        else:
            self.idle()

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # closed: drained, not read
            return
        self._heard = True
        super().data_received(data)

    def busy(self) -> None:
        """A request's headers are in: its handler runs (the body's own limits are the handler's)."""
        self._disarm()
        self._between = False

    def idle(self) -> None:
        """The connection waits for a request: it must come within the idle and header timeouts."""
        self._disarm()
        self._between = True
        self._since, self._heard = self._clock.time(), False
        self._timer = self._clock.call_later(min(self._limits.idle_s, self._limits.header_s), self._check)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        lim, now = self._limits, self._clock.time()
        if not self._heard and now >= self._since + lim.idle_s:  # closed without a word: nothing is unread
            self.force_close()
            return
        if self._heard and now >= self._since + lim.header_s:
            self._headers_too_slow()
            return
        due = self._since + (lim.header_s if self._heard else lim.idle_s)
        self._timer = self._clock.call_later(max(due - now, 0.0), self._check)

    def _headers_too_slow(self) -> None:
        self._timer = None
        self._refuse(408, "Request Timeout", f"the request's headers did not arrive within "
                     f"{self._limits.header_s:g} s", "header_timeout")

    def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
        """Answer, then close lingering (see the module's docstring)."""
        self._disarm()
        transport = self.transport
        if self._lingering or transport is None or transport.is_closing():
            return
        self._lingering = True
        self.close()  # no request of this connection is handled any more
        transport.write(refusal(status, reason, message, code))
        try:
            transport.write_eof()  # (after what is buffered)
        except (OSError, RuntimeError, NotImplementedError):
            transport.close()
            return
        self._timer = self._clock.call_later(self._limits.linger_s, transport.close)

    def log_exception(self, *args, **kw) -> None:
        """A request that is not valid HTTP is the client's doing: one WARNING line (rate-limited
        per kind, ipc/log_limit.py), not an ERROR with a traceback per request."""
        exc = kw.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            log.warning("invalid HTTP request from %s: %s", self._address, " ".join(str(exc).split())[:200])
            return
        super().log_exception(*args, **kw)

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        """The server stops: a connection between requests, with nothing of it unread or
        unacknowledged, closes now (the module's docstring); the others as aiohttp closes them."""
        transport = self.transport
        if self._between and not self._heard and not self._lingering and transport is not None and delivered(transport):
            self.force_close()
        await super().shutdown(timeout)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        lim = self._limits
        lim.held -= 1
        lim.by_address[self._address] -= 1
        if lim.by_address[self._address] <= 0:
            del lim.by_address[self._address]
        super().connection_lost(exc)


def _timed(handler: Handler) -> Handler:
    """`handler`, its answer sent, with the connection's timers off meanwhile (a slow reader of a
    long answer is not taken for an idle connection)."""

    async def run(request: web.BaseRequest) -> web.StreamResponse:
        proto = request.protocol
        proto.busy()
        try:
            resp = await handler(request)
            try:
                await resp.prepare(request)
                await resp.write_eof()
            except ConnectionError:  # the client left (aiohttp sees it gone and drops the connection)
                pass
            return resp
        finally:
            if request.transport is not None and not request.transport.is_closing():
                proto.idle()

    return run


async def lingering_answer(request: web.BaseRequest, status: int, reason: str, message: str,
                           code: str) -> web.StreamResponse:
    """A refusal of a request whose body is not read (413, 408, 503): sent, the write side
    shut, what the client still sends drained for at most LINGER_S (aiohttp's lingering read
    of an unread body), then closed."""
    body = refusal(status, reason, message, code).split(b"\r\n\r\n", 1)[1]
    resp = web.Response(body=body, status=status, reason=reason, content_type="application/json")
    resp.force_close()
    await resp.prepare(request)
    await resp.write_eof()
    transport = request.transport
    if transport is not None and not transport.is_closing() and transport.can_write_eof():
        transport.write_eof()
    return resp


async def serve(handler: Handler, sock: socket.socket, stop: asyncio.Event, limits: Limits | None = None,
                started: Callable[[], None] | None = None) -> None:
    """Serve `handler` on the listening `sock` until `stop` is set; then requests in flight get
    SHUTDOWN_S to finish. `started` is called once it listens."""
    lim = limits or Limits()
    loop = asyncio.get_running_loop()
    server = web.Server(_timed(handler), handler_cancellation=True)
    listening = await loop.create_server(
        lambda: _Guarded(server, lim, loop=loop, access_log=None, keepalive_timeout=lim.header_s + lim.idle_s,
                         lingering_time=lim.linger_s, max_line_size=MAX_LINE, max_field_size=MAX_LINE),
        sock=sock)
    if started is not None:
        started()
    try:
        await stop.wait()
    finally:
        listening.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(server.shutdown(SHUTDOWN_S), SHUTDOWN_S + 1)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(listening.wait_closed(), SHUTDOWN_S)
