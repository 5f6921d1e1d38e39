"""A decode node D facing hostile peers on its handshake port: peer messages need an
authenticated session, a peer touches only its own requests, shares bound what one peer holds,
and no field of a peer message can hurt D or an unrelated request. Then P's side: stale send
orders never write into blocks D may have reused, D's death is noticed fast, and a restarted D
is served again at once. Real nodes, real sockets, real processes."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest
import zmq

from kvrt.runtime.client import api
from kvrt.runtime.client.client import RequestError
from kvrt.runtime.pd import messages as wire
from kvrt.runtime.pd.auth import P2D, AuthError, Session, load_secret, new_nonce, session_key
from tests.conftest import REPO
from tests.launched import SMALL, launched, oracle, pd_secret_file
from tests.runtime.pd.test_pd import pd_node, pd_pair, wait_for  # noqa: F401  (pd_node is a fixture)

D_OPTS = (*SMALL, "--num-gpu-blocks", "64", "--pd-timeout", "20", "--rank-timeout", "2")


class FakePeer:
    """A hand-made P: a DEALER on D's port that speaks the peer protocol (with or without the
    secret), so a test can send what a hostile or buggy peer would."""

    def __init__(self, port: int, secret: bytes = b"", name: str = "fake"):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.secret, self.name = secret, name
        self.session: Session | None = None

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def send_clear(self, msg) -> None:
        self.sock.send(api.API.encode(msg))

    def send(self, msg) -> None:
        self.send_clear(self.session.seal(msg))

    def recv(self, timeout: float = 10.0):
        """The next message from D (opened if sealed), skipping pongs."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.sock.poll(int(left * 1000)), f"no answer from D within {timeout}s"
            msg = api.API.decode(self.sock.recv())
            if isinstance(msg, wire.PdSealed) and self.session is not None:
                msg = self.session.open(msg)
            if not isinstance(msg, wire.PdPong):
                return msg

    def handshake(self) -> None:
        nonce = new_nonce()
        self.send_clear(wire.PdHello(self.name, nonce))
        welcome = self.recv()
        assert isinstance(welcome, wire.PdWelcome), welcome
        self.session = Session(welcome.session, session_key(self.secret, nonce, welcome.session, self.name),
                               self.name, P2D)
        self.send(wire.PdPing(1))  # confirms the session

    def prealloc(self, rid: str, prompt, new: int = 8):
        self.send(wire.PdPrealloc(rid, np.asarray(prompt, np.int32), new))
        return self.recv()


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    """One decode node for the peer tests (no prefill node: the tests are its peers)."""
    import uuid

    from tests.conftest import leftovers

    tmp = tmp_path_factory.mktemp("pdsec")
    secret = pd_secret_file(tmp)
    name = "t" + uuid.uuid4().hex[:10]
    with launched(name, tmp / "d", "--role", "decode", *D_OPTS, "--pd-secret-file", secret) as d:
        d.secret = load_secret(secret)
        yield d
    assert not leftovers(name)


@pytest.fixture
def peer(decode):
    with contextlib.closing(FakePeer(decode.port, decode.secret, "p-" + os.urandom(3).hex())) as p:
        p.handshake()
        yield p
    decode.idle_stats(timeout=25)  # every lease this test left is back


def prompt(seed: int, n: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, n).astype(np.int32)


@pytest.mark.e2e
def test_unauthenticated_peer_messages_are_refused_and_change_nothing(decode):
    with contextlib.closing(FakePeer(decode.port)) as raw:
        before = decode.engine_stats()
        raw.send_clear(wire.PdPrealloc("evil", prompt(1), 8))
        answer = raw.recv()
        assert isinstance(answer, api.ErrorEvent) and answer.code == "bad_request", answer
        raw.send_clear(wire.PdKvReady("evil", 7))
        assert isinstance(raw.recv(), api.ErrorEvent)
        wait_for(lambda: decode.engine_stats()["pd_refused"] >= before["pd_refused"] + 2, "D to count them")
        assert decode.engine_stats()["device_used"] == 0
    # a client asking straight for that prompt gets the right tokens (nothing was recorded)
    assert list(decode.client.generate(prompt(1), 4).output_token_ids) == \
        list(oracle().generate_dense(prompt(1), 4))


