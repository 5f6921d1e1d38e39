"""Ports handed out for later binds never come from the ephemeral range, where the kernel gives
outgoing connections their local ports, a pair is two free consecutive ports, and a port handed
out is leased: nobody, this process included, gets it again before it could have been bound."""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from kvrt.ipc.ports import LEASE_S, ephemeral_range, free_port, free_port_pair, lease, lease_dir


def test_a_free_port_is_bindable_and_outside_the_ephemeral_range():
    lo, hi = ephemeral_range()
    for _ in range(20):
        p = free_port()
        assert not lo <= p <= hi
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_pair_is_two_consecutive_free_ports():
    p = free_port_pair()
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", p))
        b.bind(("127.0.0.1", p + 1))


def test_a_held_port_is_never_handed_out():
    held = []
    try:
        for _ in range(30):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            held.append(s)
        ports = {s.getsockname()[1] for s in held}
        assert len(ports) == 30
        assert free_port() not in ports
    finally:
        for s in held:
            s.close()


def test_listeners_on_every_interface_are_named_and_those_on_the_host_are_not():
    from kvrt.ipc.ports import listening_wider_than

    with socket.create_server(("0.0.0.0", 0)) as wide, socket.create_server(("127.0.0.1", 0)) as narrow:
        found = listening_wider_than("127.0.0.1")
        assert f"0.0.0.0:{wide.getsockname()[1]}" in found
        assert not any(a.endswith(f":{narrow.getsockname()[1]}") for a in found)
        assert listening_wider_than("0.0.0.0") == [], "asked for every interface: nothing is wider"


def test_ports_drawn_and_never_bound_are_all_different():
    """The race that failed a suite: a test names several ports before the node it starts binds
    any, so the bind check alone could hand one out twice."""
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == 300
    pairs = [free_port_pair() for _ in range(100)]
    assert not {p for q in pairs for p in (q, q + 1)} & set(ports)


@pytest.mark.e2e
def test_two_processes_drawing_at_once_never_meet():
    code = "from kvrt.ipc.ports import free_port\nprint(*(free_port() for _ in range(200)))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    drawn = [set(map(int, p.communicate(timeout=60)[0].split())) for p in procs]
    assert all(len(d) == 200 for d in drawn)
    assert not (drawn[0] & drawn[1]) and not (drawn[0] & drawn[2]) and not (drawn[1] & drawn[2])


def test_a_lease_blocks_for_one_to_two_periods_then_lapses():
    port, now = 7, time.time()  # a port free_port never draws
    d = lease_dir()
    assert d is not None and (d.stat().st_mode & 0o777) == 0o700
    try:
        assert lease(port, now=now)
        assert not lease(port, now=now), "leased in this period"
        assert not lease(port, now=now + LEASE_S), "leased in the period before"
        assert lease(port, now=now + 2 * LEASE_S), "two periods on, the lease has lapsed"
        assert not lease(port, 8, now=now + 2 * LEASE_S), "one of two leased: neither is"
        assert lease(8, now=now + 2 * LEASE_S), "the failed pair left no lease on its free port"
    finally:
        for f in d.glob("7.*"):
            f.unlink()
        for f in d.glob("8.*"):
            f.unlink()


def test_lapsed_leases_are_swept():
    d, now = lease_dir(), time.time()
    stale = d / f"9.{int(now // LEASE_S) - 5}"
    stale.touch()
    assert lease(10, now=now)
    assert not stale.exists()
    for f in d.glob("10.*"):
        f.unlink()
