"""Bounded connections on an HTTP port (a node's and `kvrt route`'s): a connection that sends
nothing is closed after a few seconds, one that does not finish its request's headers within
HEADER_S is answered 408 and closed, one client address may hold only so many connections at
once, and the server as a whole only so many.

Why: uvicorn's h11 protocol starts its keep-alive timer only after a first response and stops
it at the first byte received, so a connection that never sends a request, or sends its
headers a byte at a time (slowloris), was held for ever, and a thousand of them exhausted the
launcher's file descriptors. A connection over its address's share or over the server's total
is answered 503 "over capacity" (in the OpenAI error shape, so that a client shows why) and
closed before anything is read. The body's own size and time limits are an ASGI middleware
(runtime/http/body_limit.py): h11 hands the body over in pieces.

Every close is a lingering one: the answer goes out, then the write side is shut, and what the
client still sends is read and dropped until it closes too (at most LINGER_S). Closing a socket
with unread input makes the kernel send a reset, which can reach the client before the answer
and discard it: a client that had already sent its request would see "connection reset" rather
than the 503, 408 or 413 that says why. (The one close that must not linger is an answer's cut
to a client that reads nothing, runtime/http/stalled.py: each request's scope holds the
connection's abort for it, ABORT.) At the server's stop, a connection between requests whose
answers the client has all acknowledged, with nothing of its own unread, closes at once: there
is nothing a reset could discard, and a kept-alive client that reads nothing until its next
request (a pooled connection) would otherwise hold the stop for uvicorn's whole graceful timeout.
"""
from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import socket
import struct
import termios
from collections import Counter

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvrt.ipc.log_limit import limit_logs

IDLE_S = 5.0             # a connection that says nothing for this long is closed
HEADER_S = 10.0          # a request's headers must be whole this long after its first byte may come
PER_ADDRESS = 256        # connections one client address may hold at once
TOTAL = 4096             # connections of the whole server
LINGER_S = 5.0           # a closed connection's input is drained this long at most
OVER_CAPACITY = "over_capacity"
ABORT = "kvrt.abort"     # a request's scope entry: drop its connection now, unsent bytes and all


def refusal(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, its body an OpenAI-shaped error."""
    body = json.dumps({"error": {"message": message, "type": "service_unavailable" if status == 503
                                 else "invalid_request_error", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def delivered(transport: asyncio.BaseTransport) -> bool:
    """Whether every byte written to `transport` was acknowledged by the client and nothing it
    sent is unread: then a close can discard nothing, so it need not linger."""
    sock = transport.get_extra_info("socket")
    if sock is None or transport.is_closing() or transport.get_write_buffer_size():  # type: ignore[attr-defined]
        return False
    try:
        unread, unacked = (struct.unpack("i", fcntl.ioctl(sock.fileno(), op, b"\0" * 4))[0]
                           for op in (termios.FIONREAD, termios.TIOCOUTQ))
    except OSError:
        return False
    return unread == 0 and unacked == 0


class _Lingering:
    """A transport whose close() lingers (see the module's docstring); everything else is the
    transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, linger_s: float) -> None:
        self._transport, self._loop, self._linger_s = transport, loop, linger_s
        self.lingering = False
        self._timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close_now(self) -> None:
        """Close without lingering (what `delivered` allows)."""
        self.closed()
        self._transport.close()

    def close(self) -> None:
        if self.lingering or self._transport.is_closing():
            return
        self.lingering = True
        try:
            self._transport.write_eof()  # (after what is buffered)
            self._transport.resume_reading()
        except (OSError, RuntimeError, NotImplementedError):
            self._transport.close()
            return
        self._timer = self._loop.call_later(self._linger_s, self._transport.close)

    def closed(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _no_delay(transport: asyncio.Transport) -> None:
    """Send each write at once (TCP_NODELAY). asyncio sets it only on sockets made with protocol
    IPPROTO_TCP, and the listening socket a node binds itself has protocol 0, as do the ones it
    accepts. Without it a response's body, written after its headers, waited for the client's
    delayed ACK: a request on a kept-alive connection took 40 ms more, and streamed events
    queued behind one another the same way."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def guarded_protocol(per_address: int = PER_ADDRESS, total: int = TOTAL, idle_s: float = IDLE_S,
                     header_s: float = HEADER_S, linger_s: float = LINGER_S) -> type[H11Protocol]:
    """An h11 protocol class (uvicorn's `http=`) with the idle and header timeouts and the
    connection limits; each call makes a class with its own count of connections (one per server)."""
    by_address: Counter[str] = Counter()
    busy = refusal(503, "Service Unavailable", f"over capacity: this address already holds {per_address} "
                   f"connections to this server; retry later", OVER_CAPACITY)
    full = refusal(503, "Service Unavailable", f"over capacity: the server holds its limit of {total} "
                   f"connections; retry later", OVER_CAPACITY)
    slow = refusal(408, "Request Timeout", f"the request's headers did not arrive within {header_s:g} s",
                   "header_timeout")

    class Guarded(H11Protocol):
        _address = ""
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            _no_delay(transport)
            transport = _Lingering(transport, self.loop, linger_s)  # type: ignore[assignment]
            super().connection_made(transport)
            self._address = self.client[0] if self.client else ""
            by_address[self._address] += 1
            over = busy if by_address[self._address] > per_address else full if len(self.connections) > total else b""
            if over:
                transport.write(over)
                transport.close()
                return
            # the keep-alive timer from the start: a connection that never sends is closed too
            self.timeout_keep_alive_task = self.loop.call_later(idle_s, self.timeout_keep_alive_handler)
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_s, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.write(slow)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:  # closed: drained, not read
                return
            super().data_received(data)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are whole: its body is the middleware's
                self._disarm_header_timer()
                self.cycle.scope[ABORT] = self.transport.abort  # type: ignore[index]

        def on_response_complete(self) -> None:
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request on this connection (before a pipelined one starts)
            super().on_response_complete()

        def shutdown(self) -> None:
            """The server stops: uvicorn closes a connection between requests (lingering, as
            every close here), and one within a request after its answer; the first closes at
            once where the client has everything (the module's docstring)."""
            at_once = (self.cycle is None or self.cycle.response_complete) and delivered(self.transport)
            super().shutdown()
            if at_once and self.transport.lingering:
                self.transport.close_now()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            self.transport.closed()
            by_address[self._address] -= 1
            if by_address[self._address] <= 0:
                del by_address[self._address]
            super().connection_lost(exc)

    return Guarded


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 0, **guard) -> uvicorn.Config:
    """The uvicorn settings of every kvrt HTTP server: the guarded protocol (`guard`: its
    limits), no access log, no lifespan, a short graceful stop. uvicorn's own `limit_concurrency`
    is left off: its 503 would not say why."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2, http=guarded_protocol(**guard),
                            timeout_keep_alive=guard.get("idle_s", IDLE_S))
    limit_logs(logging.getLogger("uvicorn"))  # its own handler ("Invalid HTTP request received." per bad request)
    return config
