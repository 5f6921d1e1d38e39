"""`kvrt bench attacks`: a tiny run through the real CLI (two attacks, a small node) prints the
documented JSON rows, the node up after each. No timing is asserted; the figures are the
benchmark's output."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def test_a_tiny_run_prints_its_rows():
    r = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "attacks", "--attacks", "tokenize,logprobs",
                        "--idle-s", "0.5", "--json", "--", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim",
                        "16"], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout)
    assert [row["attack"] for row in rows] == ["tokenize", "logprobs"]
    for row in rows:
        assert set(row) == {"attack", "outcome", "probes", "probe_p50_ms", "probe_max_ms", "idle_max_ms", "ratio",
                            "growth_mib", "alive"}
        assert row["alive"] and row["probes"] >= 1 and row["outcome"].startswith("400")
