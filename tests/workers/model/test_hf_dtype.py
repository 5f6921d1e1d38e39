"""The compute dtype of a checkpoint's forward pass (workers/model/hf_model.py): float16 projections
with float32 accumulation match the independent dense float64 reference (tests/hfkit.py) within
a float16 tolerance and give its greedy tokens; float32 stays exact to 1e-4; BF16 weights are
held as float16 exactly where they fit and refused where they do not; an activation that
overflows float16 fails the step instead of answering garbage; and `auto` resolves as a launch
needs it (float32 on a CPU, the checkpoint's precision on a GPU).

The GPU runs the same checks through tests/workers/model/test_gpu_model.py.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest

from tests.hfkit import (ARCH_CASES, VOCAB, case_config, dense_logits, from_bf16_bits, greedy, grouped,
                         make_checkpoint, paged_pool, to_bf16_bits)
from kvrt.workers.model.checkpoint import CheckpointError, inspect
from kvrt.workers.model.hf_model import HFModel, checkpoint_dtype, resolve_compute_dtype, to_half
from kvrt.workers.model.transformer import SeqInput

BS = 8
ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
U16 = 2.0 ** -11  # float16's unit roundoff
# Float16 tolerance, relative to the row's largest logit: every projection rounds its operand
# and its result to float16 (<= U16 each, relative), the two layers' roundings reach the last
# hidden state damped by the residual stream (float32) and the final RMSNorm, and the LM head
# adds two more; measured <= 3.4 U16 over every architecture and file dtype, so 8 U16 has room
# without hiding a real error (a float32-only bug, e.g. a wrong bias or RoPE, is >= 1e-1).
F16_TOL = 8 * U16


def run_paged(model: HFModel, toks: np.ndarray, chunks, xp=np) -> list[np.ndarray]:
    """Logits after each chunk of one sequence prefilled in uneven chunks then decoded, plus a
    second sequence sharing its first two blocks batched with a decode of the first: the
    logits rows in the order the reference computes them (see `expected`)."""
    pool = paged_pool(model, 64, BS, model.kv_dtype.name, xp)
    table = np.arange(10, 10 + -(-(len(toks) + 1) // BS), dtype=np.int32)
    out, pos = [], 0
    for n in chunks:
        out.append(model.step_logits(pool, grouped(model, [SeqInput(toks[pos:pos + n], pos, table)], 64))[0])
        pos += n
    other = np.concatenate([toks[:2 * BS], np.arange(5) * 7 % VOCAB]).astype(np.int32)
    got = model.step_logits(pool, grouped(model, [SeqInput(np.array([7], np.int32), len(toks), table),
                                                  SeqInput(other[2 * BS:], 2 * BS,
                                                           np.array([*table[:2], 40], np.int32))], 64))
    return out + [got[0], got[1]]


def expected(ck, toks: np.ndarray, chunks) -> list[np.ndarray]:
    want = dense_logits(ck, toks)
    ends = np.cumsum(chunks) - 1
    other = np.concatenate([toks[:2 * BS], np.arange(5) * 7 % VOCAB]).astype(np.int32)
    return [want[e] for e in ends] + [dense_logits(ck, np.concatenate([toks, [7]]))[-1], dense_logits(ck, other)[-1]]


def within(got: np.ndarray, want: np.ndarray, tol: float) -> float:
    """The error relative to the row's largest logit; AssertionError above `tol`."""
    err = float(np.abs(got - want).max() / np.abs(want).max())
    assert err <= tol, f"logits off by {err:.2e} of the largest logit (tolerance {tol:.2e})"
    return err


def check_dtype(ck, matmul_dtype: str, kv: str, tol: float, xp=np) -> None:
    chunks = (13, 8, 1, 1, 20)
    toks = np.random.default_rng(1).integers(0, VOCAB, sum(chunks)).astype(np.int32)
    model = HFModel(inspect(ck.path), 512, xp=xp, kv_dtype=kv, matmul_dtype=matmul_dtype)
    for got, want in zip(run_paged(model, toks, chunks, xp), expected(ck, toks, chunks)):
        within(got, want, tol)


