"""Bounded connections on a real node: more idle TCP connections to each of its ports (HTTP,
the ZeroMQ client API, KV events and their replay) than its soft open-files limit allows leave
it serving a well-behaved client (the launcher raises the limit to the hard one; idle
connections are closed, here after --http-idle-timeout 1 s rather than the default 5 s, and the
HTTP port refuses an address's excess over 256 at once)."""
from __future__ import annotations

import contextlib
import json
import resource
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from kvrt.ipc.ports import free_port, free_port_pair
from tests.launched import SMALL, launched, oracle

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

SOFT = 256  # the node's soft open-files limit at start (a user's default is often 1,024)
IDLE = 300  # idle connections to each port: past SOFT, and past the HTTP port's 256 per address


def _low_soft_limit() -> None:  # runs in the launcher between fork and exec
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(SOFT, hard), hard))


def _http_get(url: str, within_s: float) -> dict:
    """GET `url` as JSON, retrying a refusal (503) or a dropped connection for up to `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.loads(r.read())
        except (urllib.error.HTTPError, urllib.error.URLError, ConnectionError) as e:
            if time.monotonic() > deadline:
                raise AssertionError(f"GET {url} not served within {within_s} s: {e}") from None
            time.sleep(0.2)  # a client retrying a refused request


def test_idle_connections_to_every_port_leave_the_node_serving(node, tmp_path):
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 4 * IDLE + 1024:
        pytest.skip(f"the hard open-files limit ({hard}) is too low for this test's own sockets")
    http, events = free_port(), free_port_pair()
    ports = [http, events, events + 1]
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "64", "--http-port", str(http), "--http-idle-timeout",
                  "1", "--kv-events-port", str(events), preexec=_low_soft_limit) as ln:
        with contextlib.ExitStack() as idle:
            for port in [*ports, ln.port]:
                for _ in range(IDLE):
                    s = idle.enter_context(socket.socket())
                    s.settimeout(2)
                    with contextlib.suppress(ConnectionError, socket.timeout):
                        s.connect(("127.0.0.1", port))
            prompt = np.array([5, 6, 7, 8], np.int32)
            res = ln.client.generate(prompt, 4, timeout=30)
            assert [int(t) for t in res.output_token_ids] == oracle().generate_dense(prompt, 4)
            assert _http_get(f"http://127.0.0.1:{http}/v1/models", within_s=20)["data"]
            assert ln.proc.poll() is None, ln.logs()
