"""ZeroMQ clients of an engine that is stopped (SIGSTOP) or killed are told so within the
client's liveness window (runtime/client/client.py: the engine probes every client with requests
in flight every 0.5 s), not after their own timeout: the request ends with an ErrorEvent of code
`node_silent`, raised by generate and stream, returned by poll. Once the stopped engine goes on,
the node serves again (the request's cancel reached it). Before the fix, each wait here lasted
the whole client timeout."""
from __future__ import annotations

import contextlib
import os
import signal

import numpy as np
import pytest

from kvrt.ipc.ports import free_port
from kvrt.runtime.client.api import SILENT, ErrorEvent
from kvrt.runtime.client.client import Client, RequestError, Result
from kvrt.runtime.node.status import snapshot
from tests.launched import SMALL, launched, oracle
from tests.runtime.node.test_launch import launched as launched_bg  # noqa: F401  (the fixture)

# a stopped or killed engine's silence is what each test waits out: the client's own liveness
# window (4 probe intervals, as every client has), not a bound set short for the test
pytestmark = pytest.mark.e2e

TIMEOUT = 30.0  # each client's own timeout: far above its liveness window
LONG = 3000     # tokens of a request that is still running when the engine stops


def engine_pid(node: str) -> int:
    return next(p["pid"] for p in snapshot(node)["processes"] if p["role"] == "engine")


@contextlib.contextmanager
def stopped(pid: int):
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_stopped_engine_ends_the_stream_with_node_silent_and_the_node_serves_after(node, tmp_path):
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "512", "--hang-timeout", "600") as ln:
        with Client(ln.port, timeout=TIMEOUT) as c, contextlib.ExitStack() as stop:
            with pytest.raises(RequestError) as e:
                for i, _ in enumerate(c.stream([1, 2, 3], LONG)):
                    if i == 0:
                        stop.enter_context(stopped(engine_pid(node)))
        assert e.value.code == SILENT and "sent nothing" in e.value.message, e.value
        prompt = np.arange(4, 20, dtype=np.int32)
        assert ln.client.generate(prompt, 4, timeout=TIMEOUT).output_token_ids.tolist() == \
            oracle().generate_dense(prompt, 4)
        assert ln.idle_stats()["seqs_running"] == 0  # the stopped request's cancel reached the engine


def test_a_killed_engine_ends_every_polled_request_with_node_silent(launched_bg):  # noqa: F811
    port = free_port()
    n = launched_bg("--port", str(port), *SMALL, "--num-gpu-blocks", "512")
    n.wait_for("ready:")
    with Client(port, timeout=TIMEOUT) as c:
        rids = [c.submit([1, 2, 3 + i], LONG) for i in range(3)]
        assert c.poll(TIMEOUT)  # the node speaks: tokens are coming
        os.kill(n.child_pids()["engine[0]"], signal.SIGKILL)
        ended: dict[str, ErrorEvent] = {}
        while len(ended) < len(rids):
            events = c.poll(TIMEOUT)
            assert events, f"no event within {TIMEOUT:g} s; ended so far: {sorted(ended)}"
            ended |= {ev.request_id: ev for ev in events if isinstance(ev, (ErrorEvent, Result))}
    assert all(isinstance(ev, ErrorEvent) and ev.code == SILENT for ev in ended.values()), ended
    assert n.proc.wait(30) != 0
