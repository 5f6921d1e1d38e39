"""One prefill node handing off to several decode nodes, and several prefill nodes handing off to
one decode node, with real nodes on this machine.

P sends each request to the decode node that last reported the most free blocks (D reports them
in its pongs and allocation answers), and to the next one when a decode node refuses the request
or is lost. Answers must equal the dense reference (a mixed node's) wherever they were decoded.
"""
from __future__ import annotations

import contextlib
import re
import time

import numpy as np
import psutil
import pytest

from kvrt.ipc.ports import free_port
from tests.conftest import leftovers, reclaim_dead
from tests.launched import SMALL, launched, launched_together, oracle, pd_secret_file, shared_prefix_prompts
from tests.runtime.engine.test_oracle import NEW, run_all, tokens
from tests.runtime.pd.test_pd import TRANSPORTS, kill_node, pd_node, wait_for  # noqa: F401  (pd_node: a fixture)


@contextlib.contextmanager
def pd_nodes(node: str, tmp_path, secret: str, per_decode: tuple[tuple[str, ...], ...],
             per_prefill: tuple[tuple[str, ...], ...] = ((),), transport: str = "shm"):
    """Decode nodes node+"d0", node+"d1", ... (one per `per_decode` option tuple) and prefill
    nodes node+"p", node+"p1", ... (one per `per_prefill`) naming them all, started at once (a
    prefill node waits for its sessions with the decode nodes anyway); yields (decode nodes,
    prefill nodes)."""
    ports = [free_port() for _ in per_decode]
    peers = ",".join(f"tcp://127.0.0.1:{port}" for port in ports)
    common = (*SMALL, "--pd-transport", transport, "--pd-secret-file", secret)
    ds = [(f"{node}d{i}", tmp_path / f"d{i}", ("--role", "decode", *common, *opts), port)
          for i, (opts, port) in enumerate(zip(per_decode, ports))]
    names = [node + ("p" if i == 0 else f"p{i}") for i in range(len(per_prefill))]
    ps = [(name, tmp_path / name, ("--role", "prefill", *common, "--decode-peer", peers, *opts), 0)
          for name, opts in zip(names, per_prefill)]
    with launched_together(*ds, *ps) as started:
        yield started[:len(ds)], started[len(ds):]


def prefill_node(name: str, tmp_path, secret: str, ds, *opts: str, transport: str = "shm"):
    return launched(name, tmp_path / name, "--role", "prefill", *SMALL, "--pd-transport", transport,
                    "--pd-secret-file", secret,
                    "--decode-peer", ",".join(f"tcp://127.0.0.1:{d.port}" for d in ds), *opts)


def answers(client, ids: list) -> list[list[int]]:
    """The output tokens of the requests `ids` submitted on `client`, in that order; every event
    an answer, none an error."""
    got = {}
    while len(got) < len(ids):
        events = client.poll(timeout=60)
        assert events, "no answer within 60 s"
        for ev in events:
            assert not hasattr(ev, "code"), ev
            if hasattr(ev, "output_token_ids"):
                got[ev.request_id] = ev.output_token_ids.tolist()
    return [got[i] for i in ids]


def wait_for_free_blocks(p, ds) -> None:
    """Until P has heard every decode node's free blocks (it logs the first report of a session)."""
    def known() -> bool:
        logs = p.logs()
        return all(re.search(rf"decode node tcp://127\.0\.0\.1:{d.port}: \d+ free blocks", logs) for d in ds)

    wait_for(known, "P to hear the free blocks of every decode node")


@pytest.fixture
def multi_node(pd_node):
    """A name prefix whose nodes (+"p", +"d0", +"d1", +"p1") are reclaimed if dead (a killed
    one) and checked for leftovers."""
    yield pd_node
    for n in (pd_node + "d0", pd_node + "d1", pd_node + "p1"):
        reclaim_dead(n)
        assert not leftovers(n), f"shared memory of {n} leaked: {leftovers(n)}"


@pytest.mark.e2e
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_requests_go_to_the_decode_node_with_most_free_blocks(multi_node, tmp_path, transport):
    """D0 (listed first) has 64 blocks, D1 has 512: every request goes to D1."""
    prompts = shared_prefix_prompts(seed=31)
    want = [oracle().generate_dense(p, NEW) for p in prompts]
    secret = pd_secret_file(tmp_path)
    with pd_nodes(multi_node, tmp_path, secret, (("--num-gpu-blocks", "64"), ("--num-gpu-blocks", "512")),
                  transport=transport) as ((small, big), (p,)):
        wait_for_free_blocks(p, (small, big))
        assert tokens(run_all(p.client, prompts, concurrent=False)) == want
        assert tokens(run_all(p.client, prompts)) == want, p.logs()
        s, b = small.idle_stats(), big.idle_stats()
        assert b["finished_requests"] == 2 * len(prompts) and s["finished_requests"] == 0, (s, b)
        assert p.idle_stats()["failed_requests"] == 0


