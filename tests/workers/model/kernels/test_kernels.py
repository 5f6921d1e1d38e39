"""Each Triton kernel of the torch backend against the float64 reference: the reference model's
own numpy formulas (RMSNorm, SiLU, RoPE as workers/model/hf_model.py computes it) and the
reference paged attention (workers/model/attention.py in float64), over random inputs, block
tables, GQA groups, cached prefixes and padding rows. On a CPU they run under Triton's
interpreter (the kernels lane); on a GPU compiled (.ci/gpu)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.torchkit import triton_device
from kvrt.workers.model.attention import AttnShape, Span, paged_attention, plan_attention

torch, DEVICE = triton_device()
# masked lanes (padding rows, empty stretches) compute NaN that a tl.where then drops; the
# interpreter runs them on NumPy, which warns
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

from kvrt.workers.model.kernels.decode_attention import paged_decode  # noqa: E402
from kvrt.workers.model.kernels.norm import rms_norm  # noqa: E402
from kvrt.workers.model.kernels.plan import block_m_for, num_splits_for, scratch_shapes, tiles  # noqa: E402
from kvrt.workers.model.kernels.prefill_attention import paged_prefill  # noqa: E402
from kvrt.workers.model.kernels.rope_kv import rope_write_kv  # noqa: E402
from kvrt.workers.model.kernels.silu_mul import silu_mul  # noqa: E402

DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}
# activations' dtypes: bfloat16 only compiled (Triton's interpreter computes it wrongly on NumPy)
ACTIVATIONS = ["float16", "float32"] + (["bfloat16"] if DEVICE == "cuda" else [])
U16 = 2.0 ** -11
UNIT = {"float16": U16, "float32": 1e-6, "bfloat16": 2.0 ** -8}


def dev(a: np.ndarray, dtype=None):
    t = torch.from_numpy(np.array(a))  # a copy: a kernel writing into it leaves `a` as it was
    return t.to(DEVICE, dtype) if dtype is not None else t.to(DEVICE)


def host(t) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy()


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("d", [32, 96, 896])
@pytest.mark.parametrize("out_dtype", ACTIVATIONS)
@pytest.mark.parametrize("with_delta", [False, True])
def test_rms_norm_with_the_residual_add(d, out_dtype, with_delta):
    rng = np.random.default_rng(d)
    x = rng.standard_normal((5, d)).astype(np.float32)
    delta = rng.standard_normal((5, d)).astype(np.float16)
    w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    xt, out = dev(x), torch.empty((5, d), dtype=DTYPES[out_dtype], device=DEVICE)
    rms_norm(xt, dev(w), 1e-6, out, dev(delta) if with_delta else None)
    ref_x = x.astype(np.float64) + (delta.astype(np.float64) if with_delta else 0)
    want = ref_x / np.sqrt((ref_x ** 2).mean(-1, keepdims=True) + 1e-6) * w
    assert rel_err(host(xt), ref_x) < 1e-6  # the residual stream, updated in place (float32)
    assert rel_err(host(out), want) < UNIT[out_dtype]


@pytest.mark.parametrize("dtype", ACTIVATIONS)
@pytest.mark.parametrize("m", [64, 1500])
def test_silu_times_up(m, dtype):
    rng = np.random.default_rng(m)
    gu = dev((3 * rng.standard_normal((3, 2 * m))).astype(np.float32), DTYPES[dtype])
    out = torch.empty((3, m), dtype=DTYPES[dtype], device=DEVICE)
    silu_mul(gu, out)
    g, u = host(gu[:, :m]), host(gu[:, m:])
    assert rel_err(host(out), g / (1 + np.exp(-g)) * u) < UNIT[dtype]


def pool_of(rng, blocks: int, layers: int, bs: int, kvh: int, hd: int, dtype: str) -> np.ndarray:
    """A pool full of random K/V; NaN in one block's slots that no sequence may read."""
    pool = rng.standard_normal((blocks, layers, 2, bs, kvh, hd)).astype(dtype)
    pool[-1] = np.nan  # never in a block table: reading it would show
    return pool


