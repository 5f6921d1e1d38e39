"""The node runtime as a user meets it: `kvrt launch`, `kvrt status`, `kvrt clean`, and what
happens when real processes are SIGKILLed (nothing hangs, nothing leaks)."""
from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from kvrt.ipc.ports import free_port
from kvrt.runtime.node.config import NodeConfig
from tests.conftest import REPO, leftovers

pytestmark = pytest.mark.e2e


def kvrt(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrt.launcher", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


class Launched:
    """A `kvrt launch` in the background, with its stderr lines readable with a timeout."""

    def __init__(self, node: str, *extra: str):
        self.node = node
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvrt.launcher", "launch", "--node", node, "--num-gpu-blocks", "32",
             *([] if "--port" in extra else ["--port", str(free_port())]), *extra],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stderr:
            self.lines.put(line)

    def wait_for(self, text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break
            self.log.append(line)
            if text in line:
                return line
        raise AssertionError(f"{text!r} not seen within {timeout}s; log:\n{''.join(self.log)}")

    def status(self) -> dict:
        r = kvrt("status", "--node", self.node, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["nodes"][0]

    def child_pids(self) -> dict[str, int]:
        return {f"{p['role']}[{p['rank']}]": p["pid"] for p in self.status()["processes"]}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def launched(node):
    nodes = []

    def start(*extra, name=None):
        n = Launched(name or node, *extra)
        nodes.append(n)
        return n

    yield start
    for n in nodes:
        n.stop()
    kvrt("clean", "--node", node)


def test_launch_ready_status_and_clean_stop(launched, node, tmp_path):
    n = launched("--num-cpu-blocks", "16", "--storage", f"file:{tmp_path}/store")
    n.wait_for("ready:")
    snap = n.status()
    assert snap["state"] == "running" and snap["launcher_alive"]
    roles = sorted(f"{p['role']}[{p['rank']}]" for p in snap["processes"])
    assert roles == ["cache-transfer[0]", "engine[0]", "gateway[0]", "worker[0]"]
    assert all(p["alive"] and p["ready"] and p["heartbeat_age_s"] < 5 for p in snap["processes"])
    assert {"engine.to.worker.0", "engine.to.transfer.0", "transfer.0.to.engine"} <= set(snap["rings"])
    assert snap["engine"]["device_total"] == 32 and snap["engine"]["host_total"] == 16
    cfg = NodeConfig(node=node, num_gpu_blocks=32, num_cpu_blocks=16, storage=f"file:{tmp_path}/store")
    assert snap["objects"] == len(cfg.shared_objects())  # what launch validation counts is what it creates
    text = kvrt("status", "--node", node).stdout
    assert "engine[0]" in text and "cache-transfer[0]" in text
    n.proc.send_signal(signal.SIGTERM)
    assert n.proc.wait(20) == 0
    assert not leftovers(node)


@pytest.mark.parametrize("victim", ["engine[0]", "worker[0]", "cache-transfer[0]", "cache-messager[0]"])
def test_sigkill_of_a_child_stops_the_node_nonzero_and_clean(launched, node, victim, tmp_path):
    """The launcher sees the death itself: with --hang-timeout and --rank-timeout at 60 s (a
    decode node's --pd-timeout above them), no watch of heartbeats or steps can be what stops
    the node within the 15 s it is given (a bound far from both, so a second test beside this
    one cannot trip it)."""
    from kvrt.ipc.ports import free_port
    from tests.launched import pd_secret_file

    n = launched("--num-cpu-blocks", "8", "--role", "decode", "--port", str(free_port()),
                 "--pd-secret-file", pd_secret_file(tmp_path), "--hang-timeout", "60", "--rank-timeout", "60",
                 "--pd-timeout", "120")
    n.wait_for("ready:")
    pids = n.child_pids()
    psutil.Process(pids[victim]).send_signal(signal.SIGKILL)
    assert n.proc.wait(15) != 0
    assert not leftovers(node)
    for pid in pids.values():
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_sigkill_of_the_launcher_then_clean_and_relaunch(launched, node):
    n = launched()
    n.wait_for("ready:")
    pids = n.child_pids()
    n.proc.send_signal(signal.SIGKILL)
    n.proc.wait()
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids.values() if psutil.pid_exists(p)], timeout=10)
    assert not alive, f"children outlived their launcher: {alive}"
    assert leftovers(node)  # a SIGKILLed launcher cannot clean up ...
    r = kvrt("clean", "--node", node)
    assert r.returncode == 0 and "removed" in r.stdout
    assert not leftovers(node)  # ... but `kvrt clean` can
    again = launched()
    again.wait_for("ready:")
    again.proc.send_signal(signal.SIGINT)
    assert again.proc.wait(20) == 0


