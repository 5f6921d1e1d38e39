"""cache-transfer[r]: the process that moves rank r's KV blocks between tiers.

It executes the engine's TransferTasks (every rank gets every task: each rank holds its own
share of every block's KV heads): SWAP2CPU / SWAP2GPU copy blocks between the rank's device
and host pools, GPU2STORAGE and STORAGE2GPU move them to and from the storage backend. It
answers each task with one TransferDone. It decides nothing: the block ids and storage keys
come in the task, and it touches a block only between receiving the order and publishing the
answer (the engine gave it the blocks for exactly that long).

A bad task (ids out of range, no host pool, a storage failure, an ownership violation in
debug mode) is answered ok=False with the reason and the process goes on; a malformed message
is counted on the ring and skipped. Run as `python -m kvrt.workers.cache_transfer --node N --rank R`.

Tasks queued in the ring are taken together, and a swap is answered once its copies landed:
on a CPU that is as soon as they are issued (a memcpy), so each task is answered before the
next starts, as one at a time; on a GPU the copies of the tasks behind it are already queued
on the stream while this process waits for the first task's event and sends its answer, so
the copy engine does not idle through the answer path. Answers go out in task order.
"""
from __future__ import annotations

import logging
import sys
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvrt.ipc import protocol
from kvrt.ipc.errors import ProtocolError, WaitTimeout
from kvrt.ipc.ownership import OwnershipError, check_owners
from kvrt.ipc.protocol import StorageKeys, TaskKind, TransferDone, TransferTask
from kvrt.ipc.signals import Signal
from kvrt.ipc.topology import Topology

from kvrt.workers.child import EXIT_OK, WAIT_S, Child, run_child
from kvrt.workers.kv_pool import CopyJob, PoolError, attach_pools, block_list, start_copy
from kvrt.workers.storage.base import StorageError, StoreHung
from kvrt.workers.storage.factory import open_storage
from kvrt.workers.storage.io import block_io
from kvrt.workers.storage.mac import node_mac

log = logging.getLogger("kvrt.workers.cache_transfer")  # not __main__ under python -m

AHEAD = 8  # tasks whose copies may be issued before the oldest of them is answered


@dataclass
class Started:
    """A task taken from the ring: its copies issued (`job`), or its answer already known
    (`done`: a storage task, a refused or failed one)."""

    task: TransferTask
    what: str
    t0: float
    job: CopyJob | None = None
    done: TransferDone | None = None
    device: list[int] | None = None  # checked again for ownership once the copies landed
    host: list[int] | None = None

    def landed(self) -> bool:
        return self.job is None or self.job.done()


