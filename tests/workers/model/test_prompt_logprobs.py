"""Prompt logprobs (workers/model/prompt_logprobs.py): every scored row equals a float64 reference
log-softmax of the model's own logits (the target's logprob and rank, the top k with ties by the
lower id), whatever the blocking of rows; through the model, a prompt scored in one chunk or in
many gives the same values at every position, each equal to the dense reference's."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.workers.model import prompt_logprobs as pl
from kvrt.workers.model.transformer import Model, SeqInput
from kvrt.workers.model.prompt_logprobs import PromptQuery, score_prompt
from tests.workers.model.test_transformer import SMALL, make_pool, prompt_of
from tests.gpukit import cuda_cupy


def reference(logits: np.ndarray, targets: np.ndarray, ks: np.ndarray) -> tuple:
    """float64 log-softmax per row, the target's rank, and the top k sorted (ties: lower id)."""
    z = logits.astype(np.float64)
    lsm = z - np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1, keepdims=True)) - z.max(-1, keepdims=True)
    rows = np.arange(len(z))
    lps = lsm[rows, targets]
    ranks = (z > z[rows, targets][:, None]).sum(-1) + 1
    ids, tops = [], []
    for r, k in enumerate(ks):
        order = np.lexsort((np.arange(z.shape[1]), -z[r]))[:k]
        ids += order.tolist()
        tops += lsm[r, order].tolist()
    return lps, ranks, np.array(ids, np.int64), np.array(tops)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(2, 300), st.integers(0, 2**32 - 1), st.integers(1, 5),
       st.sampled_from([np.float32, np.float64]))
def test_scores_equal_the_float64_reference_in_any_blocking(n, vocab, seed, per_block, dtype):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((n, vocab)) * 3).astype(dtype)
    logits[:, rng.integers(0, vocab, 3)] = logits[:, :1]  # ties
    targets = rng.integers(0, vocab, n)
    ks = rng.integers(0, min(vocab, 21) + 1, n)
    want = reference(logits, targets, ks)
    saved = pl.BLOCK_BYTES
    pl.BLOCK_BYTES = per_block * 8 * vocab  # rows per block: per_block
    try:
        got = score_prompt(lambda h: h, logits, PromptQuery(np.arange(n), targets, ks), vocab)
    finally:
        pl.BLOCK_BYTES = saved
    np.testing.assert_allclose(got.logprobs, want[0], rtol=0, atol=1e-12)
    assert got.ranks.tolist() == want[1].tolist()
    assert got.top_ids.tolist() == want[2].tolist()
    np.testing.assert_allclose(got.top_logprobs, want[3], rtol=0, atol=1e-12)


def test_no_rows_and_no_alternatives():
    z = np.zeros((3, 8))
    got = score_prompt(lambda h: h, z, PromptQuery(np.arange(0), np.arange(0), np.arange(0)), 8)
    assert got.logprobs.shape == got.ranks.shape == got.top_ids.shape == (0,)
    got = score_prompt(lambda h: h, z, PromptQuery(np.arange(3), np.array([1, 2, 3]), np.zeros(3, np.int64)), 8)
    np.testing.assert_allclose(got.logprobs, -np.log(8))
    assert got.ranks.tolist() == [1, 1, 1] and len(got.top_ids) == 0