def test_second_launch_of_a_live_name_is_refused(launched, node):
    n = launched()
    n.wait_for("ready:")
    r = kvrt("launch", "--node", node, "--num-gpu-blocks", "8", "--port", str(free_port()))
    assert r.returncode == 1 and "is live" in r.stderr
    r = kvrt("clean", "--node", node)
    assert r.returncode == 1 and "refusing" in r.stdout
    assert n.status()["state"] == "running"
    n.proc.send_signal(signal.SIGTERM)
    assert n.proc.wait(20) == 0


@pytest.mark.parametrize("args, text", [
    (["--tp", "0"], "--tp"),
    (["--block-size", "12"], "power of two"),
    (["--num-gpu-blocks", "-3"], "--num-gpu-blocks"),
    (["--num-cpu-blocks", "-1"], "--num-cpu-blocks"),
    (["--storage", "s3://x"], "file:DIR"),
    (["--storage", "mooncake://127.0.0.1:1"], "--storage-insecure"),
    (["--storage", "mooncake://127.0.0.1:1", "--storage-secret-file", "/nonexistent"], "cannot read it"),
    (["--node", "a.b"], "--node"),
    (["--tp", "3"], "divide"),
    (["--port", "70000"], "--port"),
    (["--dtype", "floatx"], "--dtype"),
    (["--role", "prefill", "--port", "7000"], "--decode-peer"),
    (["--role", "decode"], "--port"),
    (["--decode-peer", "tcp://127.0.0.1:1"], "--role prefill"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--num-gpu-blocks", "100000000"], "/dev/shm"),
    (["--node", "n" * 300], "--node"),
    (["--tp", "128", "--num-kv-heads", "128", "--num-cpu-blocks", "1"], "registry holds"),
    (["--ready-timeout", "-1"], "--ready-timeout"),
    (["--rank-timeout", "0"], "--rank-timeout"),
    (["--pd-timeout", "nan"], "--pd-timeout"),
    (["--dtype", "object"], "float dtype"),
    (["--dtype", "int8"], "float dtype"),
    (["--block-size", "8192"], "--max-model-len"),
    (["--compute-dtype", "float16"], "--model checkpoints"),
    (["--threads", "0"], "--threads"),
    (["--model-backend", "torch"], "--model checkpoints"),
    (["--wait-spin-us", "-5"], "--wait-spin-us"),
    (["--cuda-graph-max-batch", "-2"], "--cuda-graph-max-batch"),
])
def test_bad_configuration_gets_a_clear_error(node, args, text):
    if "--port" not in args and "--role" not in args:  # reachable, so that the error is the one asked for
        args = [*args, "--port", str(free_port())]
    r = kvrt("launch", "--node", node, *args) if "--node" not in args else kvrt("launch", *args)
    assert r.returncode in (1, 2) and text in r.stderr, r.stderr
    assert not leftovers(node)


def test_status_and_clean_without_nodes():
    r = kvrt("status", "--node", "nosuchnode")
    assert r.returncode == 1 and "does not exist" in r.stdout
    r = kvrt("clean", "--node", "nosuchnode")
    assert r.returncode == 0


def test_prometheus_metrics_served(launched):
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n = launched("--num-cpu-blocks", "8", "--metrics-port", str(port))
    n.wait_for("ready:")
    deadline = time.monotonic() + 10
    while True:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)  # the engine opens the port just after it reports ready
    assert 'kvrt_blocks_capacity{tier="device"} 32.0' in body and 'state="total"' not in body
    assert 'kvrt_prefix_hit_tokens_total{tier="host"}' in body
    assert 'kvrt_ring_depth_bytes{ring="engine.to.transfer.0"}' in body
    assert "# TYPE kvrt_transfer_task_seconds histogram" in body
    assert "# TYPE kvrt_ttft_seconds histogram" in body
    assert 'kvrt_sequences{state="running"} 0.0' in body and "kvrt_generated_tokens_total 0.0" in body
    n.proc.send_signal(signal.SIGTERM)
    assert n.proc.wait(20) == 0


def test_check_ownership_mode_launches(launched, node, monkeypatch):
    monkeypatch.setenv("KVRT_CHECK_OWNERSHIP", "1")
    n = launched("--num-cpu-blocks", "8")
    n.wait_for("ready:")
    assert n.status()["config"]["check_ownership"] is True
    n.proc.send_signal(signal.SIGTERM)
    assert n.proc.wait(20) == 0
