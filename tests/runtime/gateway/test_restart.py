"""A gateway that dies (here SIGKILL: as sudden as libzmq's abort) is started again and the node
goes on: the engine keeps its pid and its other requests; the HTTP API, which reaches the engine
over its private socket, answers while the gateway is down; a ZeroMQ request whose answers died
with the gateway ends at its client with node_silent (never a hang) and is cancelled at the
engine; a new client is served by the new gateway; `kvrt status` counts the restart. A hung
gateway is killed and replaced the same way."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import psutil
import pytest

from kvrt.ipc.ports import free_port
from kvrt.runtime.client import api
from kvrt.runtime.client.client import Client, Result
from kvrt.runtime.node.status import snapshot
from tests.conftest import REPO
from tests.launched import SMALL, launched, oracle
from tests.runtime.http.test_http import _wait_healthy

pytestmark = pytest.mark.e2e


def _gateway(node: str) -> dict:
    return next(p for p in snapshot(node)["processes"] if p["role"] == "gateway")


def _complete(port: int, prompt: list[int]) -> dict:
    body = json.dumps({"model": "kvrt-reference", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        return json.load(r)


def test_a_killed_gateway_is_replaced_and_the_node_goes_on(node, tmp_path):
    http = free_port()
    prompt = np.arange(5, 30, dtype=np.int32)
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "512", "--http-port", str(http)) as ln:
        _wait_healthy(http)
        engine = next(p["pid"] for p in snapshot(node)["processes"] if p["role"] == "engine")
        old = _gateway(node)["pid"]
        rid = ln.client.submit(prompt, 3000)  # long: still running when the gateway dies
        first = ln.client.poll(30)
        assert first and not isinstance(first[0], (Result, api.ErrorEvent)), first
        os.kill(old, signal.SIGKILL)
        # the HTTP API does not go through the gateway
        answer = _complete(http, [int(t) for t in prompt])
        assert answer["choices"][0]["finish_reason"] == "length"
        # the request whose answers died with the gateway: told, not left waiting
        end = None
        deadline = time.monotonic() + 30
        while end is None and time.monotonic() < deadline:
            end = next((e for e in ln.client.poll(1.0) if isinstance(e, (Result, api.ErrorEvent))), None)
        assert isinstance(end, api.ErrorEvent) and end.code == api.SILENT and end.request_id == rid, end
        stats = ln.idle_stats(timeout=20)  # ... and the engine cancelled it (its client was gone)
        assert stats["seqs_running"] == stats["seqs_waiting"] == 0, stats
        # a new gateway, counted; a new client is served through it
        deadline = time.monotonic() + 30
        while not (snapshot(node)["gateway_restarts"] >= 1 and _gateway(node)["ready"]):
            assert time.monotonic() < deadline, snapshot(node)
            time.sleep(0.1)  # a test waiting for another process
        assert _gateway(node)["pid"] != old
        with Client(ln.port, timeout=30) as c:
            got = [int(t) for t in c.generate(prompt, 4).output_token_ids]
        assert got == oracle().generate_dense(prompt, 4)
        assert next(p["pid"] for p in snapshot(node)["processes"] if p["role"] == "engine") == engine
        status = subprocess.run([sys.executable, "-m", "kvrt.launcher", "status", "--node", node], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert "gateway restarts 1" in status.stdout, status.stdout


@pytest.mark.alone  # --hang-timeout 1: a second test beside it could make a running process look hung
def test_a_hung_gateway_is_killed_and_replaced(node, tmp_path):
    """SIGSTOP: no heartbeat for --hang-timeout, as a gateway stuck in a loop would be; the
    launcher kills it and starts another instead of stopping the node."""
    prompt = np.arange(7, 19, dtype=np.int32)
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "64", "--hang-timeout", "1") as ln:
        old = _gateway(node)["pid"]
        os.kill(old, signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while not (snapshot(node)["gateway_restarts"] >= 1 and _gateway(node)["ready"]):
            assert time.monotonic() < deadline and ln.proc.poll() is None, ln.logs()
            time.sleep(0.1)  # a test waiting for another process
        assert _gateway(node)["pid"] != old and not psutil.pid_exists(old)
        with Client(ln.port, timeout=30) as c:
            got = [int(t) for t in c.generate(prompt, 4).output_token_ids]
        assert got == oracle().generate_dense(prompt, 4)


def test_a_fresh_clients_first_request_lost_with_the_gateway_ends_with_node_silent(node, tmp_path):
    """A client that never heard from the node sends its first request into a gateway that dies
    before relaying it: the dropped connection tells the client the node was there, so the
    request ends with node_silent once the node stays silent, not at the client's own timeout."""
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "64") as ln:
        gateway = _gateway(node)["pid"]
        with Client(ln.port, timeout=60, connect_timeout=10) as c:  # (connected: nothing left to resend)
            os.kill(gateway, signal.SIGSTOP)  # the request waits unread in the gateway's socket ...
            try:
                rid = c.submit(np.arange(3, 20, dtype=np.int32), 4)
                time.sleep(0.2)  # (a test letting the request reach the stopped process)
            finally:
                os.kill(gateway, signal.SIGKILL)  # ... and dies with it
            t0, end = time.monotonic(), None
            while end is None and time.monotonic() - t0 < 30:
                end = next((e for e in c.poll(1.0) if isinstance(e, (Result, api.ErrorEvent))), None)
            assert isinstance(end, api.ErrorEvent) and end.code == api.SILENT and end.request_id == rid, end
            assert time.monotonic() - t0 < 15, "told only after the client's own timeout"
