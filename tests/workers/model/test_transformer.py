"""The worker's model (workers/model/transformer.py): greedy outputs through the paged pool must equal the
cache-free dense reference exactly, whatever the chunking, block tables and batch mates."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrt.ipc.config import NodeConfig
from kvrt.workers.model.transformer import Model, ModelShape, SeqInput
from tests.gpukit import cuda_cupy

SMALL = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128,
                   mlp_dim=64, max_model_len=256, seed=3)


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(ModelShape())


@pytest.fixture(scope="module")
def small() -> Model:
    return Model(SMALL)


def make_pool(shape: ModelShape, num_blocks: int, block_size: int, dtype: str = "float32",
              fill: float = np.nan, xp=np):
    """A device pool as the node lays it out; NaN-filled so reading an unwritten slot poisons
    the logits instead of passing silently."""
    return xp.full((num_blocks, shape.num_layers, 2, block_size, shape.num_kv_heads, shape.head_dim),
                   fill, dtype=dtype)


def prompt_of(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, n).astype(np.int32)


@dataclass
class Seq:
    """One request of the toy scheduler below."""

    prompt: np.ndarray
    max_new: int
    table: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose KV is in the pool
    out: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> np.ndarray:
        return np.concatenate([self.prompt, np.array(self.out, dtype=np.int32)])

    @property
    def finished(self) -> bool:
        return len(self.out) >= self.max_new


def next_input(seq: Seq, chunk: int, free: list[int], bs: int) -> SeqInput:
    """Schedule up to `chunk` prompt tokens (or the last output token), growing the block
    table from the shuffled free list."""
    toks = seq.tokens[seq.computed:seq.computed + (chunk if seq.computed < len(seq.prompt) else 1)]
    if seq.computed < len(seq.prompt):
        toks = toks[:len(seq.prompt) - seq.computed]
    while len(seq.table) * bs < seq.computed + len(toks):
        seq.table.append(free.pop())
    return SeqInput(toks, seq.computed, np.array(seq.table, dtype=np.int32))


def drive(m: Model, pool, seqs: list[Seq], rng: np.random.Generator, max_chunk: int,
          free: list[int] | None = None) -> None:
    """A toy scheduler: every step, a random subset of the unfinished seqs advances by a random
    prefill chunk or one decode token, all in one batch; blocks come from a shuffled free list."""
    bs = pool.shape[3]
    if free is None:
        free = [int(b) for b in rng.permutation(pool.shape[0])]
    while not all(s.finished for s in seqs):
        live = [s for s in seqs if not s.finished]
        picked = [s for s in live if rng.random() < 0.7] or [live[0]]
        batch = [next_input(s, int(rng.integers(1, max_chunk + 1)), free, bs) for s in picked]
        nxt = m.step(pool, batch)
        assert nxt.dtype == np.int32 and nxt.shape == (len(batch),)
        for s, inp, tok in zip(picked, batch, nxt):
            s.computed += len(inp.tokens)
            if s.computed == len(s.tokens):
                s.out.append(int(tok))


# ---- exactness ----

@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), bs=st.sampled_from([4, 16]), nseq=st.integers(1, 4),
       max_chunk=st.integers(1, 24))
def test_paged_chunked_equals_dense(small, seed, bs, nseq, max_chunk):
    rng = np.random.default_rng(seed)
    seqs = [Seq(prompt_of(rng, int(rng.integers(1, 40)), SMALL.vocab_size), int(rng.integers(1, 7)))
            for _ in range(nseq)]
    pool = make_pool(SMALL, 4 * 12 + 8, bs)
    drive(small, pool, seqs, rng, max_chunk)
    for s in seqs:
        assert s.out == small.generate_dense(s.prompt, s.max_new)


@pytest.mark.parametrize("bs", [4, 16])
def test_default_shape_long_prompts_interleaved(model, bs):
    rng = np.random.default_rng(bs)
    seqs = [Seq(prompt_of(rng, n, 512), k) for n, k in ((150, 6), (33, 10), (97, 4))]
    pool = make_pool(model.shape, 100, bs)
    drive(model, pool, seqs, rng, max_chunk=64)
    for s in seqs:
        assert s.out == model.generate_dense(s.prompt, s.max_new)


@pytest.mark.parametrize("kind", ["gqa", "float16"])
def test_variants_gqa_and_half_pool(kind):
    shape = ModelShape(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16, vocab_size=256,
                       mlp_dim=64, seed=11) if kind == "gqa" else SMALL
    dtype = "float16" if kind == "float16" else "float32"
    m = Model(shape, kv_dtype=dtype)
    rng = np.random.default_rng(5)
    seqs = [Seq(prompt_of(rng, n, shape.vocab_size), 5) for n in (45, 12)]
    pool = make_pool(shape, 40, 4, dtype)
    drive(m, pool, seqs, rng, max_chunk=16)
    for s in seqs:
        assert s.out == m.generate_dense(s.prompt, s.max_new)


def test_float16_rounding_is_mirrored_by_dense():
    """The dense reference really rounds K/V through kv_dtype: float16 and float32 models with
    the same weights give different (but each self-consistent) logits."""
    p = prompt_of(np.random.default_rng(0), 40, SMALL.vocab_size)
    a = Model(SMALL, kv_dtype="float32").dense_logits(p)
    b = Model(SMALL, kv_dtype="float16").dense_logits(p)
    assert not np.array_equal(a, b) and np.allclose(a, b, atol=0.1)


def test_shared_prefix_reuses_blocks(model):
    bs = 4
    rng = np.random.default_rng(7)
    common = prompt_of(rng, 37, 512)
    a = Seq(np.concatenate([common, prompt_of(rng, 9, 512)]), 8)
    b = Seq(np.concatenate([common, prompt_of(rng, 5, 512)]), 8)
    pool = make_pool(model.shape, 64, bs)
    free = [int(x) for x in rng.permutation(64)]
    a.max_new = 3
    drive(model, pool, [a], rng, max_chunk=10, free=free)
    shared = len(common) // bs  # full blocks of the common prefix
    b.table = list(a.table[:shared])
    b.computed = shared * bs
    before = pool[b.table].copy()
    a.max_new = 8
    drive(model, pool, [a, b], rng, max_chunk=10, free=free)  # a decodes while b prefills
    assert b.table[:shared] == a.table[:shared]
    assert np.array_equal(pool[b.table[:shared]], before, equal_nan=True)  # shared blocks untouched
    assert a.out == model.generate_dense(a.prompt, 8)
    assert b.out == model.generate_dense(b.prompt, 8)


def test_moved_block_same_output_corrupted_block_differs(model):
    """The model really reads the pool through the block table: a block copied to another id
    (a swap out and back in) changes nothing; overwriting it changes the output."""
    bs, rng = 16, np.random.default_rng(9)
    seq = Seq(prompt_of(rng, 70, 512), 1)
    pool = make_pool(model.shape, 16, bs)
    free = [int(x) for x in rng.permutation(16)]
    drive(model, pool, [seq], rng, max_chunk=32, free=free)
    snapshot, table0 = pool.copy(), list(seq.table)

    def decode(n: int) -> tuple[list[int], np.ndarray]:
        """n decode steps from the end of the prefill; the tokens and the first step's logits."""
        s = Seq(seq.prompt, 1 + n, list(table0), len(seq.prompt), list(seq.out))
        spare = list(free)
        first = model.step_logits(pool, [next_input(s, 1, spare, bs)])
        s.computed += 1
        s.out.append(int(first[0].argmax()))
        drive(model, pool, [s], rng, max_chunk=1, free=spare)
        return s.out[1:], first

    clean, clean_logits = decode(8)
    assert seq.out + clean == model.generate_dense(seq.prompt, 9)

    pool[:] = snapshot  # move block 2 of the table elsewhere, poison the old copy
    moved_to = free[0]
    pool[moved_to] = pool[table0[2]]
    pool[table0[2]] = np.nan
    table0[2] = moved_to
    free = free[1:]
    assert decode(8)[0] == clean

    pool[:] = snapshot  # overwrite block 1 (positions 16..31) with other K/V values
    table0[2] = seq.table[2]
    pool[table0[1]] = rng.standard_normal(pool[table0[1]].shape).astype(np.float32) * 3
    bad, bad_logits = decode(8)
    assert not np.allclose(bad_logits, clean_logits)
    assert bad != clean


