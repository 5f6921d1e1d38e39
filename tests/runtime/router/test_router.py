"""`kvrt route`: the policies on their own, then the real router (a `kvrt route` process) in front
of two real nodes with HTTP and KV events: cache-aware sends a prompt whose prefix a node holds to
that node (which then serves it from its cache), round-robin alternates, the openai client works
through it (streaming too), a node that stops is taken out (its request fails over once), and a
client that leaves before its answer cancels it on the node."""
from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import openai
import pytest

from kvrt.ipc.ports import free_port, free_port_pair
from kvrt.runtime.cache.event_secret import EventSecret
from kvrt.runtime.cache.keys import BlockHasher, salted_root
from kvrt.runtime.client.chat_template import ChatTemplate, Message
from kvrt.runtime.client.tokenizer import ByteTokenizer, HFTokenizer
from kvrt.runtime.router.app import Router
from kvrt.runtime.router.backends import Backends
from kvrt.runtime.router.policy import Candidate, Picker
from tests.conftest import REPO
from tests.launched import SMALL, interrupt, launched, launched_together
from tests.runtime.http.test_http import _wait_healthy, leave_before_a_whole_answer
from tests.tokenizer_kit import make_tokenizer_dir

MODEL = "kvrt-reference"


def test_round_robin_alternates_and_least_load_takes_the_idlest():
    rr = Picker("round-robin")
    cands = [Candidate(0, 5), Candidate(1, 0)]
    assert [rr.pick(cands).index for _ in range(4)] == [0, 1, 0, 1]
    ll = Picker("least-load")
    assert {ll.pick(cands).index for _ in range(4)} == {1}


def test_cache_aware_follows_the_prefix_until_the_node_is_too_loaded():
    ca = Picker("cache-aware", load_margin=2)
    assert {ca.pick([Candidate(0, 2, 0), Candidate(1, 4, 7)]).index for _ in range(4)} == {1}
    assert {ca.pick([Candidate(0, 1, 0), Candidate(1, 4, 7)]).index for _ in range(4)} == {0}  # 3 > margin
    assert [ca.pick([Candidate(0, 0), Candidate(1, 0)]).index for _ in range(4)] == [0, 1, 0, 1]  # nothing cached
    with pytest.raises(ValueError):
        Picker("fastest")


def _router(tokenizer_dir: str = "") -> Router:
    """A router over two described (fake) backends with different key roots; nothing started."""
    backends = Backends(["http://127.0.0.1:1", "http://127.0.0.1:2/v1/"], events=False)
    for b, root in zip(backends.items, (b"a" * 16, b"b" * 16)):
        b.key_root, b.block_size, b.described = root, 4, True
    return Router(backends, Picker("cache-aware"), tokenizer_dir)


def test_prompt_keys_are_the_nodes_keys_for_ids_text_and_chat(tmp_path):
    r = _router()
    assert [b.url for b in r.backends.items] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    ids = list(range(10))
    keys = r.keys("/v1/completions", json.dumps({"prompt": ids}).encode())
    assert keys == {(b"a" * 16, 4): BlockHasher(4, b"a" * 16).update(ids),
                    (b"b" * 16, 4): BlockHasher(4, b"b" * 16).update(ids)}
    text = r.keys("/v1/completions", json.dumps({"prompt": ["héllo world", "other"]}).encode())
    assert text[(b"a" * 16, 4)] == BlockHasher(4, b"a" * 16).update(ByteTokenizer().encode("héllo world"))
    assert r.keys("/v1/completions", b"not json") == {} and r.keys("/v1/chat/completions", b"{}") == {}
    salted = r.keys("/v1/completions", json.dumps({"prompt": ids, "cache_salt": "tenant-a"}).encode())
    assert salted[(b"a" * 16, 4)] == BlockHasher(4, salted_root(b"a" * 16, "tenant-a")).update(ids)  # as the node
    assert not set(salted[(b"a" * 16, 4)]) & set(keys[(b"a" * 16, 4)])
    assert r.keys("/v1/completions", json.dumps({"prompt": ids, "cache_salt": 7}).encode()) == {}
    r.backends.stop()
    tok_dir = make_tokenizer_dir(tmp_path / "tok")
    r = _router(tok_dir)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    tok = HFTokenizer.from_dir(tok_dir)
    rendered = ChatTemplate(tok.chat_template, tok.special_tokens).render(
        [Message("system", "be brief"), Message("user", "hi")], add_generation_prompt=True)
    want = BlockHasher(4, b"b" * 16).update(tok.encode(rendered, add_special_tokens=False))
    assert want and r.keys("/v1/chat/completions", json.dumps({"messages": msgs}).encode())[(b"b" * 16, 4)] == want
    r.backends.stop()


