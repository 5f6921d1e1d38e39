"""One forward step at a time: built from the scheduler's batch, sent to every worker rank,
done when each has answered, and the node failed when one does not answer in time.

Why a class of its own: the step in flight has state the scheduler does not keep (the ranks'
answers so far, the watch on its deadline) and a wire format the scheduler need not know
(`StepBatch`, flattened, with sampling fields only when some request samples). The loop only
launches a step and hands over the answers; their outcome goes to the clients.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable

import numpy as np

from kvrt.ipc import protocol as P
from kvrt.ipc.channel import Sender, broadcast
from kvrt.ipc.rank_group import RankGroup
from kvrt.ipc.watchdog import Watchdog, pause_gap
from kvrt.runtime.client import api
from kvrt.runtime.engine.clients import Clients
from kvrt.runtime.engine.ownership import OwnerSync, check_step
from kvrt.runtime.engine.scheduler import Scheduler, Step
from kvrt.runtime.engine.stats import EngineStats
from kvrt.runtime.node.config import NodeConfig

log = logging.getLogger("kvrt.engine")


# A step is overdue only once both bounds have passed: its worker ranks made no progress (no
# mark: a layer, a key tile of attention, a block of prompt scores; workers/progress.py) for the
# progress bound, and it ran longer than its size suggests. The progress bound is --rank-timeout,
# or SLACK times the longest stretch without a mark that an answered step ever had, if longer: it
# is learned from what the workers measurably did, and it holds however loaded the machine is,
# since a slower machine makes its marks further apart but still makes them (the first long step
# of a deep model under load is many marks, each well inside the bound). The size bound only keeps
# a step that makes no marks for a while but is short for its size (a GPU step whose host has
# queued every layer and waits for the device) from being cut on the progress bound alone:
# --rank-timeout plus SLACK times the slowest seconds per unit of work seen, before any the rank
# timeout per FIRST_STEP_WORK.
SLACK = 4.0  # a stretch without progress, or a step per unit of work, may be this many times the longest seen
FIRST_STEP_WORK = float(1 << 22)
LEARN_WORK = 1 << 16  # a step smaller than this is mostly fixed costs: its speed is not learned
# On a GPU the workers compile a kernel at its first use (CuPy, for each dtype and shape class;
# seconds each where the kernel cache is empty, a fresh machine's case): compiling makes no mark.
# The worker's warm-up compiles what a short batch needs, yet a node's first steps still meet new
# shapes: each of its first COMPILE_STEPS steps may go COMPILE_ALLOWANCE_S longer without
# progress. A worker stopped or blocked is still found by its heartbeat within --hang-timeout;
# this only delays the case of a worker that spins forever inside one of its very first steps.
COMPILE_STEPS = 1000
COMPILE_ALLOWANCE_S = 60.0


def step_work(chunks: list[int], starts: list[int]) -> int:
    """A step's size in (query token, context position) pairs: attention's cost, and at least
    one per token (the rest of the model's cost is per token)."""
    return sum(c * (s + c) for c, s in zip(chunks, starts))


class StepTimeout(RuntimeError):
    """A worker rank did not answer a step in time: the node is unhealthy; the engine exits."""


class StepRunner:
    """The step in flight between the scheduler and the worker ranks. `tick_s` is the loop's
    turn: a node paused whole with a step in flight goes on with it when resumed, since the
    bounds count the engine's own running time. `marks()` gives each worker rank's progress
    marks as its process published them (ipc/member.py); none: the progress bound alone never
    passes while the size bound has not."""

    def __init__(self, cfg: NodeConfig, to_workers: list[Sender], sched: Scheduler, clients: Clients,
                 owners: OwnerSync, stats: EngineStats, tick_s: float,
                 marks: Callable[[], tuple[int, ...]] = tuple):
        self.cfg = cfg
        self.to_workers = to_workers
        self.sched = sched
        self.clients = clients
        self.owners = owners
        self.stats = stats
        self._marks = marks
        self._answers: RankGroup[P.StepResult] | None = None  # answers to the step in flight
        self._watch: Watchdog[str] = Watchdog(pause_gap(cfg.rank_timeout, tick_s))
        self._s_per_work = 0.0  # the slowest seconds per unit of work of any answered step (0: none yet)
        self._longest_still = 0.0  # the longest stretch without progress of any answered step
        self._still = 0.0       # the longest one of the step in flight so far
        self._work = 0          # the work of the step in flight
        self._launched = 0.0
        self._answered = 0      # steps every rank answered so far
        self.deadline_s = cfg.rank_timeout  # how long the step in flight may take by its size

    def launch(self, step: Step) -> None:
        """Send `step` to every worker rank (checked against the block owners in debug mode)."""
        roles = self.owners.sync()
        bs = self.cfg.block_size
        tokens, tables, group_tables = [], [], []
        for seq, chunk, start, table, groups in zip(step.seqs, step.chunks, step.starts, step.tables,
                                                    step.group_tables or [[]] * len(step.seqs)):
            tokens.append(seq.tokens[start:start + chunk])
            tables.append(table)
            group_tables += groups
            if roles is not None:
                for g in [table] + groups:
                    t = np.asarray(g, dtype=np.int64)
                    reads = t[:start // bs]
                    check_step(roles, t[start // bs:], reads[reads >= 0], f"step {step.step_id} ({seq.request_id})")
        batch = P.StepBatch(step.step_id, np.concatenate(tokens), np.array(step.chunks, dtype=np.int32),
                            np.array(step.starts, dtype=np.int32), np.concatenate(tables).astype(np.int32),
                            np.array([len(t) for t in tables], dtype=np.int32))
        if group_tables:
            batch.group_tables = np.concatenate(group_tables).astype(np.int32)
        seqs = step.seqs
        biases = [seq.bias() for seq in seqs]
        if any(seq.temperature > 0 or seq.logprobs or seq.top_logprobs or seq.penalised for seq in seqs) \
                or any(biases):  # else all greedy: none sent
            batch.temperature = [seq.temperature for seq in seqs]
            batch.top_p = [seq.top_p for seq in seqs]
            batch.top_k = np.array([seq.top_k for seq in seqs], dtype=np.int32)
            batch.min_p = [seq.min_p for seq in seqs]
            batch.seed = [seq.seed for seq in seqs]
            batch.logprobs = np.array([seq.logprobs for seq in seqs], dtype=np.int32)
            _adjustments(batch, seqs, biases)
        _prompt_rows(batch, step)
        guided = [i for i, seq in enumerate(seqs) if seq.guide is not None]
        if guided:  # each guided sequence's allowed tokens now (runtime/engine/guide.py)
            batch.guided_rows = np.array(guided, dtype=np.int32)
            batch.guided_mask = np.concatenate([seqs[i].guide.mask for i in guided])
        broadcast(self.to_workers, batch, self.cfg.rank_timeout)
        self._work = step_work(step.chunks, step.starts)
        self._launched = time.monotonic()
        self.deadline_s = self.deadline_for(self._work)
        self._still = 0.0
        self._answers = RankGroup(self.cfg.tp, math.inf)  # overdue by the watch instead
        self.stats.count("steps")

    def on_result(self, res: P.StepResult) -> None:
        """One worker rank's answer; with the last one, the step's outcome to its clients."""
        step, answers = self.sched.inflight, self._answers
        if step is None or answers is None or res.step_id != step.step_id or not 0 <= res.rank < answers.size:
            log.warning("answer to step %d from worker[%d] for no step in flight", res.step_id, res.rank)
            return
        if not answers.add(res.rank, res):
            return
        self._answers = None
        self._answered += 1
        self._longest_still = max(self._longest_still, self._still, self._progress(step.step_id))
        if self._work >= LEARN_WORK:
            self._s_per_work = max(self._s_per_work, (time.monotonic() - self._launched) / self._work)
        errors = [a.error for a in answers.answers if a.error]
        if errors:
            self.clients.apply(self.sched.fail_step(step, "; ".join(errors)))
        elif problem := _prompt_scores(step, answers.answers[0]):
            self.clients.apply(self.sched.fail_step(step, f"worker[0]: {problem}"))
        else:
            first = answers.answers[0]
            self.clients.apply(self.sched.finish_step(step, first.tokens, first.logprobs,
                                                      _alternatives(step, first)))

    def deadline_for(self, work: int) -> float:
        """The size bound of a step of `work`: --rank-timeout, plus SLACK times what the slowest
        big step (LEARN_WORK) answered so far took per unit of work (before any: the rank timeout
        per FIRST_STEP_WORK). Alone it stops nothing (module comment)."""
        cfg = self.cfg
        per_work = SLACK * self._s_per_work if self._s_per_work else cfg.rank_timeout / FIRST_STEP_WORK
        return cfg.rank_timeout + per_work * work

    def stall_s(self) -> float:
        """How long the step in flight may go without a progress mark of any worker rank:
        --rank-timeout, or SLACK times the longest stretch without one of the steps answered so
        far when that is longer; a GPU node's first steps may also compile kernels."""
        compiling = COMPILE_ALLOWANCE_S if self.cfg.device == "cuda" and self._answered < COMPILE_STEPS else 0.0
        return max(self.cfg.rank_timeout, SLACK * self._longest_still) + compiling

    def _progress(self, step_id: int) -> float:
        """The engine's running seconds since a worker rank last made progress in step `step_id`."""
        return self._watch.observe("progress", (step_id, self._marks()))

    def check_deadline(self) -> None:
        """StepTimeout once the step in flight is overdue: no progress for `stall_s()` and longer
        than its size bound, both in the engine's running time (one round of the watch per call:
        once per turn of the loop); its requests are told first."""
        self._watch.tick()
        step, answers = self.sched.inflight, self._answers
        if step is None or answers is None:
            return
        still = self._progress(step.step_id)
        self._still = max(self._still, still)
        ran = self._watch.observe("step", step.step_id)
        if still < self.stall_s() or ran < self.deadline_s:
            return
        why = (f"worker rank(s) {answers.missing()} did not answer step {step.step_id}: no progress for "
               f"{still:.3g}s (the bound: {self.stall_s():.3g}s), {ran:.3g}s in all (a step of its size: "
               f"{self.deadline_s:.3g}s)")
        for seq in step.seqs:
            self.clients.reply(seq.client, api.ErrorEvent(seq.request_id, api.FAILED, why))
        raise StepTimeout(why)


def _adjustments(batch: P.StepBatch, seqs: list, biases: list[dict[int, float]]) -> None:
    """The batch's top_logprobs, logit bias and penalty fields, each group only when some
    sequence uses it; penalties as each sequence's distinct tokens and output counts now."""
    if any(seq.top_logprobs for seq in seqs):
        batch.top_logprobs = np.array([seq.top_logprobs for seq in seqs], dtype=np.int32)
    if any(biases):
        batch.bias_lens = np.array([len(b) for b in biases], dtype=np.int32)
        batch.bias_ids = np.array([t for b in biases for t in b], dtype=np.int32)
        batch.bias_vals = [v for b in biases for v in b.values()]
    if any(seq.penalised for seq in seqs):
        empty = (np.empty(0, np.int64), np.empty(0, np.int64))
        counts = [seq.penalty_counts() if seq.penalised else empty for seq in seqs]
        batch.repetition = [seq.repetition_penalty for seq in seqs]
        batch.presence = [seq.presence_penalty for seq in seqs]
        batch.frequency = [seq.frequency_penalty for seq in seqs]
        batch.pen_lens = np.array([len(ids) for ids, _ in counts], dtype=np.int32)
        batch.pen_ids = np.concatenate([ids for ids, _ in counts]).astype(np.int32)
        batch.pen_counts = np.concatenate([c for _, c in counts]).astype(np.int32)


def _prompt_rows(batch: P.StepBatch, step: Step) -> None:
    """The batch's prompt-logprob fields, when some sequence still scores its prompt: each
    sequence's rows to score and their targets (the prompt token after each row's position)."""
    rows = [seq.prompt_rows(start, chunk) for seq, chunk, start in zip(step.seqs, step.chunks, step.starts)]
    if not any(rows):
        return
    batch.prompt_rows = np.array(rows, dtype=np.int32)
    batch.prompt_targets = np.concatenate([seq.tokens[start + 1:start + 1 + n]
                                           for seq, start, n in zip(step.seqs, step.starts, rows)]).astype(np.int32)
    batch.prompt_top = np.array([seq.prompt_logprobs or 0 for seq in step.seqs], dtype=np.int32)


def _prompt_scores(step: Step, res: P.StepResult) -> str:
    """Give each sequence that scores its prompt its rows' scores from rank 0's answer; what is
    wrong with the answer's size ("" when nothing)."""
    rows = [seq.prompt_rows(start, chunk) for seq, chunk, start in zip(step.seqs, step.chunks, step.starts)]
    ks = [(seq.prompt_logprobs or 0) if n else 0 for seq, n in zip(step.seqs, rows)]
    n, tops = sum(rows), sum(r * k for r, k in zip(rows, ks))
    if (len(res.prompt_logprobs), len(res.prompt_ranks), len(res.prompt_top_ids), len(res.prompt_top_logprobs)) \
            != (n, n, tops, tops):
        return (f"answered {len(res.prompt_logprobs)} prompt logprobs and {len(res.prompt_top_ids)} alternatives "
                f"for {n} prompt rows with {tops} alternatives")
    at, top_at = 0, 0
    ids, lps = res.prompt_top_ids.tolist(), list(res.prompt_top_logprobs)
    for seq, start, r, k in zip(step.seqs, step.starts, rows, ks):
        if not r:
            continue
        top = [[ids[top_at + i * k:top_at + (i + 1) * k], lps[top_at + i * k:top_at + (i + 1) * k]] for i in range(r)]
        seq.add_prompt_scores(start, list(res.prompt_logprobs[at:at + r]), res.prompt_ranks[at:at + r].tolist(),
                              top if k else None)
        at, top_at = at + r, top_at + r * k
    return ""


def _alternatives(step: Step, res: P.StepResult) -> list[list] | None:
    """Each sequence's [ids, logprobs] alternatives from rank 0's answer (None: none asked,
    or an answer of the wrong size, which then gives each sequence empty ones)."""
    ks = [seq.top_logprobs for seq in step.seqs]
    if not any(ks) or len(res.top_ids) != sum(ks) or len(res.top_logprobs) != sum(ks):
        return None
    out, at = [], 0
    for k in ks:
        out.append([res.top_ids[at:at + k].tolist(), list(res.top_logprobs[at:at + k])])
        at += k
    return out
