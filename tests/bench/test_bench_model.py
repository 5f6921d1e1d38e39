"""`kvrt bench model`: the checkpoint it writes loads with the real loader, and a tiny run
through the real CLI prints the documented JSON structure (phases, roofline, thread settings,
the transformers comparison where torch is installed). No timing is asserted; speed belongs
to the benchmark's output."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest

import kvrt.bench.model as model_bench
from tests.conftest import REPO
from kvrt.workers.model.checkpoint import inspect
from kvrt.workers.model.threads import PARALLEL_ROWS


@pytest.mark.parametrize("shape, arch", [("small", "Qwen2ForCausalLM"), ("small-gemma3", "Gemma3ForCausalLM"),
                                         ("small-moe", "Qwen3MoeForCausalLM")])
def test_written_checkpoint_loads_with_the_real_loader(tmp_path, shape, arch):
    model_bench.write_checkpoint(str(tmp_path), shape)
    info = inspect(str(tmp_path))
    assert info.config.arch == arch and info.config.tie_word_embeddings == (shape != "small-moe")
    assert {n: tuple(t.shape) for n, t in info.tensors.items()} == info.config.expected_tensors()
    assert {t.dtype for t in info.tensors.values()} == {"BF16"}


def test_gemma3_1b_shape_reads_as_gemma3_1b():
    """Gemma 3 1B: 1.0 B parameters, five sliding layers of 512 tokens to each full one."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(model_bench.SHAPES["gemma3-1b"], f)
        from kvrt.workers.model.checkpoint import parse_config

        c = parse_config(d)
    params = sum(math.prod(s) for s in c.expected_tensors().values())
    assert 0.99e9 < params < 1.01e9
    assert c.features.windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))


def test_written_checkpoint_carries_the_format_transformers_checks(tmp_path):
    """The transformers comparison on a GPU loads this file: it reads the safetensors metadata
    `save_pretrained` writes, and some versions refuse (or fail on) a file without it."""
    from safetensors import safe_open

    model_bench.write_checkpoint(str(tmp_path), "small")
    with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
        assert f.metadata() == {"format": "pt"}


def test_default_shape_is_qwen2_5_0_5b():
    """Writing 1 GB is the benchmark's job, not a unit test's: the shape it would write."""
    s = model_bench.SHAPES["0.5b"]
    assert (s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"], s["num_key_value_heads"],
            s["intermediate_size"], s["vocab_size"]) == (896, 24, 14, 2, 4864, 151936)


