"""Answers to the clients of one ROUTER socket with ROUTER_MANDATORY: sent at once, kept for a
client that does not read when the sender asks, dropped otherwise.

Why one class for the engine's private socket and the gateway's public one: both must never block
on a client, must tell a client that is gone (its send fails with EHOSTUNREACH) from one whose
queue is full (EAGAIN), and must hold the final notices of a full client's requests until it reads
again, in order, while its other answers are dropped (runtime/engine/server.py says why).
"""
from __future__ import annotations

import errno
from collections import deque
from collections.abc import Callable

import zmq


class KeptAnswers:
    """Sends on `router`; `gone(client)` is called once for each client found gone."""

    def __init__(self, router: zmq.Socket, gone: Callable[[bytes], None]):
        self._router = router
        self._gone = gone
        self._backlog: dict[bytes, deque[bytes]] = {}  # kept answers of clients whose queue is full

    def send(self, client: bytes, data: bytes, keep: bool) -> bool:
        """Send or keep `data`; False if it was dropped because the client's queue is full."""
        backlog = self._backlog.get(client)
        if backlog is None:
            if self._send_now(client, data):
                return True
            backlog = self._backlog[client] = deque()
        if keep:  # bounded: the engine keeps one notice per request it ends, and bounds requests
            backlog.append(data)
            return True
        return False

    def flush(self) -> None:
        """Kept answers go out once their client reads again; a client with none left is back to
        normal (its next answer that does not fit starts a backlog again)."""
        for client, backlog in list(self._backlog.items()):
            while backlog and self._send_now(client, backlog[0]):
                if self._backlog.get(client) is not backlog:
                    break  # the client is gone, and its backlog with it
                backlog.popleft()
            if not backlog:
                self._backlog.pop(client, None)

    def _send_now(self, client: bytes, data: bytes) -> bool:
        """Send without waiting; False when the client's queue is full. A client that is gone
        takes nothing: its backlog is dropped and `gone` told."""
        try:
            self._router.send_multipart([client, data], zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            self._backlog.pop(client, None)
            self._gone(client)
        return True
