"""The engine's compile processes (runtime/grammar/worker.py): a few of them, each held to a time
limit per compile (killed, not abandoned, past it, and a fresh one started) and a memory limit,
with compiles taken from the clients in turn.

Why per-client turns: one client's slow grammar must not delay another's ordinary schema. A
client has at most one compile running; the next compile goes to the client whose last turn is
the oldest among those with none running, so with N processes up to N clients compile at once,
and a client that floods only queues behind itself.

Why the index comes back as bytes: a compile process's Index reaches the engine in
outlines-core's own binary form (`Index.from_binary`), read here, in the process's thread, so
the engine's loop never parses it; nothing is pickled.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from kvrt.ipc.lifetime import die_with_parent
from kvrt.runtime.grammar import messages as M
from kvrt.runtime.grammar.limits import Limits
from kvrt.runtime.grammar.spec import GrammarError, describe

log = logging.getLogger("kvrt.grammar")
READY_TIMEOUT_S = 120.0  # a compile process reads the vocabulary (a large tokenizer.json) before it is ready
RESTART_PAUSE_S = 1.0    # between failed starts of a compile process
REPLY_SLACK = 1 << 20   # a reply's bytes beyond its index


@dataclass
class Compiled:
    """A compiled grammar: its outlines-core Index, how many token ids its vocabulary spans (a
    mask written from it needs room for all of them, even where the model has fewer), and the
    bytes of its binary form (what the engine's cache counts)."""

    index: Any
    vocab_size: int
    nbytes: int = 0


@dataclass
class _Job:
    id: int
    guided: dict
    eos: int
    client: bytes
    future: Future = field(default_factory=Future)


class _Queues:
    """Jobs waiting, per client, and which clients have one running. The next job is that of
    the client whose last turn is the oldest (a client that never had one first), among those
    with none running; ties go to the one that came to wait first."""

    def __init__(self) -> None:
        self.waiting: OrderedDict[bytes, deque[_Job]] = OrderedDict()  # clients in the order they came to wait
        self.running: set[bytes] = set()
        self.turn: dict[bytes, int] = {}  # client -> the number of its last turn (of clients waiting or running)
        self._turns = 0

    def put(self, job: _Job) -> None:
        self.waiting.setdefault(job.client, deque()).append(job)

    def take(self) -> _Job | None:
        ready = [c for c in self.waiting if c not in self.running]
        if not ready:
            return None
        client = min(ready, key=lambda c: self.turn.get(c, 0))
        jobs = self.waiting[client]
        job = jobs.popleft()
        if not jobs:
            del self.waiting[client]
        self._turns += 1
        self.turn[client] = self._turns
        self.running.add(client)
        return job

    def done(self, client: bytes) -> None:
        self.running.discard(client)
        if client not in self.waiting:
            self.turn.pop(client, None)  # a client that comes back later is not held back by an old turn


class CompilePool:
    """`workers` compile processes over one vocabulary (`setup`), each compile under `limits`;
    `wake` is called (from a pool thread) when a compile ends."""

    def __init__(self, setup: M.Setup, limits: Limits, workers: int = 2, wake: Callable[[], None] | None = None,
                 command: list[str] | None = None):
        from kvrt.runtime.node.supervisor import child_command

        self.setup = setup
        self.limits = limits
        self.wake = wake
        self.command = command or child_command("kvrt.runtime.grammar.worker", [])
        self.vocab_size = 0
        self._queues = _Queues()
        self._cond = threading.Condition()
        self._closed = False
        self._used = False  # the processes start with the first compile (a node may never need one)
        self._ids = 0
        self._slots = [_Slot(self, i) for i in range(max(1, workers))]
        for s in self._slots:
            s.thread.start()

    def submit(self, guided: dict, eos: int, client: bytes = b"") -> Future:
        """A Future of the `Compiled` grammar of `guided` (its exception a GrammarError)."""
        with self._cond:
            self._ids += 1
            job = _Job(self._ids, dict(guided), eos, client)
            if self._closed:
                job.future.set_exception(GrammarError("the node is stopping", refused=False))
                return job.future
            self._queues.put(job)
            self._used = True
            self._cond.notify_all()
        return job.future

    def _wait_used(self) -> bool:
        """Wait for the first compile; False once the pool is closed."""
        with self._cond:
            while not self._used and not self._closed:
                self._cond.wait(1.0)
            return not self._closed

    def _take(self) -> _Job | None:
        with self._cond:
            while not self._closed:
                job = self._queues.take()
                if job is not None:
                    return job
                self._cond.wait(1.0)
            return None

    def _finish(self, job: _Job, result: Compiled | None, error: GrammarError | None) -> None:
        with self._cond:
            self._queues.done(job.client)
            self._cond.notify_all()
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)
        if self.wake is not None:
            self.wake()

    def close(self) -> None:
        """Stop: waiting compiles fail, the processes are killed, the threads joined."""
        with self._cond:
            self._closed = True
            left = [j for jobs in self._queues.waiting.values() for j in jobs]
            self._queues.waiting.clear()
            self._cond.notify_all()
        for job in left:
            job.future.set_exception(GrammarError("the node is stopping", refused=False))
        for s in self._slots:
            s.kill()
        for s in self._slots:
            s.thread.join(timeout=5.0)

    def pids(self) -> list[int]:
        """The compile processes running now (for tests and `kvrt status`)."""
        return [s.proc.pid for s in self._slots if s.proc is not None and s.proc.poll() is None]


