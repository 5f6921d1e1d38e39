"""A real node for end-to-end tests: `kvrt launch` in a subprocess with its client API on a
free port, a connected client, and a clean SIGINT stop that must exit 0.

    with launched(node, tmp_path, "--num-gpu-blocks", "32") as ln:
        result = ln.client.generate([1, 2, 3], 4)
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvrt.ipc.config import NodeConfig
from kvrt.ipc.ports import free_port
from kvrt.runtime.client.client import Client, ClientError
from kvrt.runtime.node.status import snapshot
from tests.conftest import REPO
from kvrt.workers.model.transformer import Model, ModelShape

# a model small enough for the dense oracle to be quick, blocks small enough to have many
SMALL = ("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16", "--block-size", "8")


@dataclass
class Launched:
    node: str
    port: int
    proc: subprocess.Popen
    client: Client
    log_dir: str

    def engine_stats(self) -> dict:
        return snapshot(self.node)["engine"]

    def idle_stats(self, timeout: float = 5.0) -> dict:
        """Engine counters once nothing is in flight and no block is in use (the engine
        publishes them once per loop, just after its answers went out), or the last ones seen
        when that does not happen within `timeout` s (a leak: the caller's asserts say which)."""
        deadline = time.monotonic() + timeout
        while True:
            e = self.engine_stats()
            busy = e["seqs_running"] + e["seqs_waiting"] + e["seqs_loading"] + e["tasks_inflight"]
            if (not busy and not e["device_used"] and not e["host_used"]) or time.monotonic() > deadline:
                return e
            time.sleep(0.05)  # a test waiting for another process's counters, not a hot path

    def logs(self) -> str:
        out = []
        for name in sorted(os.listdir(self.log_dir)):
            with open(os.path.join(self.log_dir, name), errors="replace") as f:
                out.append(f"--- {name}\n{f.read()[-4000:]}")
        return "\n".join(out)


def pd_secret_file(directory, what: str = "pd") -> str:
    """A fresh shared secret for a prefill/decode pair (or, `what` "store", a storage tier's
    node group), in a 0600 file under `directory`."""
    import secrets

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(str(directory), f"{what}-{secrets.token_hex(4)}.secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def tiny_trace(path, requests: int = 12) -> str:
    """A Mooncake-format trace of `requests` two-turn conversations' worth of requests (shared
    first ids), written to `path`: for commands whose default trace may not be beside the repo."""
    import json

    with open(path, "w") as f:
        for i in range(requests):
            ids = [1 + i % 3, 100 + i // 2, 1000 + i]
            f.write(json.dumps({"timestamp": i * 10, "input_length": 3 * 512 - 7, "output_length": 4,
                                "hash_ids": ids}) + "\n")
    return str(path)


@contextlib.contextmanager
def launched(node: str, log_dir, *opts: str, env: dict | None = None, ready_s: float = 60.0,
             port: int = 0, preexec: Callable[[], None] | None = None):
    with _started(node, log_dir, opts, env, port, preexec) as ln:
        _wait_ready(ln, ready_s)
        yield ln


@contextlib.contextmanager
def launched_together(*nodes: tuple[str, object, tuple[str, ...], int], env: dict | None = None,
                      ready_s: float = 60.0):
    """Nodes (name, log directory, options, port or 0) started at once, yielded once all are
    ready: a prefill node may start before the decode node it names (`--decode-peer` with the
    port given here), as P waits for its session with D anyway. Each is stopped as `launched` does."""
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(_started(name, log_dir, opts, env, port, None))
                   for name, log_dir, opts, port in nodes]
        for ln in started:
            _wait_ready(ln, ready_s)
        yield started


@contextlib.contextmanager
def _started(node: str, log_dir, opts, env: dict | None, port: int, preexec: Callable[[], None] | None):
    port = port or free_port()
    cmd = [sys.executable, "-m", "kvrt.launcher", "launch", "--node", node, "--port", str(port),
           "--log-dir", str(log_dir), *opts]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=preexec)
    client = Client(port, timeout=60)
    try:
        yield Launched(node, port, proc, client, str(log_dir))
    finally:
        client.close()
        interrupt(proc, f"node {node}", 30)


def _wait_ready(ln: Launched, ready_s: float) -> None:
    """Until the node answers its client (AssertionError when it exited first)."""
    deadline = time.monotonic() + ready_s
    while True:
        if ln.proc.poll() is not None:
            raise AssertionError(f"kvrt launch exited with {ln.proc.returncode}: {ln.proc.stdout.read()}")
        try:
            ln.client.info(timeout=0.5)
            return
        except ClientError:
            if time.monotonic() > deadline:
                raise


def interrupt(proc: subprocess.Popen, what: str, timeout: float) -> str:
    """SIGINT to a kvrt process (a node, a router) that must then stop cleanly: exit 0 within
    `timeout` s, else an AssertionError with its output. Returns the output."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"{what} did not stop within {timeout} s after SIGINT:\n{out}")
    assert proc.returncode == 0, f"{what} exited with {proc.returncode}:\n{out}"
    return out


def oracle(tp: int = 1) -> Model:
    """The model a node launched with SMALL (and `--tp tp`) runs, for dense reference answers."""
    return Model(ModelShape.from_config(NodeConfig(node="", num_layers=2, num_kv_heads=2, head_dim=16, tp=tp)))


def shared_prefix_prompts(seed: int, systems: int = 3, users: int = 4, sys_len=(40, 90),
                          user_len=(5, 40), vocab: int = 512) -> list[np.ndarray]:
    """Prompts that share a few system prefixes, in an order that interleaves them."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(0, vocab, rng.integers(*sys_len)) for _ in range(systems)]
    out = []
    for u in range(users):
        for h in heads:
            out.append(np.concatenate([h, rng.integers(0, vocab, rng.integers(*user_len))]).astype(np.int32))
    return out


def crowding_prompts(seed: int = 20, n: int = 14, longest: int = 300, head: int = 96) -> list[np.ndarray]:
    """`n` prompts of 1 to `longest` tokens, about half of the longer ones behind one `head`-token
    prefix: sent together twice to a tiny device with a host tier, the second round's swap-ins
    wait together for more device blocks than the pool has (seed 20 with 24 device and 48 host
    blocks of 16 tokens, 16 new tokens each, did so)."""
    rng = random.Random(seed)
    shared = np.arange(5000, 5000 + head) % 500
    out = []
    for i in range(n):
        size = rng.randint(1, longest)
        own = np.arange(100_000 + 1000 * i, 100_000 + 1000 * i + size) % 491
        if rng.random() < 0.5 and size > head:
            own = np.concatenate((shared, own[:size - head]))
        out.append(own.astype(np.int32))
    return out
