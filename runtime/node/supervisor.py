"""The life of a node, as the launcher runs it: create every shared object, start the
children, wait until each is ready, supervise, and stop cleanly.

Why the launcher owns every object: one owner per shared object makes its lifetime explicit.
Children only attach, so a child crash never leaves a half-owned segment; the launcher
unlinks everything at exit, also after a crash, and a later launcher or `kvrt clean`
reclaims what a SIGKILLed launcher left (the registry lists it all).

Children are real processes started from the command line (no fork of this process, no
pickle); they get SIGTERM if the launcher dies (PR_SET_PDEATHSIG) and also notice by
themselves through the registry owner's pid.

Supervision: the launcher waits on a pidfd per child (it reaps through Popen, so the exit
status it reports is the real one) and reads every ready child's heartbeat; a child that died,
or whose heartbeat the launcher has seen still for --hang-timeout of its own running time (a
node paused whole and resumed is not hung: ipc/watchdog.py), fails the node. The engine goes
first: the launcher writes why into the node's errors row and sends it SIGTERM, so it fails every request
in flight with that reason at once; only then are the others stopped (a hung one killed). The
culprit reported is the process that failed by itself, in its own words (its errors row), not
one that merely left after it.

The gateway is the exception (runtime/gateway/): it owns the sockets outsiders reach, holds no
node state, and dies when libzmq aborts it on a hostile peer's bytes. Once the node runs, a dead
or hung gateway is logged with its cause (its exit, its own last error, its log's last line) and
started again after a back-off that doubles with each death in quick succession, counted in the
node status (`kvrt status`); the node goes on. During start-up its death fails the start, as any
child's does (a public port in use is reported so).
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from kvrt.ipc import protocol as P
from kvrt.ipc.lifetime import die_with_parent
from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import HEADER as RING_HEADER
from kvrt.ipc.ring import Ring
from kvrt.ipc.signals import Signal
from kvrt.ipc.sockets import make_socket_dir
from kvrt.ipc.topology import Topology
from kvrt.ipc.watchdog import Watchdog, pause_gap
from kvrt.runtime.node.config import NodeConfig
from kvrt.runtime.node.limits import raise_open_files_limit

log = logging.getLogger("kvrt.launch")
RING_BYTES = 1 << 20
PAGE = 4096
ENGINE_ABORT_S = 5.0  # how long a failing node waits for the engine to fail its requests and exit
SUPERVISE_S = 0.2  # the supervision loop's period: its longest wait for a child's exit
GATEWAY_BACKOFF_S = 0.2   # the first restart of a dead gateway waits this long, each quick next one twice the last,
GATEWAY_BACKOFF_MAX_S = 5.0  # ... up to this,
GATEWAY_STABLE_S = 30.0   # ... and a gateway that ran this long before it died restarts after the first wait again
_PROGRAMS = {P.ROLE_ENGINE: "kvrt.runtime.engine.engine", P.ROLE_WORKER: "kvrt.workers.worker",
             P.ROLE_TRANSFER: "kvrt.workers.cache_transfer", P.ROLE_MESSAGER: "kvrt.workers.cache_messager",
             P.ROLE_GATEWAY: "kvrt.runtime.gateway.gateway"}


class PoolMaker(Protocol):
    """How the KV pools are sized and made; the launcher passes workers/' implementation in,
    so runtime/ never imports workers/."""

    def bytes_needed(self, cfg: NodeConfig) -> int: ...

    def create(self, reg: Registry, cfg: NodeConfig, progress: Callable[[str], None]) -> None: ...


@dataclass
class Child:
    role: int
    rank: int
    proc: subprocess.Popen
    pidfd: int = -1  # readable once the process exited (select.poll), without reaping it
    started: float = 0.0  # time.monotonic() at its start

    @property
    def name(self) -> str:
        return f"{P.ROLE_NAMES[self.role]}[{self.rank}]"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def describe_exit(code: int | None) -> str:
    """A Popen return code in words: the real code, or the signal that ended the process."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def ring_count(cfg: NodeConfig) -> int:
    """Rings of the node: to and from each worker, cache-transfer and cache-messager rank."""
    return len(Topology.of(cfg).links)


