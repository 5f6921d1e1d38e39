"""The HTTP layer's limits over real sockets, a node's app and the router's alike (a node's app
served by uvicorn with the guarded protocol, the router by its own server, each in a thread): a body over the limit is refused while it streams in (413), a
client that trickles its headers or its body is cut (408), a connection over the limits is
refused as "over capacity" (503, which the client reads: no reset), and meanwhile a well-behaved
client is served. 2,000 streams at once to a real node: 256 stream, the rest read why not."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import select
import socket
import threading
import time
from collections import Counter
import urllib.error
import urllib.request

import openai
import psutil
import pytest

from kvrt.ipc.ports import free_port
from kvrt.runtime.client.api import TokenEvent
from kvrt.runtime.http.app import Server
from kvrt.runtime.http.app import create_app as node_app
from kvrt.runtime.http.body_limit import BODIES_AT_ONCE, SMALL_BODY, BodyLimit, max_body_bytes
from kvrt.runtime.http.connections import PER_ADDRESS
from kvrt.runtime.router.app import Router
from kvrt.runtime.router.backends import Backends
from kvrt.runtime.router.policy import Picker
from tests.launched import SMALL, launched, oracle
from tests.runtime.http.test_http import MODEL, _FakeBridge, _wait_healthy
from tests.routing_thread import serving_router
from tests.uvicorn_thread import serving, serving_server

BIG = 64 << 20      # bytes a hostile client offers
CHUNK = 64 << 10


@contextlib.contextmanager
def _app(kind: str, body_s: float = 30.0, bridge: _FakeBridge | None = None):
    """The node's app over a fake engine (model length 64)."""
    assert kind == "node"
    yield node_app(Server(bridge or _FakeBridge(True), MODEL), body_s=body_s)


@contextlib.contextmanager
def _served(kind: str, body_s: float = 30.0, **limits):
    """The node's app over a fake engine (model length 64), or the router over no live backend,
    served; yields the base URL."""
    if kind == "node":
        with _app(kind, body_s) as app, serving(app, **limits) as base:
            yield base
        return
    backends = Backends(["http://127.0.0.1:9"], events=False)
    backends.items[0].max_model_len = 64  # as a node would report it: the router's limit is the node's
    try:
        with serving_router(Router(backends, Picker("round-robin")), body_s=body_s, **limits) as base:
            yield base
    finally:
        backends.stop()


LIMIT = max_body_bytes(64)


