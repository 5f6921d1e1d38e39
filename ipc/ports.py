"""Free TCP ports, for a process that must name its port before another binds it (a demo node,
a mooncake master's metrics, a test's or a benchmark's nodes).

A port the OS says is free now may be taken before it is bound again: callers that can, bind
port 0 instead and read back what they got."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` the OS says is free now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A free port P with P+1 free too (a node's KV events and their replay socket)."""
    for _ in range(100):
        p = free_port(host)
        with socket.socket() as s:
            try:
                s.bind((host, p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError(f"no two consecutive free ports on {host}")