def shm_needs(cfg: NodeConfig, pool_bytes: int) -> dict[str, int]:
    """Bytes of /dev/shm each kind of object takes once created (every segment is allocated in
    full at creation), for the room check before any of them exists."""
    signal_bytes = [*Topology.of(cfg).signal_bytes(), PAGE]  # ... and the config
    return {"KV pools": pool_bytes,
            "rings": ring_count(cfg) * _pages(RING_HEADER + RING_BYTES),
            "signals": sum(_pages(n) for n in signal_bytes)}


def _pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


# `python -m` would put the working directory first on sys.path, so a `kvrt/` folder where
# `kvrt launch` runs would be imported instead of the installed kvrt. The children drop it
# (as -P does, which needs 3.11) and import kvrt from where it is installed.
_BOOT = ("import runpy, sys; sys.path[:1] = [] if sys.path[:1] == [''] else sys.path[:1]; "
         "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def child_command(module: str, args: Sequence[str]) -> list[str]:
    """The command line that runs kvrt's `module` as a program with `args`, importing kvrt's
    own modules whatever the working directory holds."""
    return [sys.executable, "-c", _BOOT, module, *args]


class Node:
    def __init__(self, cfg: NodeConfig, pools: PoolMaker, progress: Callable[[str], None] = print):
        self.cfg = cfg
        self.pools = pools
        self.progress = progress
        self.reg: Registry | None = None
        self.children: list[Child] = []
        self._stop_signal = 0
        self._job: threading.Thread | None = None
        self._job_rc = 0
        self._sig: dict[str, Signal] = {}  # the signals the launcher reads and writes itself
        self._watch: Watchdog[int] = Watchdog(pause_gap(cfg.hang_timeout, SUPERVISE_S))  # heartbeats by slot
        self._gateway_due: float | None = None  # when a dead gateway's successor starts
        self._gateway_deaths = 0  # deaths in quick succession (GATEWAY_STABLE_S): the back-off's exponent
        self._wake = -1  # the read end of the signals' wake-up pipe while run() runs (_dead_children polls it)

    # ---- shared objects ------------------------------------------------------------------
    def create_objects(self) -> None:
        """Create the registry (refusing a live node) and every object the children attach."""
        cfg = self.cfg
        self.reg = reg = Registry.create(cfg.node)
        try:
            _check_shm_room(shm_needs(cfg, self.pools.bytes_needed(cfg)), cfg)
            P.publish_config(reg, cfg.to_dict())
            if cfg.has_gateway:
                make_socket_dir(cfg.node)  # (removed with the shared memory: Registry.unlink_all)
            self._sig.update(Topology.of(cfg).create(reg, RING_BYTES))
            self.pools.create(reg, cfg, self.progress)
        except BaseException:
            self.unlink()
            raise

    def unlink(self) -> None:
        for s in self._sig.values():
            s.close()
        self._sig.clear()
        if self.reg is not None:
            removed = self.reg.unlink_all()
            log.debug("unlinked %d objects of node %s", len(removed), self.cfg.node)
            self.reg = None

    # ---- children ------------------------------------------------------------------------
    def start_children(self) -> None:
        cfg = self.cfg
        if cfg.log_dir and not os.path.isdir(cfg.log_dir):
            os.makedirs(cfg.log_dir, mode=0o700)  # logs carry prompts' fates: the user's alone
        for role, rank in Topology.of(cfg).processes:
            self._start(role, rank)

    def _start(self, role: int, rank: int) -> Child:
        cfg = self.cfg
        level = logging.getLevelName(logging.getLogger().level)
        cmd = child_command(_PROGRAMS[role], ["--node", cfg.node, "--log-level", level])
        if role not in (P.ROLE_ENGINE, P.ROLE_GATEWAY):
            cmd += ["--rank", str(rank)]
        out = None
        if cfg.log_dir:
            out = os.open(self._log_path(role, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.fchmod(out, 0o600)  # also a file left by an earlier run with a wider mode
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True,
                                    preexec_fn=die_with_parent, cwd=os.getcwd(), env=_child_env())
        finally:
            if out is not None:
                os.close(out)
        child = Child(role, rank, proc, os.pidfd_open(proc.pid), time.monotonic())
        self.children.append(child)
        self._assign_rings(role, rank, proc.pid)
        return child

    def _log_path(self, role: int, rank: int) -> str:
        return os.path.join(self.cfg.log_dir, f"{P.ROLE_NAMES[role]}-{rank}.log")

    def _assign_rings(self, role: int, rank: int, pid: int) -> None:
        """Write `pid` into the rings this child will write and read, before it attaches, so a
        child killed during start-up is reported by its peers' waits as dead, not awaited."""
        for link in Topology.of(self.cfg).links:
            if link.producer == (role, rank):
                Ring.assign(self.reg.find(link.channel.obj), producer=pid)
            if link.consumer == (role, rank):
                Ring.assign(self.reg.find(link.channel.obj), consumer=pid)

    def _dead_children(self, timeout: float) -> list[Child]:
        """Block up to `timeout` s until a child exits; returns every child that has exited
        and was not returned before. Reaps through Popen, so each keeps its real status."""
        live = [c for c in self.children if c.proc.returncode is None]
        if live:
            poller = select.poll()
            for c in live:
                poller.register(c.pidfd, select.POLLIN)
            if self._wake >= 0:  # a signal ends the wait too: a stop starts at once
                poller.register(self._wake, select.POLLIN)
            poller.poll(max(timeout, 0.0) * 1000)
            if self._wake >= 0:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake, 256)
        return [c for c in live if c.proc.poll() is not None]

    def _error_of(self, c: Child) -> str:
        errors = self._sig.get(P.ERRORS)
        return P.get_text(errors.array[self._slot(c)]) if errors is not None else ""

    def _slot(self, c: Child) -> int:
        return P.slot_of(self.cfg.tp, c.role, c.rank)

    def _report(self, c: Child, when: str = "") -> str:
        """`worker[0] (pid 12) exited with code 1<when>: <its own last error>`."""
        err = self._error_of(c)
        return f"{c.name} (pid {c.proc.pid}) {describe_exit(c.proc.returncode)}{when}" + (f": {err}" if err else "")

    def _culprit(self, dead: list[Child]) -> Child:
        """The child that failed by itself: not one that left because another was gone."""
        return next((c for c in dead if c.proc.returncode != P.EXIT_ORPHAN), dead[0])

    def _hung(self) -> list[tuple[Child, float]]:
        """Ready children whose heartbeat has not moved for the hang timeout of the launcher's
        own running time, with those seconds (one round of supervision per call)."""
        beats, ready = self._sig[P.HEARTBEAT].array, self._sig[P.READY].array
        cfg = self.cfg.to_dict()
        paused = self._watch.tick()
        if paused:
            log.warning("the launcher did not run for %.1fs (was the node paused?): each process has "
                        "--hang-timeout (%gs) from now to beat again", paused, self.cfg.hang_timeout)
        out = []
        for c in self.children:
            slot = self._slot(c)
            beat = int(beats[slot])
            if c.proc.returncode is None and ready[slot] and beat:
                still = self._watch.observe(slot, beat)
                if still > P.hang_threshold(cfg, c.role):
                    out.append((c, still))
        return out

    def _in_step(self, c: Child) -> str:
        """`, in step N` when the child said it was computing step N (a worker does)."""
        step = int(self._sig[P.PROCS].array[self._slot(c), P.PROC_STEP]) - 1 if P.PROCS in self._sig else -1
        return f", in step {step}" if step >= 0 else ""

    def wait_ready(self) -> None:
        """Wait for every child's ready flag, with a progress line and the config's timeout
        (which also bounds a child that hangs while starting)."""
        ready = self._sig[P.READY]
        slots = {c.name: self._slot(c) for c in self.children}
        t0 = time.monotonic()
        next_line = t0 + 1.0
        while True:
            waiting = [n for n, s in slots.items() if not ready.array[s]]
            if not waiting:
                return
            if dead := self._dead_children(0.1):
                for c in dead:
                    log.error("%s", self._report(c, " during start-up"))
                raise RuntimeError(self._report(self._culprit(dead), " during start-up"))
            if self._stop_signal:
                raise KeyboardInterrupt
            now = time.monotonic()
            if now - t0 > self.cfg.ready_timeout:
                raise TimeoutError(f"timed out after {self.cfg.ready_timeout:.0f}s waiting for "
                                   f"{', '.join(waiting)} to become ready")
            if now >= next_line:
                self.progress(f"waiting for {', '.join(waiting)} ({len(slots) - len(waiting)}/"
                              f"{len(slots)} ready, {now - t0:.0f}s)")
                next_line = now + 1.0

    def _set_status(self, value: int) -> None:
        if P.NODE_STATUS in self._sig:
            self._sig[P.NODE_STATUS].array[P.ST_NODE] = value

    def _beat(self) -> None:
        """The launcher's heartbeat: `kvrt status` tells a hung launcher from a live one by it."""
        st = Signal.attach(self.reg, P.NODE_STATUS)
        st.array[P.ST_LAUNCHER_BEAT] = time.monotonic_ns()
        st.close()

    def _start_job(self, job: Callable[[], int]) -> None:
        """Run `job` (a workload against the ready node, e.g. the demo) in a thread; the node
        stops cleanly when it returns, and exits with its code."""
        def body() -> None:
            try:
                self._job_rc = job()
            except Exception:
                log.exception("the node's job failed")
                self._job_rc = 1

        self._job = threading.Thread(target=body, name="node-job", daemon=True)
        self._job.start()

    def supervise(self) -> int:
        """Run until a signal (exit 0 after a clean stop), a child's death or hang (exit 1),
        or the end of the node's job (its exit code)."""
        self._set_status(P.NODE_RUNNING)
        while not self._stop_signal:
            self._beat()
            if self._job is not None and not self._job.is_alive():
                self.stop()
                return self._job_rc
            dead = [c for c in self._dead_children(SUPERVISE_S) if not self._gateway_died(c)]
            if dead:
                for c in dead:
                    log.error("%s", self._report(c))
                self._fail(self._report(self._culprit(dead)))
                return 1
            hung = [(c, age) for c, age in self._hung() if not self._gateway_hung(c, age)]
            self._restart_gateway_when_due()
            if hung:
                for c, age in hung:
                    log.error("%s (pid %d) is hung: no heartbeat for %.1fs (--hang-timeout %g)",
                              c.name, c.proc.pid, age, self.cfg.hang_timeout)
                c, age = hung[0]
                self._fail(f"{c.name} (pid {c.proc.pid}) is hung (no heartbeat for {age:.1f}s{self._in_step(c)})",
                           [c for c, _ in hung])
                return 1
        log.info("signal %d: stopping node %s", self._stop_signal, self.cfg.node)
        self.stop()
        return 0

    # ---- the gateway: restarted, never the node's end (module docstring) ----------------------
    def _gateway_died(self, c: Child, why: str = "") -> bool:
        """True if `c` is the gateway: its death is logged with its cause and its successor's
        start scheduled after the back-off."""
        if c.role != P.ROLE_GATEWAY:
            return False
        quick = time.monotonic() - c.started < GATEWAY_STABLE_S
        self._gateway_deaths = self._gateway_deaths + 1 if quick else 1
        delay = min(GATEWAY_BACKOFF_S * 2 ** (self._gateway_deaths - 1), GATEWAY_BACKOFF_MAX_S)
        log.error("%s%s%s; another starts in %.1fs (the engine and its requests go on)", self._report(c), why,
                  self._last_words(c), delay)
        self._retire(c)
        self._gateway_due = time.monotonic() + delay
        return True

    def _gateway_hung(self, c: Child, still: float) -> bool:
        """True if `c` is the gateway: it is killed, then replaced as a dead one is."""
        if c.role != P.ROLE_GATEWAY:
            return False
        c.proc.kill()
        try:
            c.proc.wait(ENGINE_ABORT_S)
        except subprocess.TimeoutExpired:
            log.warning("gateway (pid %d) still runs after SIGKILL", c.proc.pid)
        return self._gateway_died(c, f" after it hung (no heartbeat for {still:.1f}s)")

    def _retire(self, c: Child) -> None:
        """Forget a child that is gone: its slot's ready flag and heartbeat are cleared, so its
        successor is watched from its own first beat."""
        self.children.remove(c)
        if c.pidfd >= 0:
            os.close(c.pidfd)
            c.pidfd = -1
        slot = self._slot(c)
        for name in (P.READY, P.HEARTBEAT):
            if name in self._sig:
                self._sig[name].array[slot] = 0

    def _restart_gateway_when_due(self) -> None:
        if self._gateway_due is None or time.monotonic() < self._gateway_due:
            return
        self._gateway_due = None
        c = self._start(P.ROLE_GATEWAY, 0)
        restarts = 0
        if P.NODE_STATUS in self._sig:
            status = self._sig[P.NODE_STATUS].array
            status[P.ST_GATEWAY_RESTARTS] += 1
            restarts = int(status[P.ST_GATEWAY_RESTARTS])
        log.warning("gateway started again (pid %d; restart %d of this node)", c.proc.pid, restarts)

    def _last_words(self, c: Child) -> str:
        """`; its log ends: <line>` from the child's log file (libzmq's assertion, say)."""
        if not self.cfg.log_dir:
            return ""  # (its stderr is the launcher's: the line is just above)
        try:
            with open(self._log_path(c.role, c.rank), "rb") as f:
                f.seek(max(os.fstat(f.fileno()).st_size - 4096, 0))
                lines = [ln for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return f"; its log ends: {lines[-1][-300:]}" if lines else ""

    def _fail(self, why: str, hung: Sequence[Child] = ()) -> None:
        """A child died or hung: the engine first (SIGTERM after `why` is written where it
        reads it, so it fails every request in flight naming the cause), then the others."""
        log.error("stopping node %s: %s", self.cfg.node, why)
        if P.ERRORS in self._sig:
            P.put_text(self._sig[P.ERRORS].array[-1], why)
        for c in hung:  # a stopped process would sit on SIGTERM forever
            c.proc.kill()
        engine = next((c for c in self.children if c.role == P.ROLE_ENGINE), None)
        if engine is not None and engine.alive:
            engine.proc.send_signal(signal.SIGTERM)
            try:
                engine.proc.wait(ENGINE_ABORT_S)
            except subprocess.TimeoutExpired:
                log.warning("engine (pid %d) did not stop within %.0fs of SIGTERM", engine.proc.pid, ENGINE_ABORT_S)
        for c in self.children:
            if c.alive and c is not engine:
                c.proc.send_signal(signal.SIGTERM)
        self.stop(grace_s=2.0)
        log.error("node %s stopped because %s", self.cfg.node, why)

    def stop(self, grace_s: float = 10.0) -> None:
        """Ask the engine to wind down (it tells the others), then make sure every child is gone."""
        if self.reg is not None:
            self._set_status(P.NODE_STOPPING)
        alive = [c for c in self.children if c.proc.poll() is None]
        deadline = time.monotonic() + grace_s
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if sig is not None:
                for c in alive:
                    if c.proc.poll() is None:
                        c.proc.send_signal(sig)
                deadline = time.monotonic() + 2.0
            # each child is reaped as its pidfd says it exited (Popen.wait polls with sleeps of up
            # to 50 ms, and the gateway waits for the engine's reaping before it exits)
            alive = [c for c in alive if c.proc.poll() is None]
            while alive and (left := deadline - time.monotonic()) > 0:
                self._dead_children(left)
                alive = [c for c in alive if c.proc.poll() is None]
            if not alive:
                break
            log.warning("still running after %s: %s", "stop request" if sig is None else sig.name,
                        ", ".join(c.name for c in alive))

    # ---- the whole life ----------------------------------------------------------------
    def run(self, job: Callable[[], int] | None = None) -> int:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._on_signal)
        # a signal's handler runs only once the wait it arrived in is over; its byte on this pipe
        # (Python writes it as the signal arrives) ends the supervision's wait at once instead
        self._wake, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old_wake = signal.set_wakeup_fd(wake_w)
        raise_open_files_limit()  # (the children inherit it)
        try:
            self.create_objects()
            self.start_children()
            self.wait_ready()
            self.progress(f"node {self.cfg.node} ready: role {self.cfg.role}, tp {self.cfg.tp}, device "
                          f"{self.cfg.device}, {self.cfg.num_gpu_blocks} device + {self.cfg.num_cpu_blocks} "
                          f"host blocks of {self.cfg.block_bytes} bytes (kvrt status --node {self.cfg.node})")
            if job is not None:
                self._start_job(job)
            return self.supervise()
        except KeyboardInterrupt:
            self.stop()
            return 0
        except Exception:
            self.stop(grace_s=2.0)
            raise
        finally:
            for c in self.children:
                if c.pidfd >= 0:
                    os.close(c.pidfd)
                    c.pidfd = -1
            self.unlink()
            signal.set_wakeup_fd(old_wake)
            os.close(wake_w)
            os.close(self._wake)
            self._wake = -1

    def _on_signal(self, signum: int, _frame) -> None:
        self._stop_signal = signum


# glibc malloc (see _child_env): blocks under 32 MiB (the ceiling of glibc's own adaptive
# threshold) come from the heap, and up to 128 MiB of freed heap is kept for the next step
CHILD_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(128 << 20)}