def test_batch_mates_do_not_matter(small):
    """A seq's logits are the same alone and in a batch with others (up to summation order)."""
    rng = np.random.default_rng(2)
    pool = make_pool(SMALL, 32, 4)
    p1, p2 = prompt_of(rng, 21, 128), prompt_of(rng, 13, 128)
    t1, t2 = np.arange(0, 6, dtype=np.int32), np.arange(6, 10, dtype=np.int32)
    both = small.step_logits(pool, [SeqInput(p1, 0, t1), SeqInput(p2, 0, t2)])
    alone = small.step_logits(pool, [SeqInput(p2, 0, t2)])
    np.testing.assert_allclose(both[1], alone[0], rtol=0, atol=1e-10)
    np.testing.assert_allclose(both[0], small.dense_logits(p1)[-1], rtol=0, atol=1e-10)
    assert small.step(pool, []).shape == (0,)


# ---- weights, logits, generation ----

def test_logit_spread_and_top2_gaps(model):
    rng = np.random.default_rng(0)
    logits = np.concatenate([model.dense_logits(prompt_of(rng, 200, 512)) for _ in range(3)])
    assert np.isfinite(logits).all()
    assert logits.std() > 1.0
    top2 = np.sort(logits, axis=1)[:, -2:]
    gaps = top2[:, 1] - top2[:, 0]
    assert gaps.min() > 1e-5            # numerical error is ~1e-13: argmax ties cannot happen
    assert np.median(gaps) > 0.1
    assert (gaps < 1e-3).mean() < 0.01
    # context matters: changing the first token changes the last position's logits
    p = prompt_of(rng, 50, 512)
    q = p.copy()
    q[0] = (q[0] + 1) % 512
    assert np.abs(model.dense_logits(p)[-1] - model.dense_logits(q)[-1]).max() > 1e-3


