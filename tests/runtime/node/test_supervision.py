"""Supervision of a real node: a dead or hung process is reported by name with its real exit
status and its own last error, clients in flight get an error at once, and the node stops
with exit 1 leaving nothing in /dev/shm; a node paused whole and resumed is not hung. Also what
a damaged registry does to a live node."""
from __future__ import annotations

import contextlib
import os
import signal
import stat
import struct
import subprocess
import sys
import time

import psutil
import pytest

from kvrt.ipc.registry import HEADER, SLOT, Registry
from kvrt.ipc.shm import Segment, object_name
from kvrt.runtime.client.api import ErrorEvent, TokenEvent
from kvrt.runtime.client.client import Client, Result
from tests.conftest import REPO, leftovers
from kvrt.ipc.ports import free_port
from tests.runtime.node.test_launch import kvrt, launched  # noqa: F401  (the fixture)

# the tests that set --hang-timeout, --rank-timeout or --launcher-grace of a second or two, and
# stop processes, are `alone`: a second test beside them could make a running process look hung
pytestmark = pytest.mark.e2e

SMALL = ("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16", "--block-size", "8",
         "--num-gpu-blocks", "1200")  # room for three 3000-token requests


def _decoding(c: Client, n: int, tokens: int = 3000) -> list[str]:
    """Submit `n` requests of `tokens` tokens each and return their ids once each has streamed a token."""
    rids = [c.submit([1 + i, 2, 3], tokens) for i in range(n)]
    started: set[str] = set()
    while started != set(rids):
        events = c.poll(30)
        assert events, "no token within 30 s"
        for ev in events:
            assert isinstance(ev, TokenEvent), ev
            started.add(ev.request_id)
    return rids


def _errors(c: Client, rids: list[str]) -> dict[str, str]:
    """The error message of each request (token events still on the way are skipped)."""
    errors: dict[str, str] = {}
    while len(errors) < len(rids):
        events = c.poll(30)
        assert events, f"requests {sorted(set(rids) - set(errors))} got no error within 30 s"
        for ev in events:
            if isinstance(ev, ErrorEvent):
                errors[ev.request_id] = ev.message
            else:
                assert isinstance(ev, TokenEvent), ev
    return errors


def test_in_flight_requests_fail_at_once_naming_a_sigkilled_worker(launched, node):
    port = free_port()
    n = launched("--port", str(port), *SMALL)
    n.wait_for("ready:")
    pids = n.child_pids()
    with Client(port, timeout=120) as c:
        rids = _decoding(c, 3)
        psutil.Process(pids["worker[0]"]).send_signal(signal.SIGKILL)
        errors = _errors(c, rids)
    assert all(f"worker[0] (pid {pids['worker[0]']}) was killed by SIGKILL" in m for m in errors.values()), errors
    assert n.proc.wait(20) == 1
    n.wait_for(f"stopped because worker[0] (pid {pids['worker[0]']}) was killed by SIGKILL")
    assert not leftovers(node)


@pytest.mark.alone
def test_a_stopped_worker_is_reported_hung_and_the_node_stops(launched, node):
    port = free_port()
    n = launched("--port", str(port), "--hang-timeout", "1", "--rank-timeout", "120", *SMALL)
    n.wait_for("ready:")
    pids = n.child_pids()
    worker = pids["worker[0]"]
    with Client(port, timeout=120) as c:
        rids = _decoding(c, 1)
        n.proc.send_signal(signal.SIGSTOP)  # the launcher looks away while the worker hangs,
        os.kill(worker, signal.SIGSTOP)     # so that status can be seen calling it hung first
        try:
            deadline = time.monotonic() + 30
            while True:
                procs = {f"{p['role']}[{p['rank']}]": p for p in n.status()["processes"]}
                if procs["worker[0]"]["hung"] or time.monotonic() > deadline:
                    break
            assert procs["worker[0]"]["hung"] and not procs["engine[0]"]["hung"], procs
            assert "HUNG" in kvrt("status", "--node", node).stdout
        finally:
            n.proc.send_signal(signal.SIGCONT)
        errors = _errors(c, rids)
    assert f"worker[0] (pid {worker}) is hung" in errors[rids[0]], errors
    assert n.proc.wait(20) == 1
    n.wait_for(f"worker[0] (pid {worker}) is hung")
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    assert not leftovers(node)