def prompt_scores(model: Model, prompt: np.ndarray, chunks: list[int], k: int, block_size: int = 4) -> tuple:
    """Prefill `prompt` in `chunks` as the engine does: each chunk's rows scored against the
    token after them (the next chunk's first included), the last prompt position not scored."""
    pool = make_pool(model.shape, 32, block_size, dtype=model.kv_dtype.name)
    table = np.arange(-(-len(prompt) // block_size), dtype=np.int32)
    lps, ranks, ids, tops, pos = [], [], [], [], 0
    for c in chunks:
        n = min(c, len(prompt) - 1 - pos)
        q = PromptQuery(np.arange(n), prompt[pos + 1:pos + 1 + n].astype(np.int64), np.full(n, k))
        _, s = model.step_outputs(pool, [SeqInput(prompt[pos:pos + c], pos, table)], q)
        lps += s.logprobs.tolist()
        ranks += s.ranks.tolist()
        ids += s.top_ids.tolist()
        tops += s.top_logprobs.tolist()
        pos += c
    assert pos == len(prompt)
    return np.array(lps), ranks, ids, np.array(tops)


@pytest.mark.parametrize("chunks", [[37], [1, 36], [5, 8, 4, 20], [12, 12, 12, 1]])
def test_a_prompt_scores_the_same_in_one_chunk_or_many(chunks):
    model = Model(SMALL)
    prompt = prompt_of(np.random.default_rng(4), 37, SMALL.vocab_size)
    dense = model.dense_logits(prompt)[:-1]
    want = reference(dense, prompt[1:], np.full(len(prompt) - 1, 3))
    one = prompt_scores(model, prompt, [37], 3)
    got = prompt_scores(model, prompt, chunks, 3)
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-9)
    np.testing.assert_allclose(got[0], one[0], rtol=0, atol=1e-10)
    assert got[1] == one[1] == want[1].tolist()
    assert got[2] == one[2] == want[2].tolist()
    np.testing.assert_allclose(got[3], want[3], rtol=0, atol=1e-9)


def test_rows_outside_the_step_are_refused():
    model = Model(SMALL)
    pool = make_pool(SMALL, 4, 4)
    seq = SeqInput(np.arange(3, dtype=np.int32), 0, np.arange(1, dtype=np.int32))
    with pytest.raises(ValueError, match="rows"):
        model.step_outputs(pool, [seq], PromptQuery(np.array([3]), np.array([1]), np.array([0])))
    with pytest.raises(ValueError, match="targets"):
        model.step_outputs(pool, [seq], PromptQuery(np.array([0]), np.array([SMALL.vocab_size]), np.array([0])))


def test_cupy_scores_equal_numpys():
    """The same scores from logits on a GPU (skipped without CUDA)."""
    cupy = cuda_cupy()
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((300, 5000)) * 3).astype(np.float32)
    query = PromptQuery(np.arange(300), rng.integers(0, 5000, 300), rng.integers(0, 21, 300))
    want = score_prompt(lambda h: h, logits, query, 5000)
    got = score_prompt(lambda h: h, cupy.asarray(logits), query, 5000, cupy)
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-9)
    assert got.ranks.tolist() == want.ranks.tolist() and got.top_ids.tolist() == want.top_ids.tolist()
    np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, rtol=0, atol=1e-9)
    model, ref = Model(SMALL, xp=cupy), Model(SMALL)
    prompt = prompt_of(rng, 37, SMALL.vocab_size)
    pool = make_pool(SMALL, 32, 4, xp=cupy)
    q = PromptQuery(np.arange(36), prompt[1:].astype(np.int64), np.full(36, 3))
    _, s = model.step_outputs(pool, [SeqInput(prompt, 0, np.arange(10, dtype=np.int32))], q)
    np.testing.assert_allclose(s.logprobs, reference(ref.dense_logits(prompt)[:-1], prompt[1:], q.ks)[0],
                               rtol=0, atol=1e-9)


def test_the_worker_reads_the_batchs_prompt_rows():
    """Sequence i's first prompt_rows[i] rows, at its offset in the flattened tokens, each
    with its target and its sequence's alternatives; fields that disagree fail the step."""
    from kvrt.ipc import protocol as P
    from kvrt.workers.worker import Worker

    def batch(rows, targets, top):
        return P.StepBatch(1, np.zeros(10, np.int32), np.array([4, 1, 5], np.int32), np.zeros(3, np.int32),
                           np.zeros(3, np.int32), np.ones(3, np.int32), prompt_rows=np.array(rows, np.int32),
                           prompt_targets=np.array(targets, np.int32), prompt_top=np.array(top, np.int32))

    assert Worker._prompt_query(P.StepBatch(1, *(np.zeros(0, np.int32),) * 5)) is None
    q = Worker._prompt_query(batch([3, 0, 2], [7, 8, 9, 10, 11], [2, 0, 5]))
    assert q.rows.tolist() == [0, 1, 2, 5, 6] and q.targets.tolist() == [7, 8, 9, 10, 11]
    assert q.ks.tolist() == [2, 2, 2, 5, 5]
    for bad in (([3, 0], [7, 8, 9], [2, 0]), ([3, 0, 2], [7, 8], [2, 0, 5]), ([5, 0, 0], [1] * 5, [0, 0, 0]),
                ([1, 0, 0], [1], [65, 0, 0])):
        with pytest.raises(ValueError, match="prompt logprob"):
            Worker._prompt_query(batch(*bad))


def test_a_checkpoint_scores_its_prompt_as_its_own_logits_say(tmp_path):
    """Through a checkpoint's model (float32 logits), chunked: the float64 log-softmax of the
    logits the same model computes for the whole prompt at once."""
    from kvrt.workers.model.checkpoint import inspect
    from kvrt.workers.model.hf_model import HFModel
    from tests.hfkit import VOCAB, make_checkpoint

    model = HFModel(inspect(make_checkpoint(tmp_path, "Qwen2ForCausalLM").path), 512)
    prompt = np.random.default_rng(5).integers(0, VOCAB, 29).astype(np.int32)
    got = prompt_scores(model, prompt, [11, 11, 7], 4, block_size=8)
    want = reference(model.dense_logits(prompt)[:-1], prompt[1:], np.full(28, 4))
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-4)
    np.testing.assert_allclose(got[3], want[3], rtol=0, atol=1e-4)
