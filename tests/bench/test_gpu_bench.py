"""The GPU script's benchmarks at a tiny scale on a CPU, through the real CLI: `kvrt bench model
--backend torch` and `kvrt bench throughput` print the documented JSON, and `gpu_report` records
steps and reads every goal's figure from them (a missing one says so). No timing is asserted;
speed belongs to the benchmarks' output. The benchmarks skip without torch (the kernels lane
runs them; the GPU script, `.ci/gpu`, in full)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO
from kvrt.bench import gpu_report
from kvrt.bench.throughput import workload


def kvrt(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrt.launcher", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.e2e
def test_bench_model_torch_json():
    pytest.importorskip("torch")
    proc = kvrt("bench", "model", "--backend", "torch", "--shape", "small", "--batches", "1,2", "--contexts", "16",
                "--decode-steps", "1", "--prompt-len", "20", "--prefill-repeats", "1", "--compute-dtype", "bfloat16",
                "--no-transformers", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["meta"]["backend"] == "torch" and out["meta"]["compute_dtype"] == "bfloat16"
    rows = out["rows"]
    assert [(r["kind"], r["batch"], r["context"]) for r in rows] == [("decode", 1, 16), ("decode", 2, 16),
                                                                    ("prefill", 1, 0)]
    for r in rows:
        assert r["eager_ms"] > 0 and r["best_ms"] == r["eager_ms"] and r["floor_ms"] > 0 and r["vs_floor"] > 0
        assert r["graph_ms"] is None  # no CUDA graphs on a CPU, and the row says so
    assert "no CUDA graphs" in rows[0]["note"]


@pytest.mark.e2e
def test_bench_throughput_json():
    pytest.importorskip("torch")
    proc = kvrt("bench", "throughput", "--shape", "small", "--device", "cpu", "--requests", "4", "--min-len", "5",
                "--max-input-len", "20", "--max-output-len", "12", "--max-num-seqs", "4", "--max-num-batched-tokens",
                "128", "--timeout", "120", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    want = workload(4, 5, 20, 12)
    assert out["requests"] == 4 and out["failed"] == 0 and out["unanswered"] == 0
    assert out["output_tokens"] == sum(want.outputs) and out["prompt_tokens"] == sum(map(len, want.prompts))
    assert out["output_tokens_s"] > 0 and out["steps"] > 0


def test_the_workload_is_drawn_in_its_own_order():
    """Prompts first, then output lengths, from one generator seeded 0: the lengths a reader of
    the published workload gets for the same seed."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    outputs = [rng.randint(100, 1024) for _ in range(256)]
    w = workload(256, 100, 1024, 1024)
    assert w.prompts == prompts and w.outputs == outputs
    assert all(100 <= len(p) <= 1024 for p in w.prompts) and all(100 <= n <= 1024 for n in w.outputs)


def test_gpu_report_records_steps_and_reads_the_goals(tmp_path):
    out = str(tmp_path)
    model = {"meta": {}, "rows": [{"kind": "decode", "batch": 32, "context": 128, "vs_gen": 12.5, "vs_floor": 7.0},
                                  {"kind": "decode", "batch": 1, "context": 128, "vs_gen": 9.0},
                                  {"kind": "prefill", "batch": 1, "context": 0, "vs_hf": 2.5}]}
    (tmp_path / "m.json").write_text(json.dumps(model))
    gpu_report.record(out, "bench-model-bfloat16", 0, 12, str(tmp_path / "m.json"))
    (tmp_path / "t.json").write_text(json.dumps({"output_tokens_s": 16000.0}))
    gpu_report.record(out, "throughput", 0, 30, str(tmp_path / "t.json"))
    (tmp_path / "bad.txt").write_text("Traceback: it broke")
    line = gpu_report.record(out, "bench-copy", 1, 3, str(tmp_path / "bad.txt"))
    assert line["result"] is None and "it broke" in line["output"]
    (tmp_path / "gpu-tests.log").write_text("...\n===== 3 failed, 95 passed, 1 error in 120.00s =====\n")
    goals = {g.what: g for g in gpu_report.all_goals(out)}
    assert goals["GPU tests failed or errored"].value == 4 and goals["GPU tests failed or errored"].status == "missed"
    assert goals["decode batch 32, ctx 128, bfloat16: x generate"].status == "met"
    assert goals["decode batch 32, ctx 128, bfloat16: x HBM floor"].status == "missed"
    assert goals["decode batch 1, ctx 128, bfloat16: x generate"].status == "met"
    assert goals["prefill 512 tokens, bfloat16: x one transformers forward"].status == "met"
    assert goals["decode batch 32, ctx 128, float16: x generate"].status == "missing"
    assert goals["nano-vllm workload, output tokens/s"].status == "met"
    assert goals["one-block swap2cpu task p50, us"].status == "missing"  # its step printed no JSON
    table = gpu_report.render(list(goals.values()))
    assert "missing" in table and "16,000.00" in table
