"""Prefill/decode disaggregation with real nodes: a prefill node P hands each request's KV to a
decode node D through its cache-messager processes. Answers must equal the dense reference
(and so a mixed node's), P's prefix hit rate must equal a mixed node's, no block may be read
before its KV is written (KVRT_CHECK_OWNERSHIP=1), and killing either side must fail
requests with a clear error, never hang, and leak no block on the survivor.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from kvrt.ipc.ports import free_port
from kvrt.runtime.client.client import RequestError
from tests.conftest import REPO
from tests.launched import SMALL, launched, launched_together, oracle, pd_secret_file, shared_prefix_prompts
from tests.runtime.engine.test_oracle import NEW, run_all, tokens

pytestmark = pytest.mark.e2e


def mooncake_available() -> bool:
    try:
        import mooncake.engine  # noqa: F401
        return True
    except Exception:  # not installed, or libibverbs missing: the transport reports which
        return False


TRANSPORTS = [pytest.param("shm", id="shm"),
              pytest.param("mooncake", id="mooncake", marks=pytest.mark.skipif(
                  not mooncake_available(), reason="mooncake-transfer-engine not importable"))]


@contextlib.contextmanager
def pd_pair(node, tmp_path, *opts, transport="shm", env=None, d_opts=(), p_opts=()):
    """A decode node and a prefill node pointed at it, sharing a fresh secret; yields (P, D)."""
    common = (*SMALL, "--pd-transport", transport, "--pd-secret-file", pd_secret_file(tmp_path), *opts)
    d_port = free_port()
    with launched_together((node + "d", tmp_path / "d", ("--role", "decode", *common, *d_opts), d_port),
                           (node + "p", tmp_path / "p", ("--role", "prefill", "--decode-peer", f"tcp://127.0.0.1:{d_port}",
                                                         *common, *p_opts), 0), env=env) as (d, p):
        wait_for(lambda: p.engine_stats()["pd_sessions"] >= 1, "P's session with D")
        yield p, d


@pytest.fixture
def pd_node(node):
    """Two node names (node+"p", node+"d"); neither may leave anything in /dev/shm."""
    yield node
    from tests.conftest import leftovers, reclaim_dead

    for n in (node + "p", node + "d"):
        reclaim_dead(n)
        assert not leftovers(n), f"shared memory of {n} leaked: {leftovers(n)}"


@pytest.mark.parametrize("env", [pytest.param({}, id="plain"),
                                 pytest.param({"KVRT_CHECK_OWNERSHIP": "1"}, id="ownership")])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pd_answers_equal_the_reference(pd_node, tmp_path, transport, env):
    prompts = shared_prefix_prompts(seed=11)
    model = oracle()
    want = [model.generate_dense(p, NEW) for p in prompts]
    with pd_pair(pd_node, tmp_path, transport=transport, env=env) as (p, d):
        concurrent = run_all(p.client, prompts)
        assert tokens(concurrent) == want, p.logs() + d.logs()
        again = run_all(p.client, prompts, concurrent=False)
        assert tokens(again) == want
        assert sum(r.cached_device for r in again) > 0, "P must record its computed blocks"
        pe, de = p.idle_stats(), d.idle_stats()
        assert pe["device_used"] == 0 and de["device_used"] == 0
        assert pe["pd_sent_bytes"] > 0 and pe["failed_requests"] == de["failed_requests"] == 0
        assert de["device_cached"] > 0, "D records the blocks it received (after kv-ready)"


def test_a_cache_salt_holds_on_both_sides_of_the_handoff(pd_node, tmp_path):
    """P and D both chain a salted request's keys from its salt's root: a tenant's repeated
    prompt finds its blocks on P and on D (fewer bytes travel), another salt finds none on either."""
    prompt = np.random.default_rng(3).integers(0, 512, 48).astype(np.int32)
    want = oracle().generate_dense(prompt, NEW)
    with pd_pair(pd_node, tmp_path) as (p, _):
        results, sent = [], [0]
        for salt in ("tenant-a", "tenant-a", "tenant-b"):
            results.append(p.client.generate(prompt, NEW, cache_salt=salt))
            sent.append(p.idle_stats()["pd_sent_bytes"])
        assert [r.output_token_ids.tolist() for r in results] == [want] * 3
        assert [r.cached_device > 0 for r in results] == [False, True, False]
        first, again, other = (b - a for a, b in zip(sent, sent[1:]))
        assert again < first and other == first, sent


def conversations(seed: int, n: int = 4, turns: int = 3) -> list[np.ndarray]:
    """Multi-turn prompts in arrival order: each turn is the previous prompt plus a (scripted)
    answer and a new user message, under one of two system prompts."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 512, 48) for _ in range(2)]
    convs = [systems[i % 2] for i in range(n)]
    out = []
    for _ in range(turns):
        for i in range(n):
            convs[i] = np.concatenate([convs[i], rng.integers(0, 512, rng.integers(8, 30))]).astype(np.int32)
            out.append(convs[i])
    return out