@pytest.mark.e2e
@pytest.mark.alone
def test_a_refused_request_goes_to_the_next_decode_node(multi_node, tmp_path):
    """D0 has the most free blocks but takes one preallocation per peer at a time: the burst's
    other requests, refused there, are decoded by D1."""
    prompts = shared_prefix_prompts(seed=32)
    want = [oracle().generate_dense(p, NEW) for p in prompts]
    secret = pd_secret_file(tmp_path)
    with pd_nodes(multi_node, tmp_path, secret, (("--num-gpu-blocks", "1024", "--pd-peer-max-preallocs", "1"),
                                                 ("--num-gpu-blocks", "1024", "--pd-peer-max-blocks", "400"))) \
            as ((d0, d1), (p,)):
        wait_for_free_blocks(p, (d0, d1))
        assert tokens(run_all(p.client, prompts)) == want, p.logs()
        s0, s1 = d0.idle_stats(), d1.idle_stats()
        assert s0["pd_refused"] > 0, "D0 should have refused part of the burst"
        assert s0["finished_requests"] > 0 and s1["finished_requests"] > 0, (s0, s1)
        assert s0["finished_requests"] + s1["finished_requests"] == len(prompts)
        assert p.idle_stats()["failed_requests"] == 0


@pytest.mark.e2e
@pytest.mark.alone
def test_a_dead_decode_node_leaves_the_others_serving(multi_node, tmp_path):
    """D0 (most free blocks) is SIGKILLed: once P has noticed, every request goes to D1."""
    prompts = shared_prefix_prompts(seed=33)
    want = [oracle().generate_dense(p, NEW) for p in prompts]
    secret = pd_secret_file(tmp_path)
    opts = ("--pd-timeout", "3", "--rank-timeout", "1", "--pd-dead-after", "1.5")  # (P: D0 lost after 1.5 s)
    with launched(multi_node + "d1", tmp_path / "d1", "--role", "decode", *SMALL, "--pd-secret-file", secret,
                  *opts) as d1:
        d0_stack = contextlib.ExitStack()
        d0 = d0_stack.enter_context(launched(multi_node + "d0", tmp_path / "d0", "--role", "decode", *SMALL,
                                             "--num-gpu-blocks", "1024", "--pd-secret-file", secret, *opts))
        with prefill_node(multi_node + "p", tmp_path, secret, (d0, d1), *opts) as p:
            wait_for_free_blocks(p, (d0, d1))
            assert tokens(run_all(p.client, prompts[:3])) == want[:3]
            assert d0.idle_stats()["finished_requests"] == 3
            kill_node(d0.proc)
            with contextlib.suppress(AssertionError):  # launched() may say it did not exit 0: it was killed
                d0_stack.close()
            wait_for(lambda: "lost the decode node tcp://127.0.0.1:%d" % d0.port in p.logs(),
                     "P to notice that D0 is gone")
            assert tokens(run_all(p.client, prompts)) == want, p.logs()
            assert d1.idle_stats()["finished_requests"] == len(prompts)
            assert p.idle_stats()["failed_requests"] == 0


@pytest.mark.e2e
@pytest.mark.alone
def test_requests_asked_of_a_decode_node_that_stops_answering_go_to_another(multi_node, tmp_path):
    """D0 (most free blocks) is paused (SIGSTOP) with no request on it; the requests P then asks
    of it get no answer, and once P counts D0 as lost they are asked of D1 and all finish."""
    prompts = shared_prefix_prompts(seed=35)[:4]
    want = [oracle().generate_dense(p, NEW) for p in prompts]
    secret = pd_secret_file(tmp_path)
    opts = ("--pd-timeout", "8", "--rank-timeout", "1", "--pd-dead-after", "2")  # (P: D0 lost after 2 s)
    paused = ("--num-gpu-blocks", "1024", "--hang-timeout", "60", *opts)  # its launcher must not mind the pause
    with pd_nodes(multi_node, tmp_path, secret, (paused, opts), (opts,)) as ((d0, d1), (p,)):
        wait_for_free_blocks(p, (d0, d1))
        procs = [psutil.Process(d0.proc.pid), *psutil.Process(d0.proc.pid).children(recursive=True)]
        for proc in procs:
            proc.suspend()
        try:
            assert tokens(run_all(p.client, prompts)) == want, p.logs()
        finally:
            for proc in procs:
                proc.resume()
        logs = p.logs()
        assert f"lost the decode node tcp://127.0.0.1:{d0.port}" in logs
        assert "trying another decode node" in logs
        assert d1.idle_stats()["finished_requests"] == len(prompts)
        assert p.idle_stats()["failed_requests"] == 0


