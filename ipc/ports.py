"""Free TCP ports, for a process that must name its port before another binds it (a demo node,
a mooncake master's metrics, a test's or a benchmark's nodes).

A port the OS says is free now may be taken before it is bound again. The worst taker is the
kernel itself: every outgoing connection (a ZeroMQ peer, a store client) gets a local port from
the ephemeral range, and `bind(port 0)` picks from that same range. So the ports handed out here
come from below it, where only an explicit bind can take them, and at random. Random alone still
lets two callers meet: a port handed out is not bound until the process it was meant for starts
(seconds, on a loaded machine), and a test that names five ports, or three tests starting nodes
at once, drew the same port about once a suite. So each port handed out is also leased for a
minute or two in a directory every process of this user shares (`lease`); a port leased by
anyone, this process included, is not handed out again until the lease lapses. Callers that can,
bind port 0 instead and read back what they got.

And the other question a process asks about ports: which of its own listeners are open on
every interface although it was told to use one (`listening_wider_than`): Mooncake's transfer
engine has no working option to bind one address, so kvrt reports what it could not confine."""
from __future__ import annotations

import logging
import os
import random
import socket
import stat
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

WILDCARDS = ("", "0.0.0.0", "::", "*")
LOWEST = 20000  # above the registered services people run on a node
TRIES = 200
LEASE_S = 60  # a lease lasts one to two of these: longer than any start-up takes to bind its port


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


def lease_dir() -> Path | None:
    """The directory of this user's port leases, made 0700 on first use; None (leases skipped,
    the bind check alone remains) where it cannot be made or is not this user's own."""
    d = Path(tempfile.gettempdir()) / f"kvrt-ports-{os.getuid()}"
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        st = d.lstat()
    except OSError as e:
        log.debug("no port leases: %s", e)
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        log.debug("no port leases: %s is not a private directory of this user", d)
        return None
    return d


def lease(*ports: int, now: float | None = None) -> bool:
    """Lease `ports` together for LEASE_S to 2 x LEASE_S seconds: False where any is leased
    already. Why time buckets rather than a lease with an owner to release it: the port is bound
    by another process than the one that drew it, so nobody could say when to release; a lease
    named for its bucket (`port.bucket`) blocks while its bucket is this one or the one before,
    is created atomically (O_EXCL: of two processes leasing one port at once, one wins), and
    lapses with no process left to clean it up. Lapsed leases are removed on the way."""
    d = lease_dir()
    if d is None:
        return True
    bucket = int((time.time() if now is None else now) // LEASE_S)
    made = []
    try:
        for p in ports:
            if (d / f"{p}.{bucket - 1}").exists():
                return False
            fd = os.open(d / f"{p}.{bucket}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            os.close(fd)
            made.append(p)
    except FileExistsError:
        return False
    except OSError as e:
        log.debug("port lease failed: %s", e)
        return True
    finally:
        if len(made) < len(ports):
            for p in made:
                (d / f"{p}.{bucket}").unlink(missing_ok=True)
    _sweep(d, int(time.time() // LEASE_S))  # by the clock, whatever `now` a test passed
    return True


def _sweep(d: Path, bucket: int) -> None:
    """Remove leases older than the bucket before this one: they block nobody any more."""
    try:
        names = os.listdir(d)
    except OSError:
        return
    for name in names:
        _, _, b = name.partition(".")
        if b.lstrip("-").isdigit() and int(b) < bucket - 1:
            (d / name).unlink(missing_ok=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now, outside the kernel's ephemeral range, and leased
    to the caller (not handed out again, to anyone, for a minute or two)."""
    rng = random.Random()  # seeded from the OS: two processes asking at once draw apart
    for _ in range(TRIES):
        p = _draw(rng)
        if _bindable(host, p) and lease(p):
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
    """A free port P with P+1 free too (a node's KV events and their replay socket), both
    leased as `free_port` leases one."""
    rng = random.Random()
    for _ in range(TRIES):
        p = _draw(rng)
        if p + 1 < 65536 and _bindable(host, p, p + 1) and lease(p, p + 1):
            return p
    raise RuntimeError(f"no two consecutive free TCP ports on {host} after {TRIES} tries")
