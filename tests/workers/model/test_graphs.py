"""Decode graphs' bookkeeping (workers/model/graphs.py) on a CPU, with a recording stand-in for
torch.cuda.CUDAGraph: which bucket a batch replays, what the static buffers hold at each replay
(the step's rows, then padding rows that write nothing and attend to nothing), which steps stay
eager, the capture budget, and that replayed steps give the eager steps' logits and tokens
(the K/V they write included). The real graphs run in tests/workers/model/test_gpu_torch.py."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvrt.workers.model.graphs import BUCKETS, bucket_for, buckets_up_to


def test_buckets():
    assert buckets_up_to(8) == [1, 2, 4, 8]
    assert buckets_up_to(100) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 100]
    assert buckets_up_to(0) == []
    assert [bucket_for(n, [1, 2, 4, 8]) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert list(BUCKETS) == sorted(BUCKETS)


class Recording:
    """A graph maker that records: capture runs the body once (as a capture would record it)
    and keeps its output; a replay runs it again over whatever the static buffers hold and
    writes the result into that same output, noting the buffers' contents first."""

    def __init__(self) -> None:
        self.captures: list[int] = []
        self.replays: list[dict] = []
        self.static = None

    def capture(self, body):
        out = body()
        self.captures.append(int(out.shape[0]))
        return _Fake(self, body, out)


class _Fake:
    def __init__(self, owner: Recording, body, out) -> None:
        self.owner, self.body, self.output = owner, body, out

    def replay(self) -> None:
        st, b = self.owner.static, int(self.output.shape[0])
        packed = st.packed.numpy().copy()
        self.owner.replays.append(dict(bucket=b, tokens=packed[:b].copy(), positions=packed[b:2 * b].copy(),
                                       slots=packed[2 * b:3 * b].copy(), context=packed[3 * b:4 * b].copy(),
                                       tables=st.tables.numpy()[:b].copy()))
        self.output.copy_(self.body())


@pytest.fixture
def setup(tmp_path):
    from tests.torchkit import torch_device

    torch, device = torch_device()
    if device != "cpu":
        pytest.skip("the recording stand-in runs the CPU op set")
    from tests.hfkit import make_checkpoint
    from tests.workers.model.test_torch_backend import torch_model

    ck = make_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype="BF16")
    model = torch_model(ck, "float32")
    pool = np.zeros(model.shape.kv_layout(4, "float32").pool_shape(80), np.float32)
    rec = Recording()
    report = model.capture_graphs(pool, 8, math.inf, maker=rec)
    rec.static = model.graphs.static
    return model, pool, rec, report


def _prefill(model, pool, n_seqs: int, rng) -> tuple[list, list]:
    """n_seqs prompts of different lengths, prefilled (eager) into their own blocks."""
    from kvrt.workers.model.transformer import SeqInput

    tables, last = [], []
    for i in range(n_seqs):
        table = np.arange(i * 8, (i + 1) * 8, dtype=np.int32)[::-1].copy()  # not in order: a real table
        prompt = rng.integers(0, 256, 3 + 2 * i).astype(np.int32)
        tables.append(table)
        last.append((int(model.step(pool, [SeqInput(prompt, 0, table)])[0]), len(prompt)))
    return tables, last


def test_capture_and_replay_bookkeeping(setup):
    from kvrt.workers.model.transformer import SeqInput

    model, pool, rec, report = setup
    assert report.captured == [1, 2, 4, 8] and not report.skipped and rec.captures == [1, 2, 4, 8]
    rng = np.random.default_rng(0)
    tables, state = _prefill(model, pool, 5, rng)
    eager_pool = pool.copy()
    eager_state = list(state)
    for step in range(3):
        seqs = [SeqInput(np.array([tok], np.int32), pos, tables[i]) for i, (tok, pos) in enumerate(state)]
        logits = model.step_logits(pool, seqs)
        eseqs = [SeqInput(np.array([tok], np.int32), pos, tables[i]) for i, (tok, pos) in enumerate(eager_state)]
        want = model.step_outputs(eager_pool, eseqs, graphs=False)[0]
        assert np.allclose(logits, want, atol=1e-5, rtol=1e-5)
        r = rec.replays[-1]
        assert r["bucket"] == 8 and len(rec.replays) == step + 1
        assert r["tokens"][:5].tolist() == [t for t, _ in state] and not r["tokens"][5:].any()
        assert r["positions"][:5].tolist() == [p for _, p in state] and not r["positions"][5:].any()
        want_slots = [int(tables[i][p // 4]) * 4 + p % 4 for i, (_, p) in enumerate(state)]
        assert r["slots"][:5].tolist() == want_slots and (r["slots"][5:] == -1).all()
        assert r["context"][:5].tolist() == [p + 1 for _, p in state] and not r["context"][5:].any()
        for i, (_, p) in enumerate(state):
            n = p // 4 + 1
            assert r["tables"][i, :n].tolist() == tables[i][:n].tolist()
        state = [(int(t), p + 1) for t, (_, p) in zip(logits.argmax(-1), state)]
        eager_state = [(int(t), p + 1) for t, (_, p) in zip(want.argmax(-1), eager_state)]
    assert np.allclose(pool, eager_pool, atol=1e-6)  # the K/V the replays wrote: the eager steps'


def test_what_stays_eager(setup):
    from kvrt.workers.model.prompt_logprobs import PromptQuery
    from kvrt.workers.model.transformer import SeqInput

    model, pool, rec, _ = setup
    rng = np.random.default_rng(1)
    tables, state = _prefill(model, pool, 8, rng)
    more = np.arange(8 * 8, 9 * 8, dtype=np.int32)
    model.step(pool, [SeqInput(np.array([1, 2, 3], np.int32), 0, more)])
    assert rec.replays == []  # prefill steps run eager
    nine = [SeqInput(np.array([t], np.int32), p, tables[i]) for i, (t, p) in enumerate(state)]
    nine.append(SeqInput(np.array([4], np.int32), 3, more))
    model.step(pool, nine)
    assert rec.replays == []  # above the largest bucket
    one = [SeqInput(np.array([state[0][0]], np.int32), state[0][1], tables[0])]
    model.step_outputs(pool, one, PromptQuery(np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64)))
    assert rec.replays == []  # prompt scores need the hidden states
    other = np.zeros_like(pool)
    model.step(other, [SeqInput(np.array([1], np.int32), 0, np.arange(2, dtype=np.int32))])
    assert rec.replays == []  # another pool than the one captured over
    model.step(pool, one)
    assert [r["bucket"] for r in rec.replays] == [1]


def test_the_capture_budget_bounds_start_up(tmp_path):
    from tests.torchkit import torch_device

    torch, device = torch_device()
    if device != "cpu":
        pytest.skip("the recording stand-in runs the CPU op set")
    from tests.hfkit import make_checkpoint
    from tests.workers.model.test_torch_backend import torch_model

    model = torch_model(make_checkpoint(tmp_path, "LlamaForCausalLM", dtype="F32"), "float32")
    pool = np.zeros(model.shape.kv_layout(4, "float32").pool_shape(8), np.float32)
    rec = Recording()
    report = model.capture_graphs(pool, 16, -1.0, maker=rec)
    assert report.captured == [] and report.skipped == [1, 2, 4, 8, 16] and rec.captures == []
    with pytest.raises(ValueError, match="tp 1"):
        model.model.allreduce = lambda a: a
        model.capture_graphs(pool, 4, math.inf, maker=rec)
