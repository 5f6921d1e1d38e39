"""Prompt logprobs through the engine: the scheduler gives a request that scores its prompt no
prefix-cache hits (while it still scores: cached blocks have no logits) yet caches its blocks
for others; the step batch asks every prompt row with the token after it as its target (a
chunk's last row included), scores are kept once across a preemption; and through a real node
the answers equal a float64 log-softmax of the dense reference model's logits, alone or with
the prompt chunked differently by its batch mates, with a cached prefix or without."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from kvrt.ipc import protocol as P
from kvrt.ipc.config import NodeConfig
from kvrt.runtime.cache.prefix_cache import PrefixCache
from kvrt.runtime.engine.intake import validate
from kvrt.runtime.engine.scheduler import Scheduler
from kvrt.runtime.engine.sequence import Sequence
from kvrt.runtime.engine.step_runner import _prompt_rows, _prompt_scores
from kvrt.runtime.client.api import FinishedEvent, TokenEvent
from tests.conftest import leftovers
from tests.launched import SMALL, launched, oracle
from tests.runtime.engine.test_sampling import Socket, request

BS = 4


def make(rid: str, prompt: np.ndarray, k: int | None) -> Sequence:
    return Sequence.new(rid, prompt, 2, BS, prompt_logprobs=k)


def answer(step) -> tuple[P.StepResult, P.StepBatch]:
    """A worker's answer with made-up scores: row r of a sequence scored as -(position + 1)."""
    batch = P.StepBatch(step.step_id, np.zeros(0, np.int32), np.array(step.chunks, np.int32),
                        np.array(step.starts, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))
    _prompt_rows(batch, step)
    lps, ranks, ids, tops = [], [], [], []
    for i, n in enumerate(batch.prompt_rows.tolist() if len(batch.prompt_rows) else [0] * len(step.seqs)):
        for r in range(n):
            pos = step.starts[i] + r + 1
            lps.append(-float(pos))
            ranks.append(pos)
            k = int(batch.prompt_top[i])
            ids += list(range(k))
            tops += [-0.5] * k
    return P.StepResult(step.step_id, 0, np.full(len(step.seqs), 7, np.int32), prompt_logprobs=lps,
                        prompt_ranks=np.array(ranks, np.int32), prompt_top_ids=np.array(ids, np.int32),
                        prompt_top_logprobs=tops), batch


def run(s: Scheduler, limit: int = 100) -> list:
    batches = []
    for _ in range(limit):
        step = s.schedule()
        if step is None:
            return batches
        res, batch = answer(step)
        batches.append((step, batch))
        assert _prompt_scores(step, res) == ""
        s.finish_step(step, res.tokens)
    return batches


def test_a_scoring_request_takes_no_hits_but_caches_its_blocks_and_scores_every_position():
    cache = PrefixCache(BS, 64)
    s = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=8)
    prompt = np.arange(10, 40, dtype=np.int32)
    plain = make("plain", prompt, None)
    s.add(plain)
    run(s)
    scorer = make("scorer", prompt, 2)
    s.add(scorer)
    batches = run(s)
    assert scorer.cached == (0, 0, 0) and scorer.computed_prompt_tokens == 30
    for step, batch in batches:  # every chunk's rows, its last included, against the next prompt token
        if len(batch.prompt_rows):
            start, n = step.starts[0], int(batch.prompt_rows[0])
            assert batch.prompt_targets.tolist() == prompt[start + 1:start + 1 + n].tolist()
    assert scorer.prompt_lps == [-float(p) for p in range(1, 30)] and scorer.prompt_ranks == list(range(1, 30))
    assert scorer.prompt_top == [[[0, 1], [-0.5, -0.5]]] * 29
    assert not scorer.scores_prompt and scorer.reads_cache
    after = make("after", prompt, None)
    s.add(after)
    run(s)
    assert sum(after.cached) == 28, "the scorer's blocks (and the plain one's) serve later requests"
    cache.check()