def rope_tables(inv_freq: np.ndarray, n: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    ang = np.arange(n, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (np.cos(ang) * scale).astype(np.float32), (np.sin(ang) * scale).astype(np.float32)


@pytest.mark.parametrize("bias, qk_norm", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("pool_dtype", ["float16", "float32"])
@pytest.mark.parametrize("hd", [8, 64])
@pytest.mark.parametrize("qkv_dtype", ACTIVATIONS[::2])
def test_rope_writes_kv_into_the_paged_pool(bias, qk_norm, pool_dtype, hd, qkv_dtype):
    """q rotated and scaled, k rotated and stored, v stored, at each token's slot of layer 1;
    a slot of -1 writes nothing; every other slot of the pool is left as it was."""
    rng = np.random.default_rng(hd)
    h, kvh, t, bs, layers = 4, 2, 6, 4, 3
    width = (h + 2 * kvh) * hd
    qkv_t = dev(rng.standard_normal((t, width)).astype(np.float32), DTYPES[qkv_dtype])
    qkv = host(qkv_t)
    b = (0.5 * rng.standard_normal(width)).astype(np.float32)
    qn, kn = (1 + 0.1 * rng.standard_normal((2, hd))).astype(np.float32)
    inv = 1.0 / 1e4 ** (np.arange(0, hd, 2) / hd)
    cos, sin = rope_tables(inv, 64, 1.3)
    positions = np.array([0, 5, 17, 33, 63, 2], np.int32)
    slots = np.array([3, 9, 0, 22, -1, 14], np.int32)
    pool = rng.standard_normal((6, layers, 2, bs, kvh, hd)).astype(pool_dtype)
    pt, q_out = dev(pool), torch.empty((t, h, hd), dtype=torch.float32, device=DEVICE)
    rope_write_kv(qkv_t, dev(b) if bias else None, dev(qn) if qk_norm else None, dev(kn) if qk_norm else None,
                  1e-6, dev(cos), dev(sin), dev(positions), dev(slots), pt, 1, hd ** -0.5, q_out, h, kvh, hd)
    y = qkv + (b if bias else 0)
    q, k, v = (y[:, :h * hd].reshape(t, h, hd), y[:, h * hd:(h + kvh) * hd].reshape(t, kvh, hd),
               y[:, (h + kvh) * hd:].reshape(t, kvh, hd))
    if qk_norm:
        q = q / np.sqrt((q ** 2).mean(-1, keepdims=True) + 1e-6) * qn
        k = k / np.sqrt((k ** 2).mean(-1, keepdims=True) + 1e-6) * kn
    c = np.concatenate([cos[positions], cos[positions]], -1)[:, None].astype(np.float64)
    s = np.concatenate([-sin[positions], sin[positions]], -1)[:, None].astype(np.float64)

    def rot(x):
        return x * c + np.concatenate([x[..., hd // 2:], x[..., :hd // 2]], -1) * s

    assert rel_err(host(q_out), rot(q) * hd ** -0.5) < 1e-5
    want = pool.astype(np.float64)
    for i, slot in enumerate(slots):
        if slot >= 0:
            want[slot // bs, 1, 0, slot % bs] = rot(k)[i].astype(pool_dtype)
            want[slot // bs, 1, 1, slot % bs] = v[i].astype(pool_dtype)
    got = host(pt)
    tol = U16 if pool_dtype == "float16" else 1e-6
    assert rel_err(got, want) < tol
    untouched = np.ones(pool.shape[:4], bool)
    untouched[slots[slots >= 0] // bs, 1, :, slots[slots >= 0] % bs] = False
    assert np.array_equal(got[untouched], pool.astype(np.float64)[untouched])


def reference_attention(pool: np.ndarray, layer: int, q: np.ndarray, spans: list[Span], h: int, kvh: int,
                        hd: int, bs: int) -> np.ndarray:
    """The reference model's paged attention in float64 over the same pool."""
    plan = plan_attention(spans, AttnShape(h, kvh, hd, bs), np)
    return paged_attention(np, pool, layer, q.astype(np.float64), plan, np.float64)


def random_tables(rng, lens: list[int], bs: int, blocks: int) -> list[np.ndarray]:
    """Disjoint random block tables covering each length (the pool's last block never used)."""
    ids = rng.permutation(blocks - 1)
    out, at = [], 0
    for n in lens:
        k = -(-n // bs)
        out.append(ids[at:at + k].astype(np.int32))
        at += k
    assert at <= len(ids), "the pool is too small for these tables"
    return out


def padded(tables: list[np.ndarray], width: int) -> np.ndarray:
    out = np.zeros((len(tables), width), np.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = t
    return out


@pytest.mark.parametrize("pool_dtype", ["float16", "float32"])
@pytest.mark.parametrize("h, kvh, hd, bs", [(4, 2, 8, 8), (14, 2, 64, 16), (8, 8, 16, 4)])
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_decode_matches_the_reference(pool_dtype, h, kvh, hd, bs, splits):
    """Rows over contexts of 1 to a few hundred keys (every split length, stretches empty and
    full), a padding row with context 0 (output 0), the table's unused width never read."""
    rng = np.random.default_rng(h * hd + bs + splits)
    ctx = [1, 7, 64, 65, 300, 0]
    blocks = sum(-(-max(c, 1) // bs) for c in ctx) + 1
    tables = random_tables(rng, [max(c, 1) for c in ctx], bs, blocks)
    pool = pool_of(rng, blocks, 2, bs, kvh, hd, pool_dtype)
    q = (rng.standard_normal((len(ctx), h, hd)) * hd ** -0.5).astype(np.float32)
    mid_o, mid_ml = (torch.empty(s, dtype=torch.float32, device=DEVICE)
                     for s in scratch_shapes(len(ctx), h, hd, splits))
    out = torch.empty((len(ctx), h * hd), dtype=torch.float32, device=DEVICE)
    width = max(len(t) for t in tables) + 3
    paged_decode(dev(q), dev(pool), 1, dev(padded(tables, width)), dev(np.array(ctx, np.int32)), out, mid_o,
                 mid_ml, splits, h, kvh, hd)
    got = host(out)
    real = [i for i, c in enumerate(ctx) if c]
    spans = [Span(j, 1, ctx[i] - 1, tables[i].astype(np.int64)) for j, i in enumerate(real)]
    want = reference_attention(pool, 1, q[real], spans, h, kvh, hd, bs)
    assert rel_err(got[real], want) < (4 * U16 if pool_dtype == "float16" else 1e-5)
    assert np.all(got[ctx.index(0)] == 0)


def test_split_count_fills_the_gpu_and_stays_bounded():
    assert num_splits_for(1, 2) == 16 and num_splits_for(32, 2) == 4 and num_splits_for(128, 8) == 1
    assert all(1 <= num_splits_for(b, k) <= 16 for b in (1, 3, 64, 1000) for k in (1, 2, 8))


@pytest.mark.parametrize("pool_dtype", ["float16", "float32"])
@pytest.mark.parametrize("h, kvh, hd, bs", [(4, 2, 8, 8), (4, 4, 16, 16)])
def test_paged_prefill_over_cached_prefixes(pool_dtype, h, kvh, hd, bs):
    """A batch mixing a fresh prompt, a chunk over a cached prefix, decode rows and a chunk
    longer than a tile: causal within each chunk, everything before it visible."""
    rng = np.random.default_rng(h + hd)
    seqs = [(0, 37), (21, 9), (50, 1), (0, 1), (3, 70)]  # (start, new tokens)
    blocks = sum(-(-(s + n) // bs) for s, n in seqs) + 1
    tables = random_tables(rng, [s + n for s, n in seqs], bs, blocks)
    pool = pool_of(rng, blocks, 2, bs, kvh, hd, pool_dtype)
    total = sum(n for _, n in seqs)
    q = (rng.standard_normal((total, h, hd)) * hd ** -0.5).astype(np.float32)
    lens = np.array([n for _, n in seqs], np.int32)
    row0 = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
    block_m = block_m_for(int(lens.max()))
    tile_seq, tile_row = tiles(lens, block_m)
    out = torch.empty((total, h * hd), dtype=torch.float32, device=DEVICE)
    paged_prefill(dev(q), dev(pool), 0, dev(padded(tables, max(len(t) for t in tables) + 2)), dev(tile_seq), dev(tile_row), dev(row0),
                  dev(np.array([s for s, _ in seqs], np.int32)), dev(lens), out, block_m, h, kvh, hd)
    spans = [Span(int(r), n, s, t.astype(np.int64)) for r, (s, n), t in zip(row0, seqs, tables)]
    want = reference_attention(pool, 0, q, spans, h, kvh, hd, bs)
    assert rel_err(host(out), want) < (4 * U16 if pool_dtype == "float16" else 1e-5)


def test_tiles_cut_each_sequence_in_block_m_rows():
    seq, row = tiles(np.array([1, 17, 16, 40], np.int32), 16)
    assert seq.tolist() == [0, 1, 1, 2, 3, 3, 3]
    assert row.tolist() == [0, 0, 16, 0, 0, 16, 32]
