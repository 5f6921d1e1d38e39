"""Free TCP ports, for a process that must name its port before another binds it (a demo node,
a mooncake master's metrics, a test's or a benchmark's nodes).

A port the OS says is free now may be taken before it is bound again. The worst taker is the
kernel itself: every outgoing connection (a ZeroMQ peer, a store client) gets a local port from
the ephemeral range, and `bind(port 0)` picks from that same range. So the ports handed out here
come from below it, where only an explicit bind can take them, and at random, so that two
callers (a test's three sockets, two tests at once) rarely meet. Callers that can, bind port 0
instead and read back what they got.

And the other question a process asks about ports: which of its own listeners are open on
every interface although it was told to use one (`listening_wider_than`): Mooncake's transfer
engine has no working option to bind one address, so kvrt reports what it could not confine."""
from __future__ import annotations

import random
import socket
from pathlib import Path

WILDCARDS = ("", "0.0.0.0", "::", "*")
LOWEST = 20000  # above the registered services people run on a node
TRIES = 200


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux's default when unread)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _draw(rng: random.Random) -> int:
    lo, hi = ephemeral_range()
    if lo - LOWEST >= 1000:
        return rng.randrange(LOWEST, lo)
    return rng.randrange(hi + 1, 65535) if hi < 64535 else rng.randrange(1024, 65535)


def _bindable(host: str, *ports: int) -> bool:
    socks = []
    try:
        for p in ports:
            s = socket.socket()
            socks.append(s)
            s.bind((host, p))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now and outside the kernel's ephemeral range."""
    rng = random.Random()  # seeded from the OS: two processes asking at once draw apart
    for _ in range(TRIES):
        p = _draw(rng)
        if _bindable(host, p):
            return p
    raise RuntimeError(f"no free TCP port on {host} outside the ephemeral range after {TRIES} tries")


def listening_wider_than(host: str) -> list[str]:
    """This process's listening TCP sockets bound to a wildcard address rather than `host`
    ("ip:port" each); none when `host` is a wildcard itself."""
    import psutil

    if host in WILDCARDS:
        return []
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return []
    return sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in conns
                  if c.status == psutil.CONN_LISTEN and c.laddr.ip in WILDCARDS)


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A free port P with P+1 free too (a node's KV events and their replay socket)."""
    rng = random.Random()
    for _ in range(TRIES):
        p = _draw(rng)
        if p + 1 < 65536 and _bindable(host, p, p + 1):
            return p
    raise RuntimeError(f"no two consecutive free TCP ports on {host} after {TRIES} tries")
