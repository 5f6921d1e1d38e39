"""`kvrt bench sampler` on a tiny vocabulary: the JSON it promises, one row per batch and case,
and per batch and guided case, with the grammar figures."""
from __future__ import annotations

import json

import pytest

from kvrt.bench import sampler as bench
from kvrt.launcher import BENCHES


@pytest.mark.e2e  # the grammar figures come from a compile process, as a node's do
def test_bench_sampler_json_has_every_case_of_every_batch(capsys, monkeypatch):
    monkeypatch.setattr(bench, "BANDWIDTH_BYTES", 1 << 20)  # the real probe reads 256 MiB
    assert BENCHES["sampler"][0] == "kvrt.bench.sampler"
    assert bench.main(["--vocab", "300", "--batches", "1,3", "--repeat", "1", "--naive-repeat", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["vocab"] == 300 and out["bandwidth_gb_s"] > 0
    rows = out["rows"]
    assert [(r["batch"], r["case"]) for r in rows] == [(b, c) for b in (1, 3) for c in bench.CASES]
    for r in rows:
        assert r["kvrt_ms"] > 0 and r["greedy_ms"] > 0 and r["limit_ms"] > 0
        assert r["kvrt_vs_greedy"] == r["kvrt_ms"] / r["greedy_ms"]
        assert r["naive_ms"] > 0 and (r["torch_ms"] is None or r["torch_ms"] > 0)
        assert (r["nucleus_tokens"] is None) == ("top_p" not in bench.CASES[r["case"]][1])
    guided = out["guided"]
    assert [(g["batch"], g["case"]) for g in guided] == [(b, c) for b in (1, 3) for c in bench.GUIDED_CASES]
    for g in guided:
        assert g["masked_vs_unmasked"] == g["masked_ms"] / g["unmasked_ms"] > 0
    grammar = out["grammar"]
    assert grammar["compile_json_schema_s"] > 0 and grammar["compile_json_object_s"] > 0
    assert grammar["walk_tokens"] > 0 and grammar["state_and_mask_us_per_token"] > 0
    assert grammar["index_mib"] > 0 and grammar["index_read_s"] > 0


@pytest.mark.e2e
def test_bench_sampler_table(capsys, monkeypatch):
    monkeypatch.setattr(bench, "BANDWIDTH_BYTES", 1 << 20)
    assert bench.main(["--vocab", "100", "--batches", "2", "--repeat", "1", "--naive-repeat", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "kvrt ms" in lines[1] and "masked x" in lines[2 + len(bench.CASES) + 2]
    assert lines[-1].startswith("grammar over a synthetic 100-token")
    assert len(lines) == 2 + len(bench.CASES) + 3 + len(bench.GUIDED_CASES) + 1
    assert bench.main(["--vocab", "100", "--batches", "2", "--repeat", "1", "--naive-repeat", "1", "--no-guided"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2 + len(bench.CASES)