class _Slot:
    """One compile process and the thread that feeds it, times it and reads its answers."""

    def __init__(self, pool: CompilePool, n: int):
        self.pool = pool
        self.n = n
        self.proc: subprocess.Popen | None = None
        self.thread = threading.Thread(target=self._run, name=f"kvrt-grammar-{n}", daemon=True)
        self._lock = threading.Lock()

    def _run(self) -> None:
        # the processes are started from this thread, which lives as long as the pool: the
        # kernel's parent-death signal follows the thread that started a child
        if not self.pool._wait_used():
            return
        while not self.pool._closed:
            if self.proc is None and not self._start():
                time.sleep(RESTART_PAUSE_S)
                continue
            job = self.pool._take()
            if job is None:
                break
            result, error = self._compile(job)
            self.pool._finish(job, result, error)
        self.kill()

    def _start(self) -> bool:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1"}
        try:
            proc = subprocess.Popen(self.pool.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    preexec_fn=die_with_parent, env=env)
        except OSError as e:
            log.error("cannot start a grammar compile process: %s", e)
            return False
        with self._lock:
            self.proc = proc
        try:
            M.write(proc.stdin, self.pool.setup)
            ready = self._reply(proc, time.monotonic() + READY_TIMEOUT_S)
        except (OSError, ValueError) as e:
            ready = e
        if not isinstance(ready, M.Ready):
            if self.pool._closed:
                self.kill()
                return False
            log.error("a grammar compile process did not start (%s)", ready if ready is not None else
                      f"exit status {proc.poll()}")
            self.kill()
            return False
        self.pool.vocab_size = ready.vocab_size
        return True

    def _compile(self, job: _Job) -> tuple[Compiled | None, GrammarError | None]:
        limits, proc = self.pool.limits, self.proc
        t0 = time.monotonic()
        try:
            M.write(proc.stdin, M.Job(job.id, job.guided["kind"], job.guided.get("spec", ""), job.eos,
                                      limits.seconds, limits.memory_bytes, limits.index_bytes))
            reply = self._reply(proc, t0 + limits.seconds)
        except (OSError, ValueError) as e:  # a broken pipe, a malformed reply
            reply = e
        if isinstance(reply, M.Done) and reply.job == job.id:
            from outlines_core import Index

            t1 = time.monotonic()
            index = Index.from_binary(reply.index)
            log.info("compiled guided %s: %d states, %.1f MiB, %.2f s (%.3f s to read it back)", describe(job.guided),
                     reply.states, len(reply.index) / 2**20, t1 - t0, time.monotonic() - t1)
            return Compiled(index, max(self.pool.vocab_size, job.eos + 1), len(reply.index)), None
        if isinstance(reply, M.Failed) and reply.job == job.id:
            return None, GrammarError(reply.message, reply.refused)
        if reply == "timeout":
            self.kill()
            return None, GrammarError(f"guided {describe(job.guided)}: did not compile within the compile time limit "
                                      f"of {limits.seconds:g} s (kvrt launch --grammar-timeout), so it was stopped")
        status = self.kill()
        if status in (-signal.SIGABRT, -signal.SIGKILL, -signal.SIGSEGV):
            return None, GrammarError(f"guided {describe(job.guided)}: the compile went past its memory limit of "
                                      f"{limits.memory_bytes >> 20} MiB (kvrt launch --grammar-memory-mib) and "
                                      f"was stopped")
        return None, GrammarError(f"guided {describe(job.guided)}: the compile process failed ({reply or status})",
                                  refused=False)

    def _reply(self, proc: subprocess.Popen, deadline: float) -> object:
        """The process's next message, "timeout" past `deadline`, or None when it ended."""
        fd = proc.stdout.fileno()
        buf = bytearray()
        need = 4
        while len(buf) < need:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not ready:
                if self.pool._closed:
                    return None
                continue
            chunk = os.read(fd, min(need - len(buf), 1 << 22))
            if not chunk:
                return None
            buf += chunk
            if need == 4 and len(buf) >= 4:
                need = 4 + int.from_bytes(buf[:4], "little")
                if need > self.pool.limits.index_bytes + REPLY_SLACK:
                    raise ValueError(f"a {need}-byte reply from a compile process")
        return M.CODEC.decode(bytes(buf[4:]))

    def kill(self) -> int | None:
        """Kill the process (if any) and reap it: its exit status."""
        with self._lock:
            proc, self.proc = self.proc, None
        if proc is None:
            return None
        status = proc.poll()
        if status is None:
            proc.kill()
            try:
                status = proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                log.error("grammar compile process %d did not die within 10 s of SIGKILL", proc.pid)
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        return status
