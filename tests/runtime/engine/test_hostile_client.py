"""Hostile clients of the ZeroMQ client API against a real node (`kvrt launch --port`).

Each test speaks to the node with raw ZeroMQ sockets (or a raw TCP socket), bypassing the
checks runtime/client/client.py makes, and then checks three things: the hostile input ended in a
clear error or a refusal, the node still answers a well-behaved client correctly, and no
block is left in use.
"""
from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time
import uuid

import msgpack
import numpy as np
import pytest
import zmq

from kvrt.runtime.client.api import (API, BAD_REQUEST, MAX_REQUESTS_PER_CLIENT, SLOW_CLIENT, TOO_MANY, UNKNOWN, ErrorEvent,
                         FinishedEvent, TokenEvent)
from kvrt.runtime.client.client import Client
from kvrt.runtime.client.trace import TraceRequest
from kvrt.runtime.node.status import snapshot
from tests.conftest import REPO, leftovers
from tests.launched import SMALL, launched, oracle
from tests.runtime.client.test_demo_workload import write_trace

pytestmark = pytest.mark.e2e

WAIT_S = 30.0  # the longest any single wait below may take before the test fails naming it


@pytest.fixture(scope="module")
def ln(tmp_path_factory):
    """One node for the module: room for a few long requests (block size 8, 4096-token model)."""
    name = "h" + uuid.uuid4().hex[:10]
    with launched(name, tmp_path_factory.mktemp("logs"), *SMALL, "--num-gpu-blocks", "2048") as node:
        yield node
    assert not leftovers(name)


def raw_generate(rid, tokens=(1, 2, 3), max_new_tokens=4, **fields) -> bytes:
    """A generate message built by hand, so any field can carry any msgpack value."""
    body = {"t": "generate", "v": 1, "request_id": rid, "prompt": np.asarray(tokens, "<i4").tobytes(),
            "max_new_tokens": max_new_tokens, "eos_token_id": -1, "use_cache": True, "stream": True}
    body.update(fields)
    return msgpack.packb(body, use_bin_type=True)


def raw_cancel(rid) -> bytes:
    return msgpack.packb({"t": "cancel", "v": 1, "request_id": rid}, use_bin_type=True)


class Raw:
    """A DEALER that sends whatever it is given and decodes what comes back."""

    def __init__(self, port: int, **opts: int):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for opt, value in opts.items():
            self.sock.setsockopt(getattr(zmq, opt), value)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def recv(self, what: str, timeout: float = WAIT_S):
        """The next answer that is not a liveness probe (an empty message)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise AssertionError(f"no answer from the node within {timeout:g} s: waited for {what}")
            data = self.sock.recv()
            if data:
                return API.decode(data)

    def until_end(self, rid: str, timeout: float = WAIT_S):
        """Answers for `rid` until its FinishedEvent or ErrorEvent (which is returned)."""
        while True:
            ev = self.recv(f"the end of request {rid}", timeout)
            if isinstance(ev, (FinishedEvent, ErrorEvent)) and ev.request_id == rid:
                return ev

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def __enter__(self) -> "Raw":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def still_serves(ln) -> None:
    """A well-behaved client gets the exact answer, and afterwards no block is in use."""
    prompt = np.arange(5, 30, dtype=np.int32)
    with Client(ln.port, timeout=WAIT_S) as c:
        r = c.generate(prompt, 6)
    assert r.output_token_ids.tolist() == oracle().generate_dense(prompt, 6)
    assert_all_free(ln)


def assert_all_free(ln, timeout: float = WAIT_S) -> dict:
    e = ln.idle_stats(timeout)
    assert (e["seqs_running"], e["seqs_waiting"], e["seqs_loading"], e["device_used"]) == (0, 0, 0, 0), e
    return e


def wait_generating(ln, before: float) -> None:
    """Until the node has generated tokens past the count `before` (requests were admitted)."""
    deadline = time.monotonic() + WAIT_S
    while ln.engine_stats()["generated_tokens"] <= before:
        assert time.monotonic() < deadline, f"no token generated within {WAIT_S:g} s"
        time.sleep(0.02)  # polling another process's counters


def engine_pid(ln) -> int:
    return next(p["pid"] for p in snapshot(ln.node)["processes"] if p["role"] == "engine")


def peak_rss_kib(pid: int) -> int:
    """VmHWM: the most memory the process ever had resident (a high-water mark, so an
    allocation that came and went still shows)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


# ---- message shape and field types ---------------------------------------------------------

