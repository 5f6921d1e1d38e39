"""The "shm" P->D transport: P and D on one machine, blocks copied straight into D's pool.

The sender maps the receiver's device pool of the same rank through the receiver's registry
(numpy: the shared-memory segment; CuPy: the CUDA IPC handle, opened by the backend exactly as
the receiver's own children open it) and copies each run of consecutive blocks with one copy
(`ArrayBackend.copy_runs`). The mapping is kept per peer until the peer goes away or the
transport closes.

A peer that goes away is noticed before each write, cheaply: its registry file is gone or was
replaced (node stopped or restarted), or its launcher's pid is gone (one `kill(pid, 0)`); the
full check of pid and start time (psutil, ~0.1 ms) runs at most every `liveness_interval_s`.
Then the stale mapping is dropped and the peer mapped again once (a restarted node is reachable
at once); a write whose descriptor names an earlier run of the node (`instance`: its launcher's
pid and start time) is refused, since its block ids mean nothing to the new run. A peer that is
really gone makes the write raise TransferError; nothing crashes.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from kvrt.ipc import protocol
from kvrt.ipc.errors import IpcError
from kvrt.ipc.registry import Registry, pid_alive
from kvrt.ipc.shm import SHM_DIR

from kvrt.workers.backend import Pool
from kvrt.workers.transports.base import (Endpoint, TransferError, Transport, array_layout, check_deadline, check_descriptor, check_same_layout,
                        machine_id, plan_runs, pool_layout)


@dataclass
class _Peer:
    """One receiver's pool, mapped in this process."""

    node: str
    rank: int
    reg: Registry
    pool: Pool
    reg_path: str
    reg_ino: int
    owner_pid: int
    owner_start_ms: int
    checked: float  # time.monotonic() of the last full liveness check

    @property
    def instance(self) -> str:
        return f"{self.owner_pid}:{self.owner_start_ms}"

    @property
    def name(self) -> str:
        return f"node {self.node} rank {self.rank}"

    def close(self) -> None:
        self.pool.close()
        self.reg.close()


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, pool: Pool, local: Endpoint, liveness_interval_s: float = 1.0):
        super().__init__(pool, local)
        self.node = local.node
        self.rank = local.rank
        self.liveness_interval_s = liveness_interval_s
        self._machine = machine_id()
        self._peers: dict[tuple[str, int], _Peer] = {}

    def descriptor(self) -> dict:
        out = {"transport": self.name, "node": self.node, "rank": self.rank, "machine": self._machine,
               **self.layout()}
        if self.local.instance:  # which run of the node: block ids are only valid in that one
            out["instance"] = self.local.instance
        return out

    def write_blocks(self, peer: dict, src_ids: np.ndarray, dst_ids: np.ndarray,
                     deadline: float | None = None) -> int:
        self._check_open()
        p = check_descriptor(peer, self.name, ("node", "rank"))
        node, rank = str(p["node"]), int(p["rank"])
        if p.get("machine", self._machine) != self._machine:
            raise TransferError(f"shm transport: node {node} rank {rank} is on another machine "
                                f"(boot id {p['machine']}, here {self._machine}); use the mooncake transport")
        dst = self._attached(node, rank)
        instance = p.get("instance")
        if instance is not None and str(instance) != dst.instance:
            raise TransferError(f"descriptor of {dst.name} is from another run of that node (instance "
                                f"{instance}, now {dst.instance}): its block ids mean nothing there")
        if "num_blocks" in p and int(p["num_blocks"]) != dst.pool.num_blocks:
            raise TransferError(f"descriptor of {dst.name} is stale: it says {p['num_blocks']} blocks, "
                                f"its pool {dst.pool.name} has {dst.pool.num_blocks}")
        runs, n = plan_runs(src_ids, dst_ids, self.pool.num_blocks, dst.pool.num_blocks, dst.name)
        if not runs:
            return 0
        check_deadline(deadline, dst.name)
        try:
            self.pool.backend.copy_runs(dst.pool, self.pool, runs)
        except Exception as e:  # a device error; the message must name the peer
            raise TransferError(f"copy of {n} blocks from {self.who} into {dst.name} failed: {e}") from e
        return n * self.pool.block_bytes

    def close(self) -> None:
        for key in list(self._peers):
            self._detach(key)
        self.closed = True

    # ---- peers ---------------------------------------------------------------------------
    def _attached(self, node: str, rank: int) -> _Peer:
        key = (node, rank)
        peer = self._peers.get(key)
        if peer is not None:
            gone = self._gone(peer)
            if gone is None:
                return peer
            self._detach(key)  # then map it again once: a restarted node is reachable again
            try:
                peer = self._attach(node, rank)
            except TransferError as e:
                raise TransferError(f"peer {peer.name} is gone: {gone}; mapping it again failed: {e}") from None
        else:
            peer = self._attach(node, rank)
        self._peers[key] = peer
        return peer

    def _attach(self, node: str, rank: int) -> _Peer:
        who = f"node {node} rank {rank}"
        try:
            reg = Registry.attach(node)
        except (IpcError, ValueError) as e:
            raise TransferError(f"cannot reach peer {who} through shared memory: {e}") from None
        try:
            reg_path = os.path.join(SHM_DIR, reg.name_of("registry"))
            ino = os.stat(reg_path).st_ino
            pid, start = reg.owner_pid, reg.owner_start_ms
            if not pid_alive(pid, start):
                raise TransferError(f"peer {who} is gone: its launcher (pid {pid}) is dead; "
                                    f"its shared memory waits for `kvrt clean`")
            obj = protocol.device_pool(rank)
            try:
                info = reg.find(obj)
            except IpcError as e:
                raise TransferError(f"peer {who} has no device pool for rank {rank}: {e}") from None
            theirs_backend = info.meta.get("backend", "numpy")
            if theirs_backend != self.pool.backend.name:
                raise TransferError(f"peer {who} keeps its pool in {theirs_backend} memory, {self.who} in "
                                    f"{self.pool.backend.name} memory: shm needs both on one kind")
            check_same_layout(pool_layout(self.pool), f"{self.who} ({self.pool.name})",
                              array_layout(info.shape, info.dtype),
                              f"{who} ({info.name})")
            try:
                pool = self.pool.backend.open_device_pool(reg, obj)
            except (IpcError, OSError, RuntimeError) as e:
                raise TransferError(f"cannot map the pool of peer {who}: {e}") from None
        except BaseException:
            reg.close()
            raise
        return _Peer(node, rank, reg, pool, reg_path, ino, pid, start, time.monotonic())

    def _gone(self, peer: _Peer) -> str | None:
        """Why `peer`'s mapping no longer reaches a live pool, or None while it does."""
        try:
            st = os.stat(peer.reg_path)
        except FileNotFoundError:
            return "its registry was removed (the node stopped)"
        if st.st_ino != peer.reg_ino:
            return "the node was restarted (new registry); ask it for new block ids"
        try:
            os.kill(peer.owner_pid, 0)
        except ProcessLookupError:
            return f"its launcher (pid {peer.owner_pid}) exited"
        except PermissionError:
            pass
        now = time.monotonic()
        if now - peer.checked >= self.liveness_interval_s:
            if not pid_alive(peer.owner_pid, peer.owner_start_ms):
                return f"its launcher (pid {peer.owner_pid}) is dead"
            peer.checked = now
        return None

    def _detach(self, key: tuple[str, int]) -> None:
        peer = self._peers.pop(key, None)
        if peer is not None:
            peer.close()
