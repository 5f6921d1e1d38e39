"""The router as a careful proxy, over real sockets (the router served by its own server in a
thread, its backends tiny scripted HTTP servers: the peers, not the unit under test): a backend
that sends no headers within --backend-timeout is a 504 (not sent again) and avoided after, so
that the next request goes to another; a backend that answers 200 with junk is a 502, never a 200
with junk; junk or a cut in the middle of a stream ends it with an error event."""
from __future__ import annotations

import contextlib
import threading
from http.server import BaseHTTPRequestHandler
from typing import Iterator

import httpx2
import pytest

from kvrt.runtime.router.app import Router
from kvrt.runtime.router.backends import Backends
from kvrt.runtime.router.policy import Picker
from tests.runtime.http.test_stream_failures import CHUNK, _last_event, _scripted, _sse, http_server
from tests.routing_thread import serving_router

OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"id": "y"}'
BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}


@contextlib.contextmanager
def _stalling() -> Iterator[tuple[str, list]]:
    """A backend that reads each request and never answers (until the test ends); yields its URL
    and the requests it got."""
    release, got = threading.Event(), []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            got.append(self.rfile.read(int(self.headers.get("content-length", 0))))
            release.wait(30)

        def log_message(self, *_) -> None:
            pass

    with http_server(Handler) as url:
        try:
            yield url, got
        finally:
            release.set()


@contextlib.contextmanager
def _routed(urls: list[str], policy: str = "round-robin", timeout: float = 30.0) -> Iterator[tuple[str, Backends]]:
    backends = Backends(urls, events=False)
    for b in backends.items:
        b.healthy = True  # no health thread: the scripts answer POSTs only
    try:
        with serving_router(Router(backends, Picker(policy), backend_timeout=timeout)) as base:
            yield base, backends
    finally:
        backends.stop()


def _post(base: str, body: dict = BODY) -> httpx2.Response:
    return httpx2.post(base + "/v1/completions", json=body, timeout=60)


def test_a_backend_without_headers_in_time_is_a_504_sent_once_and_then_avoided():
    with _stalling() as (slow, got), _scripted(OK) as ok, _routed([slow, ok], timeout=0.5) as (base, backends):
        first = _post(base)  # round-robin: the stalling backend first
        assert first.status_code == 504, first.text
        err = first.json()["error"]
        assert err["code"] == "backend_timeout" and slow in err["message"] and "--backend-timeout" in err["message"]
        assert len(got) == 1, "a request the backend has is not sent again"
        assert backends.items[0].slow_until > 0
        health = httpx2.get(base + "/health", timeout=10).json()
        assert [b["slow"] for b in health["backends"]] == [True, False]
        after = [_post(base) for _ in range(4)]  # round-robin would give the stalling one two of them
        assert [r.status_code for r in after] == [200] * 4 and len(got) == 1
        assert {r.headers["x-kvrt-backend"] for r in after} == {ok}