class _Described:
    """An httpx2 client stand-in whose every GET answers one /kvrt/cache description."""

    def __init__(self, info: dict) -> None:
        self.info = info

    def get(self, url: str):
        return type("R", (), {"status_code": 200, "json": lambda _: self.info})()

    def close(self) -> None:
        pass


def test_the_router_reads_a_nodes_events_only_with_the_nodes_secret():
    """A node's events under the router's secret are read with it; open events are read as they
    are; events under a secret the router lacks, or another one, give no view (no affinity)."""
    ours, theirs = EventSecret.of(b"o" * 32), EventSecret.of(b"t" * 32)
    base = {"key_root": (b"r" * 16).hex(), "block_size": 8, "kv_events": "tcp://0.0.0.0:5557",
            "kv_events_replay": "tcp://0.0.0.0:5558"}
    cases = [(ours, ours, ours), (ours, None, None), (ours, theirs, "none"), (None, ours, "none"), (None, None, None)]
    for router_secret, node_secret, read_with in cases:
        backends = Backends(["http://10.0.0.7:8000"], secret=router_secret)
        backends._http = _Described({**base, "kv_events_curve_key":
                                     node_secret.server_public.decode() if node_secret else None})
        b = backends.items[0]
        backends._describe(b)
        if read_with == "none":
            assert b._events_addr is None
        else:
            assert b._events_addr == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558") and b._events_secret is read_with
        backends.stop()


@contextlib.contextmanager
def routing(urls: list[str], policy: str, *opts: str):
    """A `kvrt route` process in front of `urls`; yields its base URL once it is healthy."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvrt.launcher", "route", "--port", str(port), "--backends",
                             ",".join(urls), "--policy", policy, *opts], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if _health(f"http://127.0.0.1:{port}")["status"] == "ok":
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the router was not healthy within 30 s"
            time.sleep(0.05)  # waiting for another process
        yield f"http://127.0.0.1:{port}"
    finally:
        interrupt(proc, "the router", 20)


def _health(base: str) -> dict:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        return json.load(e)


def _complete(base: str, prompt, max_tokens: int = 2) -> tuple[str, dict]:
    """POST /v1/completions; (the backend that answered, the body)."""
    req = urllib.request.Request(base + "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode(),
        {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.headers["x-kvrt-backend"], json.load(r)


@contextlib.contextmanager
def two_nodes(names: tuple[str, str], tmp_path):
    """Two nodes with HTTP and KV events; yields their base URLs and the launched nodes."""
    http = [free_port(), free_port()]
    with launched_together(*((name, tmp_path / name, (*SMALL, "--num-gpu-blocks", "128", "--http-port", str(h),
                                                      "--kv-events-port", str(free_port_pair())), 0)
                             for name, h in zip(names, http))) as lns:
        for h in http:
            _wait_healthy(h)
        yield [f"http://127.0.0.1:{h}" for h in http], lns


def _cached(base: str, backend: str) -> int:
    """Blocks the router's view of `backend` holds."""
    return next(b["cached_blocks"] or 0 for b in _health(base)["backends"] if b["url"] == backend)


def _wait_cached(base: str, backend: str, at_least: int, timeout: float = 10.0) -> None:
    """Until the router's view of `backend` holds `at_least` blocks (its events arrived)."""
    deadline = time.monotonic() + timeout
    while _cached(base, backend) < at_least:
        assert time.monotonic() < deadline, f"the KV events of {backend} did not reach the router"
        time.sleep(0.05)  # waiting for another process


