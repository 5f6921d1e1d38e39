"""A flood of client messages against a real node: two sockets sending info requests, malformed
frames, multi-frame messages and unauthenticated peer messages as fast as they can for several seconds. The engine takes a
bounded batch per turn of its loop, so its heartbeat and its steps go on: the node does not
stop, and a well-behaved client's requests complete with the right answers meanwhile."""
from __future__ import annotations

import logging
import statistics
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from tests.conftest import REPO
from tests.launched import SMALL, launched, oracle

pytestmark = [pytest.mark.e2e, pytest.mark.alone]
log = logging.getLogger(__name__)

FLOOD_S = 3.0

# two DEALERs in one process, each sending what it can without blocking and dropping its answers
FLOODER = textwrap.dedent("""
    import sys
    from kvrt.runtime.client.api import API, InfoRequest
    from kvrt.runtime.pd.messages import PdAbort
    from tests.flooder import flood
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    info = API.encode(InfoRequest(7))
    peer = API.encode(PdAbort("r"))  # a peer message outside a session: refused (and logged, rate-limited)
    garbage = [[info], [b"\\xc1garbage"], [b"a", b"b", b"c"], [peer]]
    print(flood(f"tcp://127.0.0.1:{port}", garbage, seconds))
""")


def test_a_flood_of_messages_neither_stops_the_node_nor_starves_a_good_client(node, tmp_path):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 512, int(rng.integers(5, 60))).astype(np.int32) for _ in range(40)]
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "256", "--hang-timeout", "1") as ln:
        flood = subprocess.Popen([sys.executable, "-c", FLOODER, str(ln.port), str(FLOOD_S)], cwd=REPO,
                                 stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # the flood is on
        got, latency_ms = [], []
        for p in prompts:
            if flood.poll() is not None:
                break
            res = ln.client.generate(p, 4, timeout=30)
            got.append((p, [int(t) for t in res.output_token_ids]))
            latency_ms.append(res.e2e_ms)
        rate = float(flood.communicate(timeout=30)[0])
        assert ln.proc.poll() is None, ln.logs()
        assert ln.client.info(timeout=10).node == node
    assert len(got) >= 3, "the good client finished fewer than 3 requests during the flood"
    model = oracle()
    assert all(out == model.generate_dense(p, 4) for p, out in got)
    log.info("flood of %.0f messages/s: %d requests of a good client, e2e latency median %.1f ms, max %.1f ms",
             rate, len(got), statistics.median(latency_ms), max(latency_ms))


# sockets that flood until just before libzmq's ZMTP heartbeat would first fire on their
# connection (5 s after the handshake, when the node set one) and then close, dropping their
# unread answers (so the node's side sees a reset while it has stopped reading them)
CLOSER = textwrap.dedent("""
    import sys
    from kvrt.runtime.client.api import API
    from kvrt.runtime.pd import messages as wire
    from tests.flooder import flood_then_close
    port, sockets = int(sys.argv[1]), int(sys.argv[2])
    hello = API.encode(wire.PdHello("p", bytes(16)))
    sealed = API.encode(wire.PdSealed(b"s" * 16, 1, b"x" * 32, bytes(32)))
    print(flood_then_close(f"tcp://127.0.0.1:{port}", [[b"\\xc1garbage"], [hello], [sealed]], sockets, (4.85, 4.99)))
""")


def test_floods_from_many_sockets_that_reset_their_connections_do_not_stop_the_node(node, tmp_path):
    """Malformed, PdHello and PdSealed floods from 12 sockets, each reset while the node had
    stopped reading it (back-pressure), twice: libzmq aborted the engine with `!_io_error` when a
    ZMTP heartbeat fired on such a connection (runtime/engine/server.py). The node goes on and a
    good client is answered after each round."""
    model = oracle()
    prompt = np.arange(1, 30, dtype=np.int32)
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "64") as ln:
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", CLOSER, str(ln.port), "12"], cwd=REPO,
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr[-2000:]
            time.sleep(0.5)  # past the time the heartbeats would have fired
            assert ln.proc.poll() is None, ln.logs()
            res = ln.client.generate(prompt, 4, timeout=30)
            assert [int(t) for t in res.output_token_ids] == model.generate_dense(prompt, 4)
        log.info("two rounds of %s messages from 12 resetting sockets: the node went on", out.stdout.strip())
