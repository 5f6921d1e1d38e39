"""Fair shares between clients in the real scheduler over the real prefix cache: the waiting
queue takes owners in turn (with one owner it is a deque), a request of another owner is
admitted within a step or two of arriving however many of one owner's requests wait or run
(seats full, prefills taking the budget, the device full), and preemptions for a share lose no
work count. Liveness with several owners is test_scheduler_liveness.py's."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrt.runtime.cache.prefix_cache import PrefixCache
from kvrt.runtime.engine.fair_queue import FairQueue
from kvrt.runtime.engine.scheduler import Scheduler
from kvrt.runtime.engine.sequence import Sequence, SeqState

A, B = b"client-a", b"client-b"


@dataclass(eq=False)
class _Item:
    owner: bytes
    n: int
    client: bytes = b""


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "appendleft", "popleft", "remove"]), st.integers(0, 1 << 30))))
def test_with_one_owner_the_queue_is_a_deque(ops):
    fair, plain = FairQueue(), deque()
    for i, (op, pick) in enumerate(ops):
        if op in ("append", "appendleft"):
            item = _Item(b"", i)
            getattr(fair, op)(item)
            getattr(plain, op)(item)
        elif plain and op == "popleft":
            assert fair.popleft() is plain.popleft()
        elif plain:
            item = plain[pick % len(plain)]
            fair.remove(item)
            plain.remove(item)
        assert len(fair) == len(plain) and list(fair) == list(plain)
        assert (fair[0] is plain[0]) if plain else not fair


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=40))
def test_owners_take_turns_and_iteration_is_the_order_of_taking(adds):
    q = FairQueue()
    for i, (owner, front) in enumerate(adds):
        (q.appendleft if front else q.append)(_Item(bytes([owner]), i))
    order = list(q)
    taken = [q.popleft() for _ in range(len(order))]
    assert taken == order and not q
    for k in range(1, len(taken)):  # an owner goes again only once every owner with requests left went
        if taken[k].owner == taken[k - 1].owner:
            assert all(t.owner == taken[k].owner for t in taken[k:])


def _seq(rid: str, owner: bytes, prompt: int = 4, new: int = 200, first: int = 0) -> Sequence:
    return Sequence.new(rid, np.arange(first, first + prompt, dtype=np.int32) % 500, new, 4, owner=owner)


def _step(sched: Scheduler) -> list[str]:
    step = sched.schedule()
    if step is None:
        return []
    sched.finish_step(step, np.full(len(step.seqs), 7, dtype=np.int32))
    return [s.request_id for s in step.seqs]


def _burst_then_one(sched: Scheduler, burst: list[Sequence], steps_before: int, other: Sequence) -> int:
    """A's burst runs `steps_before` steps, then B's one request arrives: the steps until it is in one."""
    for s in burst:
        sched.add(s)
    for _ in range(steps_before):
        _step(sched)
    sched.add(other)
    for k in range(1, 200):
        if other.request_id in _step(sched):
            return k
    raise AssertionError(f"{other.request_id} was not scheduled within 200 steps")


def test_another_owners_request_is_seated_at_once_when_one_owner_holds_every_seat():
    sched = Scheduler(PrefixCache(4, 4096), max_num_seqs=8, max_num_batched_tokens=64)
    burst = [_seq(f"a{i}", A, first=10 * i) for i in range(40)]
    assert _burst_then_one(sched, burst, 3, _seq("b", B, first=3000)) == 1
    assert sum(s.state is SeqState.RUNNING for s in burst) == 7 and sched.preemptions == 1
    for _ in range(3000):
        if sched.idle:
            break
        _step(sched)
    assert all(s.finish_reason == "length" and s.num_output == 200 for s in burst)


def test_another_owners_request_runs_beside_one_owners_long_prefills():
    sched = Scheduler(PrefixCache(4, 4096), max_num_seqs=8, max_num_batched_tokens=64)
    burst = [_seq(f"a{i}", A, prompt=400, new=4, first=400 * i) for i in range(6)]
    assert _burst_then_one(sched, burst, 2, _seq("b", B, prompt=100, new=4, first=3000)) == 1
    steps = [_step(sched) for _ in range(3)]
    assert all("b" in s for s in steps), "its prefill goes on beside theirs, in turns"


def test_another_owners_request_gets_blocks_from_one_owner_holding_the_device():
    sched = Scheduler(PrefixCache(4, 64), max_num_seqs=16, max_num_batched_tokens=64)
    burst = [_seq(f"a{i}", A, prompt=4, new=40, first=10 * i) for i in range(16)]
    for s in burst:
        sched.add(s)
    for _ in range(30):
        _step(sched)
    assert sched.cache.check()["device_free"] == 0 and sched.waiting, "the burst fills the device and waits"
    other = _seq("b", B, prompt=8, new=4, first=3000)
    sched.add(other)
    assert "b" in _step(sched)
    for _ in range(3000):
        if sched.idle:
            break
        _step(sched)
    assert all(s.finish_reason == "length" for s in burst + [other])
    sched.cache.check()
