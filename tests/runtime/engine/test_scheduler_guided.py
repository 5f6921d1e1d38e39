"""The scheduler with guided requests, on a real prefix cache and real grammar states over a
futures the test completes: a request waits aside for its grammar (holding no blocks, others
run meanwhile), runs once it is there, fails (told once) when it cannot compile, can be
cancelled while it waits, fails when its grammar reaches a dead state, and no step carries more
guided rows than the cap."""
from __future__ import annotations

from concurrent.futures import Future

import numpy as np
from outlines_core import Index, Vocabulary

from kvrt.runtime.cache.prefix_cache import PrefixCache
from kvrt.runtime.engine.grammars import Compiled
from kvrt.runtime.engine.guide import GuideState
from kvrt.runtime.engine.scheduler import Scheduler
from kvrt.runtime.engine.sequence import Sequence, SeqState

BS, VOCAB, EOS = 4, 64, 63
SPEC = {"kind": "regex", "spec": "ab"}


def index() -> Compiled:
    """'ab' over tokens a=1, b=2 (and 'ab'=3)."""
    return Compiled(Index("ab", Vocabulary(EOS, {"a": [1], "b": [2], "ab": [3]})), EOS + 1)


def allowed(mask: np.ndarray) -> list[int]:
    return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")).tolist()


def guided(rid: str, fut: Future, n: int = 6, new: int = 4, first: int = 10) -> Sequence:
    prompt = np.arange(n, dtype=np.int32) + first
    return Sequence.new(rid, prompt, new, BS, eos_token_id=EOS, guide=GuideState(SPEC, fut, EOS, VOCAB))


def plain(rid: str, n: int = 6) -> Sequence:
    return Sequence.new(rid, np.arange(n, dtype=np.int32), 2, BS)


def test_a_request_waits_for_its_grammar_aside_then_runs_inside_it():
    cache = PrefixCache(BS, 64)
    s = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=64)
    fut: Future = Future()
    g, p = guided("g", fut), plain("p")
    s.add(g)
    s.add(p)
    step = s.schedule()
    assert [q.request_id for q in step.seqs] == ["p"] and s.compiling == [g] and not g.matched
    s.finish_step(step, np.array([5], np.int32))
    fut.set_result(index())
    step = s.schedule()
    assert g in step.seqs and allowed(g.guide.mask) == [1, 3]  # 'a' or 'ab' first
    tokens = np.array([3 if q is g else 5 for q in step.seqs], np.int32)
    out = s.finish_step(step, tokens)
    assert allowed(g.guide.mask) == [EOS]  # complete: only the end
    step = s.schedule()
    out = s.finish_step(step, np.array([EOS if q is g else 5 for q in step.seqs], np.int32))
    assert g.finish_reason == "eos" and g in out.finished and g.guide.finished
    assert not s.take_failed().failed
    cache.check()


def test_a_grammar_that_fails_fails_its_request_once_and_frees_it():
    cache = PrefixCache(BS, 64)
    s = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=64)
    fut: Future = Future()
    g = guided("g", fut)
    s.add(g)
    assert s.schedule() is None
    fut.set_exception(ValueError("cannot compile guided regex 'ab': nope"))
    assert s.schedule() is None
    failed = s.take_failed().failed
    assert [(q.request_id, why) for q, why in failed] == [("g", "cannot compile guided regex 'ab': nope")]
    assert g.state is SeqState.FINISHED and s.idle and not s.compiling and not s.take_failed().failed
    cache.check()


def test_cancel_while_the_grammar_compiles():
    s = Scheduler(PrefixCache(BS, 64), max_num_seqs=4, max_num_batched_tokens=64)
    g = guided("g", Future())
    s.add(g)
    s.schedule()
    assert s.cancel("g") is g and g.finish_reason == "cancelled" and s.idle and not s.compiling


def test_a_dead_state_fails_the_request_instead_of_sampling_garbage():
    s = Scheduler(PrefixCache(BS, 64), max_num_seqs=4, max_num_batched_tokens=64)
    fut: Future = Future()
    fut.set_result(index())
    g = guided("g", fut)
    s.add(g)
    step = s.schedule()
    out = s.finish_step(step, np.array([2], np.int32))  # 'b' first: no transition
    assert [q for q, _ in out.failed] == [g] and "outside" in out.failed[0][1] and g.state is SeqState.FINISHED


def test_max_tokens_before_the_grammar_is_complete_is_length():
    s = Scheduler(PrefixCache(BS, 64), max_num_seqs=4, max_num_batched_tokens=64)
    fut: Future = Future()
    fut.set_result(index())
    g = guided("g", fut, new=1)
    s.add(g)
    out = s.finish_step(s.schedule(), np.array([1], np.int32))
    assert g in out.finished and g.finish_reason == "length" and not out.failed


def test_no_step_carries_more_guided_rows_than_the_cap():
    s = Scheduler(PrefixCache(BS, 256), max_num_seqs=16, max_num_batched_tokens=512)
    s.max_guided = 2
    fut: Future = Future()
    fut.set_result(index())
    seqs = [guided(str(i), fut) for i in range(5)] + [plain("p")]
    for q in seqs:
        s.add(q)
    for _ in range(30):
        step = s.schedule()
        if step is None:
            break
        assert sum(q.guide is not None for q in step.seqs) <= 2
        s.finish_step(step, np.array([1 if q.guide is not None and not q.num_output else
                                      (2 if q.guide is not None else 5) for q in step.seqs], np.int32))
    assert all(q.state is SeqState.FINISHED for q in seqs)


def test_preemption_keeps_the_grammar_state():
    """Requests preempted and recomputed go on from where their grammar was: a model that takes
    the lowest allowed token writes exactly 'aaaaaab' then EOS, however often it was preempted."""
    cache = PrefixCache(BS, 12)  # too few blocks for three growing requests: preemptions
    s = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=64)
    fut: Future = Future()
    fut.set_result(Compiled(Index("a{6}b", Vocabulary(EOS, {"a": [1], "b": [2]})), EOS + 1))
    seqs = [guided(str(i), fut, n=14, new=10, first=100 * i) for i in range(3)]  # (no shared prefix)
    for q in seqs:
        s.add(q)
    for _ in range(200):
        step = s.schedule()
        if step is None:
            break
        s.finish_step(step, np.array([allowed(q.guide.mask)[0] for q in step.seqs], np.int32))
    assert s.preemptions > 0
    for q in seqs:
        assert q.finish_reason == "eos" and q.output.tolist() == [1] * 6 + [2, EOS], q.output
    cache.check()
