"""Liveness of the real scheduler over the real prefix cache: every request the intake would
accept finishes, whatever arrives together, whatever the tiers and however transfer tasks end.

Hypothesis plays the engine and the cache-transfer ranks: requests with shared prefixes arrive
at random steps (each fits the device alone, as intake guarantees), some are cancelled in any
state, swap and storage tasks complete in any order, late, short or failed. After every step
the cache's invariant checker runs. A run fails when some accepted request is still unfinished
after a generous bound on steps (a stall or a livelock), when any block is left in use at the
end, or when a finished request's cached tokens per tier and computed prompt tokens do not add
up to its prompt. Examples: KVRT_LIVENESS_EXAMPLES (default 150; the closing note of the change
that added this test ran thousands).
"""
from __future__ import annotations

import os
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvrt.runtime.cache.prefix_cache import PrefixCache, TaskKind
from kvrt.runtime.engine.scheduler import Scheduler
from kvrt.runtime.engine.sequence import Sequence, SeqState
from tests.launched import crowding_prompts

EXAMPLES = int(os.environ.get("KVRT_LIVENESS_EXAMPLES", "150"))
BASES = [np.arange(1000 * b, 1000 * b + 200, dtype=np.int32) for b in range(3)]


class _Store:
    """A storage tier: keys written through become readable; reads may come back short. A
    shared one (a Mooncake Store other nodes write to) cannot be listed: its lookup says "maybe
    all of them" and the read finds out."""

    def __init__(self, shared: bool = False) -> None:
        self.keys: set[bytes] = set()
        self.shared = shared

    def held(self, keys) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.keys:
            n += 1
        return n

    def lookup(self, keys) -> int:
        return len(keys) if self.shared else self.held(keys)


