"""Continuous batching over the paged KV cache: which sequences compute which tokens next.

One step at a time is in flight (the engine sends it to every worker rank and waits for the
answers before scheduling the next), so everything here runs between steps and no block a
step uses can change under it. A step is built from:
1. running sequences in admission order: a decode token each, or the next prefill chunk;
   when the device runs out of blocks, a sequence waits if blocks are on their way back
   (swap-outs in flight); else blocks are taken from the newest loading sequence whose swap-in
   still waits for room, then from a loaded one not yet admitted, then from the most recently
   admitted running sequence not yet in the step, which is preempted (released, queued again
   at the front, recomputed later: most of its blocks are then found again in the prefix
   cache); no new sequence is admitted in a step where a running one lacked blocks;
2. waiting sequences, admitted in their queue's order while the token budget and seats last:
   matched against the prefix cache; one whose cached prefix must first be swapped in or read
   from storage waits (LOADING) until every task it needs is done, then is admitted first.
   A sequence that cannot get its blocks gives its match back at once (it holds nothing while
   it waits, so it can never keep a running sequence from growing) and is matched again later.
A chunk's KV is recorded in the prefix cache right after the step that wrote it, never before
(a block is matchable only once its KV exists).

Liveness: a request that fits the device alone (checked at intake) always finishes. Waiting
sequences hold no blocks; loading ones whose swap-ins wait for room give their blocks up
before running ones do, and also when nothing else can run (then the one holding the most
device blocks that does not wait for the oldest such swap-in); running sequences are
preempted newest first, so the oldest always progresses. Deferred swap-ins get room oldest
first, each as soon as it fits alone (runtime/cache/tasks.py), and a sequence that gave its
blocks up to them is not matched again until none waits, so it cannot take the same blocks
back. A sequence reads storage at most once per admission: matched again before it ran, it
finds what its read brought in the tree, and reads holding each other's room cannot repeat
(tests/runtime/engine/test_scheduler_liveness.py).

Fair shares (runtime/engine/fair_queue.py): requests belong to owners (a client socket, or the
HTTP client a request was sent on behalf of). The waiting queue takes owners in turn, first in,
first out within each; running sequences are scheduled in turns of owners too (each owner's
oldest first, the oldest owner first; the decodes before the prefills), a prefill chunk taking
at most an equal share of what the decodes leave, so one owner's long prefills cannot take every
step's budget. An owner with a request waiting and none admitted (a newcomer) is admitted right
after the running sequences had their blocks (and, as any admission, not in a step where one
lacked them: it never keeps one from growing), with up to half the step's budget kept for it;
when the seats are full, or the device has no free blocks for its first chunk, the newest
running sequence of the owner holding the most seats (at least two) is preempted for it. So
another client's burst, or its streams nobody reads, cannot keep a request waiting for the
burst to end. With one owner all of this is the arrival order above.

A guided request (runtime/engine/guide.py) runs only once its grammar is compiled: one that
reaches the head of the queue before then waits aside (`compiling`, holding no blocks) and goes
back to the front when it is ready, so requests behind it are not held up by a compile; one
whose grammar fails is finished and told through `take_failed`. No step carries more guided
sequences than `max_guided` (their masks must fit the step message).

KV from or to outside (a KV connector, runtime/pd/) adds two life cycles, and the
scheduler knows only the connector's hooks, never who is on the other side. A request whose
tokens an external source supplies asynchronously (`get_num_new_matched_tokens`) waits in its
own queue to hold blocks for them (matched against the local prefix cache first, so only
missing blocks travel), then stays EXTERNAL while they are written and joins the running set
at `external_kv_arrived`, when its received blocks are recorded in the prefix cache (not
before: their KV did not exist here until then). A request the connector `takes_over` after a
token leaves the running set holding its blocks (EXTERNAL) until the connector drops it. A
request whose blocks the connector is `reading` (sending them out while it prefills) is never
preempted, and if it ends then, its blocks are held until the connector `release_held`s them.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvrt.runtime.cache.prefix_cache import PrefixCache, TaskOutcome
from kvrt.runtime.engine.fair_queue import FairQueue, owner_of
from kvrt.runtime.engine.sequence import Sequence, SeqState
from kvrt.runtime.pd.connector import SchedulerHooks

log = logging.getLogger(__name__)


@dataclass
class Step:
    """A scheduled step: sequence i computes `chunks[i]` tokens from its num_computed."""

    step_id: int
    seqs: list[Sequence] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    # per sequence, the block table of each layer group after the first (runtime/cache/groups.py;
    # -1 where a sliding group reads nothing); empty lists for a model of one group
    group_tables: list[list[list[int]]] = field(default_factory=list)


@dataclass
class StepOutcome:
    """What a finished step means for clients: new tokens (sequence, its output index) and
    sequences that are done (finish_reason set) or failed (with a reason)."""

    emitted: list[tuple[Sequence, int]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)


class Scheduler:
    def __init__(self, cache: PrefixCache, max_num_seqs: int, max_num_batched_tokens: int,
                 connector: SchedulerHooks | None = None):
        self.cache = cache
        self.connector = connector if connector is not None else SchedulerHooks()
        self.block_size = cache.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting = FairQueue()  # round-robin over owners, FIFO within one
        self.running: list[Sequence] = []
        self.loading: dict[str, Sequence] = {}
        self.reserving: deque[Sequence] = deque()  # waiting for blocks to hold for external KV
        self.external_ids: dict[str, int] = {}  # request -> tokens an external source supplies, until they arrived
        self.seqs: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # ended while the connector read their blocks: not released yet
        self.inflight: Step | None = None
        self.max_guided = 1 << 30  # guided sequences per step (their masks must fit the step message)
        self.compiling: list[Sequence] = []  # waiting for their grammar (guided decoding), in arrival order
        self.failed: list[tuple[Sequence, str]] = []  # failed outside a step, not told yet
        self._step_ids = itertools.count(1)
        self.preemptions = 0

    # ---- intake -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs or seq.request_id in self.held:
            raise ValueError(f"request id {seq.request_id!r} is already in flight")
        self.seqs[seq.request_id] = seq
        external, load_async = self.connector.get_num_new_matched_tokens(seq)
        if external > 0 and load_async:
            self.external_ids[seq.request_id] = min(external, seq.num_tokens)
            self.reserving.append(seq)
        else:
            self.waiting.append(seq)

    def cancel(self, request_id: str) -> Sequence | None:
        """Cancel a request: returns it finished now, or None when it is in the step in flight
        (it finishes, cancelled, when that step ends). KeyError if unknown."""
        seq = self.seqs[request_id]
        seq.cancelled = True
        if (self.inflight is not None and seq in self.inflight.seqs) or seq.state is SeqState.EXTERNAL:
            return None  # (an external transfer uses its blocks: the connector ends it)
        self._finish(seq, "cancelled")
        return seq

    @property
    def idle(self) -> bool:
        return not self.seqs

    # ---- building a step ------------------------------------------------------------------
    def schedule(self) -> Step | None:
        """The next step, or None when nothing can run now (idle, or waiting for tasks/blocks)."""
        step = Step(next(self._step_ids))
        budget = self.max_num_batched_tokens
        short = False  # a running sequence lacked blocks: admit nobody new in this step
        self._grammars_ready()
        newcomers = self._newcomers()
        kept = self._make_room(newcomers, budget) if newcomers else 0
        budget -= kept
        turns, share = _in_turns(self.running, budget)
        for seq in turns:
            if budget <= 0 or len(step.seqs) >= self.max_num_seqs:
                break
            if seq.state is not SeqState.RUNNING:
                continue  # preempted while this step was being built
            if seq.guide is not None and not seq.guide.ready():
                if seq.guide.problem:
                    self._fail_guided(seq)
                continue  # (a decode node's request whose grammar still compiles)
            if seq.guide is not None and self._guided(step) >= self.max_guided:
                continue  # its mask would not fit this step: the next one
            chunk = min(seq.num_tokens - seq.num_computed, budget, share)
            preemptions = self.preemptions
            if self._grow(seq, seq.num_computed + chunk, step):
                self._add(step, seq, chunk)
                budget -= chunk
            else:
                short = True
            short |= self.preemptions != preemptions
        budget += kept
        if newcomers and not short:
            budget -= self._seat(newcomers, step, budget)
        while not short and self.waiting and budget > 0 and len(step.seqs) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.guide is not None and not seq.guide.ready():
                self.waiting.popleft()  # waits for its grammar aside, holding nothing
                if seq.matched:
                    self._unmatch(seq)
                self.compiling.append(seq)
                continue
            if seq.guide is not None and self._guided(step) >= self.max_guided:
                break
            if not seq.matched:
                if not self._may_match(seq):
                    break
                self._match(seq)
                if seq.state is SeqState.LOADING:
                    self.waiting.popleft()
                    self.loading[seq.request_id] = seq
                    continue
            chunk = min(seq.num_tokens - seq.num_computed, budget)
            if self.cache.allocate(seq.request_id, seq.num_computed + chunk) is None:
                for other in self.waiting:  # loaded ones queued behind it hold nothing either
                    if other.matched:
                        self._unmatch(other)
                seq.gave_way = self.cache.swap_ins_wait  # its match would take their room again
                break
            self.waiting.popleft()
            seq.state = SeqState.RUNNING
            seq.scheduled_at = seq.scheduled_at or time.monotonic()
            seq.asked_storage = False  # matched again after a preemption, it may read again
            self.running.append(seq)
            self._add(step, seq, chunk)
            budget -= chunk
        if not step.seqs:
            if self.cache.stalled_swap_ins and (giver := self._room_giver()) is not None:
                self._preempt(giver)
            return None
        self.inflight = step
        return step

    def _newcomers(self) -> list[bytes]:
        """Owners with a request waiting that could be admitted now and none admitted (running or
        loading), while other owners have some; in the queue's turn order."""
        if not self.waiting or not (self.running or self.loading):
            return []
        seated = {owner_of(s) for s in self.running} | {owner_of(s) for s in self.loading.values()}
        out = []
        for owner in self.waiting.owners():
            seq = self.waiting.head_of(owner)
            if owner in seated or (seq.guide is not None and not seq.guide.ready()) \
                    or (seq.gave_way and self.cache.swap_ins_wait):
                continue  # (the queue's own turn moves a compiling one aside; see _may_match)
            out.append(owner)
        return out

    def _make_room(self, newcomers: list[bytes], budget: int) -> int:
        """Seats for the newcomers, taken from the owners holding the most (while the seats are
        full), and the part of the step's budget kept for them: at most half of it."""
        for owner in newcomers:
            if len(self.running) < self.max_num_seqs or not self._preempt_for_share(owner):
                break
        need = sum(self.waiting.head_of(o).num_tokens for o in newcomers)
        return min(budget // 2, need)

    def _seat(self, newcomers: list[bytes], step: Step, budget: int) -> int:
        """Admit each newcomer's first request, after the running sequences had their blocks:
        as an admission from the queue, except that the blocks of its first chunk may be taken
        from the newest running sequence (not in this step) of an owner holding two seats or
        more. Returns the tokens it gave out."""
        given = 0
        for owner in newcomers:
            left = budget - given
            if left <= 0 or len(step.seqs) >= self.max_num_seqs:
                break
            seq = self.waiting.head_of(owner)
            if seq.guide is not None and self._guided(step) >= self.max_guided:
                continue
            if not seq.matched:
                if not self._may_match(seq):
                    continue
                self._match(seq)
                if seq.state is SeqState.LOADING:
                    self.waiting.pop_owner(owner)
                    self.loading[seq.request_id] = seq
                    continue
            chunk = min(seq.num_tokens - seq.num_computed, left)
            while self.cache.allocate(seq.request_id, seq.num_computed + chunk) is None:
                if not self._preempt_for_share(owner, step):
                    self._unmatch(seq)
                    seq.gave_way = self.cache.swap_ins_wait  # as in the queue's admissions
                    return given
            self.waiting.pop_owner(owner)
            seq.state = SeqState.RUNNING
            seq.asked_storage = False
            self.running.append(seq)
            self._add(step, seq, chunk)
            given += chunk
        return given

    def _preempt_for_share(self, owner: bytes, step: Step | None = None) -> bool:
        """Preempt the newest running sequence (not in `step`, and whose blocks the connector
        does not read) of the owner other than `owner` that holds the most seats, if it holds
        two or more. False when there is none."""
        mine: dict[bytes, list[Sequence]] = {}
        for s in self.running:
            mine.setdefault(owner_of(s), []).append(s)
        mine.pop(owner, None)
        for seqs in sorted(mine.values(), key=len, reverse=True):
            if len(seqs) < 2:
                return False
            victim = next((s for s in reversed(seqs) if not self.connector.reading(s)
                           and (step is None or s not in step.seqs)), None)
            if victim is not None:
                log.info("preempting %s so that another client's request is served", victim.request_id)
                self._preempt(victim)
                return True
        return False

    @staticmethod
    def _guided(step: Step) -> int:
        return sum(seq.guide is not None for seq in step.seqs)

    def _grammars_ready(self) -> None:
        """Sequences whose grammar is now compiled go back to the front of the queue (they
        arrived before those queued since), in arrival order; those whose grammar failed fail."""
        if not self.compiling:
            return
        ready = []
        for seq in list(self.compiling):
            if seq.guide.ready() or seq.guide.problem:
                if seq.guide.problem:
                    self._fail_guided(seq)
                else:
                    self.compiling.remove(seq)
                    ready.append(seq)
        for seq in reversed(ready):
            self.waiting.appendleft(seq)

    def _fail_guided(self, seq: Sequence) -> None:
        """A guided sequence whose grammar cannot be followed fails (`take_failed` tells it)."""
        self._finish(seq, "error")
        self.failed.append((seq, seq.guide.problem))

    def take_failed(self) -> StepOutcome:
        """The sequences that failed outside a step since the last call (their grammar did not
        compile, in time or at all), to tell their clients."""
        out, self.failed = StepOutcome(failed=self.failed), []
        return out

    def _add(self, step: Step, seq: Sequence, chunk: int) -> None:
        start = seq.num_computed
        step.seqs.append(seq)
        step.chunks.append(chunk)
        step.starts.append(start)
        blocks = -(-(start + chunk) // self.block_size)
        step.tables.append(self.cache.block_table(seq.request_id)[:blocks])
        step.group_tables.append([t[:blocks] for t in self.cache.group_tables(seq.request_id)])
        seq.ran_prompt(start, start + chunk)

    def _grow(self, seq: Sequence, num_tokens: int, step: Step) -> bool:
        """Blocks for `num_tokens` of `seq`. When the device cannot supply them now: wait if
        they are on their way back (no preemption for blocks in-flight tasks return), else
        preempt the newest loading sequence, then later running ones."""
        while self.cache.allocate(seq.request_id, num_tokens) is None:
            if self.cache.reclaimable(seq.request_id, num_tokens):
                return False  # swap-outs in flight return the blocks; try again next step
            victim = self._victim(seq, step)
            if victim is None:
                return False  # blocks come back when tasks finish; try again next step
            self._preempt(victim)
        return True

    def _victim(self, seq: Sequence, step: Step) -> Sequence | None:
        """Who gives blocks up for `seq`: the newest loading sequence whose swap-in still waits
        for room (nothing computed, nothing moving yet), then a waiting one that holds the match
        it was loaded for, then the newest running sequence not in this step. (A loading
        sequence whose transfers are under way is left alone: it becomes a waiting one.)"""
        if (stuck := self._waiting_for_room()) is not None:
            return stuck
        for other in self.waiting:
            if other.matched:
                return other
        return next((s for s in reversed(self.running)
                     if s is not seq and s not in step.seqs and not self.connector.reading(s)), None)

    def _room_giver(self) -> Sequence | None:
        """Who gives device blocks up when the oldest deferred swap-in cannot get room and no
        step can run: a waiting sequence holding the match it was loaded for (queued behind one
        that cannot start, it would hold it for nothing), else, of the loading sequences waiting
        for room, the one holding the most device blocks that does not wait for that swap-in
        itself (newest first on a tie), else the newest. A loading one is not matched again
        while swap-ins wait, so its blocks stay given up."""
        for other in self.waiting:
            if other.matched:
                return other
        waiting = [s for s in reversed(self.loading.values()) if self.cache.waits_for_room(s.request_id)]
        others = [s for s in waiting if not self.cache.waits_first(s.request_id)]
        if others:
            return max(others, key=lambda s: self.cache.device_blocks_held(s.request_id))
        return waiting[0] if waiting else None

    def _waiting_for_room(self) -> Sequence | None:
        """The newest loading sequence whose swap-in is deferred for lack of device blocks."""
        return next((s for s in reversed(self.loading.values()) if self.cache.waits_for_room(s.request_id)), None)

    def _may_match(self, seq: Sequence) -> bool:
        """A sequence that gave its blocks up to swap-ins waiting for room (it stopped loading,
        or its allocation queued behind them) is matched again only once none waits: matched
        at once, it would take the same blocks back (or flip back the swap-outs making their
        room) and the swap-ins it gave way to would never get their room."""
        if seq.gave_way and self.cache.swap_ins_wait:
            return False
        seq.gave_way = False
        return True

    def _match(self, seq: Sequence) -> None:
        """Match `seq` against the prefix cache (the hit counters count its first match only).
        Every match is remembered for the cached tokens it is told: a match given back may find
        more when made again, and what it finds beyond the earlier ones is told in its tiers.

        Storage is read once per admission: a sequence matched again before it ran (its match
        given back for lack of blocks) matches the tree only, where what its read found now
        is. Else waiting sequences whose reads hold the blocks each other needs would give
        their matches back, read again, and do so for ever (a shared store's lookup says
        "maybe" to every key, so every match starts a read)."""
        keys = seq.keys if seq.reads_cache else []  # (its blocks are recorded under its keys all the same)
        res = self.cache.match(seq.request_id, keys, seq.num_tokens, count=not seq.counted,
                               storage=not seq.asked_storage)
        seq.asked_storage = seq.asked_storage or res.storage_tokens > 0
        seq.matched = seq.counted = True
        seq.matches.append((res.device_tokens, res.host_tokens, res.storage_tokens))
        seq.num_computed = res.cached_tokens
        seq.state = SeqState.WAITING if res.ready else SeqState.LOADING

    def _unmatch(self, seq: Sequence) -> None:
        """Give a waiting sequence's match back (it could not get its blocks): it holds no
        block while it waits, and is matched again when it is next in line."""
        self.cache.release(seq.request_id)
        seq.matched = False
        seq.num_computed = 0

    def _preempt(self, seq: Sequence) -> None:
        """Take `seq`'s blocks back. Only a running sequence loses computed work (and counts
        as a preemption); a loading or loaded-but-waiting one just gives its match back."""
        if seq.state is SeqState.WAITING:  # holds a loaded match: give it back, keep its place
            log.debug("%s gives its loaded match back to free device blocks", seq.request_id)
            self._unmatch(seq)
            return
        if seq.state is SeqState.LOADING:
            log.debug("%s stops loading to free device blocks", seq.request_id)
            del self.loading[seq.request_id]
            seq.gave_way = True
            if seq.request_id in self.external_ids:  # back to waiting for blocks to hold
                self._unmatch(seq)
                seq.state = SeqState.WAITING
                self.reserving.appendleft(seq)
            else:
                self._requeue(seq)
            return
        log.info("preempting %s (%d tokens computed) to free device blocks", seq.request_id, seq.num_computed)
        self.running.remove(seq)
        self._requeue(seq)
        seq.preemptions += 1
        self.preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        """Drop the sequence's blocks and queue it first: it is recomputed (prefix hits help)."""
        self._unmatch(seq)
        seq.state = SeqState.WAITING
        self.waiting.appendleft(seq)

    # ---- results --------------------------------------------------------------------------
    def finish_step(self, step: Step, tokens: np.ndarray, logprobs: list[float] | None = None,
                    top: list[list] | None = None) -> StepOutcome:
        """Apply rank 0's sampled tokens (and their log-probabilities and alternatives, where
        asked): advance, record written blocks, emit, finish."""
        self.inflight = None
        out = StepOutcome()
        if logprobs is None or len(logprobs) != len(step.seqs):
            logprobs = [0.0] * len(step.seqs)
        if top is None or len(top) != len(step.seqs):
            top = [None] * len(step.seqs)
        for seq, chunk, token, logprob, alt in zip(step.seqs, step.chunks, tokens.tolist(), logprobs, top):
            seq.num_computed += chunk
            if seq.cancelled:
                self._finish(seq, "cancelled")
                out.finished.append(seq)
                continue
            if seq.num_computed == seq.num_tokens:  # the chunk ended the known tokens
                seq.append(token, logprob, alt)
                out.emitted.append((seq, seq.num_output - 1))
            self.cache.update(seq.request_id, seq.num_computed, seq.keys)
            if not seq.done() and seq.guide is not None and seq.guide.problem:
                self._finish(seq, "error")  # never a token outside the grammar: the request fails
                out.failed.append((seq, seq.guide.problem))
            elif seq.done():
                self._finish(seq, seq.finish_reason)
                out.finished.append(seq)
            elif seq.num_output and self.connector.takes_over(seq):
                self.running.remove(seq)
                seq.state = SeqState.EXTERNAL
        return out

    # ---- KV from outside ----------------------------------------------------------------------
    def admit_external(self) -> list[Sequence]:
        """Sequences whose external tokens now have blocks, in arrival order (EXTERNAL; the
        connector is told through `update_state_after_alloc`). Like a waiting sequence, one is
        matched only when it is next in line and gives its match back when the blocks for the
        rest cannot be had yet."""
        out = []
        while self.reserving:
            seq = self.reserving[0]
            if not seq.matched:
                if not self._may_match(seq):
                    break
                self._match(seq)
                if seq.state is SeqState.LOADING:
                    self.reserving.popleft()
                    self.loading[seq.request_id] = seq
                    continue
            tokens = self.external_ids[seq.request_id]
            # (pages only for what it reads from the first token on: a sliding group's window)
            if self.cache.allocate(seq.request_id, tokens, reads_from=tokens) is None:
                self._unmatch(seq)
                break
            self.reserving.popleft()
            seq.state = SeqState.EXTERNAL
            seq.asked_storage = False
            out.append(seq)
            self.connector.update_state_after_alloc(
                seq, self.cache.block_table(seq.request_id)[:-(-tokens // self.block_size)])
        return out

    def external_kv_arrived(self, seq: Sequence, first_token: int, first_logprob: float = 0.0,
                            first_top: list | None = None) -> bool:
        """The external tokens' KV is written and `first_token` was sampled from it: record the
        received blocks and decode from here. False if the request is already done (then it is
        finished)."""
        seq.num_computed = self.external_ids.pop(seq.request_id)
        seq.append(first_token, first_logprob, first_top)
        self.cache.update(seq.request_id, seq.num_computed, seq.keys)
        if seq.done():
            self._finish(seq, seq.finish_reason)
            return False
        seq.state = SeqState.RUNNING
        seq.scheduled_at = seq.scheduled_at or time.monotonic()
        self.running.append(seq)
        return True

    def incoming_blocks(self) -> list[int]:
        """Blocks being written from outside (held for external tokens that are not here yet):
        nobody here may read or write them."""
        out: list[int] = []
        bs = self.block_size
        for rid, tokens in self.external_ids.items():
            seq = self.seqs[rid]
            if seq.state is SeqState.EXTERNAL:
                out += self.cache.block_table(rid)[seq.num_computed // bs:-(-tokens // bs)]
                for table in self.cache.group_tables(rid):
                    out += [b for b in table[seq.num_computed // bs:-(-tokens // bs)] if b >= 0]
        return out

    def drop(self, seq: Sequence, reason: str) -> None:
        """Finish a sequence outside a step (its KV went elsewhere, or never came)."""
        self._finish(seq, reason)

    def fail_step(self, step: Step, reason: str) -> StepOutcome:
        """A rank failed the step: its sequences fail; their blocks are released."""
        self.inflight = None
        out = StepOutcome()
        for seq in step.seqs:
            self._finish(seq, "error")
            out.failed.append((seq, reason))
        return out

    def on_task_outcome(self, outcome: TaskOutcome) -> None:
        """A swap-in or storage read finished: sequences it completes may run; sequences that
        lost the KV they waited for are recomputed from scratch instead of failing."""
        for rid, tokens in outcome.ready.items():
            seq = self.loading.pop(rid, None)
            if seq is None:
                continue
            seq.num_computed = tokens
            device, host, _ = seq.matches[-1]  # a short storage read served fewer tokens
            seq.matches[-1] = (device, host, max(0, tokens - device - host))
            if rid in self.external_ids:
                seq.state = SeqState.WAITING  # the local prefix is in place; now hold the rest
                self.reserving.appendleft(seq)
                continue
            seq.state = SeqState.WAITING
            self.waiting.appendleft(seq)
        for rid in outcome.failed:
            seq = self.loading.pop(rid, None)
            if seq is None:
                continue
            log.warning("%s lost its cached prefix (%s task failed); recomputing it",
                        rid, outcome.task.kind.value)
            if rid in self.external_ids:
                self._unmatch(seq)  # match again (what is left), then hold blocks
                seq.state = SeqState.WAITING
                self.reserving.appendleft(seq)
                continue
            self._requeue(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Take the sequence out of the one queue its state says it is in, and release it."""
        state, seq.state = seq.state, SeqState.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        self.seqs.pop(seq.request_id, None)
        external = self.external_ids.pop(seq.request_id, None) is not None
        self.loading.pop(seq.request_id, None)
        queue = {SeqState.RUNNING: self.running,
                 SeqState.WAITING: self.reserving if external else self.waiting}.get(state)
        if seq in self.compiling:
            queue = self.compiling
        if queue is not None:
            queue.remove(seq)
        if seq.matched:
            if self.connector.reading(seq):  # its blocks are being read: released when that ends
                self.held[seq.request_id] = seq
                return
            self.cache.release(seq.request_id)
            seq.matched = False

    def release_held(self, seq: Sequence) -> None:
        """The connector no longer reads the blocks of `seq`: release them if it ended meanwhile."""
        if self.held.pop(seq.request_id, None) is not None:
            self.cache.release(seq.request_id)
            seq.matched = False


def _in_turns(seqs: list[Sequence], budget: int) -> tuple[list[Sequence], int]:
    """The order in which running sequences `seqs` (in admission order) take a step's `budget`,
    and the most one prefill chunk may take. With one owner: `seqs` as they are, and all of it.
    With several: the decodes first (a token each), then the prefills in turns of owners (each
    owner's first, then each one's second, ...; owners in the order of their oldest), a chunk
    taking at most an equal share, between the owners prefilling, of what the decodes leave."""
    by_owner: dict[bytes, list[Sequence]] = {}
    for s in seqs:
        by_owner.setdefault(owner_of(s), []).append(s)
    if len(by_owner) < 2:
        return list(seqs), budget
    lists = list(by_owner.values())
    turns = [q[i] for i in range(max(map(len, lists))) for q in lists if i < len(q)]
    decodes = [s for s in turns if s.num_tokens - s.num_computed <= 1]
    prefills = [s for s in turns if s.num_tokens - s.num_computed > 1]
    owners = len({owner_of(s) for s in prefills})
    return decodes + prefills, -(-max(budget - len(decodes), 1) // max(owners, 1))
