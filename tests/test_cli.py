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


def launch_parser():
    import argparse

    from kvrt import launcher

    return launcher._add_launch(argparse.ArgumentParser().add_subparsers())


def test_launch_threads_flag_and_its_environment_default(monkeypatch):
    """--threads N|auto reaches the node config as a count, 0 for auto; $KVRT_THREADS is the default."""
    assert launch_parser().parse_args([]).threads == 0
    assert launch_parser().parse_args(["--threads", "3"]).threads == 3
    assert launch_parser().parse_args(["--threads", "auto"]).threads == 0
    monkeypatch.setenv("KVRT_THREADS", "1")
    assert launch_parser().parse_args([]).threads == 1
    for bad in ("0", "-2", "many"):
        with pytest.raises(SystemExit):
            launch_parser().parse_args(["--threads", bad])
