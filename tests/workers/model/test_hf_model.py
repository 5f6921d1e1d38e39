"""The checkpoint forward pass over the paged pool equals an independent dense float64
reference (tests/hfkit.py) to 1e-4 relative: each architecture (sliding windows, soft caps,
Gemma's norms, experts, fused projections included), tied and untied embeddings, BF16/F16/F32
files, a sharded checkpoint, each supported RoPE type in each config.json form transformers
reads (its own class's output and hand-written transformers 4 configs); chunked prefill,
batched decode and sequences sharing a prefix's blocks; a sliding layer never depends on a
block that left its window."""
from __future__ import annotations

import numpy as np
import pytest

from tests.hfkit import (ARCH_CASES, LLAMA3_SCALING, VOCAB, case_config, dense_logits, grouped, make_checkpoint,
                         paged_pool, transformers_config)
from kvrt.ipc.layout import FP8_E4M3
from kvrt.workers.model.checkpoint import inspect
from kvrt.workers.model.hf_model import HFModel
from kvrt.workers.model.transformer import SeqInput
from tests.gpukit import cuda_cupy

BS = 8
ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


def close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


BLOCKS = 64  # per layer group (tests/hfkit.py `grouped`)


def pool_for(model: HFModel, xp=np):
    return paged_pool(model, BLOCKS, BS, xp=xp)


def step_logits(model: HFModel, pool, seqs: list[SeqInput]) -> np.ndarray:
    return model.step_logits(pool, grouped(model, seqs, BLOCKS))


