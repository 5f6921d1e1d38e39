"""The client against a tiny in-test ZeroMQ ROUTER speaking runtime/client/api.py.

This is only a unit test of the client (and of the CLI's plumbing): the fake node below answers
with made-up tokens. End-to-end tests against a real node live in tests/runtime/client/test_client_e2e.py.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from kvrt.runtime.client.api import (API, BAD_REQUEST, DUPLICATE, SILENT, UNKNOWN, CancelRequest, ErrorEvent,
                         FinishedEvent, GenerateRequest, InfoReply, InfoRequest, TokenEvent)
from kvrt.runtime.client.client import Client, ClientError, RequestError, Result, address_of, as_prompt
from tests.conftest import REPO
from tests.router_thread import RouterThread

FAIL_TOKEN = 666      # a prompt starting with it gets an ErrorEvent
VOCAB = 1000
BLOCK = 16


class FakeNode(RouterThread):
    """A ROUTER in a thread. Every request streams one token per step (round-robin over the
    requests in flight, `step_s` apart); token i of a prompt ending in t is (t + i + 1) % VOCAB.
    It keeps an unlimited prefix cache of BLOCK-token blocks so cached_device is what a real
    cache would report for requests run one at a time. `silent` answers nothing; once `pause()`
    returns it does nothing at all, as a stopped engine, until `stopped` is set False."""

    def __init__(self, step_s: float = 0.002, silent: bool = False, eos: int = 0):
        self.step_s = step_s
        self.silent = silent
        self.stopped = False
        self.paused = threading.Event()  # the thread saw `stopped`
        self.eos = eos
        super().__init__()
        self.seen: set[bytes] = set()
        self.active: dict[str, dict] = {}
        self._start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.stopped:
                self.paused.set()
                self._stop.wait(self.step_s)
                continue
            self.paused.clear()
            if self.sock.poll(int(self.step_s * 1000) or 1):
                while True:
                    try:
                        ident, data = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    msg = API.decode(data)
                    self.received.append(msg)
                    if not self.silent:
                        self._handle(ident, msg)
            self._step()

    def pause(self) -> None:
        self.stopped = True
        assert self.paused.wait(5), "the fake node's thread did not pause"

    def _cached(self, prompt: np.ndarray, use_cache: bool) -> int:
        if not use_cache:
            return 0
        keys = [prompt[:(k + 1) * BLOCK].tobytes() for k in range(len(prompt) // BLOCK)]
        hit = 0
        while hit < len(keys) and keys[hit] in self.seen:
            hit += 1
        if hit * BLOCK == len(prompt):
            hit -= 1
        self.seen.update(keys)
        return hit * BLOCK

    def _handle(self, ident: bytes, msg) -> None:
        if isinstance(msg, InfoRequest):
            self._send(ident, InfoReply(msg.nonce, "fake", "mixed", VOCAB, 4096, BLOCK, self.eos))
        elif isinstance(msg, CancelRequest):
            req = self.active.pop(msg.request_id, None)
            if req is None:
                self._send(ident, ErrorEvent(msg.request_id, UNKNOWN, "no such request"))
            else:
                self._finish(req, "cancelled")
        elif isinstance(msg, GenerateRequest):
            prompt = np.asarray(msg.prompt)
            if msg.request_id in self.active:
                self._send(ident, ErrorEvent(msg.request_id, DUPLICATE, "already in flight"))
            elif len(prompt) == 0:
                self._send(ident, ErrorEvent(msg.request_id, BAD_REQUEST, "empty prompt"))
            elif prompt[0] == FAIL_TOKEN:
                self._send(ident, ErrorEvent(msg.request_id, BAD_REQUEST, "token 666 is cursed"))
            else:
                self.active[msg.request_id] = {"ident": ident, "msg": msg, "out": [], "t0": time.perf_counter(),
                                               "cached": self._cached(prompt, msg.use_cache)}

    def _step(self) -> None:
        for rid, req in list(self.active.items()):
            msg = req["msg"]
            tok = (int(msg.prompt[-1]) + len(req["out"]) + 1) % VOCAB
            req["out"].append(tok)
            if msg.stream:
                self._send(req["ident"], TokenEvent(rid, len(req["out"]) - 1, [tok]))
            if tok == msg.eos_token_id:
                self._finish(self.active.pop(rid), "eos")
            elif len(req["out"]) >= msg.max_new_tokens:
                self._finish(self.active.pop(rid), "length")

    def _finish(self, req: dict, reason: str) -> None:
        msg = req["msg"]
        n = len(msg.prompt)
        self._send(req["ident"], FinishedEvent(
            msg.request_id, np.array(req["out"], dtype=np.int32), reason, n, cached_device=req["cached"],
            computed_prompt_tokens=n - req["cached"], ttft_ms=1.0,
            e2e_ms=(time.perf_counter() - req["t0"]) * 1000))


def expected(prompt, n) -> list[int]:
    return [(int(prompt[-1]) + i + 1) % VOCAB for i in range(n)]


@pytest.fixture
def fake():
    with FakeNode() as f:
        yield f


def test_address_forms():
    assert address_of(5555) == "tcp://127.0.0.1:5555"
    assert address_of("node1:7000") == "tcp://node1:7000"
    assert address_of("ipc:///tmp/x") == "ipc:///tmp/x"
    assert address_of(80, "10.0.0.1") == "tcp://10.0.0.1:80"
    for bad in (0, 70000, "nohost", True):
        with pytest.raises(ValueError):
            address_of(bad)


def test_prompt_validation():
    assert as_prompt([1, 2, 3]).dtype == np.int32
    assert len(as_prompt([])) == 0
    for bad in ([1.5], ["a"], [[1, 2]], [2 ** 40]):
        with pytest.raises(ValueError):
            as_prompt(bad)


def test_info(fake):
    with Client(fake.port, timeout=5) as c:
        info = c.info()
        assert (info.node, info.vocab_size, info.block_size) == ("fake", VOCAB, BLOCK)
        assert c.info().nonce != info.nonce


def test_generate_streams_tokens_in_order(fake):
    got = []
    with Client(fake.port, timeout=5) as c:
        r = c.generate([1, 2, 3], 5, on_token=got.append)
    assert isinstance(r, Result)
    assert got == expected([3], 5) == r.output_token_ids.tolist()
    assert r.finish_reason == "length" and r.prompt_tokens == 3
    assert 0 < r.ttft_ms <= r.e2e_ms and r.tpot_ms is not None and r.tpot_ms >= 0
    assert r.to_dict()["cached_tokens"] == {"device": 0, "host": 0, "storage": 0}


def test_stream_iterator_and_eos(fake):
    with Client(fake.port, timeout=5) as c:
        gen = c.stream([10], 50, eos_token_id=14)
        assert list(gen) == [11, 12, 13, 14]
        assert gen.done and gen.result.finish_reason == "eos"
        assert c.in_flight == 0


def test_non_streaming_request_yields_the_whole_answer(fake):
    with Client(fake.port, timeout=5) as c:
        rid = c.submit([7], 4, stream=False)
        deadline = time.monotonic() + 5
        evs = []
        while not any(isinstance(e, Result) for e in evs) and time.monotonic() < deadline:
            evs += c.poll(0.5)
    assert [type(e) for e in evs] == [Result]
    r = evs[0]
    assert r.request_id == rid and r.output_token_ids.tolist() == expected([7], 4)
    assert r.ttft_ms == r.e2e_ms  # nothing streamed: the first token came with the end


def test_prefix_cache_fields_come_through(fake):
    prompt = list(range(1, 41))
    with Client(fake.port, timeout=5) as c:
        assert c.generate(prompt, 2).cached_device == 0
        r = c.generate(prompt + [99] * 8, 2)
        assert (r.cached_device, r.cached_tokens, r.computed_prompt_tokens) == (32, 32, 16)
        assert c.generate(prompt + [5], 2, use_cache=False).cached_device == 0


def test_many_in_flight_routed_by_request_id(fake):
    prompts = {i: [i + 1] * (i + 1) for i in range(20)}
    lens = {i: 3 + i % 5 for i in prompts}
    with Client(fake.port, timeout=5) as c:
        ids = {c.submit(prompts[i], lens[i], request_id=f"r{i}"): i for i in prompts}
        assert c.in_flight == 20
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        results: dict[str, Result] = {}
        deadline = time.monotonic() + 10
        while len(results) < len(ids) and time.monotonic() < deadline:
            for ev in c.poll(0.5):
                if isinstance(ev, TokenEvent):
                    assert ev.index == len(tokens[ev.request_id])
                    tokens[ev.request_id] += list(ev.token_ids)
                else:
                    assert isinstance(ev, Result)
                    results[ev.request_id] = ev
        assert c.in_flight == 0
    assert set(results) == set(ids)
    for rid, i in ids.items():
        assert tokens[rid] == results[rid].output_token_ids.tolist() == expected(prompts[i], lens[i])


def test_generate_while_others_are_in_flight(fake):
    """Events of submitted requests seen while generate() waits are kept for poll()."""
    with Client(fake.port, timeout=5) as c:
        rid = c.submit([100], 30)
        r = c.generate([200], 3)
        assert r.output_token_ids.tolist() == expected([200], 3)
        evs = []
        deadline = time.monotonic() + 5
        while not any(isinstance(e, Result) for e in evs) and time.monotonic() < deadline:
            evs += c.poll(0.5)
    toks = [t for e in evs if isinstance(e, TokenEvent) for t in e.token_ids]
    assert all(e.request_id == rid for e in evs)
    assert toks == expected([100], 30)


# ---- a node that falls silent (runtime/client/client.py: liveness) ---------------------------

LIVENESS = 0.6  # (a real client's is 2 s, four of the engine's 0.5 s probes)


def test_a_node_that_falls_silent_ends_the_stream_with_node_silent():
    with FakeNode(step_s=0.02) as f, Client(f.port, timeout=30, liveness=LIVENESS) as c:
        with pytest.raises(RequestError) as e:
            for i, _ in enumerate(c.stream([1], 100_000)):
                if i == 0:
                    f.pause()
        assert e.value.code == SILENT and "sent nothing" in e.value.message, e.value
        assert c.in_flight == 0
        f.stopped = False
        deadline = time.monotonic() + 10
        while not any(isinstance(m, CancelRequest) for m in f.received):  # sent for when it comes back
            assert time.monotonic() < deadline, "the request's cancel never reached the node"
            time.sleep(0.01)  # (another thread's progress)


def test_poll_ends_every_request_in_flight_when_the_node_falls_silent():
    with FakeNode(step_s=0.02) as f, Client(f.port, timeout=30, liveness=LIVENESS) as c:
        rids = {c.submit([i + 1], 100_000) for i in range(3)}
        assert c.poll(5), "no token within 5 s"
        f.pause()
        ended = {}
        while set(ended) != rids:
            events = c.poll(30)
            assert events, f"poll gave nothing within 30 s; ended: {sorted(ended)}"
            ended |= {ev.request_id: ev for ev in events if isinstance(ev, ErrorEvent)}
        assert all(ev.code == SILENT for ev in ended.values()) and c.in_flight == 0


def test_a_question_to_a_node_gone_silent_raises_and_one_never_heard_from_waits_its_timeout():
    with FakeNode() as f, Client(f.port, timeout=30, liveness=LIVENESS) as c:
        c.info()
        f.pause()
        with pytest.raises(ClientError, match="sent nothing"):
            c.info()
    with FakeNode(silent=True) as f, Client(f.port, timeout=30, liveness=LIVENESS) as c:
        with pytest.raises(ClientError, match="no info reply .* within 1 s"):
            c.info(timeout=1)  # nothing heard yet: a silence says nothing about a node that never spoke


def test_error_event_raises_request_error(fake):
    with Client(fake.port, timeout=5) as c:
        with pytest.raises(RequestError) as ei:
            c.generate([FAIL_TOKEN, 1], 3)
        assert ei.value.code == BAD_REQUEST and "cursed" in ei.value.message
        with pytest.raises(RequestError, match="empty prompt"):
            c.generate([], 3)
        assert c.generate([1], 1).output_token_ids.tolist() == [2]  # the client goes on
        rid = c.submit([FAIL_TOKEN], 2)
        evs = c.poll(5)
        assert len(evs) == 1 and isinstance(evs[0], ErrorEvent) and evs[0].request_id == rid
        assert c.in_flight == 0


def test_cancel(fake):
    with Client(fake.port, timeout=5) as c:
        rid = c.submit([1], 10_000)
        while not c.poll(1):
            pass
        c.cancel(rid)
        deadline = time.monotonic() + 5
        res = []
        while not res and time.monotonic() < deadline:
            res = [e for e in c.poll(0.5) if isinstance(e, Result)]
        assert res[0].finish_reason == "cancelled" and 0 < res[0].num_output_tokens < 10_000
        c.cancel("nope")
        evs = c.poll(5)
        assert isinstance(evs[0], ErrorEvent) and evs[0].code == UNKNOWN


def test_leaving_a_stream_early_cancels_it(fake):
    with Client(fake.port, timeout=5) as c:
        with c.stream([1], 10_000) as gen:
            assert next(gen) == 2
        assert c.in_flight == 0
        deadline = time.monotonic() + 5
        while fake.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not fake.active
        assert any(isinstance(m, CancelRequest) for m in fake.received)
        assert c.generate([5], 2).output_token_ids.tolist() == [6, 7]  # late events were dropped


def test_duplicate_request_id_is_refused_locally(fake):
    with Client(fake.port, timeout=5) as c:
        c.submit([1], 100, request_id="x")
        with pytest.raises(ValueError, match="already in flight"):
            c.submit([1], 1, request_id="x")


@pytest.mark.parametrize("rid", ["", "x" * 257, "a\nb"])
def test_bad_request_ids_are_refused_locally(fake, rid):
    with Client(fake.port, timeout=5) as c, pytest.raises(ValueError, match="request_id"):
        c.submit([1], 1, request_id=rid)
    assert not any(isinstance(m, GenerateRequest) for m in fake.received)


def test_empty_messages_are_liveness_probes_not_errors():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with Client(port, timeout=5) as c:
            c._send(InfoRequest(nonce=1), "info")
            ident, _ = router.recv_multipart()
            router.send_multipart([ident, b""])
            router.send_multipart([ident, API.encode(InfoReply(1, "n", "mixed", 8, 64, 4, -1))])
            assert c.info().node == "n"
            assert c.protocol_errors == 0
    finally:
        router.close(0)
        ctx.term()


def test_silent_node_times_out_with_a_clear_error():
    with FakeNode(silent=True) as f, Client(f.port, timeout=0.3) as c:
        t0 = time.monotonic()
        with pytest.raises(ClientError, match=rf"tcp://127.0.0.1:{f.port}.*0.3 s"):
            c.info()
        with pytest.raises(ClientError, match="first token of request"):
            c.generate([1, 2], 3)
        assert time.monotonic() - t0 < 2
        assert c.poll(0.1) == []
        assert c.in_flight == 0  # the abandoned request is forgotten
        assert any(isinstance(m, CancelRequest) for m in f.received)


def test_no_node_at_all_times_out():
    with Client(1, timeout=0.2) as c:  # port 1: nothing listens
        with pytest.raises(ClientError, match="no info reply from tcp://127.0.0.1:1 within 0.2 s"):
            c.info()


def test_garbage_answers_are_counted_and_named():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        with Client(port, timeout=0.5) as c:
            c._send(InfoRequest(nonce=1), "probe")
            ident, _ = router.recv_multipart()
            router.send_multipart([ident, b"\xc1 not msgpack"])
            with pytest.raises(ClientError, match="1 undecodable"):
                c.info()
            assert c.protocol_errors == 1
    finally:
        router.close(0)
        ctx.term()


def test_closed_client_raises():
    c = Client(1, timeout=0.1)
    c.close()
    c.close()
    with pytest.raises(ClientError, match="closed"):
        c.submit([1], 1)


# ---- kvrt generate ---------------------------------------------------------------------------

def kvrt(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "kvrt.launcher", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.e2e
@pytest.mark.parametrize("args, msg", [
    (["--port", "5", "--prompt-ids", "", "--max-new-tokens", "2"], "empty"),
    (["--port", "5", "--prompt-ids", "1,x,3", "--max-new-tokens", "2"], "'x' is not an integer"),
    (["--port", "5", "--prompt-ids", "1.5", "--max-new-tokens", "2"], "not an integer"),
    (["--port", "5", "--text", "", "--max-new-tokens", "2"], "empty"),
    (["--port", "5", "--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--port", "5", "--prompt-ids", "1", "--text", "a", "--max-new-tokens", "2"], "not allowed with"),
    (["--prompt-ids", "1", "--max-new-tokens", "2"], "--port"),
    (["--port", "5", "--prompt-ids", "1"], "--max-new-tokens"),
    (["--port", "5", "--prompt-ids", "1", "--max-new-tokens", "2", "--timeout", "0"], "--timeout"),
])
def test_generate_cli_bad_input_exits_2(args, msg):
    r = kvrt("generate", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert msg in r.stderr


@pytest.mark.e2e
def test_generate_cli_json(fake):
    r = kvrt("generate", "--port", str(fake.port), "--prompt-ids", "1, 2,3", "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["output_token_ids"] == expected([3], 4)
    assert out["prompt_tokens"] == 3 and out["finish_reason"] == "length" and out["ttft_ms"] > 0
    assert out["cached_tokens"] == {"device": 0, "host": 0, "storage": 0}


@pytest.mark.e2e
def test_generate_cli_streams_text_and_ids(fake):
    r = kvrt("generate", "--port", str(fake.port), "--text", "A", "--max-new-tokens", "3")  # 'A' = 65
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "BCD" and "[length] 3 tokens" in r.stderr and "TTFT" in r.stderr
    r = kvrt("generate", "--port", str(fake.port), "--prompt-ids", "7", "--max-new-tokens", "3", "--no-cache")
    assert r.stdout.split() == ["8", "9", "10"]


@pytest.mark.e2e
def test_generate_cli_engine_error_exits_1(fake):
    r = kvrt("generate", "--port", str(fake.port), "--prompt-ids", f"{FAIL_TOKEN},1", "--max-new-tokens", "2")
    assert r.returncode == 1 and "bad_request" in r.stderr and "cursed" in r.stderr


@pytest.mark.e2e
def test_generate_cli_out_of_vocab_exits_2(fake):
    r = kvrt("generate", "--port", str(fake.port), "--prompt-ids", f"1,{VOCAB}", "--max-new-tokens", "2")
    assert r.returncode == 2 and f"outside the node's vocabulary 0..{VOCAB - 1}" in r.stderr


@pytest.mark.e2e
def test_generate_cli_no_node_exits_1():
    t0 = time.monotonic()
    r = kvrt("generate", "--port", "1", "--prompt-ids", "1", "--max-new-tokens", "2", "--timeout", "0.5")
    assert r.returncode == 1 and "tcp://127.0.0.1:1" in r.stderr and "0.5 s" in r.stderr
    assert time.monotonic() - t0 < 20
