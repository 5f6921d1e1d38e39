"""A node built by hand for tests: what the launcher creates, with this process as the launcher
and the engine, and real child processes started with subprocess (no fork, no pickle).

    with NodeKit.create(node, tmp_path, tp=2, num_cpu_blocks=32) as kit:
        kit.start_transfer()
        answers = kit.request(TransferTask(...))
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvrt.ipc import protocol
from kvrt.ipc.errors import IpcError
from kvrt.ipc.member import Member
from kvrt.ipc.protocol import PROTOCOL, Shutdown, TransferDone
from kvrt.ipc.registry import Registry, process_start_ms
from kvrt.ipc.ring import Consumer, Producer
from kvrt.ipc.signals import Signal
from kvrt.ipc.topology import ENGINE, Topology
from kvrt.runtime.engine.engine import Engine
from kvrt.runtime.node.config import NodeConfig
from kvrt.runtime.node.supervisor import Node
from tests.conftest import REPO
from kvrt.workers.kv_pool import CreatedPools, PoolMaker, create_pools

SMALL = dict(num_gpu_blocks=64, num_cpu_blocks=64, num_layers=2, num_kv_heads=2, head_dim=16, block_size=4)


@dataclass
class NodeKit:
    reg: Registry
    cfg: NodeConfig
    log_dir: str
    signals: dict[str, Signal]
    pools: CreatedPools
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)  # rank -> cache-transfer
    _ends: dict[int, tuple[Producer, Consumer]] = field(default_factory=dict)

    @classmethod
    def create(cls, node: str, log_dir, **overrides) -> "NodeKit":
        """Registry, config, the node's signals and ownership tables (if asked), pools, and the
        task/answer rings of every cache-transfer rank; this process registers as the engine."""
        cfg = NodeConfig(node=node, **{**SMALL, **overrides}).validate()
        reg = Registry.create(node)
        try:
            protocol.publish_config(reg, cfg.to_dict())
            sig = Topology.of(cfg, roles=[protocol.ROLE_TRANSFER]).create(reg, 1 << 16)
            pools = create_pools(reg, cfg, lambda line: None)
            engine = sig[protocol.PROCS].array[0]
            engine[protocol.PROC_ROLE] = protocol.ROLE_ENGINE
            engine[protocol.PROC_START] = process_start_ms(os.getpid())
            engine[protocol.PROC_PID] = os.getpid()
            sig[protocol.READY].array[0] = 1
        except BaseException:
            reg.unlink_all()
            raise
        return cls(reg, cfg, str(log_dir), sig, pools)

    # ---- children -------------------------------------------------------------------------
    def slot(self, rank: int) -> int:
        return protocol.slot_of(self.cfg.tp, protocol.ROLE_TRANSFER, rank)

    def log_path(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"cache-transfer.{rank}.log")

    def log_text(self, rank: int) -> str:
        with open(self.log_path(rank)) as f:
            return f.read()

    def start_transfer(self, ranks: list[int] | None = None, timeout: float = 30.0) -> None:
        """Start cache-transfer for `ranks` (default: all) and wait until each is READY."""
        ranks = list(range(self.cfg.tp)) if ranks is None else ranks
        for r in ranks:
            with open(self.log_path(r), "ab") as log:
                self.procs[r] = subprocess.Popen(
                    [sys.executable, "-m", "kvrt.workers.cache_transfer", "--node", self.reg.node, "--rank", str(r)],
                    cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        for r in ranks:
            self.wait_ready(r, timeout)
            if self.cfg.storage:
                self.storage_listing(r)

    def storage_listing(self, rank: int) -> list[bytes]:
        """The keys rank `rank` listed at start (it does that before it is READY)."""
        keys: list[bytes] = []
        while True:
            msg = PROTOCOL.decode(self.ends(rank)[1].get(5.0))
            assert isinstance(msg, protocol.StorageKeys), f"expected the storage listing first, got {msg}"
            keys += msg.keys
            if msg.last:
                return keys

    def wait_ready(self, rank: int, timeout: float) -> None:
        ready = self.signals[protocol.READY].array
        deadline = time.monotonic() + timeout
        while not ready[self.slot(rank)]:
            try:
                code = self.procs[rank].wait(0.02)  # doubles as the pause between looks
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                raise AssertionError(f"cache-transfer[{rank}] exited {code}:\n{self.log_text(rank)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"cache-transfer[{rank}] not READY within {timeout}s:\n{self.log_text(rank)}")

    # ---- the engine's side of the rings -----------------------------------------------------
    def ends(self, rank: int) -> tuple[Producer, Consumer]:
        if rank not in self._ends:
            topo = Topology.of(self.cfg, roles=[protocol.ROLE_TRANSFER])
            orders, answers = topo.sends(ENGINE)[rank], topo.receives(ENGINE)[rank]
            self._ends[rank] = (Producer.attach(self.reg, orders.channel.obj),
                                Consumer.attach(self.reg, answers.channel.obj))
        return self._ends[rank]

    def send(self, msg, ranks: list[int] | None = None) -> None:
        data = msg if isinstance(msg, bytes) else PROTOCOL.encode(msg)
        for r in range(self.cfg.tp) if ranks is None else ranks:
            self.ends(r)[0].put(data, 5.0)

    def request(self, task, timeout: float = 20.0) -> list[TransferDone]:
        """Send `task` to every rank and return every rank's TransferDone, in rank order."""
        deadline = time.monotonic() + timeout
        self.send(task)
        return [PROTOCOL.decode(self.ends(r)[1].get(max(deadline - time.monotonic(), 0.0)))
                for r in range(self.cfg.tp)]

    # ---- teardown ---------------------------------------------------------------------------
    def stop(self, timeout: float = 10.0) -> None:
        """Shut down the children still running (Shutdown, then SIGKILL after `timeout`)."""
        live = [r for r, p in self.procs.items() if p.poll() is None]
        for r in live:
            try:
                self.send(Shutdown("test teardown"), [r])
            except IpcError:
                pass
        for r in live:
            try:
                self.procs[r].wait(timeout)
            except subprocess.TimeoutExpired:
                self.procs[r].kill()
                self.procs[r].wait()

    def close(self) -> None:
        self.stop()
        for p, c in self._ends.values():
            p.detach()
            c.detach()
        for s in self.signals.values():
            s.close()
        self.pools.close()
        self.reg.unlink_all()

    def __enter__(self) -> "NodeKit":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def engine_with_worker(cfg: NodeConfig) -> Iterator[Engine]:
    """A real engine (in this process, stepped by the test) over a real worker[0] process of a
    node created from `cfg`, once the worker is ready; shut down and unlinked afterwards."""
    n = Node(cfg, PoolMaker(), progress=lambda m: None)
    n.create_objects()
    worker = subprocess.Popen([sys.executable, "-m", "kvrt.workers.worker", "--node", cfg.node, "--rank", "0"], cwd=REPO)
    member = None
    try:
        member = Member.join(cfg.node, protocol.ROLE_ENGINE, 0)
        eng = Engine(member)
        deadline = time.monotonic() + 60
        while not member.ready.array[protocol.slot_of(cfg.tp, protocol.ROLE_WORKER, 0)]:
            assert time.monotonic() < deadline, "worker[0] did not get ready"
            eng.step()
        yield eng
        eng.shutdown(grace_s=5)
        assert worker.wait(20) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        if member is not None:
            member.leave()
        n.unlink()
