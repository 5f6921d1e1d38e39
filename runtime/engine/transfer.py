"""The engine's side of the cache-transfer ranks: send every task to every rank, complete a
task only when all ranks answered, fail it (never hang) when one does not answer in time.

Each task carries its deadline; a rank that gets to it later (paused, overloaded) answers it
failed without touching a block, and an answer that arrives after the engine expired the task
is ignored: an expired task is reported failed exactly once.

Several tasks are in flight at once and ranks answer in their own time; the engine keeps
scheduling meanwhile, so answers are matched to tasks by id as they arrive through the
engine's fan-in, each task's answers collected by a rank group.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np

from kvrt.ipc.channel import Sender, broadcast
from kvrt.ipc.protocol import OWNER_TRANSFER, TransferDone, TransferTask
from kvrt.ipc.rank_group import RankGroup
from kvrt.runtime.engine.ownership import TASK_SOURCES, OwnerTable

log = logging.getLogger(__name__)


@dataclass
class TaskResult:
    """A finished task: ok only if every rank succeeded; `blocks` is the minimum any rank did
    (for STORAGE2GPU, the prefix every rank has)."""

    task: TransferTask
    ok: bool
    blocks: int
    nbytes: int
    seconds: float
    error: str = ""
    store_errors: int = 0  # store failures the ranks answered as misses
    store_forged: int = 0  # objects without a valid MAC the ranks answered as misses


@dataclass
class _Pending:
    task: TransferTask
    started: float
    ranks: RankGroup[TransferDone]


class TransferClient:
    def __init__(self, senders: list[Sender], rank_timeout: float, send_timeout: float = 5.0,
                 owners: tuple[OwnerTable, OwnerTable] | None = None):
        self.senders = senders
        self.owners = owners  # (device, host) tables in KVRT_CHECK_OWNERSHIP mode
        self.rank_timeout = rank_timeout
        self.send_timeout = send_timeout
        self._pending: dict[int, _Pending] = {}

    @property
    def inflight(self) -> int:
        return len(self._pending)

    def submit(self, task: TransferTask) -> None:
        """Send `task` (numbered by its creator, the prefix cache) to every rank, under a deadline.

        The task object itself is not changed: what travels is a copy with int32 block arrays
        and the deadline, and it comes back in the TaskResult under the same id."""
        if task.task_id in self._pending:
            raise ValueError(f"task {task.task_id} is already in flight")
        now = time.monotonic()
        # the ranks must not start the task after the engine gave up on it (and so may have
        # given its blocks to someone else): time.monotonic() is one clock for the whole machine
        sent = dataclasses.replace(task, device_blocks=np.asarray(task.device_blocks, dtype=np.int32),
                                   host_blocks=np.asarray(task.host_blocks, dtype=np.int32),
                                   keys=list(task.keys), deadline=now + self.rank_timeout)
        if self.owners is not None:
            dev_from, host_from = TASK_SOURCES[sent.kind]
            order = f"task {sent.task_id} ({sent.kind})"
            self.owners[0].hand_over(sent.device_blocks, OWNER_TRANSFER, dev_from, order)
            self.owners[1].hand_over(sent.host_blocks, OWNER_TRANSFER, host_from, order)
        self._pending[sent.task_id] = _Pending(sent, now, RankGroup(len(self.senders), sent.deadline))
        broadcast(self.senders, sent, self.send_timeout)

    def on_answer(self, done: TransferDone) -> TaskResult | None:
        """Record one rank's answer; returns the result once every rank has answered."""
        p = self._pending.get(done.task_id)
        if p is None:
            log.warning("answer for unknown or expired task %d from rank %d", done.task_id, done.rank)
            return None
        if not 0 <= done.rank < p.ranks.size:
            log.warning("answer for task %d from unknown rank %d", done.task_id, done.rank)
            return None
        if not p.ranks.add(done.rank, done):
            return None
        del self._pending[done.task_id]
        answers = p.ranks.answers
        errors = [f"rank {a.rank}: {a.error}" for a in answers if not a.ok]
        return TaskResult(p.task, not errors, min(a.blocks for a in answers), sum(a.nbytes for a in answers),
                          time.monotonic() - p.started, "; ".join(errors),
                          sum(a.store_errors for a in answers if isinstance(a.store_errors, int)),
                          sum(a.store_forged for a in answers if isinstance(a.store_forged, int)))

    def expire(self, now: float | None = None) -> list[TaskResult]:
        """Fail every task whose deadline passed, naming the ranks that did not answer."""
        now = time.monotonic() if now is None else now
        out = []
        for tid in [t for t, p in self._pending.items() if p.ranks.expired(now)]:
            p = self._pending.pop(tid)
            missing = p.ranks.missing()
            err = (f"task {tid} ({p.task.kind}, {len(p.task.device_blocks)} blocks): no answer from "
                   f"cache-transfer rank(s) {missing} within {self.rank_timeout:.3g}s")
            log.error(err)
            out.append(TaskResult(p.task, False, 0, 0, now - p.started, err))
        return out