def _connect(base: str) -> socket.socket:
    host, port = base.rsplit("/", 1)[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _answer(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset after its answer ends it too)."""
    out = b""
    with contextlib.suppress(ConnectionResetError, socket.timeout):
        while chunk := s.recv(65536):
            out += chunk
    return out


def _get(base: str, path: str) -> int:
    try:
        with urllib.request.urlopen(base + path, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("kind", ["node", "router"])
def test_a_chunked_body_over_the_limit_is_refused_while_it_streams_in(kind):
    me = psutil.Process()
    with _served(kind) as base:
        before = me.memory_info().rss
        s = _connect(base)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"transfer-encoding: chunked\r\n\r\n")
        piece = b"%x\r\n%s\r\n" % (CHUNK, b" " * CHUNK)
        sent = 0
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < BIG and not select.select([s], [], [], 0)[0]:  # until the server answers
                s.sendall(piece)
                sent += CHUNK
        got = _answer(s)
        s.close()
        grown = me.memory_info().rss - before
        assert _get(base, "/version" if kind == "node" else "/health") in (200, 503)  # still serving
    assert got.startswith(b"HTTP/1.1 413 "), got[:200]
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "body_too_large"
    assert sent < LIMIT + (16 << 20), f"{sent} bytes went in before the refusal (limit {LIMIT}; socket buffers)"
    assert grown < 4 * LIMIT + (16 << 20), f"the server grew by {grown} bytes"


@pytest.mark.parametrize("kind", ["node", "router"])
def test_a_declared_length_over_the_limit_is_refused_before_the_body(kind):
    with _served(kind) as base:
        s = _connect(base)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % BIG)
        got = _answer(s)  # nothing of the body was sent
        s.close()
    assert got.startswith(b"HTTP/1.1 413 ") and b"connection: close" in got.lower(), got[:300]


def _trickle(base: str, head: bytes, data: bytes, every_s: float, out: list) -> None:
    """Send `head` at once, then `data` a byte at a time, one every `every_s`, until the server
    answers or closes."""
    s = _connect(base)
    try:
        s.sendall(head)
        for b in data:
            if select.select([s], [], [], every_s)[0]:
                break
            s.sendall(bytes([b]))
        out.append(_answer(s))
    except (BrokenPipeError, ConnectionResetError):
        out.append(_answer(s))
    finally:
        s.close()


@pytest.mark.parametrize("kind", ["node", "router"])
def test_slow_headers_and_slow_bodies_are_cut_and_a_well_behaved_client_is_served(kind):
    slow_head = (b"", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + b"x" * 400)
    slow_body = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 200\r\n\r\n", b"{" * 200)
    with _served(kind, body_s=1.0, header_s=1.0) as base:
        got: list[bytes] = []
        threads = [threading.Thread(target=_trickle, args=(base, *(slow_head if i % 2 else slow_body), 0.05, got))
                   for i in range(60)]
        for t in threads:
            t.start()
        served = [_get(base, "/health") for _ in range(20)]
        for t in threads:
            t.join(30)
    assert served == [200 if kind == "node" else 503] * 20  # (the router's one backend is not there)
    assert len(got) == 60
    heads = [g for g in got if b"header_timeout" in g]
    bodies = [g for g in got if b"body_timeout" in g]
    assert len(heads) == 30 and all(g.startswith(b"HTTP/1.1 408 ") for g in heads), got[:2]
    assert len(bodies) == 30 and all(g.startswith(b"HTTP/1.1 408 ") for g in bodies), got[:2]


def test_large_bodies_coming_in_at_once_share_a_budget_and_small_requests_never_wait():
    """BODIES_AT_ONCE connections that each declare a body near the limit and stall after its
    first part hold the budget: another such body is not read until they are cut (408), then it
    is answered; a request without a large body is served meanwhile."""
    order: list[str] = []
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    size = LIMIT - 100
    body = b'{"model": "%s", "prompt": [' % MODEL.encode() + b"1," * ((size - 40) // 2)
    body += b"1]}" + b" " * (size - len(body) - 3)

    def stalled(i: int) -> None:
        s = _connect(base)
        s.sendall(head % size + body[:SMALL_BODY + 4096])
        order.append(f"stalled {_answer(s)[:12].decode()}")
        s.close()

    def whole() -> None:
        s = _connect(base)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(head % size + body)
        order.append(f"whole {s.recv(12).decode()}")  # (the status line: the connection stays open)
        s.close()

    with _app("node", body_s=5.0) as app, serving(app) as base:
        stalls = [threading.Thread(target=stalled, args=(i,)) for i in range(BODIES_AT_ONCE)]
        for t in stalls:
            t.start()
        limiter = None
        deadline = time.monotonic() + 10
        while limiter is None or limiter.budget.held < BODIES_AT_ONCE * size:  # the stalled bodies hold it all
            assert time.monotonic() < deadline, "the stalled bodies did not take the budget within 10 s"
            time.sleep(0.01)  # waiting for the server's thread
            limiter = app.middleware_stack
            while limiter is not None and not isinstance(limiter, BodyLimit):
                limiter = getattr(limiter, "app", None)
        assert _get(base, "/health") == 200
        order.append("health")
        # the late body's own deadline runs from its headers and includes its wait for the
        # budget: sent well after the stalled ones, it has that margin to be read once they are cut
        time.sleep(1.5)
        late = threading.Thread(target=whole)
        late.start()
        for t in [*stalls, late]:
            t.join(30)
    # the late body is read once a stalled one is cut and frees its share (the others may be
    # cut after it is answered: each is cut BODY_S after its own headers)
    assert order[0] == "health" and order[1] == "stalled HTTP/1.1 408", order
    assert sorted(order[1:]) == ["stalled HTTP/1.1 408"] * BODIES_AT_ONCE + ["whole HTTP/1.1 400"], order


def test_a_nodes_connections_send_each_write_at_once():
    """The listening socket is made with protocol 0 (as the node's is), so asyncio leaves Nagle on;
    the guarded protocol turns it off, or a kept-alive client's next answer waits for its ACK."""
    with _app("node") as app, serving_server(app) as (base, server):
        s = _connect(base)
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert s.recv(12) == b"HTTP/1.1 200"
        sockets = [p.transport.get_extra_info("socket") for p in server.server_state.connections]
        assert sockets and all(k.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for k in sockets)
        s.close()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_kept_alive_connection_between_requests_closes_at_the_stop_without_holding_it():
    """A client that keeps its connection after an answer and reads nothing more (a pooled
    connection): at the server's stop the connection closes at once (the client reads its end),
    and the stop does not wait out uvicorn's graceful timeout for it (uvicorn logs that it gave up)."""
    records = _Records()
    try:
        with _app("node") as app, serving_server(app) as (base, server):
            logging.getLogger("uvicorn.error").addHandler(records)  # (uvicorn's config set its handlers)
            s = _connect(base)
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert s.recv(12) == b"HTTP/1.1 200"
            server.should_exit = True  # (the server thread is joined on exit below)
        while s.recv(4096):  # the rest of the answer, then the server's end of the connection
            pass
        s.close()
    finally:
        logging.getLogger("uvicorn.error").removeHandler(records)
    assert not [m for m in records.messages if "timeout graceful shutdown exceeded" in m], records.messages


def test_a_kept_alive_connection_to_the_router_between_requests_closes_at_its_stop(monkeypatch):
    """The router's server the same: its stop closes such a connection at once (with the stop's
    wait for requests in flight and the idle timeout made longer than this test's wait for the
    close, a stop that waited for this connection would fail it)."""
    from kvrt.runtime.router import server as router_server

    monkeypatch.setattr(router_server, "SHUTDOWN_S", 600.0)
    with _served("router", idle_s=600.0, header_s=600.0) as base:
        s = _connect(base)
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert s.recv(9) == b"HTTP/1.1 "
    while s.recv(4096):  # the rest of the answer, then the server's end of the connection (10 s at most)
        pass
    s.close()


@pytest.mark.parametrize("kind", ["node", "router"])
def test_connections_over_an_address_share_or_the_total_are_over_capacity(kind):
    with _served(kind, per_address=8, total=12) as base:
        with contextlib.ExitStack() as held:
            for _ in range(8):
                held.enter_context(_connect(base))
            oa = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=10, max_retries=0)
            with pytest.raises(openai.APIStatusError) as e:
                oa.models.list()
            assert e.value.status_code == 503 and "over capacity" in e.value.message
            assert "this address" in e.value.message and "not ready" not in e.value.message
    with _served(kind, host="0.0.0.0", per_address=8, total=12) as base:
        port = int(base.rsplit(":", 1)[1])
        with contextlib.ExitStack() as held:
            for i in range(12):  # from 127.0.0.2 ... (the whole of 127/8 is this machine)
                c = held.enter_context(socket.socket())
                c.bind((f"127.0.0.{2 + i % 3}", 0))
                c.connect(("127.0.0.1", port))
            oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=10, max_retries=0)
            with pytest.raises(openai.APIStatusError) as e:
                oa.models.list()
            assert e.value.status_code == 503 and "over capacity" in e.value.message
            assert "limit of 12 connections" in e.value.message


