"""How many BLAS threads a worker's matmuls use on a CPU.

Why not the BLAS library's own default (every core): its threads spin-wait for each other at
the end of each matmul. A decode step is a few hundred small matmuls (a handful of token rows
against each weight matrix); split over two threads each one is a rendezvous, and on a shared
machine, where another process holds one of the cores, a thread waits a scheduler slice for its
preempted partner, so two threads can be many times slower than one. A prefill chunk's matmuls
(hundreds of rows) are long enough for every core to pay off. So the default, `auto`, gives a
step one thread below PARALLEL_ROWS token rows and every core of the worker's share from there;
`kvrt launch --threads N` fixes N for every step instead (`kvrt bench model --threads` measures
each choice, with and without a competing process).

threadpoolctl sets the count on whichever BLAS numpy loaded (OpenBLAS, MKL, BLIS), at run time,
for the length of a step and back (microseconds), so no setting leaks out of the step it was
chosen for.
"""
from __future__ import annotations

import logging
import os
from typing import ContextManager

from threadpoolctl import ThreadpoolController

log = logging.getLogger("kvrt.workers.threads")

AUTO = 0             # the --threads value that picks per step
PARALLEL_ROWS = 64   # token rows from which an `auto` step's matmuls use every core


def usable_cores(ranks: int = 1) -> int:
    """This process's CPUs (its affinity, not the machine's count), shared out over `ranks`
    workers of one node so their threads do not oversubscribe the cores."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, ranks))


class BlasThreads:
    """The BLAS thread count of one worker's steps: fixed (setting > 0) or chosen by each
    step's token rows (setting AUTO)."""

    def __init__(self, setting: int = AUTO, cores: int | None = None) -> None:
        if setting < 0:
            raise ValueError(f"BLAS threads must be >= 0 (0: auto), got {setting}")
        self.setting = setting
        self.cores = cores if cores is not None else usable_cores()
        self._controller = ThreadpoolController()
        log.info("BLAS threads: %s", setting or f"auto (1 below {PARALLEL_ROWS} rows, else {self.cores})")

    def count(self, rows: int) -> int:
        """Threads for a step of `rows` token rows."""
        if self.setting != AUTO:
            return self.setting
        return self.cores if rows >= PARALLEL_ROWS else 1

    def for_rows(self, rows: int) -> ContextManager[object]:
        """Run a step of `rows` token rows inside this: its thread count in force until the
        block ends."""
        return self._controller.limit(limits=self.count(rows), user_api="blas")

    def current(self) -> int:
        """The BLAS thread count in force now (the largest over loaded BLAS libraries; 0 if none)."""
        return max((lib.num_threads for lib in self._controller.select(user_api="blas").lib_controllers),
                   default=0)
