"""A flood of ZeroMQ messages from one process, for the tests that check a node keeps serving a
good client under it: DEALER sockets sending what they can without blocking and dropping every
answer. Run in a child process (`python -c`, the repository as its working directory)."""
from __future__ import annotations

import time

import zmq


def flood(address: str, messages: list[list[bytes]], seconds: float, sockets: int = 2,
          sndhwm: int | None = None) -> float:
    """Send `messages` in turn (multipart frames) from `sockets` DEALERs connected to `address`
    for `seconds`; returns the messages sent per second."""
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(sockets)]
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        if sndhwm is not None:
            s.setsockopt(zmq.SNDHWM, sndhwm)
        s.connect(address)
    sent, i, end = 0, 0, time.monotonic() + seconds
    while time.monotonic() < end:
        for s in socks:
            try:
                s.send_multipart(messages[i % len(messages)], zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
            i += 1
            while True:
                try:
                    s.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
    ctx.destroy(linger=0)
    return sent / seconds