@pytest.mark.e2e
def test_a_wrong_secret_gets_no_session(decode):
    with contextlib.closing(FakePeer(decode.port, b"not the secret at all, 32 bytes!", "liar")) as liar:
        liar.handshake()  # D answers any hello; the first sealed message shows the key is wrong
        refused = liar.recv()
        assert isinstance(refused, wire.PdRefused) and "authentication" in refused.reason, refused
        liar.send(wire.PdPrealloc("x", prompt(2), 8))
        assert isinstance(liar.recv(), wire.PdRefused)
    assert decode.engine_stats()["device_used"] == 0


@pytest.mark.e2e
def test_replayed_sealed_message_is_refused(decode, peer):
    sealed = peer.session.seal(wire.PdPrealloc("once", prompt(3), 8))
    peer.send_clear(sealed)
    assert isinstance(peer.recv(), wire.PdAllocated)
    peer.send_clear(sealed)  # the same bytes again
    refused = peer.recv()
    assert isinstance(refused, wire.PdRefused) and "replayed" in refused.reason
    peer.send(wire.PdAbort("once"))


@pytest.mark.e2e
@pytest.mark.parametrize("token", [2 ** 40, "x", None, 600, -3, True])
def test_bad_first_token_is_an_error_not_a_crash(decode, peer, token):
    """A kv-ready with a first token out of the vocabulary (or not an integer) gets an error;
    D lives on, the request stays held, and a client request decoding meanwhile is untouched."""
    innocent = decode.client.submit(prompt(4), 24)
    got = peer.prealloc("r", prompt(5))
    assert isinstance(got, wire.PdAllocated) and got.request_id == "r", got
    peer.send(wire.PdKvReady("r", token))
    err = peer.recv()
    assert isinstance(err, api.ErrorEvent) and err.code == "bad_request" and "first_token" in err.message
    results = []
    while not results:
        results = [e for e in decode.client.poll(timeout=30) if hasattr(e, "output_token_ids")]
        assert results or decode.proc.poll() is None
    assert results[0].request_id == innocent
    assert list(results[0].output_token_ids) == list(oracle().generate_dense(prompt(4), 24))
    peer.send(wire.PdAbort("r"))


@pytest.mark.e2e
def test_peers_touch_only_their_own_requests(decode, peer):
    got = peer.prealloc("mine", prompt(6))
    assert isinstance(got, wire.PdAllocated)
    wait_for(lambda: decode.engine_stats()["device_used"] > 0, "D to publish the blocks it holds")
    held = decode.engine_stats()["device_used"]
    with contextlib.closing(FakePeer(decode.port, decode.secret, "other")) as other:
        other.handshake()
        other.send(wire.PdAbort("mine"))
        other.send(wire.PdKvReady("mine", 5))
        err = other.recv()
        assert isinstance(err, api.ErrorEvent) and err.code == "failed", err
        other.send(api.CancelRequest("mine"))
        assert isinstance(other.recv(), api.ErrorEvent)
    with pytest.raises(RequestError):  # nor can a plain client, by D's own name for it
        decode.client.cancel("pd:%s:mine" % peer.name)
        decode.client.generate([1], 1, request_id="pd:%s:mine" % peer.name)
    assert decode.engine_stats()["device_used"] == held
    peer.send(wire.PdKvReady("mine", 5))  # the owner still can
    while not isinstance(msg := peer.recv(), api.FinishedEvent):
        assert isinstance(msg, api.TokenEvent), msg
    assert msg.request_id == "mine"


@pytest.mark.e2e
def test_per_peer_shares_bound_what_one_peer_holds(decode, peer):
    """A peer alone may hold the whole pool of 64 blocks, never more (over it, a peer that may
    not wait is refused; tests/runtime/pd/test_pd_quota.py has the waiting)."""
    for rid, seed in (("big1", 7), ("big2", 8)):  # 26 blocks of 8 each with its 8 new tokens
        assert isinstance(peer.prealloc(rid, prompt(seed, 200)), wire.PdAllocated)
    peer.send(wire.PdPrealloc("big3", prompt(9, 200), 8, wait=False))
    err = peer.recv()
    assert isinstance(err, api.ErrorEvent) and "share of 64" in err.message, err
    assert decode.engine_stats()["device_used"] <= 64
    peer.send(wire.PdAbort("big1"))
    peer.send(wire.PdAbort("big2"))


