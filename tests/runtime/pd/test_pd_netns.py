"""Prefill and decode on two "hosts": P and D in separate network namespaces joined by a veth
pair (a real network path with its own addresses; neither side's loopback reaches the other),
block bytes over the Mooncake transport (TCP). Answers must equal the dense reference (a
mixed node's), and the veth counters must show the block bytes crossed the link: the shm
transport (which would work across namespaces, since /dev/shm is per machine) is not used.

D listens on every interface (`--host 0.0.0.0`), as a multi-homed decode host would: its
hostname resolves to 127.0.0.1 here, so the Mooncake address it publishes has to come from its
own interfaces, and P's from its route to D.

Runs as root with `ip` (CI does); skipped with the reason elsewhere. The namespaces, the veth
pair, every process and every shared-memory object are removed whatever happens.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from kvrt.runtime.node.status import snapshot
from tests.conftest import REPO, leftovers, reclaim_dead
from tests.launched import SMALL, oracle, pd_secret_file, shared_prefix_prompts
from tests.runtime.engine.test_oracle import NEW
from tests.runtime.pd.test_pd import kill_node, mooncake_available

P_ADDR, D_ADDR = "10.231.7.1", "10.231.7.2"
D_PORT, P_PORT = 7101, 7100


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if not mooncake_available():
        return "mooncake-transfer-engine not importable"
    return None


pytestmark = [pytest.mark.e2e, pytest.mark.skipif(_netns_unavailable() is not None, reason=str(_netns_unavailable()))]


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


@pytest.fixture
def two_hosts():
    """Two namespaces (P's, D's) joined by a veth pair P_ADDR <-> D_ADDR; yields their names
    and P's veth name. Namespaces (and with them the veth pair) are deleted afterwards."""
    tag = uuid.uuid4().hex[:6]
    ns_p, ns_d, veth_p, veth_d = f"kvrtp{tag}", f"kvrtd{tag}", f"kvp{tag}", f"kvd{tag}"
    made: list[str] = []
    try:
        for ns in (ns_p, ns_d):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", veth_p, "type", "veth", "peer", "name", veth_d)
        _ip("link", "set", veth_p, "netns", ns_p)
        _ip("link", "set", veth_d, "netns", ns_d)
        for ns, dev, addr in ((ns_p, veth_p, P_ADDR), (ns_d, veth_d, D_ADDR)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except RuntimeError as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        pytest.skip(f"cannot build two network namespaces here: {e}")
    try:
        yield ns_p, ns_d, veth_p
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


@contextlib.contextmanager
def launched_in(ns: str, node: str, log_dir, *opts: str, ready_s: float = 60.0):
    """`kvrt launch` inside namespace `ns` (`ip netns exec` execs it: the pid is the launcher's);
    returns once it says it is ready; stopped with SIGINT (exit 0), killed if it does not stop."""
    os.makedirs(log_dir, exist_ok=True)
    out_path = os.path.join(str(log_dir), "launch.out")
    with open(out_path, "w") as out:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "kvrt.launcher", "launch",
                                 "--node", node, "--log-dir", str(log_dir), *opts],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + ready_s
        while f"node {node} ready" not in _read(out_path):
            assert proc.poll() is None, f"{node} exited with {proc.returncode}:\n{_read(out_path)}"
            assert time.monotonic() < deadline, f"{node} not ready within {ready_s}s:\n{_read(out_path)}"
            time.sleep(0.1)  # a test waiting for another process, not a hot path
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_node(proc)
            raise AssertionError(f"{node} did not stop within 30 s after SIGINT:\n{_read(out_path)}")
        assert proc.returncode == 0, f"{node} exited with {proc.returncode}:\n{_read(out_path)}"


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


CLIENT = """
import json, sys
import numpy as np
from kvrt.runtime.client.client import Client
prompts = json.load(open(sys.argv[2]))
with Client(int(sys.argv[1]), timeout=60) as c:
    ids = [c.submit(np.asarray(p, dtype=np.int32), int(sys.argv[3])) for p in prompts]
    done = {}
    while len(done) < len(ids):
        events = c.poll(timeout=60)
        assert events, "no answer from the prefill node within 60 s"
        for ev in events:
            if hasattr(ev, "code"):
                raise SystemExit(f"request failed: {ev}")
            if hasattr(ev, "output_token_ids"):
                done[ev.request_id] = ev.output_token_ids.tolist()
print(json.dumps([done[i] for i in ids]))
"""


