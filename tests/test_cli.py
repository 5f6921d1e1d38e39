import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def kvrt(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "kvrt.launcher", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_commands():
    r = kvrt("--help")
    assert r.returncode == 0 and "bench" in r.stdout and "stress" in r.stdout
    r = kvrt("bench")
    assert "ipc" in r.stdout
    r = kvrt("bench", "nope")
    assert r.returncode == 2 and "unknown" in r.stderr


def test_bench_ipc_json_quick():
    r = kvrt("bench", "ipc", "--json", "--scale", "0.02", "--repeat", "1")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert {row["transport"] for row in rows} == {"kvrt", "kvrt-batched", "mp.Queue", "BaseManager-tcp", "zmq-ipc"}
    assert {row["size"] for row in rows} == {64, 4096}
    for row in rows:
        assert row["sent"] == row["received"] > 0
        assert set(row) == {"transport", "size", "msgs_per_s", "rtt_p50_us", "rtt_p99_us", "sent", "received"}


def test_stress_ring_cli():
    r = kvrt("stress", "ring", "--producers", "2", "--messages", "2000", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] and out["received"] == 4000
