"""The torch backend's batch checks (workers/model/batch_plan.py) against the reference model's
own (`Model._plan`): the same layout for every valid batch, a refusal for every batch it refuses."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvrt.workers.model.batch_plan import plan_batch
from kvrt.workers.model.transformer import Model, ModelShape, SeqInput

BS, BLOCKS, VOCAB, MAX_LEN = 4, 64, 100, 96
MODEL = Model(ModelShape(vocab_size=VOCAB, max_model_len=MAX_LEN, num_layers=1))


@st.composite
def batches(draw):
    """Sequences with disjoint tables (and sometimes a shared prefix), any chunk lengths."""
    ids = list(draw(st.permutations(range(BLOCKS))))
    seqs, at = [], 0
    for _ in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 40))
        n = draw(st.integers(1, 20))
        need = -(-(start + n) // BS)
        if at + need > BLOCKS:
            break
        table = np.array(ids[at:at + need] + ids[:draw(st.integers(0, 3))], np.int32)  # a few spare ids after
        at += need
        seqs.append(SeqInput(np.array(draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)), np.int32),
                             start, table))
    return seqs


@settings(max_examples=60, deadline=None)
@given(batches())
def test_the_same_layout_as_the_reference(seqs):
    if not seqs:
        return
    try:
        plans, tokens, positions, blocks = MODEL._plan(seqs, BLOCKS, BS)
    except ValueError:
        with pytest.raises(ValueError):
            plan_batch(seqs, BLOCKS, BS, VOCAB, MAX_LEN)
        return
    b = plan_batch(seqs, BLOCKS, BS, VOCAB, MAX_LEN)
    assert np.array_equal(b.tokens, tokens) and np.array_equal(b.positions, positions)
    assert np.array_equal(b.slots, blocks * BS + positions % BS)
    assert b.lens.tolist() == [p.n for p in plans] and b.starts.tolist() == [p.start for p in plans]
    for row, p in zip(b.tables, plans):
        assert row[:len(p.table)].tolist() == p.table.tolist() and not row[len(p.table):].any()


def one(tokens, start, table):
    return SeqInput(np.asarray(tokens), start, np.asarray(table))


@pytest.mark.parametrize("seqs, text", [
    ([one([VOCAB], 0, [0])], "out of range"),
    ([one([-1], 0, [0])], "out of range"),
    ([one(np.array([], np.int32), 0, [0])], "non-empty"),
    ([one(np.array([1.0]), 0, [0])], "integer"),
    ([one([1], -1, [0])], "outside"),
    ([one([1], MAX_LEN, list(range(MAX_LEN // BS + 1)))], "outside"),
    ([one([1, 2, 3, 4, 5], 0, [0])], "needs|need"),
    ([one([1], 0, [BLOCKS])], "outside"),
    ([one([1] * 5, 0, [3, 3])], "repeats"),
    ([one([1], 0, [[0]])], "1-D"),
    ([one([1], 0, [2]), one([1], 0, [2])], "same pool slot"),
])
def test_every_refusal_of_the_reference(seqs, text):
    with pytest.raises(ValueError):
        MODEL._plan(seqs, BLOCKS, BS)
    with pytest.raises(ValueError, match=text):
        plan_batch(seqs, BLOCKS, BS, VOCAB, MAX_LEN)