CONNECTIONS = """
import json, psutil
print(json.dumps([[c.status, c.laddr.ip, c.laddr.port, *(c.raddr or ("", 0))] for c in psutil.net_connections("tcp")]))
"""


def _connections(ns: str) -> tuple[list[str], list[str]]:
    """The established TCP connections in namespace `ns` (all of them the node's there):
    (accepted on a port it listens on, opened by itself). A decode node only accepts, so P
    needs no port open to it."""
    done = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", CONNECTIONS], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    conns = json.loads(done.stdout)
    listening = {port for status, _, port, *_ in conns if status == psutil.CONN_LISTEN}
    out: tuple[list[str], list[str]] = ([], [])
    for status, ip, port, rip, rport in conns:
        if status == psutil.CONN_ESTABLISHED:
            out[port not in listening].append(f"{ip}:{port} <-> {rip}:{rport}")
    return out


def _veth_bytes(ns: str, dev: str) -> int:
    """Bytes P's end of the veth pair sent (its kernel counter)."""
    stats = json.loads(_ip("-n", ns, "-s", "-j", "link", "show", "dev", dev))[0]["stats64"]
    return int(stats["tx"]["bytes"])


@pytest.fixture
def pd_nodes():
    name = "t" + uuid.uuid4().hex[:9]
    yield name + "p", name + "d"
    for n in (name + "p", name + "d"):
        reclaim_dead(n)
        assert not leftovers(n), f"shared memory of {n} leaked: {leftovers(n)}"


def test_pd_across_network_namespaces_equals_the_reference(two_hosts, pd_nodes, tmp_path):
    ns_p, ns_d, veth_p = two_hosts
    p_node, d_node = pd_nodes
    prompts = shared_prefix_prompts(seed=23)
    want = [oracle().generate_dense(p, NEW) for p in prompts]
    (tmp_path / "prompts.json").write_text(json.dumps([p.tolist() for p in prompts]))
    common = (*SMALL, "--pd-transport", "mooncake", "--pd-secret-file", pd_secret_file(tmp_path))
    with launched_in(ns_d, d_node, tmp_path / "d", "--role", "decode", "--host", "0.0.0.0",
                     "--port", str(D_PORT), *common):
        with launched_in(ns_p, p_node, tmp_path / "p", "--role", "prefill", "--port", str(P_PORT),
                         "--decode-peer", f"tcp://{D_ADDR}:{D_PORT}", *common):
            before = _veth_bytes(ns_p, veth_p)
            client = subprocess.run(["ip", "netns", "exec", ns_p, sys.executable, "-c", CLIENT, str(P_PORT),
                                     str(tmp_path / "prompts.json"), str(NEW)],
                                    cwd=REPO, capture_output=True, text=True, timeout=120)
            logs = "\n".join(_read(tmp_path / side / "launch.out") for side in ("p", "d"))
            assert client.returncode == 0, client.stdout + client.stderr + logs
            assert json.loads(client.stdout) == want
            sent = _veth_bytes(ns_p, veth_p) - before
            accepted, dialled = _connections(ns_d)
            assert accepted and not dialled, f"D accepted {accepted} and opened {dialled}: P dials D, never back"
            pe = snapshot(p_node)["engine"]
            assert pe["failed_requests"] == 0
            assert pe["pd_sent_bytes"] > 0, "P handed no KV to D"
            assert sent > pe["pd_sent_bytes"], (f"only {sent} bytes left P's veth, for {pe['pd_sent_bytes']} "
                                                f"bytes of KV: the blocks did not cross the link")
    for side, addr in (("p", P_ADDR), ("d", D_ADDR)):
        logs = "".join(_read(str(f)) for f in (tmp_path / side).iterdir())
        assert f"rank 0 publishes {addr} to its P/D peers" in logs, f"{side} published another address:\n{logs}"