def _request(rng: random.Random, i: int, bs: int, device: int, owners: int = 1) -> Sequence:
    """A prompt that shares a prefix with others (or not), sized so that prompt + output fit
    the device alone, as intake guarantees; its owner is one of `owners`, in turn."""
    cap = device * bs
    new = rng.randint(1, max(1, cap // 3))
    plen = rng.randint(1, cap - new)
    base = BASES[rng.randrange(len(BASES))]
    shared = rng.randint(0, min(plen, len(base)))
    tail = np.arange(100_000 + 1000 * i, 100_000 + 1000 * i + plen - shared, dtype=np.int32)
    prompt = np.concatenate((base[:shared], tail))
    return Sequence.new(f"r{i}", prompt, new, bs, use_cache=rng.random() > 0.1, owner=bytes([i % owners]))


def _serve(sched: Scheduler, cache: PrefixCache, turns: int, check: bool = True,
           blocks=lambda task: None) -> list:
    """Run steps until the scheduler is idle (at most `turns`), every task done at once, a
    storage read coming back with `blocks(task)` blocks. Returns the tasks applied."""
    applied = []
    for _ in range(turns):
        if sched.idle:
            break
        step = sched.schedule()
        done = cache.take_tasks()
        if step is not None:
            sched.finish_step(step, np.full(len(step.seqs), 7, dtype=np.int32))
            done += cache.take_tasks()
        for t in done:
            sched.on_task_outcome(cache.apply_task_result(t.task_id, True, blocks(t)))
        applied += done
        if check:
            cache.check()
    return applied


def _drive(seed: int, bs: int, device: int, host: int, storage: bool | str, seqs: int, batch: int,
           n_req: int, p_done: float, p_fail: float, p_cancel: float, low_water: int | None = None,
           rounds: int = 1, owners: int = 1, groups: tuple[int, ...] = ()) -> None:
    """`rounds` > 1 sends the same prompts again (new ids) once the previous round is done: their
    prefixes were swapped out meanwhile, so many swap-ins wait for device blocks at once.
    `storage` "shared": a tier whose lookup says "maybe" and whose reads find out. `groups`: the
    windows of a model's layer groups after the first (runtime/cache/groups.py): each block of
    tokens takes a page per group, so the device has `device` blocks of tokens' worth of pages."""
    rng = random.Random(seed)
    store = _Store(shared=storage == "shared")
    cache = PrefixCache(bs, device * (1 + len(groups)), host, storage_lookup=store.lookup if storage else None,
                        write_through=storage, low_water=low_water, groups=groups)
    sched = Scheduler(cache, max_num_seqs=seqs, max_num_batched_tokens=batch)
    first = [_request(rng, i, bs, device, owners) for i in range(n_req)]
    pending = [Sequence.new(f"{q.request_id}.{r}" if r else q.request_id, q.tokens[:q.prompt_len],
                            q.max_new_tokens, bs, use_cache=q.use_cache, owner=q.owner)
               for r in range(rounds) for q in first]
    arrivals = sorted(rng.randint(0, 3 * n_req) for _ in first)
    arrivals += [None] * (len(pending) - len(arrivals))  # later rounds: when the node is idle
    accepted: list[Sequence] = []
    inflight = []
    work = sum(q.num_tokens + q.max_new_tokens for q in pending)
    bound = 40 * work + 400
    for it in range(bound):
        if pending and arrivals[0] is None and sched.idle:
            arrivals[:n_req] = [it] * n_req
        while pending and arrivals[0] is not None and arrivals[0] <= it:
            arrivals.pop(0)
            q = pending.pop(0)
            sched.add(q)
            accepted.append(q)
        if rng.random() < p_cancel and sched.seqs:
            sched.cancel(rng.choice(sorted(sched.seqs)))
        step = sched.schedule()
        inflight += cache.take_tasks()
        if step is not None:
            sched.finish_step(step, np.full(len(step.seqs), 7, dtype=np.int32))
            inflight += cache.take_tasks()
        rng.shuffle(inflight)
        keep = []
        for t in inflight:
            if rng.random() >= p_done:
                keep.append(t)
                continue
            ok = rng.random() >= p_fail
            blocks = None
            if t.kind is TaskKind.STORAGE2GPU and ok:
                blocks = rng.randint(0, store.held(t.keys) if store.shared else len(t.device_blocks))
            if t.kind is TaskKind.GPU2STORAGE and ok:
                store.keys.update(t.keys)
            sched.on_task_outcome(cache.apply_task_result(t.task_id, ok, blocks))
        inflight = keep
        cache.check()
        if not pending and sched.idle and not inflight:
            break
    stuck = [(q.request_id, q.state.value, q.num_computed, q.num_tokens) for q in accepted
             if q.state is not SeqState.FINISHED]
    assert not stuck, f"requests never finished within {bound} steps (a stall): {stuck[:8]}"
    for t in inflight + cache.take_tasks():  # write-through tasks issued by the last releases
        cache.apply_task_result(t.task_id, True)
    usage = cache.check()
    assert usage["device_used"] == 0 and usage["host_used"] == 0, usage
    for q in accepted:
        assert q.finish_reason in ("length", "cancelled"), (q.request_id, q.finish_reason)
        told = (q.request_id, q.prompt_len, q.cached, q.computed_prompt_tokens, q.preemptions)
        if q.finish_reason == "length":
            assert q.num_output == q.max_new_tokens
            assert sum(q.cached) + q.computed_prompt_tokens == q.prompt_len, f"counts do not add up: {told}"
        else:  # cancelled, maybe before its prompt was through
            assert sum(q.cached) + q.computed_prompt_tokens <= q.prompt_len, f"counted twice: {told}"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), bs=st.sampled_from([2, 4]), device=st.integers(6, 24),
       host=st.sampled_from([0, 0, 4, 16]), storage=st.sampled_from([False, True, "shared"]), seqs=st.integers(1, 8),
       batch=st.sampled_from([4, 16, 64]), n_req=st.integers(1, 10),
       p_done=st.sampled_from([0.2, 0.6, 1.0]), p_fail=st.sampled_from([0.0, 0.0, 0.2]),
       p_cancel=st.sampled_from([0.0, 0.0, 0.02]), low_water=st.sampled_from([None, 0, 3]))
def test_every_accepted_request_finishes(seed, bs, device, host, storage, seqs, batch, n_req,
                                         p_done, p_fail, p_cancel, low_water):
    _drive(seed, bs, device, host, storage, seqs, batch, n_req, p_done, p_fail, p_cancel, low_water)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), bs=st.sampled_from([2, 4]), device=st.integers(6, 24),
       host=st.sampled_from([0, 0, 4, 16]), storage=st.sampled_from([False, True, "shared"]), seqs=st.integers(1, 8),
       batch=st.sampled_from([4, 16, 64]), n_req=st.integers(2, 12), owners=st.integers(2, 4),
       p_done=st.sampled_from([0.2, 0.6, 1.0]), p_fail=st.sampled_from([0.0, 0.0, 0.2]),
       p_cancel=st.sampled_from([0.0, 0.0, 0.02]), rounds=st.sampled_from([1, 2]))
# a newcomer's admission that could not get its blocks gave its match back without giving way to
# the swap-ins waiting for room: matched again at every step, it took back the blocks their
# evictions had just made (a swap-out flipped back), and they never got room
@example(seed=896, bs=4, device=13, host=16, storage=False, seqs=1, batch=16, n_req=4, owners=4, p_done=0.2,
         p_fail=0.0, p_cancel=0.0, rounds=2)
