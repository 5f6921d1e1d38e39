"""Ports handed out for later binds never come from the ephemeral range, where the kernel gives
outgoing connections their local ports, and a pair is two free consecutive ports."""
from __future__ import annotations

import socket

from kvrt.ipc.ports import ephemeral_range, free_port, free_port_pair


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
