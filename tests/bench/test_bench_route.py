"""`kvrt bench route` end to end on a tiny run: real nodes, a real router, the JSON it promises."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.launched import tiny_trace

pytestmark = pytest.mark.e2e


def test_bench_route_json_has_a_row_per_policy_and_the_one_node_row(tmp_path):
    trace = tiny_trace(tmp_path / "trace.jsonl")
    out = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "route", "--nodes", "1", "--limit", "12",
                          "--trace", trace,
                          "--policies", "round-robin", "--json"], cwd=REPO, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout)["results"]
    assert [r["policy"] for r in results] == ["round-robin", "one node, all the cache"]
    for r in results:
        assert r["requests"] == 12 and r["failed"] == 0
        assert 0 <= r["hit_token_rate"] <= r["ideal_hit_token_rate"] + 1e-9
        assert r["ttft_p50_ms"] > 0 and r["ttft_p99_ms"] >= r["ttft_p50_ms"]


def test_bench_route_peer_runs_both_routers_on_roomy_and_small_pools(tmp_path):
    pytest.importorskip("sglang_router")
    trace = tiny_trace(tmp_path / "trace.jsonl")
    out = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "route", "--nodes", "2", "--limit", "12",
                          "--trace", trace, "--policies", "cache-aware", "--peer", "sglang-router",
                          "--overhead-requests", "5", "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert [(r["pool"], r["policy"]) for r in got["results"]] == [
        ("roomy", "cache-aware"), ("roomy", "sglang-router cache_aware"),
        ("small", "cache-aware"), ("small", "sglang-router cache_aware")]
    for r in got["results"]:
        assert r["failed"] == 0 and sum(r["routed_per_node"]) == 12
    assert set(got["kvrt_over_peer"]) == {"roomy", "small"}
    assert set(got["router_cost"]["overhead_p50_ms"]) == {"kvrt route", "sglang-router cache_aware"}


def test_bench_route_cost_only_measures_kvrt_route_over_an_instant_backend():
    out = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "route", "--cost-only", "--cost-backend",
                          "instant", "--overhead-requests", "5", "--json"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["config"]["backend"] == "instant"
    cost = got["router_cost"]
    assert cost["requests"] == 5 and set(cost["p50_ms"]) == {"direct", "kvrt route"}
    assert set(cost["overhead_p50_ms"]) == set(cost["paired_overhead_p50_ms"]) == {"kvrt route"}
    assert cost["cpu_ms_per_request"]["kvrt route"] >= 0