@pytest.mark.parametrize("bs", [1, 4])
def test_warm_up_is_a_step_of_its_own(small, bs):
    """A GPU worker runs one step before it says ready (CuPy compiles its kernels then, not
    between the first real step's heartbeats): over a scratch pool of its own, so the pools and
    the answers that follow are as if it never ran."""
    rng = np.random.default_rng(4)
    prompt = prompt_of(rng, 11, SMALL.vocab_size)
    pool = make_pool(SMALL, 32, bs)
    before = pool.copy()
    small.warm_up(bs)
    np.testing.assert_array_equal(pool, before)
    seq = Seq(prompt, 5)
    drive(small, pool, [seq], rng, max_chunk=8)
    assert seq.out == small.generate_dense(prompt, 5)


@pytest.mark.parametrize("bs, max_len", [(1, 64), (4, 64), (16, 64), (16, 3)])
def test_warm_up_takes_the_attention_shapes_serving_takes(bs, max_len):
    """CuPy compiles a kernel per dtype and count of dimensions longer than one: the warm-up's
    batches must plan to one and two items, one and several query rows (padded), one and
    several blocks, one and several key tiles, each valid for a model of max_len positions."""
    from kvrt.workers.model.attention import AttnShape, Span, plan_attention
    from kvrt.workers.model.transformer import WARM_UP_BLOCKS, Model, warm_up_steps

    shape = replace(SMALL, max_model_len=max_len)
    model, pool = Model(shape), make_pool(shape, WARM_UP_BLOCKS, bs)
    seen = set()
    for seqs, tiny in warm_up_steps(bs, max_len):
        model._plan(seqs, WARM_UP_BLOCKS, bs)  # valid: raises otherwise
        spans, row = [], 0
        for s in seqs:
            spans.append(Span(row, len(s.tokens), s.start, np.asarray(s.block_table, np.int64)))
            row += len(s.tokens)
        budgets = {"score_budget": 1, "kv_budget": 1} if tiny else {}
        plan = plan_attention(spans, AttnShape(4, 2, 16, bs), np, **budgets)
        for g in plan.groups:
            items, q, blocks = g.rows.shape[0], g.rows.shape[1], g.table.shape[1]
            seen.add((min(items, 2), min(q, 2), min(blocks, 2), min(-(-blocks // g.tile_blocks), 2)))
        model.step_logits(pool, seqs)
    want = {(1, 1, 1, 1), (1, 2, 2, 2), (1, 1, 2, 1), (1, 1, 2, 2), (2, 1, 2, 2), (2, 2, 2, 2)}
    if max_len > bs + 2:  # room for a prompt over two blocks and a row after it
        assert want <= seen, want - seen
    assert {(1, 1, 1, 1)} <= seen


def test_weights_are_seeded():
    p = prompt_of(np.random.default_rng(1), 20, SMALL.vocab_size)
    assert np.array_equal(Model(SMALL).dense_logits(p), Model(SMALL).dense_logits(p))
    other = replace(SMALL, seed=SMALL.seed + 1)
    assert not np.allclose(Model(other).dense_logits(p), Model(SMALL).dense_logits(p))


def test_generate_dense_stops(small):
    p = prompt_of(np.random.default_rng(4), 10, SMALL.vocab_size)
    full = small.generate_dense(p, 6)
    assert len(full) == 6
    assert small.generate_dense(p, 6, eos_token_id=full[2]) == full[:full.index(full[2]) + 1]
    short = Model(replace(SMALL, max_model_len=13))
    assert len(short.generate_dense(p, 6)) == 3
    assert small.generate_dense(p, 0) == []


@pytest.mark.parametrize("windows", [(), (0, 40)])
def test_the_last_positions_logits_alone_are_the_full_forwards_last_row(windows):
    """generate_dense attends only the last layer's last query: the same logits as the full
    forward's last row, past one attention chunk and with a sliding last layer."""
    m = Model(replace(SMALL, max_model_len=700, layer_windows=windows))
    p = prompt_of(np.random.default_rng(5), 600, SMALL.vocab_size)
    last = m.dense_logits(p, last_only=True)
    assert last.shape == (1, SMALL.vocab_size)
    np.testing.assert_allclose(last[0], m.dense_logits(p)[-1], rtol=1e-12, atol=1e-12)


def test_from_config():
    s = ModelShape.from_config(NodeConfig(node="", num_layers=3, num_kv_heads=8, head_dim=16, tp=2))
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (3, 4, 4, 16)
    assert (s.vocab_size, s.max_model_len, s.seed) == (512, 4096, 0)
    s = ModelShape.from_config(NodeConfig(node="", num_layers=1, num_kv_heads=2, head_dim=8, tp=1, vocab_size=100,
                                          max_model_len=64, model_seed=7, dtype="float32"))
    assert (s.vocab_size, s.max_model_len, s.seed, s.num_heads) == (100, 64, 7, 2)
    with pytest.raises(ValueError, match="divide"):
        ModelShape.from_config(NodeConfig(node="", num_layers=1, num_kv_heads=3, head_dim=8, tp=2))


# ---- validation ----

def test_bad_shapes_rejected():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelShape(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="even"):
        ModelShape(head_dim=15)
    with pytest.raises(ValueError, match="num_layers"):
        ModelShape(num_layers=0)


@pytest.mark.parametrize("change, match", [
    ({"num_layers": 3}, "layers is 3"),
    ({"num_kv_heads": 1}, "kv_heads is 1"),
    ({"head_dim": 8}, "head_dim is 8"),
])
def test_pool_mismatch_rejected(small, change, match):
    pool = make_pool(replace(SMALL, **change), 8, 4)
    with pytest.raises(ValueError, match=match):
        small.step(pool, [SeqInput(np.array([1], np.int32), 0, np.array([0], np.int32))])


def test_pool_dtype_and_rank_rejected(small):
    one = [SeqInput(np.array([1], np.int32), 0, np.array([0], np.int32))]
    with pytest.raises(ValueError, match="dtype"):
        small.step(make_pool(SMALL, 8, 4, "float16"), one)
    with pytest.raises(ValueError, match="KV pool must be"):
        small.step(np.zeros((8, 2, 2, 4, 2)), one)


@pytest.mark.parametrize("seq, match", [
    (SeqInput(np.array([1, 128], np.int32), 0, np.arange(4, dtype=np.int32)), "token id 128 out of range"),
    (SeqInput(np.array([-1], np.int32), 0, np.arange(4, dtype=np.int32)), "token id -1 out of range"),
    (SeqInput(np.arange(9, dtype=np.int32), 0, np.arange(2, dtype=np.int32)), "block_table has 2 blocks"),
    (SeqInput(np.array([1], np.int32), 8, np.arange(2, dtype=np.int32)), "block_table has 2 blocks"),
    (SeqInput(np.array([1], np.int32), 0, np.array([8], np.int32)), "outside"),
    (SeqInput(np.array([1], np.int32), 256, np.arange(8, dtype=np.int32)), "max_model_len"),
    (SeqInput(np.array([], np.int32), 0, np.arange(1, dtype=np.int32)), "non-empty"),
    (SeqInput(np.array([1.0]), 0, np.arange(1, dtype=np.int32)), "integers"),
    (SeqInput(np.array([1], np.int32), -1, np.arange(1, dtype=np.int32)), "start"),
    (SeqInput(np.arange(9, dtype=np.int32), 0, np.array([3, 1, 3], np.int32)), "repeats a block id"),
    (SeqInput(np.array([1], np.int32), 0, np.array([0], np.int32)), "same pool slot"),
])
def test_bad_seq_rejected(small, seq, match):
    pool = make_pool(SMALL, 8, 4)
    good = SeqInput(np.array([1], np.int32), 0, np.array([0], np.int32))
    with pytest.raises(ValueError, match=match):
        small.step(pool, [good, seq])
    assert np.isnan(pool).all()  # validation happens before anything is written


def test_dense_validation(small):
    with pytest.raises(ValueError, match="out of range"):
        small.dense_logits(np.array([0, 500]))
    with pytest.raises(ValueError, match="max_model_len"):
        small.dense_logits(np.zeros(257, np.int32))


# ---- GPU ----

def test_cupy_matches_dense():
    cupy = cuda_cupy()
    m, ref = Model(SMALL, xp=cupy), Model(SMALL)
    rng = np.random.default_rng(8)
    seqs = [Seq(prompt_of(rng, n, SMALL.vocab_size), 6) for n in (37, 5, 60)]
    pool = make_pool(SMALL, 48, 4, xp=cupy)
    drive(m, pool, seqs, rng, max_chunk=16)
    for s in seqs:
        assert s.out == m.generate_dense(s.prompt, s.max_new) == ref.generate_dense(s.prompt, s.max_new)


def test_a_gpus_key_tiles_are_bigger_than_a_cpus():
    """On a GPU a key tile is a round of kernel launches, so its tiles hold more (a decode batch
    of 32 over 512 tokens of a 2-KV-head, 64-dim model in one tile); on a CPU they stay
    cache-sized."""
    from kvrt.workers.model.attention import KV_BUDGET, SCORE_BUDGET, AttnShape, Span, plan_attention
    from kvrt.workers.model.transformer import attention_budgets

    assert attention_budgets(np) == (SCORE_BUDGET, KV_BUDGET)
    gpu = attention_budgets(object())
    assert gpu[0] > SCORE_BUDGET and gpu[1] > KV_BUDGET
    spans = [Span(i, 1, 511, np.arange(i * 32, (i + 1) * 32)) for i in range(32)]
    plan = plan_attention(spans, AttnShape(14, 2, 64, 16), np, score_budget=gpu[0], kv_budget=gpu[1])
    assert [g.tile_blocks for g in plan.groups] == [32]
    assert Model(SMALL).attn_budgets == attention_budgets(np)
