"""What a new user meets on a first run: the metrics port, client commands against a wrong
port, exit codes, progress, `status --watch`, `--config`, replay defaults, and the plot."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from ipc.protocol import STAT, STATS
from runtime.metrics import Metrics
from tests.conftest import REPO


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_port_answers_only_metrics_and_blocks_sum_to_capacity():
    stats = np.zeros(len(STATS), dtype=np.int64)
    for name, v in (("device_total", 32), ("device_free", 20), ("device_cached", 8), ("device_used", 4),
                    ("host_total", 16), ("host_free", 16)):
        stats[STAT[name]] = v
    port = free_port()
    Metrics(stats, dict).serve(port)
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200 and "kvrt_prefix_query_tokens" in body
    assert http_get(f"http://127.0.0.1:{port}/")[0] == 200
    for path in ("/health", "/v1/models", "/metricsx", "/metrics/x"):
        status, text = http_get(f"http://127.0.0.1:{port}{path}")
        assert status == 404 and "kvrt_" not in text, path
    samples = {}
    for line in body.splitlines():
        if line.startswith("kvrt_blocks"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert not any('state="total"' in k for k in samples)
    for tier, cap in (("device", 32), ("host", 16)):
        parts = sum(v for k, v in samples.items() if k.startswith("kvrt_blocks{") and f'tier="{tier}"' in k)
        assert parts == cap == samples[f'kvrt_blocks_capacity{{tier="{tier}"}}']


def kvrt(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, **kw)


@pytest.fixture
def silent_listener():
    """A port that accepts TCP connections and never says anything (not a kvrt node)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "1,2", "--max-new-tokens", "2"],
                                     ["replay", "--limit", "2"]])
def test_client_commands_name_a_wrong_port_long_before_their_answer_timeout(command, silent_listener):
    closed = free_port()
    for port, why in ((closed, "refused"), (silent_listener, "")):
        # --timeout 600: only the connect check can end these runs within the subprocess timeout
        r = kvrt(*command, "--port", str(port), "--timeout", "600", timeout=60)
        assert r.returncode == 1, r.stderr
        assert f"tcp://127.0.0.1:{port}" in r.stderr and why in r.stderr


def read_for(fd: int, seconds: float) -> bytes:
    """What a pty master gives within `seconds` (the child keeps writing frames)."""
    import select
    import time

    got = b""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            got += chunk
    return got


def test_status_watch_redraws_in_place_on_a_terminal_and_appends_plain_frames_to_a_pipe():
    import pty

    args = [sys.executable, "-m", "launcher", "status", "--node", "nosuchnode", "--watch", "0.2"]
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, cwd=REPO, stdout=slave, stderr=subprocess.DEVNULL)
    os.close(slave)
    try:
        tty = read_for(master, 8).decode(errors="replace")
    finally:
        proc.kill()
        proc.wait(10)
        os.close(master)
    frames = tty.count("does not exist")
    assert frames >= 2 and tty.count("\x1b[H\x1b[2J") == frames
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        piped = read_for(proc.stdout.fileno(), 8).decode()
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
    assert piped.count("does not exist") >= 2 and "\x1b" not in piped