def test_every_request_of_several_owners_finishes(seed, bs, device, host, storage, seqs, batch, n_req, owners,
                                                  p_done, p_fail, p_cancel, rounds):
    """The same with requests of several owners (clients), which the scheduler serves in turns
    and seats ahead of one another (runtime/engine/fair_queue.py): nobody waits for ever, and
    preemptions for a fair share lose no count."""
    _drive(seed, bs, device, host, storage, seqs, batch, n_req, p_done, p_fail, p_cancel, rounds=rounds,
           owners=owners)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), bs=st.sampled_from([2, 4]), device=st.integers(6, 24),
       host_ratio=st.sampled_from([1, 2, 3]), seqs=st.sampled_from([4, 16]), batch=st.sampled_from([16, 64]),
       n_req=st.integers(4, 14), p_done=st.sampled_from([0.3, 1.0]), p_fail=st.sampled_from([0.0, 0.0, 0.1]),
       storage=st.sampled_from([False, True, "shared"]))
# a swap-in deferred for room, its waiter gone but a node of it adopted by a running request: its
# idle ancestors are no room (they are not leaves), or the running requests wait for ever
@example(seed=429201516, bs=2, device=18, host_ratio=1, seqs=4, batch=16, n_req=13, p_done=0.3, p_fail=0.0,
         storage="shared")
def test_swap_ins_that_wait_together_for_more_room_than_the_device_has_all_finish(
        seed, bs, device, host_ratio, seqs, batch, n_req, p_done, p_fail, storage):
    """The same prompts sent again at once after a first round swapped their prefixes out: the
    swap-ins that then wait for device blocks need more together than free and evictable blocks
    cover, though each fits alone."""
    _drive(seed, bs, device, host_ratio * device, storage, seqs, batch, n_req, p_done, p_fail, 0.0,
           rounds=2)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), bs=st.sampled_from([2, 4]), device=st.integers(6, 24),
       host=st.sampled_from([0, 0, 4, 16]), storage=st.sampled_from([False, True]), seqs=st.integers(1, 8),
       batch=st.sampled_from([4, 16, 64]), n_req=st.integers(1, 10), p_done=st.sampled_from([0.2, 0.6, 1.0]),
       p_fail=st.sampled_from([0.0, 0.0, 0.2]), p_cancel=st.sampled_from([0.0, 0.0, 0.02]),
       groups=st.sampled_from([(3,), (6,), (0,), (4, 4), (0, 5)]), rounds=st.sampled_from([1, 2]))
def test_every_accepted_request_finishes_with_layer_groups(seed, bs, device, host, storage, seqs, batch, n_req,
                                                           p_done, p_fail, p_cancel, groups, rounds):
    """The same over a model whose layers form groups (sliding windows, a second full group):
    a block of tokens takes a page per group and sliding pages are given back as requests run."""
    _drive(seed, bs, device, host, storage, seqs, batch, n_req, p_done, p_fail, p_cancel, rounds=rounds,
           groups=groups)


def test_a_tiny_device_with_a_host_tier_serves_two_rounds_of_shared_prompts():
    """tests/runtime/engine/test_oracle.py's tiny-pool case without processes: 24 device and 48 host blocks of
    16 tokens, 14 prompts sent together twice, every swap done at once."""
    bs = 16
    cache = PrefixCache(bs, 24, 48)
    sched = Scheduler(cache, max_num_seqs=256, max_num_batched_tokens=2048)
    for r in range(2):
        seqs = [Sequence.new(f"{r}.{i}", p, 16, bs) for i, p in enumerate(crowding_prompts())]
        for q in seqs:
            sched.add(q)
        _serve(sched, cache, 5000)
        assert [q.finish_reason for q in seqs] == ["length"] * len(seqs), (
            r, [q.request_id for q in seqs if q.state is not SeqState.FINISHED])


# Its examples are the suite's longest (two rounds of up to 16 requests over both tiers, hundreds
# of ms each on a quiet machine): split over PARTS test items, each a share of the examples under
# pytest's per-test timeout of its own, so that a loaded machine (and xdist's two workers) never
# brings all of them against one timeout.
PARTS = 3