@pytest.mark.alone
def test_a_stopped_worker_fails_its_step_after_the_rank_timeout(launched, node):
    """The engine's own watch of a step: the worker stopped alone while the engine runs."""
    port = free_port()
    n = launched("--port", str(port), "--hang-timeout", "120", "--rank-timeout", "1", *SMALL)
    n.wait_for("ready:")
    worker = n.child_pids()["worker[0]"]
    with Client(port, timeout=120) as c:
        rids = _decoding(c, 1)
        os.kill(worker, signal.SIGSTOP)
        errors = _errors(c, rids)
    assert "worker rank(s) [0] did not answer step" in errors[rids[0]], errors
    assert n.proc.wait(20) == 1
    line = n.wait_for("stopped because")
    assert "engine[0]" in line and "exited with code 1: worker rank(s) [0] did not answer step" in line, line
    assert not leftovers(node)


@pytest.mark.alone
def test_a_stopped_launcher_is_noticed_and_the_node_stops_naming_it(launched, node):
    """The launcher SIGSTOPped alone: nobody supervises the node or serves its HTTP clients. The
    engine calls it hung once its heartbeat stood still for twice --hang-timeout, and at least
    --launcher-grace (here 2 s rather than the default 10 s, so the answers that must outlast it
    stay short), fails every request in flight naming it and exits; once the launcher runs again
    it stops the node with exit 1 and says why, leaving nothing in /dev/shm."""
    port = free_port()
    # answers long enough to outlast the engine's 2 s bound on a quiet machine: contexts of up to
    # 8,000 tokens, whose attention slows each step as they grow
    n = launched("--port", str(port), "--hang-timeout", "1", "--launcher-grace", "2", *SMALL[:-1], "2100",
                 "--max-model-len", "8192")
    n.wait_for("ready:")
    with Client(port, timeout=120) as c:
        rids = _decoding(c, 2, tokens=8000)
        n.proc.send_signal(signal.SIGSTOP)
        try:
            errors = _errors(c, rids)
        finally:
            n.proc.send_signal(signal.SIGCONT)
    launcher = f"the launcher (pid {n.proc.pid}) made no progress"
    assert all(launcher in m and "stopped or hung" in m for m in errors.values()), errors
    assert n.proc.wait(30) == 1
    assert launcher in n.wait_for("stopped because")
    assert not leftovers(node)


def _end_of(c: Client, rid: str) -> Result | ErrorEvent | None:
    """How request `rid` ended (its token events are skipped); None if nothing came for 30 s."""
    while events := c.poll(30):
        for ev in events:
            if isinstance(ev, (Result, ErrorEvent)) and ev.request_id == rid:
                return ev
    return None


def _stopped_because(n) -> str:
    """Why the node stopped, as its launcher said, or that it is still running."""
    return "the node is still running" if n.proc.poll() is None else n.wait_for("stopped because")


@pytest.mark.alone
@pytest.mark.parametrize("launcher_first", [False, True], ids=["children-first", "launcher-first"])
def test_a_node_paused_whole_past_the_hang_timeout_serves_on_when_resumed(launched, node, launcher_first):
    """Every process SIGSTOPped (as a VM pause or `docker pause` does) for twice --hang-timeout
    and --rank-timeout with a step in flight, then SIGCONTed in the reverse order, one at a
    time: neither the launcher nor the engine takes the pause for a hang. Frozen children
    first, the launcher and the engine are resumed before the worker and see only old beats
    and an old step until it runs again."""
    timeout = 2.0
    port = free_port()
    n = launched("--port", str(port), "--hang-timeout", str(timeout), "--rank-timeout", str(timeout), *SMALL)
    n.wait_for("ready:")
    pids = n.child_pids()
    children = [pids["worker[0]"], pids["engine[0]"]]  # the worker first: the engine has a step in flight
    frozen = [n.proc.pid, *children] if launcher_first else [*children, n.proc.pid]
    with Client(port, timeout=120, liveness=None) as c:  # (the node's own view: its client would call it gone)
        rid = c.submit([7, 8, 9], 1000)
        assert any(isinstance(ev, TokenEvent) for ev in c.poll(30)), "no token within 30 s"
        try:
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(2 * timeout)  # the pause
        finally:
            for pid in reversed(frozen):
                with contextlib.suppress(ProcessLookupError):  # (one the node reaped: the asserts say why)
                    os.kill(pid, signal.SIGCONT)
                time.sleep(timeout / 4)  # the next one resumes a while later: each looks alone first
        end = _end_of(c, rid)
        assert isinstance(end, Result) and end.num_output_tokens == 1000, (end, _stopped_because(n))
        assert c.generate([1, 2, 3], 8).num_output_tokens == 8
    assert n.proc.poll() is None, _stopped_because(n)
    n.wait_for("the launcher did not run for")
    n.proc.send_signal(signal.SIGINT)
    assert n.proc.wait(30) == 0
    assert not leftovers(node)


