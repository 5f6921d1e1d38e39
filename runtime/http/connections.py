"""Bounded connections on the HTTP port: a connection that sends nothing is closed after a few
seconds, one client address may hold only so many connections at once, and the server as a
whole only so many (uvicorn's `limit_concurrency`: 503 beyond it).

Why: uvicorn's h11 protocol starts its keep-alive timer only after a first response, so a
connection that never sends a request was held for ever, and a thousand of them exhausted
the launcher's file descriptors. A connection over its address's share is answered 503 and
closed at once, before anything is read.
"""
from __future__ import annotations

import asyncio
from collections import Counter

from uvicorn.protocols.http.h11_impl import H11Protocol

IDLE_S = 5.0             # a connection that says nothing for this long is closed
PER_ADDRESS = 256        # connections one client address may hold at once
TOTAL = 4096             # connections and requests of the whole server (uvicorn's limit_concurrency)
_BUSY = b"too many connections from this address\n"
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"connection: close\r\ncontent-length: " + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY)


def guarded_protocol(per_address: int = PER_ADDRESS, idle_s: float = IDLE_S) -> type[H11Protocol]:
    """An h11 protocol class (uvicorn's `http=`) with the idle timeout and the per-address limit;
    each call makes a class with its own count of connections by address (one per server)."""
    by_address: Counter[str] = Counter()

    class Guarded(H11Protocol):
        _address = ""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._address = self.client[0] if self.client else ""
            by_address[self._address] += 1
            if by_address[self._address] > per_address:
                transport.write(_REFUSAL)
                transport.close()
                return
            # the keep-alive timer from the start: a connection that never sends is closed too
            self.timeout_keep_alive_task = self.loop.call_later(idle_s, self.timeout_keep_alive_handler)

        def connection_lost(self, exc: Exception | None) -> None:
            by_address[self._address] -= 1
            if by_address[self._address] <= 0:
                del by_address[self._address]
            super().connection_lost(exc)

    return Guarded