def check_paged(ck, chunks=(13, 8, 1, 1, 20), xp=np) -> None:
    """Prefill one sequence in uneven chunks and decode, then run a second sequence sharing its
    first two blocks in the same batch as a decode of the first; every step's logits equal the
    dense reference's at that position."""
    model = HFModel(inspect(ck.path), 512, xp=xp)
    pool = pool_for(model, xp=xp)
    rng = np.random.default_rng(1)
    toks = rng.integers(0, VOCAB, sum(chunks)).astype(np.int32)
    want = dense_logits(ck, toks)
    table = np.arange(10, 10 + -(-len(toks) // BS), dtype=np.int32)
    pos = 0
    for n in chunks:
        got = step_logits(model, pool, [SeqInput(toks[pos:pos + n], pos, table)])
        pos += n
        close(got[0], want[pos - 1])
    other = np.concatenate([toks[:2 * BS], rng.integers(0, VOCAB, 5)]).astype(np.int32)
    other_table = np.concatenate([table[:2], [40]]).astype(np.int32)
    more = np.concatenate([toks, [7]]).astype(np.int32)
    big_table = np.concatenate([table, [41]]).astype(np.int32)
    got = step_logits(model, pool, [SeqInput(more[-1:], len(toks), big_table),
                                   SeqInput(other[2 * BS:], 2 * BS, other_table)])
    close(got[0], dense_logits(ck, more)[-1])
    close(got[1], dense_logits(ck, other)[-1])
    got = step_logits(model, pool, [SeqInput(other[:3], 0, np.array([50], np.int32))])[0]
    assert got.argmax() == dense_logits(ck, other[:3])[-1].argmax()


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_paged_logits_equal_dense_reference(tmp_path, arch, tied, dtype):
    check_paged(make_checkpoint(tmp_path, arch, dtype=dtype, tied=tied))


@pytest.mark.parametrize("dtype", ["F32", "BF16"])
@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_each_architecture_paged_equals_dense(tmp_path, case, dtype):
    """Windows of 12 tokens over blocks of 8: the chunks, the decode and the second sequence's
    prefix hit each start or end inside a window."""
    arch, cfg = case_config(case, tied=dtype == "BF16")
    check_paged(make_checkpoint(tmp_path, arch, dtype=dtype, config=cfg))


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_fp8_pages_of_each_architecture(tmp_path, case):
    """FP8 e4m3 pages (`--kv-cache-dtype fp8`), a layer group's own for Gemma's and Qwen's
    sliding layers: a prompt in chunks and decode steps equal the dense reference whose K and V
    ml_dtypes rounds to e4m3 (`kv_rounding`), within what float32 vs float64 moves across a
    rounding boundary of e4m3 (measured <= 1.2e-3 relative), far below what the rounding
    itself changes (>= 1.5e-2: the reference without it is off by that much)."""
    arch, cfg = case_config(case)
    ck = make_checkpoint(tmp_path, arch, config=cfg, seed=7)
    model = HFModel(inspect(ck.path), 512, kv_dtype=FP8_E4M3)
    pool = paged_pool(model, 16, BS, FP8_E4M3)
    toks = np.random.default_rng(1).integers(0, VOCAB, 60).astype(np.int32)
    fp8, plain = dense_logits(ck, toks, "fp8"), dense_logits(ck, toks)
    table = np.arange(8, dtype=np.int32)
    pos, shown = 0, 0.0
    for n in (13, 8, 20, 1, 1, 17):
        got = model.step_logits(pool, grouped(model, [SeqInput(toks[pos:pos + n], pos, table)], 16))[0]
        pos += n
        scale = float(np.abs(fp8[pos - 1]).max())
        assert np.abs(got - fp8[pos - 1]).max() <= 4e-3 * scale, pos
        shown = max(shown, float(np.abs(got - plain[pos - 1]).max()) / scale)
    assert shown > 1e-2, "FP8 must show in the logits"


def test_blocks_that_left_the_window_are_never_used(tmp_path):
    """Mistral slides every layer: once a sequence's blocks have left the window they are
    overwritten with NaN (a freed block can hold anything), and its next steps still equal
    the dense reference."""
    arch, cfg = case_config("mistral")
    ck = make_checkpoint(tmp_path, arch, config=cfg)
    model = HFModel(inspect(ck.path), 512)
    pool = pool_for(model)
    toks = np.random.default_rng(2).integers(0, VOCAB, 60).astype(np.int32)
    table = np.arange(10, 18, dtype=np.int32)
    step_logits(model, pool, [SeqInput(toks[:40], 0, table)])
    pool[table[:(40 - 12 + 1) // BS]] = np.nan  # every slot before position 29, the next query's window
    close(step_logits(model, pool, [SeqInput(toks[40:50], 40, table)])[0], dense_logits(ck, toks[:50])[-1])
    pool[table[:(50 - 12 + 1) // BS]] = np.nan
    close(step_logits(model, pool, [SeqInput(toks[50:51], 50, table)])[0], dense_logits(ck, toks[:51])[-1])


def test_f16_sharded_checkpoint(tmp_path):
    check_paged(make_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype="F16", shards=3))


def test_llama3_rope_scaling(tmp_path):
    """Positions beyond the scaling's original context, where the scaled frequencies matter."""
    ck = make_checkpoint(tmp_path, "LlamaForCausalLM", dtype="BF16", rope_scaling=LLAMA3_SCALING,
                         head_dim=32, num_attention_heads=2, num_key_value_heads=1)
    check_paged(ck, chunks=(40, 40, 1, 1))


# RoPE parameters as a transformers 5 `rope_parameters`; the scalings' original context (64) is
# below the positions check_paged reaches, and max_position_embeddings (512) is 8 times it
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "original_max_position_embeddings": 64}
ROPES = {
    "theta": {"rope_type": "default", "rope_theta": 1e6},  # Qwen2.5 / Qwen3
    "linear": {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0},
    "llama3": {**LLAMA3_SCALING, "rope_theta": 5e5},
    "yarn": YARN,
    "yarn-mscale": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "yarn-attention-factor": {**YARN, "attention_factor": 0.8},
}
NARROW = dict(num_attention_heads=2, num_key_value_heads=1)  # head_dim 16: eight frequencies to scale


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_rope_written_by_transformers(tmp_path, arch, rope):
    """config.json as transformers' own config class writes it (transformers 5: no top-level
    rope_theta or rope_scaling), positions past the scalings' original context."""
    cfg = transformers_config(arch, ROPES[rope], **NARROW)
    assert "rope_theta" not in cfg and "rope_scaling" not in cfg, "transformers 5 writes rope_parameters"
    check_paged(make_checkpoint(tmp_path, arch, dtype="BF16", config=cfg), chunks=(40, 40, 1, 1))


@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_handwritten_transformers4_form(tmp_path, rope):
    """The same parameters in transformers 4's form: top-level rope_theta, and a rope_scaling
    whose type is under the legacy key `type`."""
    params = dict(ROPES[rope])
    theta, kind = params.pop("rope_theta"), params.pop("rope_type")
    scaling = None if kind == "default" else {"type": kind, **params}
    arch = ARCHS[list(ROPES).index(rope) % len(ARCHS)]
    check_paged(make_checkpoint(tmp_path, arch, dtype="BF16", rope_scaling=scaling, rope_theta=theta, **NARROW),
                chunks=(40, 40, 1, 1))


def test_bf16_decoding_is_exact(tmp_path):
    """A BF16 tensor read back is its exact float32 value (bf16 is a float32's top half)."""
    from tests.hfkit import write_safetensors
    from kvrt.workers.model.checkpoint import Weights, read_header

    bits = np.array([0x3F80, 0xC000, 0x0000, 0x7F80, 0x3E20], dtype=np.uint16)  # 1, -2, 0, inf, 0.15625
    write_safetensors(str(tmp_path / "w.safetensors"), {"t": ("BF16", bits)})
    _, tensors = read_header(str(tmp_path / "w.safetensors"))
    info = type("I", (), {"tensors": tensors})()
    got = Weights(info).get("t")
    assert got.dtype == np.float32 and got.tolist() == [1.0, -2.0, 0.0, np.inf, 0.15625]


def test_cupy_matches_dense(tmp_path):
    """The same code path on a GPU (CuPy), where one is present, yarn's scaled cos and sin too."""
    cupy = cuda_cupy()
    for arch in ARCHS:
        check_paged(make_checkpoint(tmp_path / arch, arch, dtype="BF16"), xp=cupy)
    cfg = transformers_config("Qwen2ForCausalLM", ROPES["yarn-mscale"], **NARROW)  # cos and sin scaled on the GPU
    ck = make_checkpoint(tmp_path / "yarn", "Qwen2ForCausalLM", dtype="BF16", config=cfg)
    check_paged(ck, chunks=(40, 40, 1, 1), xp=cupy)


def test_a_step_marks_progress_in_every_layer(tmp_path):
    """The worker's progress mark is called inside a step, after each key tile of attention and
    each layer: a long prefill chunk of a big checkpoint must not look like a hung worker."""
    model = HFModel(inspect(make_checkpoint(tmp_path, num_hidden_layers=3).path), 512)
    beats = []
    model.beat = lambda: beats.append(1)
    step_logits(model, pool_for(model), [SeqInput(np.arange(20, dtype=np.int32), 0, np.arange(3, dtype=np.int32))])
    assert len(beats) == 2 * 3  # per layer: its one key tile of attention, then the layer's end
