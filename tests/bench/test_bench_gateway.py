"""`kvrt bench gateway` through the real CLI at a tiny scale: the JSON it promises (every path,
request and mode; percentiles in order; CPU per request where it is measured; the ratios), never
its timings, and no node left behind."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvrt.launcher import BENCHES
from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def test_bench_gateway_json_has_every_path_request_and_mode():
    assert BENCHES["gateway"][0] == "kvrt.bench.gateway"
    before = set(_shm())
    r = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "gateway", "--requests", "20", "--rounds", "2", "--json"],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["rounds"] == 2
    rows = {(x["path"], x["kind"], x["mode"]): x for x in out["rows"]}
    assert set(rows) == {(p, k, "sequential") for p in ("gateway", "direct") for k in ("info", "generate")} | \
        {(p, "info", "pipelined") for p in ("gateway", "direct", "echo")} | {("echo", "info", "sequential")}
    for (path, kind, mode), x in rows.items():
        assert x["n"] >= 10 and 0 < x["p50_us"] <= x["p99_us"] and x["per_s"] > 0
        assert x["node_cpu_us"] is not None and x["node_cpu_us"] >= 0
        assert (x["gateway_cpu_us"] is not None) == (path == "gateway")
        assert (x["engine_cpu_us"] is not None) == (path != "echo")
    assert {(x["kind"], x["mode"]) for x in out["ratios"]} == {("info", "sequential"), ("generate", "sequential"),
                                                                ("info", "pipelined")}
    for x in out["ratios"]:
        assert x["p50_vs_direct"] > 0
    assert set(_shm()) <= before  # the node it launched is gone, its private sockets too


def _shm() -> list[str]:
    """The objects and private socket directories of the benchmark's nodes."""
    import os
    import tempfile

    shm = [n for n in os.listdir("/dev/shm") if n.startswith(("kvrt.benchgw", "sem.kvrt.benchgw"))]
    return shm + [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"kvrt.{os.geteuid()}.benchgw")]