def _child_env() -> dict[str, str]:
    """The children's environment: BLAS single-threaded unless the user chose otherwise. Each
    process of a node already has its own core to itself at best; a BLAS thread pool per
    process oversubscribes the cores, and on a busy machine its spinning threads made a small
    matmul 100x slower (8 ms instead of 70 us, measured on the 2-core CI machine).

    glibc's malloc keeps its heap unless the user chose otherwise (CHILD_MALLOC): by default it
    gives freed memory back once 2x the largest freed block sits unused at the top of the heap,
    so a worker that only ever ran decode steps (a decode node's) returned its step temporaries
    after every step and took ~1,000 page faults in the next one: 7 ms of CPU per step where a
    mixed node's worker, whose prefills had raised those thresholds, took 3.8 ms."""
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    if not any(var in env for var in CHILD_MALLOC):  # (setting one turns glibc's own adjustment off)
        env.update(CHILD_MALLOC)
    return env


def _check_shm_room(needs: dict[str, int], cfg: NodeConfig) -> None:
    """Refuse a node that would not fit in /dev/shm, naming what takes the room, before any of
    it is created (a segment created on a full tmpfs would SIGBUS a process at first touch)."""
    from kvrt.ipc.shm import shm_free_bytes

    free, need = shm_free_bytes(), sum(needs.values())
    if need > free:
        pools = (f"{cfg.num_cpu_blocks} host" if cfg.device == "cuda"
                 else f"{cfg.num_gpu_blocks} device + {cfg.num_cpu_blocks} host")
        parts = {"KV pools": f"{cfg.tp} rank(s) × {pools} blocks × {cfg.block_bytes} bytes",
                 "rings": f"{ring_count(cfg)} × {RING_BYTES / 2**20:.0f} MiB"}
        detail = ", ".join(f"{what} {n / 2**20:.1f} MiB" + (f" ({parts[what]})" if what in parts else "")
                           for what, n in needs.items())
        raise RuntimeError(f"/dev/shm has {free / 2**20:.1f} MiB free but node {cfg.node} needs "
                           f"{need / 2**20:.1f} MiB: {detail}; lower --num-gpu-blocks/--num-cpu-blocks "
                           f"or free /dev/shm")
