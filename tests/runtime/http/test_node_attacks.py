"""Attacks on a real node's HTTP port, rerun as they were first made: a prompt longer than the
model and a body over the limit get an error (never a request dropped unanswered), a temperature
at or below 1e-308 samples the greedy token (dividing by it once overflowed into garbage), eight
16 MiB bodies at once, or eight just under the limit (long prompts, or lists of the wrong type),
are answered without the HTTP server growing by many times their size, and a killed
engine ends an HTTP client's stream with an error. Each ends by checking that the node still
serves a well-behaved client the right answer (the killed engine's node stops, as designed)."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import socket
import urllib.error
import urllib.request

import openai
import psutil
import pytest

from kvrt.ipc.ports import free_port
from kvrt.runtime.http.body_limit import max_body_bytes
from tests.launched import SMALL, launched, oracle
from tests.runtime.http.test_http import MODEL, _wait_healthy
from tests.runtime.http.test_stream_failures import LONG, _stream_killing
from tests.runtime.node.test_launch import launched as launched_bg  # noqa: F401  (the fixture)

pytestmark = pytest.mark.e2e
log = logging.getLogger(__name__)

MODEL_LEN = 4096   # the default --max-model-len
BODY = 16 << 20    # each of the eight bodies of the original attack
GROWTH = 256 << 20  # what the HTTP server may grow by over eight refused bodies (it grew by 2.4 GiB)


def _serves_right(oa: openai.OpenAI) -> None:
    prompt = [9, 8, 7, 6]
    r = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert r.choices[0].token_ids == oracle().generate_dense(prompt, 4)


@pytest.fixture
def http_node(node, tmp_path):
    http = free_port()
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "64", "--http-port", str(http)) as ln:
        _wait_healthy(http)
        yield ln, http, openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", timeout=60,
                                      max_retries=0)
        assert ln.proc.poll() is None, ln.logs()


def test_a_prompt_over_the_model_length_is_an_error_and_a_tiny_temperature_is_greedy(http_node):
    ln, _, oa = http_node
    for n in (MODEL_LEN + 1, MODEL_LEN + 20_000):
        with pytest.raises(openai.BadRequestError) as e:
            oa.completions.create(model=MODEL, prompt=[1] * n, max_tokens=1)
        assert e.value.code == "context_length_exceeded" and str(MODEL_LEN) in e.value.message, e.value.message
    prompt = [3, 1, 4, 1, 5]
    greedy = oracle().generate_dense(prompt, 6)
    for t in (1e-308, 1e-320, 5e-324):
        r = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=t, seed=1)
        assert r.choices[0].token_ids == greedy, t
    _serves_right(oa)


def _post_whole(port: int, body_bytes: int, item: bytes) -> bytes:
    """POST a body of `body_bytes` (a JSON prompt of `item`s), declaring its length and sending
    all of it whatever the server answers early: the first bytes of the answer."""
    text = json.dumps({"model": MODEL, "max_tokens": 1, "prompt": []}).encode()
    fill = body_bytes - len(text) - len(item)
    body = text[:-2] + item + (b"," + item) * (fill // (len(item) + 1)) + b" " * (fill % (len(item) + 1)) \
        + b"]}"
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n" % len(body))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(body)
        out = b""
        with contextlib.suppress(ConnectionResetError, socket.timeout):
            while len(out) < 400 and (chunk := s.recv(65536)):
                out += chunk
        return out
    finally:
        s.close()


@pytest.mark.parametrize("size, item", [(BODY, b"0"), (max_body_bytes(MODEL_LEN) - 64, b"0"),
                                        (max_body_bytes(MODEL_LEN) - 64, b"0.5")],
                         ids=["16MiB", "token-ids-just-under-the-limit", "floats-just-under-the-limit"])
def test_eight_large_bodies_at_once_are_refused_without_the_server_holding_them(http_node, size, item):
    ln, http, oa = http_node
    server = psutil.Process(ln.proc.pid)  # the launcher: the HTTP server is a thread in it
    before = server.memory_info().rss
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _post_whole(http, size, item), range(8)))
    grown = server.memory_info().rss - before
    log.info("eight bodies of %d bytes: the HTTP server grew by %d MiB", size, grown >> 20)
    want = b"HTTP/1.1 413 " if size > max_body_bytes(MODEL_LEN) else b"HTTP/1.1 400 "
    assert all(a.startswith(want) for a in answers), [a[:120] for a in answers]
    assert grown < GROWTH, f"the HTTP server grew by {grown >> 20} MiB over eight bodies of {size >> 20} MiB"
    _serves_right(oa)


def _post_raw(port: int, path: str, body: bytes) -> tuple[int, dict]:
    """POST `body` as it is (a client library would refuse to write it): the status and the error."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_json_nested_thousands_of_levels_deep_is_a_400_wherever_it_is(http_node):
    """A body, a guided_json schema given as text, and a tool call's arguments in a chat turn,
    each nested past what a JSON parser can follow (its RecursionError was a 500): each is a
    400 naming the depth, and the node goes on."""
    ln, http, oa = http_node
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(openai.BadRequestError) as e:
        oa.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2, extra_body={"guided_json": deep})
    assert "levels deep" in e.value.message, e.value.message
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": ' + deep[:4000] + "}"}}
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}])
    assert "levels deep" in e.value.message, e.value.message
    status, err = _post_raw(http, "/v1/completions", f'{{"model": "{MODEL}", "prompt": [1], "x": {deep}}}'.encode())
    assert status == 400 and "levels deep" in err["error"]["message"], (status, err)
    _serves_right(oa)


def test_a_killed_engine_ends_the_http_stream_with_an_error(launched_bg):  # noqa: F811
    http = free_port()
    n = launched_bg("--port", str(free_port()), "--http-port", str(http), *SMALL, "--num-gpu-blocks", "512")
    n.wait_for("ready:")
    _wait_healthy(http)
    engine = n.child_pids()["engine[0]"]
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", timeout=60, max_retries=0)
    err, got = _stream_killing(oa, engine)
    assert 0 < got < LONG and "stopping" in err.message, (got, err.message)  # an error, not a hang
    assert n.proc.wait(30) != 0  # a node whose engine died stops, nonzero (never a silent half-node)