@pytest.mark.parametrize("answer,stream", [
    (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 9\r\n\r\nnot json!", False),
    (b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 13\r\n\r\n<html></html>", False),
    (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 9\r\n\r\n[1, 2, 3]", False),
    (_sse(b"data: hello\n\n", b"data: [DONE]\n\n"), True),
    (_sse(b'data: {"no": "choices"}\n\n', b"data: [DONE]\n\n"), True),
])
def test_a_backend_answering_200_with_junk_is_a_502(answer, stream):
    with _scripted(answer) as junk, _routed([junk]) as (base, _):
        r = _post(base, {**BODY, "stream": stream})
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "backend_junk" and junk in err["message"], err


def test_junk_in_the_middle_of_a_stream_ends_it_with_an_error_event():
    with _scripted(_sse(CHUNK, b"data: <junk>\n\n", CHUNK, b"data: [DONE]\n\n")) as junk, _routed([junk]) as (base, _):
        r = _post(base, {**BODY, "stream": True})
    assert r.status_code == 200 and r.content.startswith(CHUNK), r.content
    assert b"data: <junk>\n" not in r.content and b"[DONE]" not in r.content  # (its error event quotes it)
    err = _last_event(r.content)["error"]
    assert err["code"] == "backend_junk" and "not an OpenAI chunk" in err["message"]


def test_a_stream_cut_mid_way_ends_with_an_error_event_over_real_sockets():
    with _scripted(_sse(CHUNK, b'data: {"id": "x", "cho', whole=False)) as cut, _routed([cut]) as (base, _):
        r = _post(base, {**BODY, "stream": True})
    assert r.status_code == 200 and b"[DONE]" not in r.content
    assert _last_event(r.content)["error"]["code"] == "backend_broke_off"


@pytest.mark.e2e
def test_a_stopped_node_behind_the_router_costs_one_timeout_then_the_other_node_serves(node, tmp_path):
    """Two real nodes behind `kvrt route --backend-timeout 2`; one's launcher (its HTTP server)
    SIGSTOPped before any request: requests are answered (at most one 504 naming it, none held
    for long), the rest by the other node with the right tokens; resumed, it serves again."""
    import os
    import signal

    from kvrt.ipc.ports import free_port
    from tests.launched import SMALL, launched_together, oracle
    from tests.runtime.http.test_http import MODEL, _wait_healthy
    from tests.runtime.router.test_router import routing

    ports = [free_port(), free_port()]
    want = oracle().generate_dense([3, 4, 5], 3)
    with launched_together((node + "a", tmp_path / "a", (*SMALL, "--http-port", str(ports[0])), 0),
                           (node + "b", tmp_path / "b", (*SMALL, "--http-port", str(ports[1])), 0)) as (a, _):
        for p in ports:
            _wait_healthy(p)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        with routing(urls, "round-robin", "--backend-timeout", "2") as base:
            os.kill(a.proc.pid, signal.SIGSTOP)
            try:
                got = [httpx2.post(base + "/v1/completions", json={"model": MODEL, "prompt": [3, 4, 5],
                                   "max_tokens": 3, "temperature": 0}, timeout=60) for _ in range(4)]
            finally:
                os.kill(a.proc.pid, signal.SIGCONT)
            codes = [r.status_code for r in got]
            assert codes.count(504) <= 1 and codes.count(200) >= 3, [r.text for r in got]
            assert all(urls[0] in r.json()["error"]["message"] for r in got if r.status_code == 504)
            served = [r for r in got if r.status_code == 200]
            assert all(r.headers["x-kvrt-backend"] == urls[1] and r.json()["choices"][0]["token_ids"] == want
                       for r in served)
        _wait_healthy(ports[0])
        assert a.proc.poll() is None


@contextlib.contextmanager
def _keeping_alive(answer: bytes) -> Iterator[tuple[str, list]]:
    """A backend that answers every POST with `answer` (whole, with its length or chunked) and
    keeps the connection; yields its URL and the client port of each request it got."""
    ports: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            ports.append(self.client_address[1])
            self.wfile.write(answer)
            self.wfile.flush()

        def log_message(self, *_) -> None:
            pass

    with http_server(Handler) as url:
        yield url, ports


@pytest.mark.parametrize("answer,stream", [(OK, False), (_sse(CHUNK, b"data: [DONE]\n\n"), True)])
def test_requests_one_after_another_reuse_one_connection_to_the_backend(answer, stream):
    with _keeping_alive(answer) as (url, ports), _routed([url]) as (base, _):
        for _ in range(3):
            r = _post(base, dict(BODY, stream=stream))
            assert r.status_code == 200 and b"error" not in r.content, r.content
    assert len(ports) == 3 and len(set(ports)) == 1, ports


def test_the_router_serves_its_own_metrics():
    from prometheus_client.parser import text_string_to_metric_families

    with _keeping_alive(OK) as (url, _), _routed([url]) as (base, _):
        for _ in range(2):
            assert _post(base).status_code == 200
        r = httpx2.get(base + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    assert samples[("kvrt_router_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 2
    assert samples[("kvrt_router_routed_total", (("backend", url),))] == 2
    assert samples[("kvrt_router_backend_healthy", (("backend", url),))] == 1
    assert samples[("kvrt_router_info", (("policy", "round-robin"),))] == 1