@pytest.mark.e2e
@pytest.mark.parametrize("bad", [
    dict(request_id=""), dict(request_id=7), dict(request_id="x" * 1000), dict(max_new_tokens=True),
    dict(max_new_tokens=0), dict(eos_token_id=512), dict(eos_token_id=-2), dict(use_cache="yes"), dict(wait=1),
    dict(prompt=np.array([512], np.int32)), dict(prompt=np.empty(0, np.int32)),
    dict(guided={"kind": "json_schema", "spec": "[" * 5000 + "]" * 5000}),  # a parser's recursion: refused first
])
def test_bad_preallocations_get_an_error_and_hold_nothing(decode, peer, bad):
    fields = dict(request_id="b", prompt=prompt(9), max_new_tokens=8, eos_token_id=-1, use_cache=True) | bad
    peer.send(wire.PdPrealloc(**fields))
    err = peer.recv()
    assert isinstance(err, api.ErrorEvent) and err.code == "bad_request", err
    assert decode.engine_stats()["device_used"] == 0


# ---- configuration ---------------------------------------------------------------------------

def kvrt_launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "KVRT_PD_SECRET"}
    return subprocess.run([sys.executable, "-m", "kvrt.launcher", "launch", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**clean, **(env or {})})


@pytest.mark.e2e
def test_pd_roles_refuse_to_start_without_a_secret(node, tmp_path):
    r = kvrt_launch("--node", node, "--role", "decode", "--port", "7001")
    assert r.returncode == 2 and "secret" in r.stderr and "token_hex" in r.stderr, r.stderr
    loose = tmp_path / "loose.secret"
    loose.write_text("a" * 64)
    loose.chmod(0o644)
    r = kvrt_launch("--node", node, "--role", "decode", "--port", "7001", "--pd-secret-file", str(loose))
    assert r.returncode == 2 and "chmod 600" in r.stderr, r.stderr
    r = kvrt_launch("--node", node, "--role", "decode", "--port", "7001", env={"KVRT_PD_SECRET": "short"})
    assert r.returncode == 2 and "at least 16" in r.stderr, r.stderr


@pytest.mark.e2e
def test_pd_timeout_not_above_rank_timeout_plus_margin_is_rejected(node, tmp_path):
    r = kvrt_launch("--node", node, "--role", "decode", "--port", "7001", "--pd-timeout", "3",
                    "--rank-timeout", "2", "--pd-secret-file", pd_secret_file(tmp_path))
    assert r.returncode == 2 and "--pd-timeout 3 must be more than --rank-timeout 2" in r.stderr, r.stderr


# ---- P's side: stale orders, a dead or restarted D --------------------------------------------

def _child_pid(launcher: subprocess.Popen, module: str) -> int:
    for proc in psutil.Process(launcher.pid).children(recursive=True):
        if module in " ".join(proc.cmdline()):
            return proc.pid
    raise AssertionError(f"no {module} process under {launcher.pid}")


@pytest.mark.alone
@pytest.mark.e2e
def test_a_paused_messager_never_writes_into_blocks_d_took_back(pd_node, tmp_path):
    """SIGSTOP P's cache-messager past --rank-timeout: P fails the request and D takes its blocks
    back; once resumed, the messager must answer the old order "expired" and write nothing."""
    from kvrt.ipc.registry import Registry
    from kvrt.runtime.node.status import snapshot
    from kvrt.workers.kv_pool import attach_pools

    with pd_pair(pd_node, tmp_path, "--pd-timeout", "4", "--rank-timeout", "1") as (p, d):
        messager = psutil.Process(_child_pid(p.proc, "kvrt.workers.cache_messager"))
        messager.suspend()
        try:
            with pytest.raises(RequestError) as e:
                p.client.generate(prompt(10), 4)
            assert "did not answer" in str(e.value), str(e.value)
            wait_for(lambda: d.engine_stats()["device_used"] == 0, "D to take the blocks back")
        finally:
            messager.resume()
        answers = lambda: snapshot(p.node)["rings"]["messager.0.to.engine"]["records_in"]  # noqa: E731
        wait_for(lambda: answers() >= 2, "the messager to answer the stale order")  # hello + answer
        reg = Registry.attach(d.node)
        try:
            pool, _ = attach_pools(reg, 0, _config(d.node))
            try:
                assert not pool.array.any(), "the stale order wrote into D's pool"
            finally:
                pool.close()
        finally:
            reg.close()
        assert "expired" in p.logs()


