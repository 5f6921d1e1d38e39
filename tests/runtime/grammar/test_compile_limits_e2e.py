"""A node under grammar attacks, through its HTTP API: a 30-byte regex whose automaton doubles
with each step of its repeat is stopped at the compile time limit and answered 400 naming it,
while another client's ordinary schema request (from another address) is answered before it;
a schema whose `minLength` is a billion, and a tool whose `pattern` no automaton holds, are 400s
naming the keyword (a 503 once, which clients retry); ZeroMQ clients get the same refusal as a
bad_request error; the node goes on serving and its compile processes end with it.

Each request's latency is printed (the figures of the report), never asserted."""
from __future__ import annotations

import http.client
import json
import threading
import time

import numpy as np
import pytest

from kvrt.ipc.ports import free_port
from kvrt.runtime.client.client import ClientError, Sampling
from kvrt.runtime.client.tokenizer import HFTokenizer
from tests.hfkit import make_checkpoint
from tests.launched import launched
from tests.runtime.http.test_http import _wait_healthy
from tests.tokenizer_kit import make_tokenizer_dir

pytestmark = [pytest.mark.e2e, pytest.mark.alone]  # it bounds a compile in time and keeps a core busy
EXPONENTIAL = "(a|b)*a(a|b){16}"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}


def _post(port: int, body: dict, source: str = "127.0.0.1", path: str = "/v1/chat/completions") -> tuple[int, dict, float]:
    """(status, JSON body, seconds) of one request from `source` (another loopback address is
    another client: the node's compiles and quotas go by address)."""
    t0 = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120, source_address=(source, 0))
    try:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read()), time.monotonic() - t0
    finally:
        c.close()


def _chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 48, "temperature": 1.0, "seed": 3, **extra}


@pytest.fixture
def served(node, tmp_path):
    directory = tmp_path / "qwen2"
    make_checkpoint(directory, "Qwen2ForCausalLM", dtype="BF16", tied=True, seed=7, vocab_size=320,
                    max_position_embeddings=2048)  # a tools prompt is long in a tiny vocabulary
    make_tokenizer_dir(directory)
    http = free_port()
    with launched(node, tmp_path, "--block-size", "8", "--model", str(directory), "--num-gpu-blocks", "256",
                  "--http-port", str(http), "--grammar-timeout", "4") as n:
        _wait_healthy(http)
        yield n, http, str(directory)


def test_grammar_attacks_are_refused_by_their_limits_while_others_are_served(served):
    n, http, model = served
    attack: dict = {}

    def attacker() -> None:
        attack["status"], attack["body"], attack["s"] = _post(http, _chat(guided_regex=EXPONENTIAL))
        attack["done"] = time.monotonic()

    t = threading.Thread(target=attacker)
    t.start()
    time.sleep(0.5)  # the attacker's compile is running
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    status, body, other_s = _post(http, _chat(response_format=fmt), source="127.0.0.2")
    other_done = time.monotonic()
    t.join(timeout=60)
    print(f"\nanother client's schema request during the regex attack: {other_s:.2f} s; "
          f"the attack's 400: {attack['s']:.2f} s")
    assert status == 200, body
    assert json.loads(body["choices"][0]["message"]["content"]).keys() <= {"name", "age"}
    assert other_done < attack["done"], "the other client's request waited for the attack's compile"
    assert attack["status"] == 400, attack
    err = attack["body"]["error"]
    assert "--grammar-timeout" in err["message"] and err["param"] == "guided_regex", err

    # a schema whose automaton is refused before it is built, naming the keyword
    huge = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 10 ** 9}}}
    status, body, s = _post(http, _chat(response_format=huge))
    print(f"minLength 1e9 refused in {s:.2f} s")
    assert status == 400 and "minLength" in body["error"]["message"], body
    assert body["error"]["param"] == "response_format"

    # a tool whose pattern no automaton holds: the request's 400, not a 503 that clients retry
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}, "required": ["x"]}}}
    status, body, s = _post(http, _chat(tools=[tool], tool_choice="required"))
    assert status == 400 and "pattern" in body["error"]["message"] and body["error"]["param"] == "tools", body

    # the same refusals over ZeroMQ: a bad_request error naming the limit
    tok = HFTokenizer.from_dir(model)
    prompt = np.array(tok.encode("hello"), np.int64)
    with pytest.raises(ClientError, match="minLength"):
        n.client.generate(prompt, 8, eos_token_id=tok.eos_token_ids[0],
                          sampling=Sampling(guided={"kind": "json_schema",
                                                    "spec": json.dumps({"type": "string", "minLength": 10 ** 9})}))
    # and the node goes on: an ordinary grammar still compiles and holds
    status, body, s = _post(http, _chat(response_format=fmt))
    assert status == 200, body
    stats = n.idle_stats()
    assert stats["failed_requests"] >= 0
