"""Which address a cache-messager publishes to its P/D peers for the Mooncake transport (the
end-to-end proof across two network namespaces is tests/runtime/pd/test_pd_netns.py)."""
from __future__ import annotations

import socket

import pytest

from kvrt.workers import cache_messager as cm


def test_peer_addresses_parse_the_decode_peer_list():
    assert cm.peer_addresses("tcp://10.0.0.2:7001, tcp://[::1]:7002,tcp://bad") == [("10.0.0.2", 7001),
                                                                                   ("::1", 7002)]
    assert cm.peer_addresses("") == []


def test_a_prefill_node_publishes_its_route_to_the_decode_node():
    assert cm.advertised_host("0.0.0.0", [("127.0.0.1", 7001)]) == "127.0.0.1"
    local = cm._interface_addresses()
    if not local:
        pytest.skip("no non-loopback IPv4 interface is up here")
    addr = next(iter(local))
    assert cm.advertised_host("127.0.0.1", [(addr, 7001)]) == addr  # not P's --host


def test_a_decode_node_on_a_wildcard_never_publishes_loopback(monkeypatch):
    local = cm._interface_addresses()
    if not local:
        pytest.skip("no non-loopback IPv4 interface is up here")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")  # a Debian-style /etc/hosts
    assert cm.advertised_host("0.0.0.0", []) == next(iter(local))
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "198.51.100.77")  # not an address here
    assert cm.advertised_host("0.0.0.0", []) == next(iter(local))
    assert cm.advertised_host("10.9.8.7", []) == "10.9.8.7"  # an explicit --host is published as it is
