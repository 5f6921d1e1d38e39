"""A model whose layers form groups (ipc/layout.py LayerGroups: full attention and sliding
windows) over the paged pool, a page per group: greedy answers equal the dense reference's
(which applies each layer's window to the whole sequence), while the toy scheduler below frees
every sliding page its window has left and poisons it with NaN, as the prefix cache lets
another request take it (runtime/cache/groups.py). A sliding layer that read a freed page, or a
group that wrote another's page, would show as a wrong token."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrt.ipc.layout import FP8_E4M3, LayerGroups
from kvrt.workers.model.transformer import WARM_UP_BLOCKS, Model, ModelShape, SeqInput, warm_up_steps
from tests.workers.model.test_transformer import Seq, prompt_of

SHAPE = dict(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=128, mlp_dim=64,
             max_model_len=256, seed=5)


def poison(pool, page: int) -> None:
    pool[page] = 0x7F if pool.dtype == np.uint8 else np.nan


def drive_groups(m: Model, pool, seqs: list[Seq], rng: np.random.Generator, max_chunk: int) -> int:
    """`drive` of test_transformer with a table per layer group; sliding pages of groups after
    the first leave the table (-1, back to the free list, poisoned) once no later query of the
    sequence reads them. Returns the pages freed that way."""
    bs = pool.shape[3]
    groups = m.shape.groups
    free = [int(b) for b in rng.permutation(pool.shape[0])]
    for b in free:
        poison(pool, b)
    tables = {id(s): [[] for _ in groups.windows] for s in seqs}
    freed = 0
    while not all(s.finished for s in seqs):
        live = [s for s in seqs if not s.finished]
        picked = [s for s in live if rng.random() < 0.7] or [live[0]]
        batch = []
        for s in picked:
            n = int(rng.integers(1, max_chunk + 1)) if s.computed < len(s.prompt) else 1
            toks = s.tokens[s.computed:s.computed + n]
            if s.computed < len(s.prompt):
                toks = toks[:len(s.prompt) - s.computed]
            ts = tables[id(s)]
            while len(ts[0]) * bs < s.computed + len(toks):
                for t in ts:
                    t.append(free.pop())
            batch.append(SeqInput(toks, s.computed, np.array(ts[0], np.int32),
                                  tuple(np.array(t, np.int32) for t in ts[1:])))
        nxt = m.step(pool, batch)
        for s, inp, tok in zip(picked, batch, nxt):
            s.computed += len(inp.tokens)
            if s.computed == len(s.tokens):
                s.out.append(int(tok))
            for g, t in enumerate(tables[id(s)]):
                w = groups.windows[g]
                if g and w and not s.finished:  # (group 0's pages are the prefix cache's tree: kept)
                    for i in range(max(0, (s.computed - w + 1) // bs)):
                        if t[i] >= 0:
                            poison(pool, t[i])
                            free.append(t[i])
                            t[i] = -1
                            freed += 1
    return freed


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), windows=st.sampled_from([(0, 6, 0, 6), (5, 0, 5, 5), (0, 9, 9, 9), (7, 7, 7, 7)]),
       bs=st.sampled_from([2, 4]), max_chunk=st.integers(1, 12), nseq=st.integers(1, 3))
def test_grouped_paged_equals_dense(seed, windows, bs, max_chunk, nseq):
    m = Model(ModelShape(**SHAPE, layer_windows=windows))
    rng = np.random.default_rng(seed)
    seqs = [Seq(prompt_of(rng, int(rng.integers(1, 40)), 128), int(rng.integers(1, 8))) for _ in range(nseq)]
    pool = np.empty(m.shape.kv_layout(bs, "float32").pool_shape(len(m.shape.groups.windows) * 90), np.float32)
    drive_groups(m, pool, seqs, rng, max_chunk)
    for s in seqs:
        assert s.out == m.generate_dense(s.prompt, s.max_new)


def test_sliding_pages_are_freed_and_the_window_changes_the_answers():
    """A long prompt over a narrow window frees most sliding pages, and the window is real:
    the same weights with every layer full answer otherwise."""
    windows = (0, 4, 4, 4)
    m = Model(ModelShape(**SHAPE, layer_windows=windows))
    assert m.shape.groups == LayerGroups((0, 4, 4, 4), ((0,), (1,), (2,), (3,)), 1)
    rng = np.random.default_rng(1)
    seqs = [Seq(prompt_of(rng, 60, 128), 12)]
    pool = np.empty(m.shape.kv_layout(4, "float32").pool_shape(4 * 20), np.float32)
    freed = drive_groups(m, pool, seqs, rng, max_chunk=8)
    assert freed >= 3 * (60 // 4 - 2)
    assert seqs[0].out == m.generate_dense(seqs[0].prompt, 12)
    assert seqs[0].out != Model(ModelShape(**SHAPE)).generate_dense(seqs[0].prompt, 12)


def test_grouped_fp8_pool():
    m = Model(ModelShape(**SHAPE, layer_windows=(0, 6, 0, 6)), kv_dtype=FP8_E4M3)
    rng = np.random.default_rng(2)
    seqs = [Seq(prompt_of(rng, n, 128), 5) for n in (30, 17)]
    layout = m.shape.kv_layout(4, FP8_E4M3)
    pool = np.empty(layout.pool_shape(2 * 40), layout.storage_dtype)
    drive_groups(m, pool, seqs, rng, max_chunk=8)
    for s in seqs:
        assert s.out == m.generate_dense(s.prompt, s.max_new)


def test_a_group_table_that_misses_a_page_its_window_reads_is_refused():
    m = Model(ModelShape(**SHAPE, layer_windows=(0, 4, 0, 4)))
    pool = np.zeros(m.shape.kv_layout(2, "float32").pool_shape(20), np.float32)
    seq = SeqInput(np.array([1], np.int32), 6, np.arange(4, dtype=np.int32), (np.array([-1, -1, 9, -1], np.int32),))
    with pytest.raises(ValueError, match="group 1"):
        m.step(pool, [seq])
    with pytest.raises(ValueError, match="group tables"):
        m.step(pool, [SeqInput(np.array([1], np.int32), 0, np.arange(1, dtype=np.int32))])


@pytest.mark.parametrize("bs", [1, 4])
def test_warm_up_steps_give_every_group_its_tables(bs):
    """A GPU worker's warm-up steps (`warm_up_steps`, which compile CuPy's kernels before the
    worker says ready) are valid steps of a model of layer groups, each group over pages of
    its own: a step without the group tables is refused, so the warm-up would compile nothing."""
    m = Model(ModelShape(**SHAPE, layer_windows=(0, 6, 0, 6)))
    groups = len(m.shape.groups.windows)
    pool = np.zeros(m.shape.kv_layout(bs, "float32").pool_shape(WARM_UP_BLOCKS * groups), np.float32)
    for seqs, _ in warm_up_steps(bs, SHAPE["max_model_len"], groups):
        assert np.isfinite(m.step_logits(pool, seqs)).all()