@pytest.mark.parametrize("part", range(PARTS))
@settings(max_examples=max(EXAMPLES // PARTS, 1), deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1), bs=st.sampled_from([2, 4]), device=st.integers(6, 24),
       host=st.sampled_from([4, 16, 64]), seqs=st.integers(4, 16), batch=st.sampled_from([4, 16, 64]),
       n_req=st.integers(4, 16), p_done=st.sampled_from([0.2, 0.6, 1.0]), p_fail=st.sampled_from([0.0, 0.2]))
def test_prompt_counts_add_up_with_a_host_tier_and_storage(part, seed, bs, device, host, seqs, batch, n_req,
                                                           p_done, p_fail):
    """Many requests in flight over both tiers, twice (the second round hits the host and
    storage), so matches are given back and made again, loading requests are preempted, storage
    reads come back short and swap-ins fail: `_drive` checks that each finished request's cached
    tokens per tier and computed prompt tokens add up to its prompt. (`part`: which share of the
    examples; each part draws its own, its seeds apart from the others'.)"""
    _drive(seed ^ (part * 0x9E3779B1), bs, device, host, True, seqs, batch, n_req, p_done, p_fail, 0.0, rounds=2)


def test_long_decodes_that_fit_one_at_a_time_all_finish_together():
    """Eight requests of 16 prompt + 3,000 new tokens on a 512-block device (189 blocks each):
    they used to preempt each other for ever; one at a time each fits."""
    for host in (0, 256):
        cache = PrefixCache(16, 512, host)
        sched = Scheduler(cache, max_num_seqs=256, max_num_batched_tokens=2048)
        seqs = [Sequence.new(str(i), np.arange(16, dtype=np.int32) + 100 * i, 3000, 16) for i in range(8)]
        for q in seqs:
            sched.add(q)
        _serve(sched, cache, 20_000, check=False)
        assert all(q.finish_reason == "length" for q in seqs), [q.num_output for q in seqs]
        assert sched.preemptions <= 16, f"{sched.preemptions} preemptions (host blocks: {host})"
        cache.check()


def test_a_waiting_match_never_keeps_a_running_request_from_growing():
    """16-block device: the running request needs its last free blocks; a waiting request whose
    match pins cached blocks the running one would otherwise evict must not stall it."""
    bs = 4
    cache = PrefixCache(bs, 16)
    sched = Scheduler(cache, max_num_seqs=8, max_num_batched_tokens=64)
    shared = np.arange(500, 540, dtype=np.int32)  # 10 blocks, cached by a finished request
    first = Sequence.new("first", shared, 1, bs)
    sched.add(first)
    while not sched.idle:
        sched.finish_step(sched.schedule(), np.array([7], dtype=np.int32))
    runner = Sequence.new("runner", np.arange(20, dtype=np.int32), 40, bs)  # 15 blocks in the end
    sched.add(runner)
    sched.finish_step(sched.schedule(), np.array([7], dtype=np.int32))
    waiter = Sequence.new("waiter", np.concatenate((shared, [1, 2, 3])), 20, bs)
    sched.add(waiter)
    for _ in range(500):
        if runner.state is SeqState.FINISHED:
            break
        step = sched.schedule()
        assert step is not None, "no step could be scheduled: the waiting match pins the device"
        sched.finish_step(step, np.full(len(step.seqs), 7, dtype=np.int32))
    assert runner.finish_reason == "length"
    for _ in range(500):
        if sched.idle:
            break
        sched.finish_step(sched.schedule(), np.full(1, 7, dtype=np.int32))
    assert waiter.finish_reason == "length"
    cache.check()


def test_requests_whose_shared_store_reads_hold_each_others_room_all_finish():
    """A shared store's lookup says "maybe" to every key, so each match starts a read into new
    device blocks. Two requests that together fill a 6-block device both read, both miss, and
    each then lacks the blocks the other's read holds: matched again with another read each
    time, they gave their matches back for ever. Storage is read once per admission."""
    bs = 4
    store = _Store(shared=True)
    cache = PrefixCache(bs, 6, storage_lookup=store.lookup, write_through=True)
    sched = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [Sequence.new("a", np.arange(20, dtype=np.int32), 2, bs),
            Sequence.new("b", np.arange(100, 110, dtype=np.int32), 3, bs)]
    for q in seqs:
        sched.add(q)
    tasks = _serve(sched, cache, 200,
                   blocks=lambda t: store.held(t.keys) if t.kind is TaskKind.STORAGE2GPU else None)
    reads = sum(t.kind is TaskKind.STORAGE2GPU for t in tasks)
    assert [q.finish_reason for q in seqs] == ["length", "length"], [q.state for q in seqs]
    assert reads <= 4, f"{reads} storage reads for two requests"


def test_a_request_that_recorded_a_block_during_its_swap_in_still_fits_the_device():
    """Found by the two-round property: a request computed a block whose node was being swapped
    in at the same time, so it kept its own copy besides the node's; on a 6-block device that
    request then needed 7 blocks and waited for ever. Its copy is freed once the swap-in is done."""
    _drive(1367, 2, 6, 18, False, 4, 16, 6, 0.3, 0.0, 0.0, rounds=2)
