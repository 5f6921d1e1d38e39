"""`kvrt bench model`: the checkpoint it writes loads with the real loader, and a tiny run
through the real CLI prints the documented JSON structure. No timing is asserted; speed belongs
to the benchmark's output."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest

import kvrt.bench.model as model_bench
from tests.conftest import REPO
from kvrt.workers.checkpoint import inspect


def test_written_checkpoint_loads_with_the_real_loader(tmp_path):
    model_bench.write_checkpoint(str(tmp_path), "small")
    info = inspect(str(tmp_path))
    assert info.config.arch == "Qwen2ForCausalLM" and info.config.tie_word_embeddings
    assert {n: tuple(t.shape) for n, t in info.tensors.items()} == info.config.expected_tensors()
    assert {t.dtype for t in info.tensors.values()} == {"BF16"}


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


@pytest.mark.e2e
def test_cli_small_json_structure():
    proc = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "model", "--shape", "small",
                           "--batches", "1,3", "--prompt-len", "5", "--decode-steps", "2", "--memcpy-mib", "8",
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    meta, rows = out["meta"], out["rows"]
    assert meta["device"] == "cpu" and meta["prompt_len"] == 5 and meta["decode_steps"] == 2
    assert meta["weight_bytes"] > 0 and meta["memcpy_gb_s"] > 0
    assert [(r["phase"], r["batch"]) for r in rows] == [
        ("memcpy", 0), ("prefill", 1), ("decode", 1), ("prefill", 3), ("decode", 3)]
    assert rows[0]["gb_s"] > 0
    for r in rows[1:]:
        assert r["tokens_s"] > 0
    for r in rows[2::2]:
        assert r["tokens"] == 2 * r["batch"]
        assert r["ms_step"] > 0 and r["floor_ms"] > 0
        assert r["vs_floor"] == pytest.approx(r["ms_step"] / r["floor_ms"])


@pytest.mark.e2e
def test_cli_table_and_help():
    proc = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "model", "--shape", "small",
                           "--batches", "2", "--prompt-len", "4", "--decode-steps", "1", "--memcpy-mib", "8"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "vs floor" in proc.stdout and "decode" in proc.stdout
    help_ = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "model", "--help"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0 and "--decode-steps" in help_.stdout and "floor" in help_.stdout


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


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers")
                    is not None, reason="torch and transformers are installed here")
def test_transformers_row_without_torch_is_a_noted_skip(tmp_path):
    row = model_bench.transformers_row(str(tmp_path), 32, 8, 2, 1.0)
    assert row.phase == "transformers decode" and row.batch == 32
    assert row.note.startswith("skipped:") and row.tokens_s is None


@pytest.mark.e2e
def test_cli_float16_compute_holds_half_the_bytes():
    """--compute-dtype float16 (a GPU's default for this BF16 checkpoint) holds the projections
    and the embedding in two bytes, so the decode floor it is measured against halves too."""
    def run(dtype: str) -> dict:
        proc = subprocess.run([sys.executable, "-m", "kvrt.launcher", "bench", "model", "--shape", "small", "--batches", "2",
                               "--prompt-len", "4", "--decode-steps", "1", "--memcpy-mib", "8", "--compute-dtype", dtype,
                               "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["meta"]

    f32, f16 = run("auto"), run("float16")
    assert (f32["compute_dtype"], f16["compute_dtype"]) == ("float32", "float16")
    assert f32["params"] == f16["params"]
    assert f16["weight_bytes"] < 0.6 * f32["weight_bytes"]  # norms stay float32: a little over half
