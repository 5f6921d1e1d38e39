"""FP8 e4m3 KV blocks (workers/model/kv_format.py): the encoding and decoding checked byte for
byte against ml_dtypes' float8_e4m3fn (an independent implementation), and the model over an
FP8 pool: its paged greedy answers equal its dense reference's with K and V rounded through
e4m3 exactly as the pool stores them, for the reference model and a checkpoint transformers'
shapes describe, while the logits stay close to float32 KV's."""
from __future__ import annotations

import numpy as np
import pytest

from kvrt.ipc.layout import FP8_E4M3, KVLayout
from kvrt.workers.model.checkpoint import inspect
from kvrt.workers.model.hf_model import HFModel
from kvrt.workers.model.kv_format import E4M3_MAX, KVFormat, e4m3_encode, e4m3_values
from kvrt.workers.model.transformer import Model, SeqInput
from tests.hfkit import VOCAB, dense_logits, make_checkpoint
from tests.workers.model.test_transformer import SMALL, Seq, drive, prompt_of

ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes (the dev extra) is the independent e4m3 oracle")
F8 = ml_dtypes.float8_e4m3fn


def test_every_byte_decodes_as_ml_dtypes_reads_it():
    ref = np.arange(256, dtype=np.uint8).view(F8).astype(np.float64)
    got = e4m3_values()
    assert np.array_equal(got, ref, equal_nan=True) and np.array_equal(np.signbit(got), np.signbit(ref))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_encoding_rounds_to_nearest_even_as_ml_dtypes_does(dtype):
    """Random magnitudes over e4m3's whole range, every representable value, and every midpoint
    between neighbours (the ties): the same byte as ml_dtypes' conversion."""
    rng = np.random.default_rng(0)
    vals = e4m3_values()
    finite = np.sort(vals[np.isfinite(vals)])
    x = np.concatenate([rng.standard_normal(50_000) * 10.0 ** rng.uniform(-5, 2.7, 50_000), finite,
                        (finite[1:] + finite[:-1]) / 2, [0.0, -0.0]]).astype(dtype)
    x = x[np.abs(x) <= E4M3_MAX]
    assert np.array_equal(e4m3_encode(x), x.astype(F8).view(np.uint8))


def test_encoding_saturates_and_keeps_nan():
    """Beyond +-448 (inf too) the largest finite value, as vLLM's quantization clamps; NaN stays
    NaN (a NaN in K or V is a bug the logits must show, not hide)."""
    got = e4m3_encode(np.array([449.0, 1e30, np.inf, -np.inf, -500.0, np.nan]))
    assert got.tolist() == [0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F]
    assert np.isnan(e4m3_values()[0x7F])


def test_an_fp8_block_is_half_a_float16_one_and_its_pool_says_so():
    f16 = KVLayout.of_node(3, 16, 4, 32, "float16", tp=2)
    f8 = KVLayout.of_node(3, 16, 4, 32, FP8_E4M3, tp=2)
    assert f8.block_bytes * 2 == f16.block_bytes and f8.storage_dtype == np.uint8
    pool = np.zeros(f8.pool_shape(5), dtype=f8.storage_dtype)
    assert KVLayout.of_pool_shape(pool.shape, pool.dtype) == f8
    assert f8.differences(f16) == [("dtype", FP8_E4M3, "float16")]


def test_reference_model_over_an_fp8_pool_equals_its_dense_reference():
    """Chunked prefill, batches and decode through the FP8 pool give the dense reference's
    greedy tokens exactly: both attend over the same e4m3-rounded K and V."""
    m = Model(SMALL, kv_dtype=FP8_E4M3)
    rng = np.random.default_rng(4)
    seqs = [Seq(prompt_of(rng, n, SMALL.vocab_size), 6) for n in (45, 12, 30)]
    layout = SMALL.kv_layout(4, FP8_E4M3)
    pool = np.full(layout.pool_shape(64), 0x7F, dtype=layout.storage_dtype)  # NaN: an unwritten read shows
    drive(m, pool, seqs, rng, max_chunk=16)
    for s in seqs:
        assert s.out == m.generate_dense(s.prompt, s.max_new)