@pytest.mark.e2e
def test_cache_aware_and_round_robin_routing_over_two_nodes(node, tmp_path):
    rng = np.random.default_rng(1)
    system = rng.integers(0, 512, 64).tolist()
    with two_nodes((node + "a", node + "b"), tmp_path) as (urls, _):
        with routing(urls, "cache-aware") as ca:
            first, body = _complete(ca, system + [1, 2, 3])
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            _wait_cached(ca, first, 67 // 8)
            for turn in range(3):  # round-robin would alternate: affinity keeps the prefix's node
                landed, body = _complete(ca, system + [7, turn, 9, 10])
                assert landed == first
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
            text = "a shared system prompt, long enough to fill a few blocks of eight bytes. "
            held = {u: _cached(ca, u) for u in urls}
            t1, _ = _complete(ca, text + "first question")  # text: keys from the byte tokenizer
            _wait_cached(ca, t1, held[t1] + len(text.encode()) // 8)
            for _ in range(2):
                t2, body = _complete(ca, text + "second question")
                assert t2 == t1 and body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            oa = openai.OpenAI(base_url=ca + "/v1", api_key="none", timeout=60, max_retries=0)
            assert [m.id for m in oa.models.list().data] == [MODEL]
            r = oa.completions.create(model=MODEL, prompt=system + [4], max_tokens=4, temperature=0)
            assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens_details.cached_tokens >= 64
            chunks = list(oa.completions.create(model=MODEL, prompt=system + [4], max_tokens=4, temperature=0,
                                                stream=True))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
            with pytest.raises(openai.NotFoundError):  # the node's 404, relayed
                oa.completions.create(model="nope", prompt=[1], max_tokens=1)
            req = urllib.request.Request(ca + "/tokenize", json.dumps({"model": MODEL, "prompt": "ab"}).encode(),
                                         {"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as t:
                assert json.load(t)["tokens"] == list(b"ab")
        with routing(urls, "round-robin") as rr:
            landed = [_complete(rr, system + [8, i])[0] for i in range(4)]
            assert landed[0] != landed[1] and landed[0::2] == [landed[0]] * 2 and landed[1::2] == [landed[1]] * 2


@pytest.mark.e2e
def test_a_stopped_node_is_taken_out_and_its_request_fails_over(node, tmp_path):
    with two_nodes((node + "a", node + "b"), tmp_path) as (urls, lns):
        with routing(urls, "round-robin", "--health-interval", "60") as slow, routing(urls, "round-robin") as rr:
            assert {_complete(slow, [1, 2, 3])[0], _complete(slow, [1, 2, 4])[0]} == set(urls)
            # stop node b (gracefully: it must leave nothing behind); the routers still count it in
            lns[1].proc.send_signal(signal.SIGTERM)
            lns[1].proc.wait(30)
            landed = [_complete(slow, [5, 6, i])[0] for i in range(2)]  # one of them was for b: failed over
            assert landed == [urls[0], urls[0]]
            assert [b["healthy"] for b in _health(slow)["backends"]] == [True, False]
            deadline = time.monotonic() + 10  # the polling router notices on its own
            while [b["healthy"] for b in _health(rr)["backends"]] != [True, False]:
                assert time.monotonic() < deadline, "the stopped node was not taken out within 10 s"
                time.sleep(0.1)  # waiting for the router's next health check
            assert _complete(rr, [9, 9, 9])[0] == urls[0]


@pytest.mark.e2e
def test_a_client_that_leaves_before_a_whole_answer_cancels_it_on_the_node(node, tmp_path):
    http = free_port()
    with launched(node, tmp_path, *SMALL, "--num-gpu-blocks", "128", "--http-port", str(http)) as ln:
        _wait_healthy(http)
        with routing([f"http://127.0.0.1:{http}"], "round-robin") as base:
            leave_before_a_whole_answer(ln, int(base.rsplit(":", 1)[1]))