@pytest.mark.parametrize("fields, words", [
    (dict(eos_token_id=True), "eos_token_id"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(use_cache="no"), "use_cache"),
    (dict(stream=1), "stream"),
    (dict(eos_token_id=-7), "eos_token_id"),
    (dict(request_id="x" * 257), "request_id"),
    (dict(request_id="a\nb"), "request_id"),
    (dict(request_id=b"bytes"), "request_id"),
    (dict(request_id=["a"]), "request_id"),
    (dict(prompt=[1, 2]), "prompt"),
])
def test_wrong_field_types_get_a_clear_error(ln, fields, words):
    rid = fields.pop("request_id", "typed-" + uuid.uuid4().hex[:6])
    with Raw(ln.port) as raw:
        raw.sock.send(raw_generate(rid, **fields))
        ev = raw.recv(f"the answer to a generate with {fields or rid!r}")
    assert isinstance(ev, ErrorEvent) and ev.code == BAD_REQUEST and words in ev.message, ev
    assert len(ev.message) < 300  # the bad value is not echoed back in full
    assert_all_free(ln)


def test_a_guided_schema_nested_thousands_of_levels_deep_gets_an_error(ln):
    """Its text would take a JSON parser past Python's recursion limit (RecursionError, which
    ended the engine): refused by its depth before any parser reads it, on a node with no
    checkpoint as on one with."""
    spec = "[" * 5000 + "]" * 5000
    with Raw(ln.port) as raw:
        raw.sock.send(raw_generate("deep", guided={"kind": "json_schema", "spec": spec}))
        ev = raw.until_end("deep")
    assert isinstance(ev, ErrorEvent) and ev.code == BAD_REQUEST and "levels deep" in ev.message, ev
    assert ln.proc.poll() is None
    still_serves(ln)


def test_a_message_nested_past_the_bound_gets_an_error(ln):
    """msgpack itself decodes a thousand levels; quoting such a value in an error message
    recursed past Python's limit. The engine refuses the message by its depth."""
    deep = msgpack.unpackb(b"\x91" * 1000 + b"\x01")
    with Raw(ln.port) as raw:
        raw.sock.send(raw_generate("nested", logit_bias=[deep]))
        ev = raw.recv("the answer to a deeply nested message")
    assert isinstance(ev, ErrorEvent) and ev.code == BAD_REQUEST and "levels deep" in ev.message, ev
    assert ln.engine_stats()["intake_errors"] == 0  # a refusal, not a handler that raised
    still_serves(ln)


def test_multi_frame_message_gets_an_error(ln):
    with Raw(ln.port) as raw:
        raw.sock.send_multipart([raw_generate("mf-1"), b"extra"])
        ev = raw.recv("the answer to a two-frame message")
        assert isinstance(ev, ErrorEvent) and ev.code == BAD_REQUEST and "2 frames" in ev.message, ev
        raw.sock.send(raw_generate("mf-2", max_new_tokens=2))  # the connection is still good
        assert isinstance(raw.until_end("mf-2"), FinishedEvent)
    still_serves(ln)


# ---- one client cannot touch another's requests --------------------------------------------

def test_cancel_only_by_the_client_that_submitted(ln):
    rid = "owned-" + uuid.uuid4().hex[:6]
    with Raw(ln.port) as owner, Raw(ln.port) as other:
        owner.sock.send(raw_generate(rid, max_new_tokens=40))
        first = owner.recv("the first token")
        assert isinstance(first, TokenEvent) and first.request_id == rid
        other.sock.send(raw_cancel(rid))
        ev = other.recv("the answer to a cancel of another client's request")
        assert isinstance(ev, ErrorEvent) and ev.code == UNKNOWN and ev.request_id == rid, ev
        end = owner.until_end(rid)
        assert isinstance(end, FinishedEvent) and end.finish_reason == "length", end
        assert len(end.output_token_ids) == 40
    still_serves(ln)


# ---- clients that go away or never read -----------------------------------------------------

def test_disconnect_cancels_the_clients_requests(ln):
    before = ln.engine_stats()["generated_tokens"]
    n, new = 4, 2000
    with Raw(ln.port) as raw:
        for i in range(n):
            raw.sock.send(raw_generate(f"gone-{i}", tokens=np.arange(1, 9) + i, max_new_tokens=new))
        raw.recv("the first token")  # running
    wait_generating(ln, before)
    e = assert_all_free(ln)
    # they ended long before their 8000 tokens: the disconnect cancelled them
    assert e["generated_tokens"] - before < n * new // 2, e
    still_serves(ln)