class CacheTransfer:
    """One rank's pools, storage and rings, and the loop that serves the engine's tasks."""

    spin_s = 0.0  # how long the next task is awaited, and a copy's event polled, spinning (the node's --wait-spin-us)

    def __init__(self, child: Child):
        self.child = child
        cfg, reg, rank = child.cfg, child.reg, child.rank
        self.rank = rank
        self.device, self.host = attach_pools(reg, rank, cfg)
        self.storage = open_storage(cfg.storage, rank, cfg.tp, cfg.host, child.beat, node_mac(cfg))
        self.blocks = block_io(self.device, self.storage, child.beat) if self.storage is not None else None
        self.owners: dict[str, np.ndarray] = {}
        if cfg.check_ownership:
            self.owners = {"device": _owner_table(reg, protocol.OWNERS_DEVICE, rank),
                           "host": _owner_table(reg, protocol.OWNERS_HOST, rank)}
        me, topo = (protocol.ROLE_TRANSFER, rank), Topology.of(cfg)
        [self.tasks], [self.answers] = topo.receivers(reg, me), topo.senders(reg, me)
        self.spin_s = cfg.wait_spin_s
        self.tasks.ring.spin_s = self.spin_s
        self.running: deque[Started] = deque()  # taken, not answered yet, in task order

    def close(self) -> None:
        """Close the answer ring (the engine's wait ends at once), let copies still in flight
        land (a device must not write into memory this process unmaps), detach the rest."""
        self.answers.close()
        while self.running:
            job = self.running.popleft().job
            try:
                if job is not None:
                    job.wait()
            except Exception as e:  # a device error: nothing more will land
                log.warning("a copy in flight failed while stopping: %s", e)
        self.tasks.detach()
        if self.storage is not None:
            self.storage.close()
        for pool in (self.device, self.host):
            if pool is not None:
                pool.close()

    # ---- the loop -----------------------------------------------------------------------
    def serve(self) -> int:
        log.info("serving %s: device pool %d blocks, host pool %s, storage %s, ownership checks %s",
                 self.tasks.name, self.device.num_blocks,
                 f"{self.host.num_blocks} blocks" if self.host is not None else "none",
                 self.child.cfg.storage or "none", "on" if self.owners else "off")
        self._list_storage()
        self.child.set_ready()
        ring, running = self.tasks.ring, self.running
        while True:
            if running:  # a stop (or the orphan check) waits until nothing is in flight
                self.child.beat()
            else:
                self.child.tick()
            records: list[bytes] = []
            if len(running) < AHEAD and (not running or ring.pending()):
                try:  # waits (in slices, beating) only while nothing is in flight
                    records = ring.get_many(AHEAD - len(running), WAIT_S)
                except WaitTimeout:
                    continue
            for rec in records:
                try:
                    msg = self.tasks.decode(rec)
                    if isinstance(msg, protocol.Shutdown):
                        log.info("shutdown ordered (%s)", msg.reason or "no reason given")
                        while running:
                            self._answer(running.popleft())
                        return EXIT_OK
                    if not isinstance(msg, TransferTask):
                        raise ProtocolError(f"unexpected {type(msg).__name__} on {self.tasks.name}")
                    running.append(self.start(msg))
                except ProtocolError as e:
                    ring.report_protocol_error(log, e)
                    continue
                while running and running[0].landed():  # on a CPU: every task, at once
                    self._answer(running.popleft())
            if running and (len(running) >= AHEAD or not ring.pending()):  # else take those first
                self._answer(running.popleft())

    def _answer(self, started: Started) -> None:
        self.child.answer(self.answers, self.finish(started))

    def _list_storage(self, batch: int = 2048) -> None:
        """Tell the engine which keys this rank's storage holds (its storage index starts there)."""
        if self.storage is None:
            return
        keys: list[bytes] = []
        for key in self.storage.keys():
            keys.append(key)
            if len(keys) == batch:
                self.child.answer(self.answers, StorageKeys(self.rank, keys, False))
                keys = []
        self.child.answer(self.answers, StorageKeys(self.rank, keys, True))

    # ---- tasks --------------------------------------------------------------------------
    def start(self, task: TransferTask) -> Started:
        """Check a task and issue its copies (a storage task runs whole here); a refusal or a
        failure is the answer already. ProtocolError for a task that cannot be answered."""
        if not isinstance(task.task_id, int):
            raise ProtocolError(f"task id {task.task_id!r} is not an integer")  # cannot be answered
        t0 = time.perf_counter()
        what = f"task {task.task_id} ({task.kind}) on cache-transfer[{self.rank}]"
        started = Started(task, what, t0)
        if not isinstance(task.deadline, (int, float)) or isinstance(task.deadline, bool):
            return self._failed(started, f"{what}: deadline {task.deadline!r} is not a time")
        if task.deadline and time.monotonic() >= task.deadline:  # the engine gave up: blocks may be reused
            log.warning("%s expired %.3gs before it could start; not run", what, time.monotonic() - task.deadline)
            return self._failed(started, f"{what}: expired before it could start; no block touched")
        return self._guarded(started, self._run)

    def finish(self, started: Started) -> TransferDone:
        """The task's answer, once its copies landed (beating while a long order lands)."""
        return started.done if started.done is not None else self._guarded(started, self._landed).done

    def _guarded(self, started: Started, step) -> Started:
        """Run `step(started)`; any failure becomes the task's ok=False answer."""
        what = started.what
        try:
            step(started)
        except OwnershipError as e:
            log.error("%s", e)
            return self._failed(started, str(e))
        except (StorageError, ValueError) as e:  # bad ids, no such tier, a failed write
            log.warning("%s failed: %s", what, e)
            return self._failed(started, f"{what}: {e}")
        except StoreHung:  # a read may still land in its blocks: this process must not go on
            raise
        except Exception as e:  # a task must never take the process down, but for a hung store
            log.exception("%s failed unexpectedly", what)
            return self._failed(started, f"{what}: {type(e).__name__}: {e}")
        return started

    def _failed(self, started: Started, error: str) -> Started:
        started.job = None
        started.done = TransferDone(started.task.task_id, self.rank, False, 0, 0,
                                    time.perf_counter() - started.t0, error)
        return started

    def _ok(self, started: Started, blocks: int, nbytes: int, store_errors: int = 0, store_forged: int = 0) -> None:
        started.done = TransferDone(started.task.task_id, self.rank, True, blocks, nbytes,
                                    time.perf_counter() - started.t0, store_errors=store_errors,
                                    store_forged=store_forged)

    def _run(self, started: Started) -> None:
        task = started.task
        dev = block_list(task.device_blocks, self.device.num_blocks, "device")
        handler = self._HANDLERS.get(task.kind) if isinstance(task.kind, str) else None
        if handler is None:
            raise ValueError(f"unknown task kind {task.kind!r}; expected one of {[k.value for k in TaskKind]}")
        handler(self, started, dev)

    def _landed(self, started: Started) -> None:
        nbytes = started.job.wait(self.child.beat, self.spin_s)
        self._check_owned(f"{started.what}, after the copy", started.device, started.host)
        self._ok(started, started.job.blocks, nbytes)

    def _check_owned(self, what: str, dev: list[int], host: list[int] | None) -> None:
        if not self.owners:
            return
        check_owners(self.owners["device"], dev, "device", what, protocol.OWNER_TRANSFER)
        if host is not None:
            check_owners(self.owners["host"], host, "host", what, protocol.OWNER_TRANSFER)

    def _swap(self, started: Started, dev: list[int]) -> None:
        task = started.task
        if self.host is None:
            raise PoolError("this node has no host pool (num_cpu_blocks is 0)")
        host = block_list(task.host_blocks, self.host.num_blocks, "host")
        if len(host) != len(dev):
            raise PoolError(f"{len(dev)} device blocks paired with {len(host)} host blocks")
        self._check_owned(started.what, dev, host)
        if task.kind == protocol.SWAP2CPU:
            started.job = start_copy(self.host, self.device, task.host_blocks, task.device_blocks, self.child.beat)
        else:
            started.job = start_copy(self.device, self.host, task.device_blocks, task.host_blocks, self.child.beat)
        started.device, started.host = dev, host

    def _storage_task(self, started: Started, dev: list[int]) -> None:
        task = started.task
        if self.storage is None:
            raise StorageError("this node has no storage backend (--storage is not set)")
        keys = task.keys
        if len(keys) != len(dev) or not all(isinstance(k, bytes) and k for k in keys):
            raise ValueError(f"a storage task needs one non-empty bytes key per device block "
                             f"({len(dev)} blocks, {len(keys)} keys)")
        self._check_owned(started.what, dev, None)
        errors, forged = self.storage.errors, self.storage.forged
        if task.kind == protocol.STORAGE2GPU:
            done = self._read(dev, keys, task.deadline)
            nbytes = done * self.device.block_bytes
        else:
            done, nbytes = self._write(dev, keys)
        store_errors = self.storage.errors - errors
        self._check_owned(f"{started.what}, after the copy", dev, None)
        self._ok(started, done, nbytes, store_errors, self.storage.forged - forged)

    # the handler of every task kind (the kind table is ipc/protocol.py's TaskKind)
    _HANDLERS = {TaskKind.SWAP2CPU: _swap, TaskKind.SWAP2GPU: _swap,
                 TaskKind.STORAGE2GPU: _storage_task, TaskKind.GPU2STORAGE: _storage_task}

    def _read(self, dev: list[int], keys: list[bytes], deadline: float) -> int:
        """Read the leading blocks whose objects exist and are intact; the first miss ends it.
        For a shared store this is also the lookup: the engine asks for every block its tree
        lacks, and the answer says how many the store had.

        A miss may leave its block half-written (numpy reads in place); the engine uses only
        the first `blocks` blocks of the answer, and owns the rest again once it has it. No
        block is written past the task's deadline (a slow store: the engine took the blocks
        back as a miss)."""
        return self.blocks.read(dev, keys, deadline)

    def _write(self, dev: list[int], keys: list[bytes]) -> tuple[int, int]:
        """Write every block whose key the storage does not hold yet; returns (blocks, bytes)."""
        return len(keys), self.blocks.write(dev, keys)


def _owner_table(reg, obj: str, rank: int) -> np.ndarray:
    """The debug ownership array of one tier: one int32 per block (a [tp, blocks] table
    gives this rank's row)."""
    table = Signal.attach(reg, obj).array
    return table[rank] if table.ndim == 2 else table


def main(argv: list[str] | None = None) -> int:
    return run_child(protocol.ROLE_TRANSFER, CacheTransfer, argv)


if __name__ == "__main__":
    sys.exit(main())
