"""The life of a node, as the launcher runs it: create every shared object, start the
children, wait until each is ready, supervise, and stop cleanly.

Why the launcher owns every object: one owner per shared object makes its lifetime explicit.
Children only attach, so a child crash never leaves a half-owned segment; the launcher
unlinks everything at exit, also after a crash, and a later launcher or `kvrt clean`
reclaims what a SIGKILLed launcher left (the registry lists it all).

Children are real processes started from the command line (no fork of this process, no
pickle); they get SIGTERM if the launcher dies (PR_SET_PDEATHSIG) and also notice by
themselves through the registry owner's pid.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import psutil

from ipc import protocol as P
from ipc.registry import Registry
from ipc.ring import Ring
from ipc.signals import Signal
from runtime.config import NodeConfig

log = logging.getLogger("kvrt.launch")
RING_BYTES = 1 << 20
_PR_SET_PDEATHSIG = 1


class PoolMaker(Protocol):
    """How the KV pools are sized and made; the launcher passes workers/' implementation in,
    so runtime/ never imports workers/."""

    def bytes_needed(self, cfg: dict) -> int: ...

    def create(self, reg: Registry, cfg: dict, progress: Callable[[str], None]) -> None: ...


@dataclass
class Child:
    role: int
    rank: int
    proc: subprocess.Popen

    @property
    def name(self) -> str:
        return f"{P.ROLE_NAMES[self.role]}[{self.rank}]"


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


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

    # ---- shared objects ------------------------------------------------------------------
    def create_objects(self) -> None:
        """Create the registry (refusing a live node) and every object the children attach."""
        cfg = self.cfg
        self.reg = reg = Registry.create(cfg.node)
        try:
            _check_shm_room(self.pools.bytes_needed(cfg.to_dict()), cfg)
            P.publish_config(reg, cfg.to_dict())
            slots = len(P.proc_slots(cfg.tp))
            Signal.create(reg, P.PROCS, (slots, P.PROC_FIELDS), np.int64)
            Signal.create(reg, P.HEARTBEAT, slots, np.int64)
            Signal.create(reg, P.READY, slots, np.int32)
            Signal.create(reg, P.NODE_STATUS, P.STATUS_FIELDS, np.int64)
            Signal.create(reg, P.ENGINE_STATS, len(P.STATS), np.float64)
            if cfg.check_ownership:
                Signal.create(reg, P.OWNERS_DEVICE, cfg.num_gpu_blocks, np.int32)
                Signal.create(reg, P.OWNERS_HOST, max(cfg.num_cpu_blocks, 1), np.int32)
            reg.create_doorbell(P.ENGINE_BELL)
            for r in range(cfg.tp):
                Ring.create(reg, P.to_worker(r), RING_BYTES)
                Ring.create(reg, P.from_worker(r), RING_BYTES, bell=P.ENGINE_BELL)
                if cfg.needs_transfer:
                    Ring.create(reg, P.to_transfer(r), RING_BYTES)
                    Ring.create(reg, P.from_transfer(r), RING_BYTES, bell=P.ENGINE_BELL)
                if cfg.disaggregated:
                    Ring.create(reg, P.to_messager(r), RING_BYTES)
                    Ring.create(reg, P.from_messager(r), RING_BYTES, bell=P.ENGINE_BELL)
            self.pools.create(reg, cfg.to_dict(), self.progress)
        except BaseException:
            self.unlink()
            raise

    def unlink(self) -> None:
        if self.reg is not None:
            removed = self.reg.unlink_all()
            log.debug("unlinked %d objects of node %s", len(removed), self.cfg.node)
            self.reg = None

    # ---- children ------------------------------------------------------------------------
    def start_children(self) -> None:
        cfg = self.cfg
        plan = [(P.ROLE_ENGINE, 0, "runtime.engine")]
        plan += [(P.ROLE_WORKER, r, "workers.worker") for r in range(cfg.tp)]
        if cfg.needs_transfer:
            plan += [(P.ROLE_TRANSFER, r, "workers.cache_transfer") for r in range(cfg.tp)]
        if cfg.disaggregated:
            plan += [(P.ROLE_MESSAGER, r, "workers.cache_messager") for r in range(cfg.tp)]
        level = logging.getLevelName(logging.getLogger().level)
        for role, rank, module in plan:
            cmd = [sys.executable, "-m", module, "--node", cfg.node, "--log-level", level]
            if role != P.ROLE_ENGINE:
                cmd += ["--rank", str(rank)]
            out = None
            if cfg.log_dir:
                os.makedirs(cfg.log_dir, exist_ok=True)
                out = open(os.path.join(cfg.log_dir, f"{P.ROLE_NAMES[role]}-{rank}.log"), "ab")
            proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True,
                                    preexec_fn=_die_with_parent, cwd=os.getcwd(), env=_child_env())
            if out:
                out.close()
            self.children.append(Child(role, rank, proc))

    def _dead_children(self, timeout: float) -> list[Child]:
        """Block up to `timeout` s until a child exits; returns the ones that did."""
        procs = {c.proc.pid: c for c in self.children}
        try:
            ps = [psutil.Process(pid) for pid in procs]
        except psutil.NoSuchProcess:
            ps = []
        gone, _ = psutil.wait_procs(ps, timeout=timeout) if ps else ([], [])
        dead = [procs[p.pid] for p in gone]
        dead += [c for c in self.children if c.proc.poll() is not None and c not in dead]
        return dead

    def wait_ready(self) -> None:
        """Wait for every child's ready flag, with a progress line and the config's timeout."""
        ready = Signal.attach(self.reg, P.READY)
        slots = {c.name: P.slot_of(self.cfg.tp, c.role, c.rank) for c in self.children}
        t0 = time.monotonic()
        next_line = t0 + 1.0
        try:
            while True:
                waiting = [n for n, s in slots.items() if not ready.array[s]]
                if not waiting:
                    return
                if dead := self._dead_children(0.1):
                    raise RuntimeError(f"{dead[0].name} (pid {dead[0].proc.pid}) exited with code "
                                       f"{dead[0].proc.poll()} during start-up")
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
        finally:
            ready.close()

    def _set_status(self, value: int) -> None:
        st = Signal.attach(self.reg, P.NODE_STATUS)
        st.array[P.ST_NODE] = value
        st.close()

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
        """Run until a signal (exit 0 after a clean stop), a child's death (exit 1), or the end
        of the node's job (its exit code)."""
        self._set_status(P.NODE_RUNNING)
        while not self._stop_signal:
            self._beat()
            if self._job is not None and not self._job.is_alive():
                self.stop()
                return self._job_rc
            dead = self._dead_children(0.2)
            if dead:
                for c in dead:
                    log.error("%s (pid %d) died with exit code %s; stopping node %s", c.name, c.proc.pid,
                              c.proc.poll(), self.cfg.node)
                self.stop(grace_s=2.0)
                return 1
        log.info("signal %d: stopping node %s", self._stop_signal, self.cfg.node)
        self.stop()
        return 0

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
            for c in alive:
                try:
                    c.proc.wait(max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    pass
            alive = [c for c in alive if c.proc.poll() is None]
            if not alive:
                break
            log.warning("still running after %s: %s", "stop request" if sig is None else sig.name,
                        ", ".join(c.name for c in alive))

    # ---- the whole life ----------------------------------------------------------------
    def run(self, job: Callable[[], int] | None = None) -> int:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._on_signal)
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
            self.unlink()

    def _on_signal(self, signum: int, _frame) -> None:
        self._stop_signal = signum


def _child_env() -> dict[str, str]:
    """The children's environment: BLAS single-threaded unless the user chose otherwise. Each
    process of a node already has its own core to itself at best; a BLAS thread pool per
    process oversubscribes the cores, and on a busy machine its spinning threads made a small
    matmul 100x slower (8 ms instead of 70 us, measured on the 2-core CI machine)."""
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(var, "1")
    return env


def _check_shm_room(need: int, cfg: NodeConfig) -> None:
    from ipc.shm import shm_free_bytes

    free = shm_free_bytes()
    if need > free:
        pools = (f"{cfg.num_cpu_blocks} host" if cfg.device == "cuda"
                 else f"{cfg.num_gpu_blocks} device + {cfg.num_cpu_blocks} host")
        raise RuntimeError(f"/dev/shm has {free / 2**20:.0f} MiB free but node {cfg.node} needs "
                           f"{need / 2**20:.0f} MiB for its KV pools ({cfg.tp} rank(s) × {pools} blocks × "
                           f"{cfg.block_bytes} bytes); lower --num-gpu-blocks/--num-cpu-blocks")
