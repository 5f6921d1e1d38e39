"""How many BLAS threads a worker's matmuls use on a CPU.

Why not the BLAS library's own default (every core): its threads spin-wait for each other at
the end of each matmul. A decode step is a few hundred small matmuls (a handful of token rows
against each weight matrix); split over two threads each one is a rendezvous, and on a shared
machine, where another process holds one of the cores, a thread waits a scheduler slice for its
preempted partner, so two threads can be many times slower than one. A prefill chunk's matmuls
(hundreds of rows) are long enough for every core to pay off, but only for cores nothing else
wants: a thread sharing its core with another busy process is preempted as often. So the
default, `auto`, gives a step one thread below PARALLEL_ROWS token rows, and from there the
worker's cores less those other processes are running on when the step starts (the kernel's
count of runnable threads, /proc/stat's procs_running, an instant's snapshot read in about
0.1 ms: nothing next to a step that long), at least one; `kvrt launch --threads N` fixes N for
every step instead (`kvrt bench model --threads` measures each choice, with and without a
competing process).

threadpoolctl sets the count on whichever BLAS numpy loaded (OpenBLAS, MKL, BLIS), at run time,
for the length of a step and back (microseconds), so no setting leaks out of the step it was
chosen for.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, ContextManager

from threadpoolctl import ThreadpoolController

log = logging.getLogger("kvrt.workers.model.threads")

AUTO = 0             # the --threads value that picks per step
PARALLEL_ROWS = 64   # token rows from which an `auto` step's matmuls use every core


def runnable_others() -> int:
    """Threads the kernel has running or ready to run now, this one left out (0 where
    /proc/stat does not say)."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"procs_running"):
                    return max(0, int(line.split()[1]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def usable_cores(ranks: int = 1) -> int:
    """This process's CPUs (its affinity, not the machine's count), shared out over `ranks`
    workers of one node so their threads do not oversubscribe the cores."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, ranks))


class BlasThreads:
    """The BLAS thread count of one worker's steps: fixed (setting > 0) or chosen by each
    step's token rows (setting AUTO)."""

    def __init__(self, setting: int = AUTO, cores: int | None = None,
                 others: Callable[[], int] = runnable_others) -> None:
        if setting < 0:
            raise ValueError(f"BLAS threads must be >= 0 (0: auto), got {setting}")
        self.setting = setting
        self.cores = cores if cores is not None else usable_cores()
        self.others = others
        self.last = 0  # the count of the latest step, for a benchmark's row
        self._controller = ThreadpoolController()
        log.info("BLAS threads: %s", setting or f"auto (1 below {PARALLEL_ROWS} rows, else up to {self.cores})")

    def count(self, rows: int) -> int:
        """Threads for a step of `rows` token rows, starting now."""
        if self.setting != AUTO:
            return self.setting
        if rows < PARALLEL_ROWS:
            return 1
        return max(1, self.cores - self.others())

    def for_rows(self, rows: int) -> ContextManager[object]:
        """Run a step of `rows` token rows inside this: its thread count in force until the
        block ends."""
        self.last = self.count(rows)
        return self._controller.limit(limits=self.last, user_api="blas")

    def current(self) -> int:
        """The BLAS thread count in force now (the largest over loaded BLAS libraries; 0 if none)."""
        return max((lib.num_threads for lib in self._controller.select(user_api="blas").lib_controllers),
                   default=0)
