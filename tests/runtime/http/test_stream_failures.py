"""A failed answer is reported as one, never as a finished answer: a stream whose node fails
after its first byte ends with an error event (and no `[DONE]`) that the real `openai` client
raises, through a node's own HTTP API (its worker SIGKILLed mid-stream) and through `kvrt route`
(the node's launcher SIGKILLed mid-stream); a non-streamed answer cut mid-body is a 5xx. The
router's cases that a real node cannot be made to show (a body cut after its headers, a stream
that just stops) are unit tests over scripted backends on real sockets."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import httpx2
import openai
import psutil
import pytest
from fastapi.testclient import TestClient

from kvrt.runtime.client.api import ErrorEvent, TokenEvent
from kvrt.runtime.http.app import Server
from kvrt.runtime.http.app import create_app as node_app
from kvrt.runtime.router.app import Router
from kvrt.runtime.router.backends import Backends
from kvrt.runtime.router.policy import Picker
from kvrt.runtime.router.relay import EventRelay
from kvrt.ipc.ports import free_port
from tests.runtime.http.test_http import MODEL, _FakeBridge, _wait_healthy
from tests.runtime.node.test_launch import launched  # noqa: F401  (the fixture)
from tests.routing_thread import serving_router
from tests.runtime.router.test_router import routing

SMALL = ("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16", "--block-size", "8",
         "--num-gpu-blocks", "400")  # room for one LONG answer
LONG = 3000  # tokens: far more than can be generated between the first chunk and a kill


# ---- the openai client, with the raw event stream it parsed ------------------------------------

class _Tee(httpx2.SyncByteStream):
    """A body that keeps its bytes, and reads the rest when the client closes it early (the
    openai client stops at an error event: what came after it is read here)."""

    def __init__(self, inner: httpx2.SyncByteStream, into: bytearray) -> None:
        self.inner, self.into = inner, into
        self._chunks = self._read()

    def _read(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.into += chunk
            yield chunk

    def __iter__(self) -> Iterator[bytes]:
        return self._chunks

    def close(self) -> None:
        with contextlib.suppress(httpx2.HTTPError):
            for _ in self._chunks:
                pass
        self.inner.close()


class _Recording(httpx2.HTTPTransport):
    """Keeps the bytes of every answer's body, so that a test can see the raw event stream (the
    openai client shows parsed chunks only: not a `[DONE]` after an error)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = bytearray()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        r = super().handle_request(request)
        return httpx2.Response(r.status_code, headers=r.headers, stream=_Tee(r.stream, self.body),
                               extensions=r.extensions)


def _recording_client(base: str) -> tuple[openai.OpenAI, _Recording]:
    rec = _Recording()
    return openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=60, max_retries=0,
                         http_client=httpx2.Client(transport=rec)), rec


def _last_event(body: bytes) -> dict:
    """The data of a raw event stream's last event, as JSON."""
    last = body.decode().strip().split("\n\n")[-1]
    assert last.startswith("data: "), body[-300:]
    return json.loads(last[len("data: "):])


def _stream_killing(oa: openai.OpenAI, pid: int) -> tuple[openai.APIError, int]:
    """Stream a LONG completion and SIGKILL `pid` once its first chunk is in: the error the
    client raised (it must raise) and the chunks it got before."""
    stream = oa.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=LONG, temperature=0, stream=True)
    got = 0
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            got += 1
            if got == 1:
                os.kill(pid, signal.SIGKILL)
    return e.value, got


# ---- real processes -------------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_worker_killed_mid_stream_ends_the_nodes_stream_with_the_reason(launched, node):  # noqa: F811
    http = free_port()
    n = launched("--port", str(free_port()), "--http-port", str(http), *SMALL)
    n.wait_for("ready:")
    _wait_healthy(http)
    worker = n.child_pids()["worker[0]"]
    oa, rec = _recording_client(f"http://127.0.0.1:{http}")
    err, got = _stream_killing(oa, worker)
    assert type(err) is openai.APIError, f"not the stream's error event: {err!r}"
    assert f"worker[0] (pid {worker}) was killed by SIGKILL" in err.message and 0 < got < LONG
    assert b"data: [DONE]" not in rec.body, "a failed stream must not end as a finished one"
    assert _last_event(bytes(rec.body))["error"]["message"] == err.message
    assert n.proc.wait(20) == 1


@pytest.mark.e2e
def test_a_node_killed_mid_stream_ends_the_routers_stream_with_an_error(launched, node):  # noqa: F811
    http = free_port()
    n = launched("--port", str(free_port()), "--http-port", str(http), *SMALL)
    n.wait_for("ready:")
    _wait_healthy(http)
    children = [psutil.Process(p) for p in n.child_pids().values()]
    url = f"http://127.0.0.1:{http}"
    with routing([url], "round-robin") as base:
        oa, rec = _recording_client(base)
        err, got = _stream_killing(oa, n.proc.pid)  # the launcher, and the HTTP server in it
        assert type(err) is openai.APIError, f"not the stream's error event: {err!r}"
        assert url in err.message and 0 < got < LONG
        assert b"data: [DONE]" not in rec.body
        assert _last_event(bytes(rec.body))["error"]["code"] == "backend_broke_off"
    n.proc.wait(20)
    _, alive = psutil.wait_procs(children, timeout=10)  # they go with their launcher; then the fixture cleans
    assert not alive, f"children outlived their launcher: {alive}"