def test_a_killed_engine_is_reported_with_its_signal_not_code_0(launched, node):
    n = launched(*SMALL)
    n.wait_for("ready:")
    engine = n.child_pids()["engine[0]"]
    os.kill(engine, signal.SIGKILL)
    assert n.proc.wait(20) == 1
    line = n.wait_for(f"engine[0] (pid {engine})")
    assert "was killed by SIGKILL" in line and "code 0" not in line, line
    assert not leftovers(node)


def test_port_clash_reports_the_gateways_own_error_and_logs_are_private(node, tmp_path):
    """The gateway owns the public port (runtime/gateway/): at start-up its death fails the start."""
    import socket

    logs = tmp_path / "logs"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = subprocess.run([sys.executable, "-m", "kvrt.launcher", "launch", "--node", node, "--port",
                            str(s.getsockname()[1]), "--log-dir", str(logs), *SMALL],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert "gateway[0]" in last and "exited with code 1" in last and "Address already in use" in last, r.stderr
    assert stat.S_IMODE(os.stat(logs).st_mode) == 0o700
    files = os.listdir(logs)
    assert {"engine-0.log", "gateway-0.log"} <= set(files)
    for f in files:
        assert stat.S_IMODE(os.stat(logs / f).st_mode) == 0o600, f
    assert not leftovers(node)


def test_a_live_node_with_a_damaged_registry_slot_keeps_status_clean_and_stops_clean(launched, node):
    n = launched(*SMALL)
    n.wait_for("ready:")
    reg = Registry.attach(node)
    slot = [e.name for e in reg.entries()].index(object_name(node, "engine.to.worker.0"))
    reg.close()
    seg = Segment.attach(object_name(node, "registry"))
    struct.pack_into("<I8s", seg.mm, HEADER + slot * SLOT, 8, b"\xc1" * 8)
    seg.close()
    st = kvrt("status", "--node", node)
    assert st.returncode == 0 and "Traceback" not in st.stderr and "engine[0]" in st.stdout, st
    cl = kvrt("clean", "--node", node)
    assert cl.returncode == 1 and "refusing" in cl.stdout, cl
    n.proc.send_signal(signal.SIGINT)
    assert n.proc.wait(30) == 0
    assert not leftovers(node)


def test_a_corrupt_ring_fails_its_consumer_and_the_launcher_names_it(launched, node):
    n = launched(*SMALL)
    n.wait_for("ready:")
    worker = n.child_pids()["worker[0]"]
    ring = object_name(node, "engine.to.worker.0")
    seg = Segment.attach(ring)
    cap = struct.unpack_from("<Q", seg.mm, 8)[0]
    tail = struct.unpack_from("<Q", seg.mm, 64)[0]  # an idle engine: nothing else is writing here
    off = 512 + (tail & (cap - 1))
    seg.mm[off: off + 64] = b"\xab" * 64  # garbage, published as if it were a record
    struct.pack_into("<Q", seg.mm, 64, tail + 64)
    seg.close()
    assert n.proc.wait(30) == 1
    line = n.wait_for("stopped because")
    assert f"worker[0] (pid {worker}) exited with code 1" in line and "corrupt record" in line, line
    assert not leftovers(node)
