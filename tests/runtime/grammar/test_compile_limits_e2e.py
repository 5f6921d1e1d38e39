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
from kvrt.runtime.client.client import RequestError, Sampling
from kvrt.runtime.client.tokenizer import HFTokenizer
from tests.hfkit import make_checkpoint
from tests.launched import launched
from tests.runtime.http.test_http import _wait_healthy
from tests.tokenizer_kit import make_tokenizer_dir

pytestmark = [pytest.mark.e2e, pytest.mark.alone]  # it bounds a compile in time and keeps a core busy
EXPONENTIAL = "(a|b)*a(a|b){22}"  # its automaton doubles with each step of the repeat: millions of
# states, past the time limit (or the memory one) on any machine (at {18} a fast one compiles it)
LIMITS = ("--grammar-timeout", "--grammar-memory-mib")  # a runaway compile is stopped by one of them
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


def _person(n: int) -> dict:
    """An ordinary schema, a new one each time (so that it is compiled, not found in the cache)."""
    schema = {**PERSON, "properties": {**PERSON["properties"], "name": {"type": "string", "maxLength": 4 + n}}}
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


def _under_attack(http: int, attack: dict, n: int) -> tuple[tuple[int, dict, float], float, bool]:
    """The attack's answer, and another client's (from another address) latency for an ordinary
    schema sent while the attack runs, and whether it was answered before the attack."""
    got: dict = {}

    def attacker() -> None:
        got["answer"] = _post(http, _chat(**attack))
        got["done"] = time.monotonic()

    t = threading.Thread(target=attacker)
    t.start()
    time.sleep(0.3)  # the attack is on its way, or already compiling
    status, body, other_s = _post(http, _chat(response_format=_person(n)), source="127.0.0.2")
    other_done = time.monotonic()
    t.join(timeout=60)
    assert status == 200, body
    assert json.loads(body["choices"][0]["message"]["content"]).keys() <= {"name", "age"}
    return got["answer"], other_s, other_done < got["done"]


def test_grammar_attacks_are_refused_by_their_limits_while_others_are_served(served):
    n, http, model = served
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}}, "required": ["x"]}}}
    attacks = [  # (name, body, the field the 400 names, what its message names)
        ("exponential regex", {"guided_regex": EXPONENTIAL}, "guided_regex", LIMITS),
        ("schema pattern", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "pattern": f"^{EXPONENTIAL}$"}}}}, "response_format", LIMITS),
        ("minLength 1e9", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "minLength": 10 ** 9}}}}, "response_format", ("minLength",)),
        ("tool pattern", {"tools": [tool], "tool_choice": "required"}, "tools", ("pattern",)),
    ]
    print()
    for i, (name, attack, param, words) in enumerate(attacks):
        (status, body, attack_s), other_s, other_first = _under_attack(http, attack, i)
        print(f"{name:>15}: refused {status} in {attack_s:.2f} s; another client's schema request meanwhile "
              f"{other_s:.2f} s")
        assert status == 400, (name, body)
        assert any(w in body["error"]["message"] for w in words) and body["error"]["param"] == param, (name, body)
        if words == LIMITS:  # a compile that runs to its limit held nobody else back
            assert other_first, f"{name}: the other client's request waited for the attack's compile"

    # the same refusal over ZeroMQ: a bad_request error naming the keyword
    tok = HFTokenizer.from_dir(model)
    prompt = np.array(tok.encode("hello"), np.int64)
    with pytest.raises(RequestError, match="minLength") as e:
        n.client.generate(prompt, 8, eos_token_id=tok.eos_token_ids[0],
                          sampling=Sampling(guided={"kind": "json_schema",
                                                    "spec": json.dumps({"type": "string", "minLength": 10 ** 9})}))
    assert e.value.code == "bad_request"
    # and the node goes on: an ordinary grammar still compiles and holds
    status, body, s = _post(http, _chat(response_format=_person(99)))
    assert status == 200, body