def test_scores_are_kept_once_across_a_preemption():
    seq = make("p", np.arange(20, dtype=np.int32), 0)
    seq.add_prompt_scores(0, [-1.0, -2.0, -3.0], [1, 2, 3], None)
    assert seq.prompt_rows(0, 8) == 8 and seq.prompt_rows(16, 8) == 3
    seq.add_prompt_scores(0, [-9.0] * 8, [9] * 8, None)  # run again from 0: the first three stay
    assert seq.prompt_lps == [-1.0, -2.0, -3.0] + [-9.0] * 5 and len(seq.prompt_ranks) == 8
    with pytest.raises(ValueError, match="gap"):
        seq.add_prompt_scores(12, [-1.0], [1], None)
    assert make("q", np.arange(20, dtype=np.int32), None).prompt_rows(0, 8) == 0


def test_a_wrong_sized_answer_fails_the_step():
    s = Scheduler(PrefixCache(BS, 64), max_num_seqs=4, max_num_batched_tokens=8)
    s.add(make("w", np.arange(12, dtype=np.int32), 1))
    step = s.schedule()
    res, _ = answer(step)
    res.prompt_logprobs = res.prompt_logprobs[:-1]
    assert "prompt rows" in _prompt_scores(step, res)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "3"])
def test_bad_prompt_logprobs_are_refused_at_intake(value):
    problem = validate(request("r", [1, 2, 3], 4, prompt_logprobs=value), NodeConfig(node="x"))
    assert problem.startswith("prompt_logprobs"), problem


def reference(prompt: np.ndarray, k: int) -> tuple:
    z = oracle().dense_logits(prompt.astype(np.int32))[:-1]
    lsm = z - z.max(-1, keepdims=True)
    lsm = lsm - np.log(np.exp(lsm).sum(-1, keepdims=True))
    at = np.arange(len(z))
    best = [np.lexsort((np.arange(z.shape[1]), -row))[:k] for row in z]
    return (lsm[at, prompt[1:]], (z > z[at, prompt[1:]][:, None]).sum(-1) + 1,
            [[b.tolist(), lsm[i, b].tolist()] for i, b in enumerate(best)])


def check(ev, want) -> None:
    np.testing.assert_allclose(ev.prompt_logprobs, want[0], rtol=0, atol=1e-9)
    assert list(ev.prompt_ranks) == want[1].tolist()
    assert [t[0] for t in ev.prompt_top] == [t[0] for t in want[2]]
    np.testing.assert_allclose([t[1] for t in ev.prompt_top], [t[1] for t in want[2]], rtol=0, atol=1e-9)


@pytest.mark.e2e
def test_a_node_answers_the_reference_prompt_logprobs_whatever_the_chunks(tmp_path):
    name = "pl" + uuid.uuid4().hex[:8]
    with launched(name, tmp_path, *SMALL, "--max-num-batched-tokens", "16") as node:
        sock = Socket(node.port)
        try:
            prompt = np.arange(30, 75) % 512
            want = reference(prompt, 3)
            sock.send(request("warm", prompt, 2))  # the prefix cache holds the prompt's blocks
            sock.until_end("warm")
            sock.send(request("alone", prompt, 2, prompt_logprobs=3))
            alone = sock.until_end("alone")
            first = [ev for ev in sock.events["alone"] if isinstance(ev, TokenEvent)][0]
            assert isinstance(alone, FinishedEvent) and alone.cached_device == 0
            check(first, want)
            check(alone, want)
            # behind a longer prompt, the chunks of this one fall elsewhere (16-token steps shared)
            sock.send(request("long", np.arange(100, 130), 4, use_cache=False))
            sock.send(request("crowd", prompt, 2, prompt_logprobs=3, use_cache=False))
            crowd = sock.until_end("crowd")
            sock.until_end("long")
            check(crowd, want)
            np.testing.assert_allclose(crowd.prompt_logprobs, alone.prompt_logprobs, rtol=0, atol=1e-12)
            sock.send(request("after", prompt, 2))
            assert sock.until_end("after").cached_device == 40, "the prompt's full blocks are cached"
            sock.send(request("none", prompt, 2))
            none = sock.until_end("none")
            assert none.prompt_logprobs == [] and all(ev.prompt_logprobs == [] for ev in sock.events["none"]
                                                      if isinstance(ev, TokenEvent))
        finally:
            sock.close()
    assert not leftovers(name)
