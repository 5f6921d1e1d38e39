"""Fair shares between HTTP clients on a real node: one address opening a hundred long streams
it never reads (or sending a burst of long requests) fills every seat of the engine, and another
address's ordinary request is answered, right, while the burst still waits (the engine takes
clients in turn and seats a newcomer: runtime/engine/fair_queue.py, scheduler.py); a stream
whose client reads nothing is cut once a write waits --http-stall-timeout (runtime/http/stalled.py),
its request cancelled. The node stays up throughout."""
from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx2
import pytest

from kvrt.ipc.ports import free_port
from tests.launched import SMALL, launched, oracle
from tests.runtime.http.test_http import MODEL, _wait_healthy

pytestmark = pytest.mark.e2e

BURST = 100       # one address's requests (under its 256 connections), far more than the engine's 32 seats
LONG = 3000       # tokens each of them asks for
STALL = 2.0       # --http-stall-timeout: the write bound of the stream nobody reads (the product's is 10 s)


def _open(port: int, body: dict, address: str = "127.0.0.1") -> socket.socket:
    """A request sent from `address` on a socket that reads (almost) nothing."""
    raw = json.dumps(body).encode()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.bind((address, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n" % len(raw) + raw)
    return s


def _waiting(ln) -> int:
    return ln.engine_stats()["seqs_waiting"]


@pytest.mark.parametrize("stream", [True, False])
def test_another_address_is_served_while_one_address_bursts(node, tmp_path, stream):
    http = free_port()
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "512", "--http-port", str(http)) as ln, \
            contextlib.ExitStack() as held:
        _wait_healthy(http)
        for i in range(BURST):
            held.callback(_open(http, {"model": MODEL, "prompt": [1 + i % 200, 2, 3], "max_tokens": LONG,
                                       "ignore_eos": True, "stream": stream}).close)
        deadline = time.monotonic() + 60
        while _waiting(ln) < BURST // 2:  # the burst is in: its requests wait for seats
            assert time.monotonic() < deadline, "the burst never reached the engine"
            time.sleep(0.05)  # a test waiting for another process's counters
        prompt = [5, 6, 7]
        with httpx2.Client(transport=httpx2.HTTPTransport(local_address="127.0.0.2"), timeout=60) as b:
            r = b.post(f"http://127.0.0.1:{http}/v1/completions",
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == oracle().generate_dense(prompt, 4)
        assert _waiting(ln) > BURST // 4, "the other address was served only once the burst was through"
        assert ln.proc.poll() is None


def _seen_then_gone(ln, timeout: float) -> None:
    """Wait until the engine has run a request and then has none left."""
    deadline = time.monotonic() + timeout
    seen = False
    while True:
        e = ln.engine_stats()
        busy = e["seqs_running"] + e["seqs_waiting"] + e["seqs_loading"]
        if seen and not busy:
            return
        seen = seen or busy > 0
        assert time.monotonic() < deadline, f"the engine {'kept' if seen else 'never got'} the request in {timeout} s"
        time.sleep(0.05)  # a test waiting for another process's counters


def test_a_stream_nobody_reads_is_cut_and_its_request_cancelled(node, tmp_path):
    http = free_port()
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "1024", "--http-port", str(http),
                  "--http-stall-timeout", str(STALL)) as ln:
        _wait_healthy(http)
        # 16 choices whose first events carry a 3,000-token prompt's scores with 20 alternatives each:
        # about 70 MB at once, far more than the sockets' buffers hold, then 1,000 tokens each
        s = _open(http, {"model": MODEL, "prompt": [(5 * j) % 256 for j in range(3000)], "max_tokens": 1000,
                         "ignore_eos": True, "stream": True, "n": 16, "prompt_logprobs": 20})
        try:
            # nothing is read until the engine is done with the request (cancelled by the cut, or
            # through on its own while the writes wait), and then for the bound once more: the
            # answer's writes have waited past it either way
            _seen_then_gone(ln, 60)
            time.sleep(STALL + 1)
            got, ended = b"", False
            s.settimeout(5)
            deadline = time.monotonic() + 60
            with contextlib.suppress(socket.timeout):
                while time.monotonic() < deadline:
                    try:
                        chunk = s.recv(1 << 20)
                    except ConnectionResetError:
                        chunk = b""
                    if not chunk:
                        ended = True
                        break
                    got = (got + chunk)[-4096:]  # (its end is what tells)
        finally:
            s.close()
        assert ended, "the stream was neither cut nor ended"
        assert b"data: [DONE]" not in got, "a stream nobody read was kept to its end"
        stats = ln.idle_stats(timeout=30)
        assert stats["seqs_running"] == 0 and stats["seqs_waiting"] == 0, stats
        assert ln.proc.poll() is None