class _Holding(_FakeBridge):
    """An engine that answers each request's first token, then holds it."""

    def submit(self, sub) -> None:
        self.put(sub, TokenEvent(sub.request_id, 0, [7]))


async def _many_streams(base: str, n: int, max_tokens: int) -> Counter:
    """`n` streams at once from one address: how each began ("stream", or the error it got)."""
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", timeout=120, max_retries=0) as oa:
        held = []

        async def one() -> str:
            try:
                held.append(await oa.completions.create(model=MODEL, prompt=[1, 2], max_tokens=max_tokens,
                                                            stream=True))
                return "stream"
            except openai.APIStatusError as e:
                return f"{e.status_code} {e.message}"
            except openai.APIError as e:
                return f"{type(e).__name__}: {e.__cause__!r}"

        out = Counter(await asyncio.gather(*(one() for _ in range(n))))
        for s in held:
            await s.close()
        return out


def test_streams_past_an_address_share_read_over_capacity_not_a_reset():
    """The refusal is a lingering close: a client that sent its request before the server
    answered reads the 503, not a connection reset."""
    with _app("node", bridge=_Holding(True)) as app, serving(app, per_address=32) as base:
        got = asyncio.run(_many_streams(base, 200, 8))
    refused = "503 Error code: 503 - over capacity: this address already holds 32 connections to this server; retry later"
    assert got == Counter({"stream": 32, refused: 168}), got


@pytest.mark.alone
@pytest.mark.e2e
def test_two_thousand_streams_to_a_node_are_served_or_told_over_capacity(node, tmp_path):
    http = free_port()
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "1024", "--max-num-seqs", str(PER_ADDRESS),
                  "--max-num-batched-tokens", str(4 * PER_ADDRESS), "--http-port", str(http)) as ln:
        _wait_healthy(http)
        got = asyncio.run(_many_streams(f"http://127.0.0.1:{http}", 2000, 3000))
        oa = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", timeout=60, max_retries=0)
        after = oa.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=3, temperature=0)
        assert after.choices[0].token_ids == oracle().generate_dense([4, 5, 6], 3)  # served, and right
        assert ln.proc.poll() is None, ln.logs()
    refused = (f"503 Error code: 503 - over capacity: this address already holds {PER_ADDRESS} connections to this server; "
               f"retry later")
    assert got == Counter({"stream": PER_ADDRESS, refused: 2000 - PER_ADDRESS}), got