# ---- the node's HTTP layer over a scripted engine -------------------------------------------------

class _FailingBridge(_FakeBridge):
    """An engine that answers a token, then fails the request."""

    def submit(self, sub) -> None:
        rid = sub.request_id
        for ev in (TokenEvent(rid, 0, [7]), ErrorEvent(rid, "failed", "worker[0] (pid 1) was killed by SIGKILL")):
            self.put(sub, ev)


def test_a_request_the_engine_fails_after_its_first_token_is_an_error_streamed_or_not():
    with TestClient(node_app(Server(_FailingBridge(True), MODEL)), raise_server_exceptions=False) as c:
        body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 8}
        r = c.post("/v1/completions", json={**body, "stream": True})
        assert r.status_code == 200 and "data: [DONE]" not in r.text, r.text
        assert "was killed by SIGKILL" in _last_event(r.content)["error"]["message"]
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 503 and "was killed by SIGKILL" in r.json()["error"]["message"], r.text


# ---- the router over scripted backends ------------------------------------------------------------

@contextlib.contextmanager
def http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` serving on a free loopback port in a thread; yields its URL."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


@contextlib.contextmanager
def _scripted(answer: bytes) -> Iterator[str]:
    """An HTTP server on a free loopback port that answers every POST with the raw bytes
    `answer` (status line, headers, body: as given, however broken) and then hangs up."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            self.wfile.write(answer)
            self.wfile.flush()
            self.close_connection = True

        def log_message(self, *_) -> None:
            pass

    with http_server(Handler) as url:
        yield url


def _sse(*events: bytes, whole: bool = True) -> bytes:
    """A chunked event-stream answer; cut before its last chunk unless `whole`."""
    body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + body
            + (b"0\r\n\r\n" if whole else b""))


CHUNK = b'data: {"id": "x", "choices": [{"index": 0, "text": "a"}]}\n\n'
NODE_ERROR = b'data: {"error": {"message": "the node failed it", "type": "t", "param": null, "code": "failed"}}\n\n'


@contextlib.contextmanager
def _router(*answers: bytes) -> Iterator[httpx2.Client]:
    """The router in this process over scripted backends, tried in the given order; a client of it."""
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(_scripted(a)) for a in answers]
        backends = Backends(urls, events=False)
        stack.callback(backends.stop)
        for b in backends.items:
            b.healthy = True  # no health thread: the scripts answer POSTs only
        base = stack.enter_context(serving_router(Router(backends, Picker("round-robin"))))
        yield stack.enter_context(httpx2.Client(base_url=base, timeout=30))


@pytest.mark.parametrize("answer,why", [
    (_sse(CHUNK, b'data: {"id": "x", "cho', whole=False), "broke off"),  # cut mid-event
    (_sse(CHUNK, CHUNK), "without [DONE]"),                              # ended, but not as a whole answer
])
def test_the_router_ends_a_cut_stream_with_an_error_event(answer, why):
    with _router(answer) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1], "stream": True})
    assert r.status_code == 200  # already sent with the first byte
    assert r.content.startswith(CHUNK) and b"data: [DONE]" not in r.content, r.content
    last = _last_event(r.content)["error"]
    assert why in last["message"] and last["code"] == "backend_broke_off"


@pytest.mark.parametrize("events", [(CHUNK, b"data: [DONE]\n\n"), (CHUNK, NODE_ERROR)])
def test_the_router_passes_a_whole_stream_as_it_came(events):
    with _router(_sse(*events)) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1], "stream": True})
    assert r.status_code == 200 and r.content == b"".join(events), r.content


def test_the_router_answers_a_body_cut_after_its_headers_with_502():
    cut = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"id": "x", "cho'
    with _router(cut) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1]})
    assert r.status_code == 502 and "broke off" in r.json()["error"]["message"], r.text


def test_a_backend_that_fails_before_the_first_byte_is_retried_on_another():
    ok = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"id": "y"}'
    with _router(b"", ok) as c:  # the first hangs up without an answer
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1]})
    assert r.status_code == 200 and r.json() == {"id": "y"}, r.text


def test_the_event_relay_sends_whole_events_and_knows_how_the_stream_ended():
    relay = EventRelay()
    assert relay.feed(CHUNK[:10]) == b"" and relay.feed(CHUNK[10:] + CHUNK[:5]) == CHUNK
    assert not relay.finished
    assert relay.feed(CHUNK[5:] + b"data: [DO") == CHUNK and relay.feed(b"NE]\n\n") == b"data: [DONE]\n\n"
    assert relay.finished
    errored = EventRelay()
    assert errored.feed(CHUNK + NODE_ERROR) == CHUNK + NODE_ERROR and errored.finished
    crlf = EventRelay()
    assert crlf.feed(b"data: [DONE]\r\n\r\n") == b"data: [DONE]\r\n\r\n" and crlf.finished