@pytest.mark.parametrize("file_dtype", ["F32", "BF16", "F16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_float16_compute_matches_dense_float64(tmp_path, arch, file_dtype):
    ck = make_checkpoint(tmp_path, arch, dtype=file_dtype, tied=arch == "Qwen3ForCausalLM")
    check_dtype(ck, "float16", "float16", F16_TOL)


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_float16_compute_of_each_architecture(tmp_path, case):
    arch, cfg = case_config(case)
    check_dtype(make_checkpoint(tmp_path, arch, dtype="BF16", config=cfg), "float16", "float16", F16_TOL)


def test_float16_compute_over_a_float32_pool(tmp_path):
    """The KV dtype is its own setting: float16 projections over a float32 pool."""
    check_dtype(make_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype="BF16"), "float16", "float32", F16_TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_compute_stays_exact(tmp_path, arch):
    check_dtype(make_checkpoint(tmp_path, arch, dtype="BF16"), "float32", "float32", 1e-4)


def test_float16_weights_are_float16(tmp_path):
    """The point of float16 on a GPU: the projections and the embedding are held in half the
    bytes; norms and biases stay float32."""
    model = HFModel(inspect(make_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype="BF16").path), 512,
                    kv_dtype="float16", matmul_dtype="float16")
    w = model.layers[0]
    assert {a.dtype for a in (model.embed, model.lm_head, w.wqkv, w.wo, w.w_gate_up, w.w_down)} \
        == {np.dtype(np.float16)}
    assert {a.dtype for a in (model.final_norm, w.attn_norm, w.mlp_norm, w.bqkv)} == {np.dtype(np.float32)}


def greedy_paged(model: HFModel, prompt: np.ndarray, new: int) -> list[int]:
    pool = paged_pool(model, 16, BS, model.kv_dtype.name, model.xp)
    table = np.arange(16, dtype=np.int32)
    tok = int(model.step(pool, grouped(model, [SeqInput(prompt, 0, table)], 16))[0])
    out = [tok]
    while len(out) < new:
        seq = SeqInput(np.array([tok], np.int32), len(prompt) + len(out) - 1, table)
        tok = int(model.step(pool, grouped(model, [seq], 16))[0])
        out.append(tok)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_float16_greedy_tokens_equal_the_reference(tmp_path, arch):
    check_greedy(make_checkpoint(tmp_path, arch, dtype="BF16", seed=3))


def check_greedy(ck, xp=np) -> None:
    """Greedy decoding in float16 answers the float64 reference's tokens. Mostly not luck: up
    to the first position whose top-2 gap is within twice the tolerance, no float16 error
    within it could flip the argmax, and that covers two thirds of the positions at least."""
    model = HFModel(inspect(ck.path), 512, xp=xp, kv_dtype="float16", matmul_dtype="float16")
    rng = np.random.default_rng(5)
    checked = 0
    for _ in range(3):
        prompt = rng.integers(0, VOCAB, int(rng.integers(5, 30))).astype(np.int32)
        want = greedy(ck, prompt, 12)
        logits = dense_logits(ck, np.concatenate([prompt, want]))[len(prompt) - 1:-1]
        top2 = np.sort(logits, axis=-1)[:, -2:]
        gaps = (top2[:, 1] - top2[:, 0]) / np.abs(logits).max(axis=-1)
        safe = int(np.argmin(gaps > 2 * F16_TOL)) if (gaps <= 2 * F16_TOL).any() else len(want)
        got = greedy_paged(model, prompt, 12)
        assert got == want
        checked += safe
    assert checked >= 24, f"only {checked} of 36 positions had a top-2 gap the tolerance cannot flip"


def test_float16_overflow_fails_the_step(tmp_path):
    """MLP activations beyond 65504 become inf in float16 and nan downstream: the step fails
    with a message naming the cure, never an argmax over nan (token 0)."""
    ck = make_checkpoint(tmp_path, "LlamaForCausalLM", dtype="F32", num_hidden_layers=1)
    from tests.hfkit import write_safetensors

    big = {n: ("F32", (w * 3000 if "gate_proj" in n or "up_proj" in n else w).astype(np.float32))
           for n, w in ck.weights.items()}
    write_safetensors(f"{ck.path}/model.safetensors", big)
    model = HFModel(inspect(ck.path), 512, matmul_dtype="float16")
    pool = np.zeros(model.shape.kv_layout(BS, "float32").pool_shape(4), np.float32)
    with pytest.raises(ValueError, match="compute-dtype float32"), np.errstate(over="ignore", invalid="ignore"):
        model.step(pool, [SeqInput(np.arange(9, dtype=np.int32), 0, np.arange(2, dtype=np.int32))])
    ok = HFModel(inspect(ck.path), 512, matmul_dtype="float32")
    with np.errstate(over="ignore"):  # exp(-gate) of a very negative gate is inf: silu is 0 there
        logits = ok.step_logits(pool, [SeqInput(np.arange(9, dtype=np.int32), 0, np.arange(2, dtype=np.int32))])
    assert np.isfinite(logits).all()


def test_bf16_to_float16_conversion():
    """BF16 -> float16 (how a GPU holds BF16 weights without a bfloat16 dtype): exact in
    float16's normal range, the nearest float16 below it, refused beyond it."""
    rng = np.random.default_rng(0)
    normal = from_bf16_bits(to_bf16_bits(rng.standard_normal(10_000).astype(np.float32) * 3))
    normal = normal[np.abs(normal) >= 2.0 ** -14]
    assert np.array_equal(to_half("w", normal).astype(np.float32), normal)  # every bit kept
    edge = from_bf16_bits(np.array([0x477F, 0xC77F, 0x3880, 0x0000], np.uint16))  # 65280, -65280, 2**-14, 0
    assert to_half("w", edge).astype(np.float32).tolist() == edge.tolist()
    tiny = np.float32(2.0 ** -20) * np.float32(1.5)
    assert to_half("w", np.array([1.0, tiny], np.float32))[1] == np.float16(tiny)  # a float16 subnormal
    for bad in (70000.0, -1e30, np.inf, np.nan):
        with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.down_proj.weight .*--compute-dtype float32"):
            to_half("model.layers.0.mlp.down_proj.weight", np.array([0.5, bad], np.float32))


def test_a_tensor_below_float16s_range_is_named(caplog):
    """Exact nearly everywhere is not exact everywhere: a tensor whose values sit below 2**-14
    loses bits in float16, and the load says which."""
    small = np.random.default_rng(1).standard_normal(1000).astype(np.float32) * 1e-6
    with caplog.at_level(logging.WARNING, logger="kvrt.workers.model.hf_model"):
        to_half("model.layers.3.self_attn.o_proj.weight", small)
        to_half("fine", small * 1e4)
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 1 and "model.layers.3.self_attn.o_proj.weight" in named[0]


def test_auto_resolves_per_device_and_checkpoint(tmp_path):
    cks = {d: inspect(make_checkpoint(tmp_path / d, dtype=d).path) for d in ("F32", "F16", "BF16")}
    assert {d: checkpoint_dtype(i) for d, i in cks.items()} == {"F32": "float32", "F16": "float16",
                                                                "BF16": "bfloat16"}
    for info in cks.values():
        assert resolve_compute_dtype("auto", "cpu", info) == "float32"  # CPU figures unchanged
        assert resolve_compute_dtype("float16", "cpu", info) == "float16"
        assert resolve_compute_dtype("bfloat16", "cuda", info) == "float16"
        assert resolve_compute_dtype("float32", "cuda", info) == "float32"
    assert [resolve_compute_dtype("auto", "cuda", cks[d]) for d in ("F32", "F16", "BF16")] == \
        ["float32", "float16", "float16"]
    with pytest.raises(ValueError, match="--compute-dtype"):
        resolve_compute_dtype("float64", "cpu", cks["F32"])


def test_checkpoint_dtype_counts_bytes(tmp_path):
    """A BF16 checkpoint with a few float32 tensors (norms kept in full precision) is BF16."""
    ck = make_checkpoint(tmp_path, dtype="BF16")
    from tests.hfkit import write_safetensors

    mixed = {n: ("F32", w.astype(np.float32)) if n.endswith("norm.weight") else ("BF16", to_bf16_bits(w))
             for n, w in ck.weights.items()}
    write_safetensors(f"{ck.path}/model.safetensors", mixed)
    assert checkpoint_dtype(inspect(ck.path)) == "bfloat16"


def test_float16_compute_roots_other_block_keys():
    """Float16 arithmetic computes other KV bytes than float32: two nodes of the same checkpoint
    must not share blocks through a storage tier across that difference. Float32 keys are
    the ones nodes had before the setting existed."""
    from kvrt.runtime.node.config import NodeConfig

    base = dict(node="n", model_dir="/m", model_arch="Qwen2ForCausalLM", model_fingerprint="f", hidden_size=32)
    f32, f16 = NodeConfig(**base).key_root, NodeConfig(**base, compute_dtype="float16").key_root
    assert f32 != f16
    assert f32 == NodeConfig(**base, compute_dtype="float32").key_root
