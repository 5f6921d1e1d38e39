"""A process's membership in a node: its row in the process table, its heartbeat, its ready
flag, and the checks that tell it the node is gone.

Every child (engine, worker, cache-transfer, cache-messager) joins the same way, so status
readers find every process in one table and a child whose launcher died notices by itself
(an orphan must exit, not spin: nobody will send it an order or unlink its memory).

A launcher that is alive but stopped (SIGSTOP) or hung supervises nothing and serves no HTTP
client; the engine tells it from a live one by its heartbeat (the NODE_STATUS word it writes on
every round of its loop once the node runs), as the launcher tells a hung child: still for
`launcher_hang_s` of the watcher's own running time (ipc/watchdog.py, so a node paused whole is
not taken for it). Twice the children's hang timeout, and at least the node's launcher_grace
(--launcher-grace, 10 s unless set): the launcher's loop shares its process with the HTTP server,
whose work may hold it up a little.
"""
from __future__ import annotations

import logging
import os
import time

from kvrt.ipc import protocol as P
from kvrt.ipc.config import NodeConfig
from kvrt.ipc.errors import IpcError
from kvrt.ipc.registry import Registry, pid_alive, process_start_ms
from kvrt.ipc.signals import Signal
from kvrt.ipc.watchdog import Watchdog, pause_gap

log = logging.getLogger(__name__)


class Member:
    def __init__(self, reg: Registry, config: NodeConfig, role: int, rank: int):
        self.reg = reg
        self.config = config
        self.role = role
        self.rank = rank
        self.tp = config.tp
        self.slot = P.slot_of(self.tp, role, rank)
        self.procs = Signal.attach(reg, P.PROCS)
        self.heartbeat = Signal.attach(reg, P.HEARTBEAT)
        self.ready = Signal.attach(reg, P.READY)
        self.status = Signal.attach(reg, P.NODE_STATUS)
        try:  # optional: nodes assembled by hand (tests, benchmarks) may not have it
            self.errors: Signal | None = Signal.attach(reg, P.ERRORS)
        except IpcError:
            self.errors = None
        self._launcher = (reg.owner_pid, reg.owner_start_ms)
        self.launcher_hang_s = max(2 * float(config.hang_timeout), float(config.launcher_grace))
        self._launcher_watch: Watchdog[str] | None = None  # made by the first launcher_hung()
        pid = os.getpid()
        row = self.procs.array[self.slot]
        row[P.PROC_ROLE], row[P.PROC_RANK], row[P.PROC_START] = role, rank, process_start_ms(pid)
        row[P.PROC_PID] = pid
        self.record_error("")
        self.beat()

    @classmethod
    def join(cls, node: str, role: int, rank: int) -> "Member":
        reg = Registry.attach(node)
        return cls(reg, NodeConfig.read(reg), role, rank)

    @property
    def name(self) -> str:
        return f"{P.ROLE_NAMES[self.role]}[{self.rank}]"

    def beat(self) -> None:
        self.heartbeat.array[self.slot] = time.monotonic_ns()

    def in_step(self, step_id: int) -> None:
        """Publish the step this process is computing (-1: none), so that whoever finds it hung
        can say in which step."""
        self.procs.array[self.slot, P.PROC_STEP] = step_id + 1

    def progressed(self, marks: int) -> None:
        """Publish how many progress marks this process made so far (a worker's layers and
        attention tiles: workers/progress.py), which the engine's bound on a step reads."""
        self.procs.array[self.slot, P.PROC_MARKS] = marks

    def set_ready(self) -> None:
        self.ready.array[self.slot] = 1
        log.info("%s ready (pid %d)", self.name, os.getpid())

    def stopping(self) -> bool:
        return int(self.status.array[P.ST_NODE]) == P.NODE_STOPPING

    def launcher_alive(self) -> bool:
        return pid_alive(*self._launcher)

    def engine_alive(self) -> bool:
        row = self.procs.array[P.slot_of(self.tp, P.ROLE_ENGINE, 0)]
        return pid_alive(int(row[P.PROC_PID]), int(row[P.PROC_START]))

    def orphaned(self) -> str:
        """Why this process should exit on its own ('' while its node is alive)."""
        if not self.launcher_alive():
            return f"launcher (pid {self._launcher[0]}) is gone"
        if self.role != P.ROLE_ENGINE and self.ready.array[0] and not self.engine_alive():
            return "engine is gone"
        return ""

    def launcher_hung(self, poll_s: float) -> str:
        """Why the node must stop because its launcher's heartbeat stood still (module docstring;
        '' while it beats, and before the node runs). Call it once a round of a loop of period
        `poll_s`."""
        if self._launcher_watch is None:
            self._launcher_watch = Watchdog(pause_gap(self.launcher_hang_s, poll_s))
        self._launcher_watch.tick()
        status = self.status.array
        if int(status[P.ST_NODE]) != P.NODE_RUNNING:
            return ""
        still = self._launcher_watch.observe("launcher", int(status[P.ST_LAUNCHER_BEAT]))
        if still < self.launcher_hang_s:
            return ""
        return (f"the launcher (pid {self._launcher[0]}) made no progress for {still:.1f}s (it is stopped or hung: "
                f"nobody supervises the node or serves its HTTP clients)")

    def record_error(self, text: str) -> None:
        """Leave this process's fatal error where the launcher reads it: the launcher reports
        the failing process's own words, even when its stderr went elsewhere."""
        if self.errors is not None:
            P.put_text(self.errors.array[self.slot], text)

    def node_failure(self) -> str:
        """Why the launcher is stopping the node ('' unless a process died or hung)."""
        return P.get_text(self.errors.array[-1]) if self.errors is not None else ""

    def leave(self) -> None:
        self.ready.array[self.slot] = 0
        for s in (self.procs, self.heartbeat, self.ready, self.status, self.errors):
            if s is not None:
                s.close()
        self.reg.close()