def _config(node: str):
    from kvrt.ipc.config import NodeConfig
    from kvrt.ipc.registry import Registry

    reg = Registry.attach(node)
    try:
        return NodeConfig.read(reg)
    finally:
        reg.close()


@pytest.mark.alone
@pytest.mark.e2e
def test_requests_fail_fast_once_d_is_gone(pd_node, tmp_path):
    from tests.runtime.pd.test_pd import kill_node

    # P counts D gone after 2 s of silence (--pd-dead-after, 5 s unless set), far below --pd-timeout
    with pd_pair(pd_node, tmp_path, "--pd-timeout", "120", "--pd-dead-after", "2") as (p, d):
        assert p.client.generate(prompt(11), 3).finish_reason == "length"
        kill_node(d.proc)
        # each try waits at most 20 s of a 120 s --pd-timeout: only a P that noticed D is gone answers
        wait_for(lambda: _fails_fast(p), "P to fail requests at once because D is gone", 30)


def _fails_fast(p) -> bool:
    try:
        p.client.generate(prompt(12), 3, timeout=20)
    except RequestError as e:
        assert "decode node" in str(e), str(e)
        return "unreachable" in str(e) or "lost" in str(e)
    return False


# ---- the session itself (unit) ------------------------------------------------------------------

def test_sealed_messages_resist_tampering_replay_and_reflection():
    secret, nonce, sid = b"s" * 32, new_nonce(), new_nonce()
    from kvrt.runtime.pd.auth import D2P

    p = Session(sid, session_key(secret, nonce, sid, "p0"), "p0", P2D)
    d = Session(sid, session_key(secret, nonce, sid, "p0"), "p0", D2P)
    first = p.seal(wire.PdKvReady("r", 5))
    assert d.open(first) == wire.PdKvReady("r", 5)
    with pytest.raises(AuthError, match="replayed"):
        d.open(first)
    second = p.seal(wire.PdAbort("r"))
    with pytest.raises(AuthError, match="authentication code"):
        d.open(wire.PdSealed(sid, second.counter, second.body[:-1] + b"x", second.mac))
    with pytest.raises(AuthError, match="authentication code"):  # D's own message sent back to it
        d.open(d.seal(wire.PdPong()))
    other = Session(sid, session_key(secret, new_nonce(), sid, "p1"), "p1", P2D)
    with pytest.raises(AuthError, match="authentication code"):
        d.open(other.seal(wire.PdAbort("r")))
    assert d.open(second) == wire.PdAbort("r")  # nothing above moved the counter


@pytest.mark.e2e
def test_the_first_handoff_after_d_restarts_succeeds(pd_node, tmp_path):
    """D stops and starts again on the same port: P notices the new D (its session is refused),
    opens a new one, and its cache-messager maps the new D's pool on the first handoff."""
    secret = pd_secret_file(tmp_path)
    common = (*SMALL, "--pd-secret-file", secret)
    want = list(oracle().generate_dense(prompt(13), 3))
    with contextlib.ExitStack() as stack:
        first_d = contextlib.ExitStack()
        d = first_d.enter_context(launched(pd_node + "d", tmp_path / "d1", "--role", "decode", *common))
        with first_d:
            p = stack.enter_context(launched(pd_node + "p", tmp_path / "p", "--role", "prefill", "--decode-peer",
                                             f"tcp://127.0.0.1:{d.port}", *common))
            assert list(p.client.generate(prompt(13), 3).output_token_ids) == want
        stack.enter_context(launched(pd_node + "d", tmp_path / "d2", "--role", "decode", *common, port=d.port))
        wait_for(lambda: p.logs().count("session with the decode node") >= 2, "P's session with the new D")
        assert list(p.client.generate(prompt(13), 3).output_token_ids) == want
