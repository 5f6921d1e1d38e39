"""Trace loading, token expansion, the ideal hit rate, and `kvrt bench cache`.

No timing is asserted here; speed belongs to the benchmark's output."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import kvrt.bench.cache as cache_bench
from kvrt.runtime.client.trace import (TRACE_BLOCK, TraceError, TraceRequest, default_trace_path, expand_tokens,
                           ideal_hit_tokens, load_trace)
from tests.conftest import REPO

TRACE = default_trace_path()


def write_trace(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def independent_ideal(reqs: list[TraceRequest], bs: int) -> int:
    """The ideal, counted the obvious way: a set of (id prefix, offset) blocks, each id prefix
    named by a number given to (the prefix before it, its last id) when first seen (exactly the
    prefix's identity, without hashing a tuple as long as the prefix for every block)."""
    per = TRACE_BLOCK // bs
    names: dict = {}
    seen: set = set()
    hits = 0
    for r in reqs:
        full = r.input_length // bs
        prefixes, name = [], -1
        for h in r.hash_ids:
            name = names.setdefault((name, h), len(names))
            prefixes.append(name)
        blocks = [(prefixes[b // per], b % per) for b in range(full)]
        m = 0
        while m < full and blocks[m] in seen:
            m += 1
        if m * bs == r.input_length:  # a whole-prompt match gives one block back
            m -= 1
        hits += m * bs
        seen.update(blocks)
    return hits


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cache_bench.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---- trace format and tokens -----------------------------------------------------------------
def test_load_trace_validates(tmp_path):
    good = {"timestamp": 5, "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}
    path = write_trace(tmp_path / "t.jsonl", [good, good])
    reqs = load_trace(path)
    assert reqs == [TraceRequest(5, 600, 7, (1, 2))] * 2
    assert len(load_trace(path, limit=1)) == 1
    bad_len = dict(good, input_length=2000)
    with pytest.raises(TraceError, match=r"t2.jsonl:2: input_length 2000"):
        load_trace(write_trace(tmp_path / "t2.jsonl", [good, bad_len]))
    (tmp_path / "t3.jsonl").write_text("{not json\n")
    with pytest.raises(TraceError, match="t3.jsonl:1"):
        load_trace(tmp_path / "t3.jsonl")


def test_expanded_tokens_reproduce_the_sharing():
    a = TraceRequest(0, 1100, 1, (7, 8, 9))
    b = TraceRequest(0, 700, 1, (7, 8))
    c = TraceRequest(0, 700, 1, (7, 10))
    ta, tb, tc = expand_tokens(a), expand_tokens(b), expand_tokens(c)
    assert ta.dtype == np.int32 and len(ta) == 1100 and len(tb) == 700
    assert np.array_equal(ta[:700], tb)  # same ids, same tokens
    assert np.array_equal(ta[:512], tc[:512])
    assert (ta[512:700] != tc[512:700]).all()  # different ids: every token differs
    assert np.array_equal(expand_tokens(a), ta)  # deterministic
    small = expand_tokens(a, vocab_size=1000)
    assert small.min() >= 0 and small.max() < 1000


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bs, reference", [(512, 0.374), (64, 0.3736)])  # the published figures
def test_ideal_matches_an_independent_count(bs, reference):
    reqs = load_trace(TRACE)
    assert len(reqs) == 12_031
    ideal = ideal_hit_tokens(reqs, bs)
    assert ideal == independent_ideal(reqs, bs)
    assert ideal / sum(r.input_length for r in reqs) == pytest.approx(reference, abs=1e-3)


# ---- the replay ------------------------------------------------------------------------------
@pytest.mark.parametrize("bs", [512, 64, 16])
def test_unlimited_replay_equals_ideal(bs):
    reqs = load_trace(TRACE, limit=400)
    row = cache_bench.replay(reqs, bs, None, 0)
    total = sum(r.input_length for r in reqs)
    assert row["hit_token_rate"] == ideal_hit_tokens(reqs, bs) / total
    assert row["evicted_device_blocks"] == 0 and row["rejected_requests"] == 0


@pytest.mark.timeout(300)
def test_full_trace_replay_equals_ideal():
    reqs = load_trace(TRACE)
    row = cache_bench.replay(reqs, 64, None, 0)
    assert row["blocks"] == 2_268_430
    assert row["hit_token_rate"] == ideal_hit_tokens(reqs, 64) / sum(r.input_length for r in reqs)


def test_limited_capacity_and_host_tier():
    reqs = load_trace(TRACE, limit=1500)
    ideal = ideal_hit_tokens(reqs, 64) / sum(r.input_length for r in reqs)
    small = cache_bench.replay(reqs, 64, 10_000, 0)
    with_host = cache_bench.replay(reqs, 64, 10_000, 30_000)
    big = cache_bench.replay(reqs, 64, 40_000, 0)
    assert small["evicted_device_blocks"] > 0 and small["swap_out_blocks"] == 0
    assert 0 < small["hit_token_rate"] < ideal
    assert with_host["swap_out_blocks"] > 0 and with_host["hit_token_rate_host"] > 0
    # the host tier holds what the device evicted: close to a device of the same total size
    assert small["hit_token_rate"] < with_host["hit_token_rate"] <= big["hit_token_rate"] + 0.01


def test_requests_larger_than_the_device_are_skipped(tmp_path):
    rows = [{"timestamp": 0, "input_length": 2048, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 0, "input_length": 300, "output_length": 1, "hash_ids": [1]}]
    reqs = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    row = cache_bench.replay(reqs, 64, 16, 0)
    assert row["rejected_requests"] == 1


# ---- the command line --------------------------------------------------------------------------
def test_cli_json(capsys):
    rc, out, _ = run_main(capsys, "--limit", "300", "--capacity-blocks", "3000", "8000", "--json")
    assert rc == 0
    results = json.loads(out)["results"]
    assert [r["capacity_blocks"] for r in results] == [3000, 8000]
    for r in results:
        for key in ("requests", "blocks", "capacity_blocks", "host_blocks", "hit_token_rate",
                    "ideal_hit_token_rate", "blocks_per_s", "peak_rss_mb"):
            assert key in r
        assert r["requests"] == 300 and r["blocks_per_s"] > 0
        assert r["hit_token_rate"] <= r["ideal_hit_token_rate"]


def test_cli_table_and_default_trace(capsys):
    rc, out, _ = run_main(capsys, "--limit", "200", "--block-size", "128")
    assert rc == 0
    assert "unlimited" in out and "blocks/s" in out and str(TRACE) in out


def test_cli_errors(capsys, tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as e:
        cache_bench.main(["--trace", str(tmp_path / "missing.jsonl")])
    assert e.value.code == 2 and "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cache_bench.main(["--block-size", "48"])
    assert "must divide 512" in capsys.readouterr().err
    monkeypatch.setattr(cache_bench, "default_trace_path", lambda: tmp_path / "nowhere.jsonl")
    with pytest.raises(SystemExit):
        cache_bench.main([])
    assert "bundled trace is not at" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("[]\n")
    rc, _, err = run_main(capsys, "--trace", str(tmp_path / "bad.jsonl"))
    assert rc == 2 and "bad.jsonl:1" in err


def test_plot_without_matplotlib_is_a_clear_error(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    trace = write_trace(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 10, "output_length": 1,
                                                 "hash_ids": [1]}])
    rc, _, err = run_main(capsys, "--trace", trace, "--plot", str(tmp_path / "p.png"))
    assert rc == 2 and "pip install 'kvrt[plot]'" in err


def test_plot_is_written(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "hit.png"
    rc, out, _ = run_main(capsys, "--limit", "150", "--capacity-blocks", "1000", "4000", "--plot", str(png))
    assert rc == 0 and png.stat().st_size > 1000 and "plot written" in out


def test_evict_scaling_section(capsys):
    rc, out, _ = run_main(capsys, "--limit", "50", "--evict-scaling", "--evict-sizes", "2000", "8000", "--json")
    assert rc == 0
    rows = json.loads(out)["evict_scaling"]
    assert [r["cached_blocks"] for r in rows] == [2000, 8000]
    assert all(r["drop_us_per_block"] > 0 and r["swap_us_per_block"] > 0 for r in rows)


@pytest.mark.e2e
def test_kvrt_dispatches_to_the_benchmark():
    r = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "cache", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--capacity-blocks" in r.stdout and "--evict-scaling" in r.stdout


def test_kv_layouts_share_one_memory(capsys, tmp_path):
    """--kv: each layout gets the pages the same memory holds (FP8: twice the blocks; Gemma-3's
    layer groups: 26/4 pages of 4 layers per all-full block), a grouped model holds more blocks
    of tokens and hands a decode node fewer bytes per request than its all-full counterpart."""
    rows = [{"timestamp": 0, "input_length": 8200 + 80 * (i % 5), "output_length": 5,
             "hash_ids": list(range(i % 3 * 100, i % 3 * 100 + 8)) + list(range(1000 + 10 * i, 1009 + 10 * i))}
            for i in range(40)]
    trace = write_trace(tmp_path / "t.jsonl", rows)
    rc, out, err = run_main(capsys, "--trace", trace, "--capacity-blocks", "200", "--eviction", "lru", "--kv",
                            "bf16", "fp8", "gemma3-full", "gemma3", "--json")
    assert rc == 0, err
    got = {r["kv"]: r for r in json.loads(out)["results"]}
    assert [got[k]["device_pages"] for k in ("bf16", "fp8", "gemma3-full", "gemma3")] == [200, 400, 200, 1300]
    assert got["bf16"]["hit_token_rate"] == got["gemma3-full"]["hit_token_rate"]
    assert got["gemma3"]["blocks_held"] > 1.5 * got["gemma3-full"]["blocks_held"]
    assert got["gemma3"]["handoff_mb_per_request"] < got["gemma3-full"]["handoff_mb_per_request"] / 2
    assert got["fp8"]["hit_token_rate"] >= got["bf16"]["hit_token_rate"]
    rc, out, _ = run_main(capsys, "--trace", trace, "--capacity-blocks", "200", "--eviction", "lru", "--kv", "gemma3")
    assert rc == 0 and "blocks held" in out and "gemma3" in out