QUICK = ["--shape", "small", "--batches", "1,3", "--contexts", "16", "--decode-steps", "2", "--prompt-len", "20",
         "--sample-batch", "2", "--memcpy-mib", "8", "--peak-n", "64"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "model", *QUICK, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.e2e
def test_cli_small_json_structure():
    proc = run_cli("--threads", "1,auto", "--no-transformers", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    meta, rows = out["meta"], out["rows"]
    assert meta["device"] == "cpu" and meta["prompt_len"] == 20 and meta["decode_steps"] == 2
    assert meta["weight_bytes"] > 0 and meta["memcpy_gb_s"] > 0 and "--no-transformers" in meta["transformers"]
    cores = meta["cores"]
    assert [(r["kind"], r["threads"]) for r in rows[:2]] == [("memcpy", "-"), ("peak", "1")]
    assert rows[0]["gb_s"] > 0 and all(r["gflop_s"] > 0 for r in rows if r["kind"] == "peak")
    steps = [r for r in rows if r["kind"] not in ("memcpy", "peak")]
    per_setting = [("decode", 1, 16), ("decode", 3, 16), ("prefill", 1, 0), ("sampled", 2, 16)]
    assert [(r["kind"], r["batch"], r["context"], r["threads"]) for r in steps] == \
        [(*k, t) for k in per_setting for t in ("1", "auto")]
    for r in steps:
        assert r["load"] == "quiet" and r["ms"] > 0 and r["tokens_s"] > 0
        if r["threads"] == "1" or r["tokens"] < PARALLEL_ROWS:
            assert r["blas_threads"] == 1
        assert 1 <= r["blas_threads"] <= cores  # auto: fewer where other processes hold cores
        assert set(r["phases_ms"]) >= {"projections", "attention", "lm_head", "sampling", "other"}
        assert sum(r["phases_ms"].values()) == pytest.approx(r["ms"], rel=1e-6) == pytest.approx(r["phased_ms"])
        assert r["graph_ms"] is None  # a GPU's
        assert r["roof_ms"] == max(r["mem_ms"], r["flop_ms"]) > 0
        assert r["vs_roof"] == pytest.approx(r["ms"] / r["roof_ms"])
        assert r["hf_ms"] is None and r["vs_hf"] is None and r["gen_ms"] is None
        assert r["tokens"] == (20 * r["batch"] if r["kind"] == "prefill" else r["batch"])
    for r in steps:
        if r["kind"] == "sampled":
            assert r["vs_greedy"] == pytest.approx(r["ms"] / r["greedy_ms"])
        else:
            assert "--no-transformers" in r["note"]


@pytest.mark.e2e
@pytest.mark.parametrize("shape", ["small-gemma3", "small-moe"])
def test_cli_other_architectures(shape):
    """The toys of Gemma 3 (sliding layers) and Qwen3-MoE run through the same grid."""
    proc = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "model", *QUICK, "--shape", shape,
                           "--no-transformers", "--json", "--batches", "2", "--sample-batch", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["meta"]["arch"] in ("Gemma3ForCausalLM", "Qwen3MoeForCausalLM")
    steps = [r for r in out["rows"] if r["kind"] in ("decode", "prefill")]
    assert [r["kind"] for r in steps] == ["decode", "prefill"] and all(r["ms"] > 0 and r["roof_ms"] > 0 for r in steps)


@pytest.mark.e2e
def test_cli_counts_array_operations_without_a_gpu():
    """--count-ops counts on NumPy; with --device cuda, a GPU's bigger key tiles make a decode
    batch's attention fewer operations (one tile), and no GPU is needed for that."""
    rows = {}
    for device in ("cpu", "cuda"):
        proc = run_cli("--count-ops", "--device", device, "--compute-dtype", "float32", "--batches", "1,8",
                       "--contexts", "16,64", "--json")
        assert proc.returncode == 0, proc.stderr
        rows[device] = json.loads(proc.stdout)["rows"]
        assert [(r["kind"], r["batch"], r["context"]) for r in rows[device]] == \
            [("decode", 1, 16), ("decode", 8, 16), ("decode", 1, 64), ("decode", 8, 64), ("prefill", 1, 0)]
        for r in rows[device]:
            assert r["ops_per_layer"] > 0 and r["ops_per_step"] >= r["ops_per_layer"] and r["top"]
    assert all(g["ops_per_layer"] <= c["ops_per_layer"] for g, c in zip(rows["cuda"], rows["cpu"]))


@pytest.mark.e2e
def test_cli_table_busy_rows_and_help():
    proc = run_cli("--threads", "1,2", "--busy", "1", "--no-transformers", "--prefill-batches", "",
                   "--sample-batch", "0", "--batches", "2")
    assert proc.returncode == 0, proc.stderr
    assert "vs roof" in proc.stdout and "kvrt/hf" in proc.stdout and "busy 1" in proc.stdout
    assert "threads decode batch 2 ctx 16 (busy 1): 2 threads / 1 =" in proc.stdout
    help_ = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "model", "--help"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0 and "--contexts" in help_.stdout and "roofline" in help_.stdout


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None,
                    reason="torch and transformers are not installed here")
def test_cli_transformers_side_by_side():
    proc = run_cli("--batches", "2", "--sample-batch", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["meta"]["transformers"].startswith("transformers ")
    steps = [r for r in out["rows"] if r["kind"] in ("decode", "prefill")]
    assert [r["kind"] for r in steps] == ["decode", "prefill"]
    for r in steps:
        assert r["hf_ms"] > 0 and r["vs_hf"] == pytest.approx(r["hf_ms"] / r["ms"])
    assert steps[0]["gen_ms"] >= 0 and steps[0]["vs_gen"] == pytest.approx(steps[0]["gen_ms"] / steps[0]["ms"])
    assert steps[1]["gen_ms"] is None


def test_without_torch_the_comparison_says_why(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    hf = model_bench.Transformers(str(tmp_path), "cpu", "float32")
    assert hf.model is None and hf.why.startswith("transformers skipped:")


def test_step_cost_counts_weights_kv_and_causal_attention():
    lim = model_bench.Limits(gb_s=1.0, gflop_s={1: 1.0}, step_bytes=1000, layer_matmul_params=10, head_params=3,
                             attn_width=2, kv_token_bytes=4)
    # one decode over 5 tokens of KV, one 3-token prompt
    nbytes, flops = lim.cost([(5, 1), (0, 3)])
    assert nbytes == 1000 + 4 * (6 + 3)
    pairs = 1 * 5 + 1 + (1 + 2 + 3)  # each query sees the keys before it and itself
    assert flops == 2 * 10 * 4 + 2 * 3 * 2 + 4 * 2 * pairs
    row = model_bench.Row("decode", blas_threads=1, ms=1.0)
    lim.roofline(row, [(5, 1)])
    assert row.roof_ms == max(row.mem_ms, row.flop_ms) and row.vs_roof == pytest.approx(1.0 / row.roof_ms)


def test_step_cost_counts_a_sliding_layer_within_its_window():
    """Two layers, one sliding over 4 tokens: its KV read and its attention pairs stop at the
    window; the full layer's are as before."""
    full = model_bench.Limits(gb_s=1.0, gflop_s={1: 1.0}, step_bytes=0, layer_matmul_params=0, head_params=0,
                              attn_width=2, kv_token_bytes=4, windows=(0, 0))
    half = model_bench.Limits(gb_s=1.0, gflop_s={1: 1.0}, step_bytes=0, layer_matmul_params=0, head_params=0,
                              attn_width=2, kv_token_bytes=4, windows=(0, 4))
    seqs = [(10, 1), (0, 6)]  # a decode after 10 tokens, a 6-token prompt
    assert full.cost(seqs) == ((11 + 6) * 4, 4 * 2 * (11 + 21))
    # per layer: 2 bytes a token, width 1; the sliding layer reads 4 keys of the decode (7..10)
    # and all 6 of the prompt, and its prompt's queries see 1, 2, 3, 4, 4, 4 keys
    assert half.cost(seqs) == ((11 + 6) * 2 + (4 + 6) * 2, 4 * (11 + 21) + 4 * (4 + 18))


def test_limits_of_experts_count_the_experts_each_token_needs(tmp_path):
    """A Qwen3-MoE toy: per token, the top 2 of its 8 experts (and the router) are multiplied;
    a step reads at least those 2 of each layer."""
    from kvrt.workers.model.hf_model import HFModel

    model_bench.write_checkpoint(str(tmp_path), "small-moe")
    model = HFModel(inspect(str(tmp_path)), 256)
    lim = model_bench.model_limits(model, 1.0, {1: 1.0})
    attention = sum(int(w.wqkv.size) + int(w.wo.size) for w in model.layers)
    expert = 3 * 64 * 32  # gate, up and down of hidden 64, width 32
    assert lim.layer_matmul_params == attention + 2 * (2 * expert + 64 * 8)
    # untied: a step reads its tokens' embedding rows, not the embedding
    assert lim.step_bytes == model_bench.weight_bytes(model) - model.embed.nbytes - 2 * 6 * expert * 4
    assert lim.windows == (0, 0)


def test_thread_summary_compares_two_threads_with_one():
    rows = [model_bench.Row("decode", t, "quiet", 8, 128, ms=ms) for t, ms in (("1", 10.0), ("2", 12.0), ("auto", 10.0))]
    [line] = model_bench.thread_summary(rows)
    assert "2 threads / 1 = 1.20" in line and "auto / best of 1 and 2 = 1.00" in line


@pytest.mark.e2e
def test_busy_processes_are_gone_after_the_block():
    with model_bench.Busy(2) as busy:
        assert all(p.poll() is None for p in busy.procs) and len(busy.procs) == 2
    assert all(p.returncode is not None for p in busy.procs)


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        model_bench.main(["--batches", "0"])
    assert "must be positive" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_cuda_without_cupy_is_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        model_bench.main(["--device", "cuda", "--shape", "small"])
    assert "CuPy" in capsys.readouterr().err


def test_cuda_without_a_usable_gpu_is_a_clear_error(monkeypatch, capsys):
    """CuPy imports but CUDA does not answer (no driver, no device): one line before anything
    is written, as `kvrt bench copy --device cuda` says it, not a traceback from the first array."""

    class CUDARuntimeError(RuntimeError):
        pass

    def no_driver() -> int:
        raise CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    fake = types.ModuleType("cupy")
    fake.cuda = SimpleNamespace(runtime=SimpleNamespace(getDeviceCount=no_driver))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    written = []
    monkeypatch.setattr(model_bench, "write_checkpoint", lambda *a: written.append(a))
    with pytest.raises(SystemExit) as e:
        model_bench.main(["--device", "cuda", "--shape", "small"])
    assert e.value.code == 2 and not written
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.e2e
def test_cli_float16_compute_holds_half_the_bytes():
    """--compute-dtype float16 (a GPU's default for this BF16 checkpoint) holds the projections
    and the embedding in two bytes, so the decode floor it is measured against halves too."""
    def run(dtype: str) -> dict:
        proc = run_cli("--batches", "2", "--threads", "1", "--prefill-batches", "", "--sample-batch", "0",
                       "--no-transformers", "--compute-dtype", dtype, "--json")
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["meta"]

    f32, f16 = run("auto"), run("float16")
    assert (f32["compute_dtype"], f16["compute_dtype"]) == ("float32", "float16")
    assert f32["params"] == f16["params"]
    assert f16["weight_bytes"] < 0.6 * f32["weight_bytes"]  # norms stay float32: a little over half


@pytest.mark.e2e
def test_cli_kv_drift_json_structure():
    """--kv-drift: a row per architecture and KV format, the baseline agreeing with itself."""
    proc = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "model", "--kv-drift", "--drift-prompts", "1",
                           "--drift-tokens", "3", "--json"], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    assert [(r["arch"], r["kv"]) for r in rows] == [(a, k) for a in ("LlamaForCausalLM", "Qwen2ForCausalLM",
                                                                      "Qwen3ForCausalLM")
                                                   for k in ("bfloat16", "float16", "fp8", "fp8 token scale")]
    for r in rows:
        assert 0 <= r["agreement"] <= 1 and 0 <= r["mean_kl"] <= r["max_kl"] and r["tokens"] == 3
        if r["kv"] == "bfloat16":
            assert r["agreement"] == 1 and r["identical"] == 1 and r["max_kl"] == 0
        else:
            assert r["max_kl"] > 0


@pytest.mark.e2e
def test_cli_fp8_and_layer_groups_rows():
    """A Gemma 3 toy's five sliding layers to one full one run over layer groups (the windows
    from its config.json, as a node takes them) and FP8 blocks."""
    proc = run_cli("--threads", "1", "--no-transformers", "--json", "--kv-cache-dtype", "fp8",
                   "--shape", "small-gemma3")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["meta"]["kv_dtype"] == "float8_e4m3fn" and out["meta"]["layer_windows"] == [16] * 5 + [0]
    assert all(r["ms"] > 0 for r in out["rows"] if r["kind"] not in ("memcpy", "peak"))
