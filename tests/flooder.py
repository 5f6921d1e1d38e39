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


def flood_then_close(address: str, messages: list[list[bytes]], sockets: int, close_after: tuple[float, float],
                     handshake_s: float = 5.0) -> int:
    """Flood from `sockets` DEALERs, socket i closing (at once, dropping what it did not read)
    `close_after[0] + i * step` s after its own ZeroMQ handshake, the times spread evenly up to
    `close_after[1]`; returns the messages sent. A socket that sends faster than the node reads
    fills its queue there, so each closes while the node has stopped reading it."""
    from zmq.utils.monitor import recv_monitor_message

    ctx = zmq.Context()
    lo, hi = close_after
    live: list[tuple[zmq.Socket, float]] = []
    for i in range(sockets):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        monitor = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        s.connect(address)
        if not monitor.poll(int(handshake_s * 1000)):
            raise TimeoutError(f"no ZeroMQ handshake with {address} within {handshake_s} s")
        recv_monitor_message(monitor)
        s.disable_monitor()
        monitor.close(linger=0)
        live.append((s, time.monotonic() + lo + (hi - lo) * i / max(sockets - 1, 1)))
    sent, i = 0, 0
    while live:
        now = time.monotonic()
        for entry in list(live):
            s, close_at = entry
            if now >= close_at:
                s.close(linger=0)
                live.remove(entry)
                continue
            try:
                s.send_multipart(messages[i % len(messages)], zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
            i += 1
    ctx.destroy(linger=0)
    return sent
