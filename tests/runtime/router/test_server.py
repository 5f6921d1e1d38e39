"""The router's own server over real sockets (runtime/router/server.py, body.py): a client that
asks `expect: 100-continue` is told to send its body, a client that leaves in the middle of a
stream closes the backend's stream without the backend being blamed, and a path or method the
router does not serve is answered in the OpenAI error shape."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Iterator

import httpx2

from kvrt.runtime.router.app import Router
from kvrt.runtime.router.backends import Backends
from kvrt.runtime.router.policy import Picker
from tests.routing_thread import serving_router
from tests.runtime.http.test_stream_failures import CHUNK, _scripted, http_server
from tests.runtime.router.test_careful_proxy import OK


@contextlib.contextmanager
def _routed(url: str) -> Iterator[tuple[str, Backends]]:
    backends = Backends([url], events=False)
    backends.items[0].healthy = True  # no health thread: the scripts answer POSTs only
    try:
        with serving_router(Router(backends, Picker("round-robin"))) as base:
            yield base, backends
    finally:
        backends.stop()


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def test_a_client_that_expects_100_continue_is_told_to_send_its_body():
    body = json.dumps({"model": "m", "prompt": [1, 2, 3]}).encode()
    with _scripted(OK) as url, _routed(url) as (base, _):
        with socket.create_connection(("127.0.0.1", _port(base)), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(body))
            got = b""
            while b"\r\n\r\n" not in got:
                got += s.recv(4096)
            assert got.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), got
            s.sendall(body)
            got = got[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
            while not got.endswith(b'{"id": "y"}'):
                got += s.recv(4096)
    assert got.startswith(b"HTTP/1.1 200 "), got


def test_a_client_that_leaves_mid_stream_closes_the_backends_stream_and_the_backend_stays_in():
    closed = threading.Event()

    class Endless(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            try:
                for _ in range(600):  # until the router closes the stream (at most 30 s)
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK))
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                closed.set()

        def log_message(self, *_) -> None:
            pass

    with http_server(Endless) as url, _routed(url) as (base, backends):
        with httpx2.stream("POST", base + "/v1/completions", json={"model": "m", "prompt": [1], "stream": True},
                           timeout=10) as r:
            assert r.status_code == 200
            first = next(r.iter_bytes())
            assert first.startswith(CHUNK)
        assert closed.wait(10), "the backend's stream was not closed within 10 s of the client leaving"
        deadline = time.monotonic() + 10
        while backends.items[0].inflight:
            assert time.monotonic() < deadline, "the request was not counted out within 10 s"
            time.sleep(0.01)  # waiting for the router's thread
        assert backends.items[0].healthy and backends.items[0].slow_until == 0


def test_a_path_or_method_the_router_does_not_serve_is_an_openai_error():
    with _scripted(OK) as url, _routed(url) as (base, _):
        missing = httpx2.post(base + "/v1/embeddings", json={}, timeout=10)
        wrong = httpx2.get(base + "/v1/completions", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