@pytest.mark.e2e
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_several_prefill_nodes_share_one_decode_node(multi_node, tmp_path, transport):
    """Two prefill nodes on one decode node, both busy at once: every answer is the reference,
    D decoded all of them, and each P's requests stay apart (same request ids on both)."""
    prompts = shared_prefix_prompts(seed=34)
    want = [oracle().generate_dense(p, NEW) for p in prompts]
    secret = pd_secret_file(tmp_path)
    with pd_nodes(multi_node, tmp_path, secret, (("--num-gpu-blocks", "1024"),), ((), ()),
                  transport=transport) as ((d,), (p0, p1)):
        ids0 = [p0.client.submit(q, NEW, request_id=f"r{i}") for i, q in enumerate(prompts)]
        ids1 = [p1.client.submit(q, NEW, request_id=f"r{i}") for i, q in enumerate(prompts)]
        assert ids0 == ids1
        for client, ids in ((p0.client, ids0), (p1.client, ids1)):
            assert answers(client, ids) == want
        assert d.idle_stats()["finished_requests"] == 2 * len(prompts)
        assert p0.idle_stats()["failed_requests"] == p1.idle_stats()["failed_requests"] == 0
        assert np.all([s["pd_sent_bytes"] > 0 for s in (p0.idle_stats(), p1.idle_stats())])


@pytest.mark.parametrize("peers,text", [("tcp://127.0.0.1:7001,127.0.0.1:7002", "tcp://HOST:PORT"),
                                        ("tcp://127.0.0.1:7001,tcp://127.0.0.1:7001", "twice"),
                                        ("tcp://127.0.0.1:99999", "tcp://HOST:PORT"),
                                        ("tcp://127.0.0.1", "tcp://HOST:PORT")])
def test_bad_decode_peer_lists_are_refused(tmp_path, peers, text):
    from kvrt.runtime.node.config import ConfigError, NodeConfig

    cfg = NodeConfig(node="x", role="prefill", port=7000, decode_peer=peers, pd_secret_file=pd_secret_file(tmp_path))
    with pytest.raises(ConfigError, match=text):
        cfg.validate()


def test_a_decode_peer_list_is_read_in_order():
    from kvrt.runtime.node.config import NodeConfig

    cfg = NodeConfig(node="x", role="prefill", decode_peer="tcp://10.0.0.2:7001, tcp://10.0.0.3:7001")
    assert cfg.decode_peers == ["tcp://10.0.0.2:7001", "tcp://10.0.0.3:7001"]


@pytest.mark.e2e
def test_decode_node_reports_the_blocks_a_peer_could_get(pd_node, tmp_path):
    """D's pongs and allocation answers say how many blocks the peer could get now: the free or
    evictable blocks of D's pool, within that peer's quota (--pd-peer-max-blocks)."""
    from kvrt.runtime.client import api
    from kvrt.runtime.pd import messages as wire
    from kvrt.runtime.pd.auth import load_secret
    from tests.runtime.pd.test_pd_security import FakePeer

    secret = pd_secret_file(tmp_path)
    with launched(pd_node + "d", tmp_path / "d", "--role", "decode", *SMALL, "--num-gpu-blocks", "64",
                  "--pd-peer-max-blocks", "40", "--pd-secret-file", secret) as d:
        with contextlib.closing(FakePeer(d.port, load_secret(secret), "fake-p")) as peer:
            peer.handshake()

            def pong() -> int:
                peer.send(wire.PdPing(2))
                deadline = time.monotonic() + 10
                while True:
                    assert peer.sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)), "no pong within 10 s"
                    msg = peer.session.open(api.API.decode(peer.sock.recv()))
                    if isinstance(msg, wire.PdPong):
                        return msg.free_blocks

            assert pong() == 40, "the quota bounds what this peer can get"
            got = peer.prealloc("r1", np.arange(40, dtype=np.int32), 8)  # 6 blocks of 8 tokens
            assert isinstance(got, wire.PdAllocated) and got.free_blocks == 34, got
            assert pong() == 34
            peer.send(wire.PdAbort("r1", "test"))
            wait_for(lambda: pong() == 40, "the aborted request's blocks to count as free again")