def test_fp8_rounding_is_mirrored_by_dense_and_stays_close_to_float32():
    p = prompt_of(np.random.default_rng(0), 40, SMALL.vocab_size)
    a = Model(SMALL, kv_dtype="float32").dense_logits(p)
    b = Model(SMALL, kv_dtype=FP8_E4M3).dense_logits(p)
    assert not np.array_equal(a, b) and np.abs(a - b).max() < 0.1 * np.abs(a).max()


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_checkpoint_over_an_fp8_pool(tmp_path, arch):
    """A checkpoint's paged step over an FP8 pool: chunked prefill then decode give the logits of
    its own dense pass with e4m3-rounded K and V (float32 arithmetic: 1e-4), and stay within a
    few percent of the independent float64 reference with exact K and V (tests/hfkit.py)."""
    ck = make_checkpoint(tmp_path, arch)
    model = HFModel(inspect(ck.path), 512, kv_dtype=FP8_E4M3)
    assert model.kv_dtype.name == FP8_E4M3
    toks = np.random.default_rng(1).integers(0, VOCAB, 37).astype(np.int32)
    bs = 8
    pool = np.full(model.shape.kv_layout(bs, FP8_E4M3).pool_shape(16), 0x7F, dtype=np.uint8)
    table = np.arange(3, 3 + 5, dtype=np.int32)
    got, pos = [], 0
    for n in (13, 20, 4):
        got.append(model.step_logits(pool, [SeqInput(toks[pos:pos + n], pos, table)])[0])
        pos += n
    mine = model.dense_logits(toks)
    ref = dense_logits(ck, toks)
    for row, end in zip(got, (12, 32, 36)):
        scale = np.abs(mine[end]).max()
        assert np.abs(row - mine[end]).max() <= 1e-4 * scale
        assert np.abs(row - ref[end]).max() <= 0.05 * scale


def test_a_pool_of_the_format_is_made_by_its_dtype():
    """`xp.zeros(shape, dtype=fmt)` makes the pool array (numpy reads the format's `dtype`)."""
    assert np.zeros(3, dtype=KVFormat(FP8_E4M3)).dtype == np.uint8
    assert np.zeros(3, dtype=KVFormat("float16")).dtype == np.float16


def test_cupy_encodes_and_attends_fp8_as_numpy_does():
    """The same arithmetic on CuPy: every byte as numpy encodes it (torch's float8_e4m3fn too,
    where torch is installed: the conversion vLLM's FP8 KV uses), and the model over an FP8 pool
    on the GPU answers as its dense reference (skipped without CUDA)."""
    from tests.gpukit import cuda_cupy

    cupy = cuda_cupy()
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(100_000) * 10.0 ** rng.uniform(-5, 2.7, 100_000)).astype(np.float32)
    want = e4m3_encode(x)
    assert np.array_equal(cupy.asnumpy(e4m3_encode(cupy.asarray(x), cupy)), want)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and hasattr(torch, "float8_e4m3fn"):
        inside = np.abs(x) <= E4M3_MAX
        got = torch.from_numpy(x[inside]).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        assert np.array_equal(got, want[inside])
    m = Model(SMALL, xp=cupy, kv_dtype=FP8_E4M3)
    seqs = [Seq(prompt_of(rng, n, SMALL.vocab_size), 5) for n in (33, 9)]
    layout = SMALL.kv_layout(4, FP8_E4M3)
    pool = cupy.full(layout.pool_shape(48), 0x7F, dtype=layout.storage_dtype)
    drive(m, pool, seqs, rng, max_chunk=16)
    for s in seqs:
        assert s.out == Model(SMALL, kv_dtype=FP8_E4M3).generate_dense(s.prompt, s.max_new)
