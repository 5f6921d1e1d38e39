"""The scheduler on a real prefix cache, without processes: steps are answered in-process with
made-up tokens. Checks the life cycles (admission, chunking, preemption, cancel in every
state, the decode side of a handoff) against the cache's own invariant checker."""
from __future__ import annotations

import numpy as np

from kvrt.runtime.cache.prefix_cache import PrefixCache
from kvrt.runtime.engine.scheduler import Scheduler
from kvrt.runtime.engine.sequence import Sequence, SeqState
from kvrt.runtime.pd.connector import SchedulerHooks

BS = 4


def seq(rid: str, n: int, new: int = 3, seed: int = 0) -> Sequence:
    prompt = np.random.default_rng(seed).integers(0, 100, n).astype(np.int32)
    return Sequence.new(rid, prompt, new, BS)


def run_step(s: Scheduler):
    step = s.schedule()
    if step is None:
        return None
    return s.finish_step(step, np.full(len(step.seqs), 7, dtype=np.int32))


def drain(s: Scheduler, limit: int = 500) -> None:
    for _ in range(limit):
        if s.idle or run_step(s) is None:
            return


def test_chunked_prefill_then_decode_to_the_end():
    cache = PrefixCache(BS, 64)
    s = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=8)
    a = seq("a", 30)
    s.add(a)
    first = s.schedule()
    assert first.chunks == [8] and first.starts == [0]
    s.finish_step(first, np.array([7], dtype=np.int32))
    assert a.num_output == 0 and a.num_computed == 8
    drain(s)
    assert a.state is SeqState.FINISHED and a.finish_reason == "length" and a.num_output == 3
    assert s.idle and cache.block_usage()["device_used"] == 0
    cache.check()


def test_preemption_when_blocks_run_out_and_everything_finishes():
    cache = PrefixCache(BS, 12)  # 48 tokens for three 14-token prompts that grow
    s = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [seq(str(i), 14, new=6, seed=i) for i in range(3)]
    for q in seqs:
        s.add(q)
    drain(s)
    assert all(q.finish_reason == "length" and q.num_output == 6 for q in seqs)
    assert s.preemptions > 0
    assert cache.block_usage()["device_used"] == 0
    cache.check()


def test_cancel_in_every_state_releases_everything():
    cache = PrefixCache(BS, 12)
    s = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=64)
    running, head, queued = seq("r", 40, new=20), seq("h", 40, seed=1), seq("q", 8, seed=2)
    for q in (running, head, queued):
        s.add(q)
    step = s.schedule()  # "r" takes 10 of 12 blocks; "h" cannot get its blocks
    assert step.seqs == [running] and s.waiting[0] is head
    assert not head.matched, "a waiting sequence that cannot get its blocks holds no match"
    assert s.cancel("h") is head and s.cancel("q") is queued
    assert s.cancel("r") is None  # in the step in flight: finishes when the step ends
    out = s.finish_step(step, np.array([7], dtype=np.int32))
    assert out.finished == [running] and running.finish_reason == "cancelled"
    assert s.idle and cache.block_usage()["device_used"] == 0
    cache.check()


class PromptFromOutside(SchedulerHooks):
    """A connector whose source supplies every prompt (a decode node's)."""

    def get_num_new_matched_tokens(self, seq: Sequence) -> tuple[int, bool]:
        return seq.prompt_len, True


def test_decode_side_holds_blocks_then_resumes_and_records():
    cache = PrefixCache(BS, 32)
    s = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=64, connector=PromptFromOutside())
    d = seq("d", 18)
    s.add(d)
    [held] = s.admit_external()
    assert held is d and d.state is SeqState.EXTERNAL and len(cache.block_table("d")) == 5
    assert cache.lookup(d.keys) == 0, "nothing is matchable before the KV arrived"
    assert s.external_kv_arrived(d, 7)
    assert cache.lookup(d.keys) == 4, "received full blocks are recorded at kv-ready"
    drain(s)
    assert d.finish_reason == "length" and d.output.tolist()[0] == 7
    again = seq("again", 18)
    s.add(again)  # the same prompt: D's own cache now serves its full blocks
    assert s.admit_external() == [again] and again.num_computed == 16
    s.drop(again, "aborted")
    assert cache.block_usage()["device_used"] == 0
    cache.check()


def test_a_prompt_position_is_told_in_the_tier_of_the_first_match_that_found_it():
    """Matched from the host (swapped in), given back, matched again on the device: still a host
    hit, as the node's counters count it; what a later match finds beyond the first is told in
    its own tier, and whatever the request ran itself is computed, never cached."""
    seq = Sequence.new("r", np.arange(40, dtype=np.int32), 4, 4)
    seq.matches.append((8, 16, 0))     # device [0, 8), host [8, 24)
    seq.matches.append((24, 0, 8))     # all on the device now, and storage [24, 32)
    assert seq.cached == (8, 16, 8)
    seq.ran_prompt(32, 40)
    assert seq.cached == (8, 16, 8) and seq.computed_prompt_tokens == 8
    seq.matches.append((4, 0, 0))      # given back again, its blocks evicted: [4, 32) recomputed
    seq.ran_prompt(4, 40)
    assert seq.cached == (4, 0, 0)
    assert seq.computed_prompt_tokens == 36 and seq.recomputed_prompt_tokens == 8
    assert sum(seq.cached) + seq.computed_prompt_tokens == seq.prompt_len