def test_pd_hit_rate_equals_mixed(pd_node, tmp_path):
    prompts = conversations(seed=5)

    def hit_rate(client):
        results = run_all(client, prompts, concurrent=False)
        return sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results), tokens(results)

    with launched(pd_node + "m", tmp_path / "m", *SMALL) as m:
        mixed_rate, mixed_tokens = hit_rate(m.client)
    with pd_pair(pd_node, tmp_path) as (p, _):
        pd_rate, pd_tokens = hit_rate(p.client)
    assert pd_tokens == mixed_tokens
    assert mixed_rate > 0.3 and pd_rate == pytest.approx(mixed_rate)


def kill_node(launcher: subprocess.Popen) -> None:
    """SIGKILL a node's launcher and every process it started (no clean stop at all)."""
    procs = psutil.Process(launcher.pid).children(recursive=True) + [psutil.Process(launcher.pid)]
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)


def wait_for(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)  # polling another process's counters in a test, not a hot path


LONG = ("--max-num-batched-tokens", "4", "--max-model-len", "8192", "--num-gpu-blocks", "1024")


@pytest.mark.alone
def test_killing_d_mid_handoff_fails_the_request_and_frees_p(pd_node, tmp_path):
    prompt = np.random.default_rng(1).integers(0, 512, 2000).astype(np.int32)
    with pd_pair(pd_node, tmp_path, *LONG, "--pd-timeout", "3", "--rank-timeout", "1.5") as (p, d):
        rid = p.client.submit(prompt, 8)
        wait_for(lambda: d.engine_stats()["device_used"] > 0, "D to hold blocks for the request")
        kill_node(d.proc)
        t0 = time.monotonic()
        failed = []
        while not failed:
            events = p.client.poll(timeout=15)
            assert events, "P gave no answer within 15 s after D died"
            failed = [e for e in events if getattr(e, "request_id", "") == rid and hasattr(e, "code")]
            assert not [e for e in events if hasattr(e, "finish_reason")], "the request cannot finish without D"
        assert failed[0].code == "failed" and "decode" in failed[0].message, failed[0]
        assert time.monotonic() - t0 < 15
        assert p.idle_stats()["device_used"] == 0, "P must free the blocks of the failed request"
        assert p.client.generate([1, 2, 3], 1).finish_reason == "length"  # one token: P alone still serves


@pytest.mark.alone
def test_killing_p_after_d_preallocated_returns_ds_blocks(pd_node, tmp_path):
    prompt = np.random.default_rng(2).integers(0, 512, 2000).astype(np.int32)
    secret = pd_secret_file(tmp_path)
    with launched(pd_node + "d", tmp_path / "d", "--role", "decode", *SMALL, *LONG, "--pd-timeout", "2",
                  "--rank-timeout", "0.5", "--pd-secret-file", secret) as d:
        port = d.port
        pcmd = [sys.executable, "-m", "kvrt.launcher", "launch", "--node", pd_node + "p", "--role", "prefill",
                "--port", "0", "--decode-peer", f"tcp://127.0.0.1:{port}", *SMALL, *LONG,
                "--pd-secret-file", secret]
        from kvrt.ipc.ports import free_port

        pport = free_port()
        pcmd[pcmd.index("--port") + 1] = str(pport)
        plauncher = subprocess.Popen(pcmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            from kvrt.runtime.client.client import Client

            with Client(pport, timeout=30) as pc:
                wait_for(lambda: _answers(pc), "the prefill node to come up", timeout=60)
                pc.submit(prompt, 8)
                wait_for(lambda: d.engine_stats()["device_used"] > 0, "D to hold blocks for P's request")
                kill_node(plauncher)
        finally:
            if plauncher.poll() is None:
                kill_node(plauncher)
        wait_for(lambda: d.engine_stats()["device_used"] == 0, "D's lease to return the blocks", timeout=15)
        stats = d.idle_stats()
        assert stats["finished_requests"] == 0, "P was killed before its handoff: D never decoded"
        assert stats["failed_requests"] >= 1 and stats["device_used"] == 0


def _answers(client) -> bool:
    from kvrt.runtime.client.client import ClientError

    try:
        client.info(timeout=0.5)
        return True
    except ClientError:
        return False



@pytest.mark.alone
def test_a_lease_too_short_for_the_handoff_fails_cleanly(pd_node, tmp_path):
    """P never writes into blocks whose lease may end mid-write: with a 2 s lease and a 2 s
    bound on a send, every handoff is refused; the request fails naming the lease, and both
    sides end with no block in use."""
    with pd_pair(pd_node, tmp_path, d_opts=("--pd-timeout", "2", "--rank-timeout", "0.5"),
                 p_opts=("--rank-timeout", "2")) as (p, d):
        with pytest.raises(RequestError) as e:
            p.client.generate(np.arange(40, dtype=np.int32), 4)
        assert e.value.code == "failed" and "lease" in str(e.value), str(e.value)
        assert p.idle_stats()["device_used"] == 0 and d.idle_stats()["device_used"] == 0
        assert p.client.generate([1, 2, 3], 1).finish_reason == "length"
