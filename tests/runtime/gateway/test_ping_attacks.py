"""Raw ZeroMQ peers that make libzmq abort the process owning the socket they reach: a queue
filled past its high-water mark, a PING command, a reset (tests/flooder.py `ping_then_reset`;
runtime/engine/server.py says why libzmq aborts). Against every port a node listens on with
ZeroMQ (the client API, a decode node's port for its prefill peers, the KV events and their
replay), the node goes on: the engine keeps its pid, another client's ordinary request gets the
dense oracle's answer afterwards, and the node stops cleanly with nothing left in /dev/shm or in
its private socket directory (the `node` fixture, `launched`). Before the gateway, each of these
aborted the engine, and the node with it."""
from __future__ import annotations

import logging
import textwrap
import time

import numpy as np
import pytest

from kvrt.ipc.ports import free_port_pair
from kvrt.runtime.cache.events import REPLAY_PER_S, KVEventView
from kvrt.runtime.client import api
from kvrt.runtime.client.client import Client, ClientError, RequestError
from kvrt.runtime.node.status import snapshot
from tests.conftest import run_py
from tests.launched import SMALL, launched, oracle, pd_secret_file

pytestmark = [pytest.mark.e2e, pytest.mark.alone]
log = logging.getLogger(__name__)

ATTACK = textwrap.dedent("""
    import sys
    from tests.flooder import ping_then_reset
    ping_then_reset(int(sys.argv[1]), connections=int(sys.argv[2]), socket_type=sys.argv[3].encode())
""")
PROMPT = np.arange(3, 40, dtype=np.int32)
# How long the node is kept busy after the resets, so that the socket's owner drains the queues
# (reaching the buffered PING: libzmq reads a stopped connection again once half its queue of
# 1,000 was taken); the engine reads the replay port at --kv-events-replay-rate (REPLAY_PER_S
# by default: 500 requests in 8 s), which the replay case raises to what 16 engine turns a
# second still serve (at most 16 requests a turn), so that the drain takes 2 s.
DRAIN_S = 1.5
REPLAY_RATE = 4 * REPLAY_PER_S
REPLAY_DRAIN_S = 500 / REPLAY_RATE + 2.0


def _pid(node: str, role: str) -> int:
    return next(p["pid"] for p in snapshot(node)["processes"] if p["role"] == role and p["alive"])


def _attack(port: int, connections: int, socket_type: str = "DEALER") -> None:
    out = run_py(ATTACK, str(port), str(connections), socket_type)
    assert out.returncode == 0, out.stderr[-2000:]


def _goes_on(ln, engine_pid: int, drain_s: float = DRAIN_S) -> None:
    """For `drain_s` the node gets requests of new prompts (each one changes the cache, so a
    batch of KV events is published and the publisher reads its subscribers' queues) and stays
    alive with the same engine; then a new client gets the oracle's answer. A request whose
    answers a dying gateway lost ends with node_silent: told, never left waiting."""
    lost, i = 0, 0
    with Client(ln.port, timeout=30) as c:  # (a DEALER reaches a restarted gateway by itself)
        _heard(c)  # a client's liveness check holds once the node has spoken (runtime/client/client.py)
        end = time.monotonic() + drain_s
        while time.monotonic() < end:
            assert ln.proc.poll() is None, ln.logs()
            try:
                c.generate(PROMPT + 100 + i, 1)
            except RequestError as e:
                assert e.code == api.SILENT, e
                lost += 1
            i += 1
            time.sleep(0.1)  # a test pacing its requests, not a hot path
    assert ln.proc.poll() is None, ln.logs()
    assert _pid(ln.node, "engine") == engine_pid
    with Client(ln.port, timeout=30) as c:
        _heard(c)
        got = [int(t) for t in c.generate(PROMPT, 4).output_token_ids]
    assert got == oracle().generate_dense(PROMPT, 4)
    log.info("gateway restarts %s, requests lost with a gateway %d", snapshot(ln.node).get("gateway_restarts"), lost)


def _heard(c: Client) -> None:
    """Hear from the node once (an info retried: the gateway may be starting again)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            c.info(timeout=1)
            return
        except ClientError:
            assert time.monotonic() < deadline, "the node did not answer an info within 30 s"


def test_a_ping_attack_on_the_client_port_ends_no_node(node, tmp_path):
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "64") as ln:
        engine = _pid(node, "engine")
        _attack(ln.port, 8)
        _goes_on(ln, engine)


def test_a_ping_attack_on_a_decode_nodes_peer_port_ends_no_node(node, tmp_path):
    """A decode node's client port is where its prefill peers connect (runtime/pd/decode.py)."""
    secret = pd_secret_file(tmp_path)
    with launched(node, tmp_path / "d", *SMALL, "--num-gpu-blocks", "64", "--role", "decode",
                  "--pd-secret-file", secret) as ln:
        engine = _pid(node, "engine")
        _attack(ln.port, 8)
        _goes_on(ln, engine)


@pytest.mark.parametrize("which", ["replay", "events"])
def test_a_ping_attack_on_the_kv_events_ports_ends_no_node(node, tmp_path, which):
    """One connection is enough: against the replay port, because the engine reads it at a
    bounded rate (--kv-events-replay-rate, here REPLAY_RATE), so its queue stays full; against
    the events port, because a publisher reads its subscribers' queues only when it publishes.
    Afterwards a late subscriber still catches up through the replay."""
    events = free_port_pair()
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "64", "--kv-events-port", str(events),
                  "--kv-events-replay-rate", str(REPLAY_RATE)) as ln:
        engine = _pid(node, "engine")
        ln.client.generate(PROMPT, 4)  # something to publish
        if which == "replay":
            _attack(events + 1, 1)
            _goes_on(ln, engine, REPLAY_DRAIN_S)
        else:
            _attack(events, 1, "SUB")
            _goes_on(ln, engine)
        view = KVEventView(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{events + 1}")
        try:
            deadline = time.monotonic() + 30
            while not view.media and time.monotonic() < deadline:  # (the gateway may be starting again)
                view.sync()
            assert view.media, "a late subscriber got nothing from the replay"
        finally:
            view.close()