def test_a_client_that_never_reads_is_cut_off(ln):
    before = ln.engine_stats()["generated_tokens"]
    n, new = 32, 1000
    rids = [f"{i:03d}-" + "s" * 252 for i in range(n)]  # the longest ids allowed: 256 bytes
    with Raw(ln.port, RCVHWM=1, RCVBUF=4096) as raw:
        for rid in rids:
            raw.sock.send(raw_generate(rid, tokens=np.arange(1, 9), max_new_tokens=new))
        wait_generating(ln, before)
        e = assert_all_free(ln)  # while the client reads nothing at all
        assert e["generated_tokens"] - before < n * new // 2, e
        # it reads at last: what was queued, then why each request ended
        told: list[ErrorEvent] = []
        while len({ev.request_id for ev in told}) < n:
            ev = raw.recv(f"the overflow errors ({len(told)} of {n} so far)")
            if isinstance(ev, ErrorEvent):
                told.append(ev)
            assert not isinstance(ev, FinishedEvent) or ev.finish_reason == "cancelled", ev
        assert sorted(ev.request_id for ev in told) == rids  # one notice per request
        raw.sock.send(raw_generate("after", max_new_tokens=2))  # reading again: served again
        assert isinstance(raw.until_end("after"), FinishedEvent)
    assert {ev.code for ev in told} == {SLOW_CLIENT}
    still_serves(ln)


def test_requests_in_flight_per_client_are_bounded(ln):
    n = MAX_REQUESTS_PER_CLIENT + 8
    with Raw(ln.port) as raw:
        for i in range(n):  # long requests: none can end before the last is sent
            raw.sock.send(raw_generate(f"many-{i}", max_new_tokens=3000))
        refused = []
        while len(refused) < n - MAX_REQUESTS_PER_CLIENT:
            ev = raw.recv(f"the refusals ({len(refused)} so far)")
            assert not isinstance(ev, (ErrorEvent, FinishedEvent)) or ev.code == TOO_MANY, ev
            if isinstance(ev, ErrorEvent):
                refused.append(ev.request_id)
        assert refused == [f"many-{i}" for i in range(MAX_REQUESTS_PER_CLIENT, n)]
    still_serves(ln)  # (the client's requests ended with its connection)


# ---- oversized messages -----------------------------------------------------------------------

def test_oversized_frames_are_refused_before_allocation(ln):
    pid = engine_pid(ln)
    peak = peak_rss_kib(pid)
    with Raw(ln.port) as raw:
        events = raw.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        raw.sock.send(b"\0" * (256 << 20))
        assert events.poll(int(WAIT_S * 1000)), f"the node did not drop a 256 MiB frame within {WAIT_S:g} s"
        raw.sock.disable_monitor()
        events.close(0)
    grew = peak_rss_kib(pid) - peak
    assert grew < 64 << 10, f"the engine's peak RSS grew by {grew} KiB for a 256 MiB frame"
    still_serves(ln)


def zmtp_connect(port: int) -> socket.socket:
    """A raw TCP connection through the ZMTP 3.0 NULL handshake, as a DEALER."""
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31)
    greeting = b""
    while len(greeting) < 64:
        chunk = s.recv(64 - len(greeting))
        assert chunk, "the node closed the connection during the ZMTP greeting"
        greeting += chunk
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    s.sendall(b"\x04" + bytes([len(body)]) + body)
    return s


def test_a_frame_announcing_16_gib_is_refused(ln):
    pid = engine_pid(ln)
    peak = peak_rss_kib(pid)
    s = zmtp_connect(ln.port)
    try:
        s.sendall(b"\x02" + struct.pack(">Q", 16 << 30) + b"\0" * 4096)  # a long frame: 16 GiB promised
        deadline = time.monotonic() + WAIT_S
        s.settimeout(0.5)
        closed = False
        while not closed and time.monotonic() < deadline:
            try:
                closed = s.recv(65536) == b""  # (the node's READY first, then the close)
            except socket.timeout:
                continue
            except ConnectionResetError:
                closed = True
        assert closed, f"the node did not close a connection announcing a 16 GiB frame within {WAIT_S:g} s"
    finally:
        s.close()
    assert peak_rss_kib(pid) - peak < 64 << 10
    still_serves(ln)


# ---- kvrt replay ---------------------------------------------------------------------------------

def test_replay_exits_nonzero_when_requests_fail(tmp_path):
    """A node with 16 blocks of 8 tokens: the trace's long requests cannot run there."""
    name = "h" + uuid.uuid4().hex[:10]
    trace = tmp_path / "t.jsonl"
    reqs = [TraceRequest(i, 512 * (2 if i % 3 else 9), 2, tuple(range(i * 10, i * 10 + (2 if i % 3 else 9))))
            for i in range(9)]
    write_trace(trace, reqs)
    with launched(name, tmp_path / "logs", *SMALL, "--num-gpu-blocks", "16") as node:
        r = subprocess.run([sys.executable, "-m", "kvrt.launcher", "replay", "--port", str(node.port), "--trace",
                            str(trace), "--tokens-per-id", "32", "--speed", "0", "--json"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
        assert_all_free(node)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    out = json.loads(r.stdout)
    assert out["errors"] == 3 and out["completed"] == 6
    assert "3 of 9 requests failed" in r.stderr and "KV blocks" in r.stderr, r.stderr
    assert not leftovers(name)
