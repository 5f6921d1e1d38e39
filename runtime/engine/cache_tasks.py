"""The prefix cache's swap and storage tasks, out to the cache-transfer ranks and back.

Why a class of its own: a task's answer touches four things besides the cache that asked for
it: the scheduler (requests waiting on the blocks), the node's view of the storage tier (keys
a write stored or a read found missing), the KV events subscribers (what that view learned)
and the counters. This is where a task is issued and where its result, a rank's storage
listing and a prefix-cache reset's storage part reach each of them.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

from kvrt.ipc import protocol as P
from kvrt.runtime.cache.events import STORAGE, KVEventPublisher
from kvrt.runtime.cache.prefix_cache import PrefixCache
from kvrt.runtime.cache.storage_index import StorageIndex
from kvrt.runtime.engine.metrics import Metrics
from kvrt.runtime.engine.ownership import OwnerSync
from kvrt.runtime.engine.scheduler import Scheduler
from kvrt.runtime.engine.stats import EngineStats
from kvrt.runtime.engine.transfer import TaskResult, TransferClient

log = logging.getLogger("kvrt.engine")


class CacheTasks:
    """Cache tasks between the prefix cache and the cache-transfer ranks. `kv_events` is bound
    when the engine opens its publisher (none: nothing is published)."""

    def __init__(self, transfer: TransferClient, cache: PrefixCache, sched: Scheduler,
                 storage: StorageIndex | None, owners: OwnerSync, stats: EngineStats, metrics: Metrics,
                 storage_uri: str):
        self.transfer = transfer
        self.cache = cache
        self.sched = sched
        self.storage = storage
        self.owners = owners
        self.stats = stats
        self.metrics = metrics
        self.storage_uri = storage_uri
        self.kv_events: KVEventPublisher | None = None

    @property
    def storage_ready(self) -> bool:
        """Every rank listed the storage tier (or there is none): requests wait for it, since
        the listing can only make them hit more."""
        return self.storage is None or self.storage.ready

    def issue(self) -> None:
        """Send the swap/storage tasks the prefix cache asked for to every cache-transfer rank."""
        self.owners.sync()
        for t in self.cache.take_tasks():
            self.transfer.submit(t)

    def on_done(self, msg: P.TransferDone) -> None:
        result = self.transfer.on_answer(msg)
        if result is not None:
            self._on_result(result)

    def expire(self, now: float | None = None) -> None:
        """Fail the tasks past their deadline (`now` infinite: every task in flight)."""
        for result in self.transfer.expire(now=now):
            self._on_result(result)

    def on_storage_keys(self, msg: P.StorageKeys) -> None:
        if self.storage is None:
            log.warning("storage listing from cache-transfer[%d] on a node without storage", msg.rank)
            return
        self.storage.listed(msg.rank, msg.keys, msg.last)
        if self.storage.ready:
            log.info("storage tier %s: %d blocks on every rank", self.storage_uri, len(self.storage))

    def reset_storage(self, storage_tasks: Iterable[int]) -> int:
        """The prefix cache was reset: forget a node-local storage tier (a shared one stays, and
        its blocks are announced again after the reset's AllBlocksCleared). Keys forgotten."""
        if self.storage is None:
            return 0
        forgotten = self.storage.reset(storage_tasks)
        if self.storage.shared and self.kv_events is not None:
            self.kv_events.stored(STORAGE, self.storage.keys(), None)
        return forgotten

    def _on_result(self, result: TaskResult) -> None:
        self.stats.count("tasks_done" if result.ok else "tasks_failed")
        self.stats.count("swap_bytes", result.nbytes)
        self.metrics.swap_seconds.labels(result.task.kind).observe(result.seconds)
        if not result.ok:
            log.error("transfer task %d (%s) failed: %s", result.task.task_id, result.task.kind, result.error)
        if self.storage is not None:
            self._learn_storage(result)
        self.sched.on_task_outcome(self.cache.apply_task_result(result.task.task_id, result.ok, result.blocks))

    def _learn_storage(self, result: TaskResult) -> None:
        """What a storage write stored, or a read found there or missing (or corrupt)."""
        task = result.task
        self.stats.count("storage_errors", result.store_errors)
        self.stats.count("storage_forged", result.store_forged)
        learn = not self.storage.from_before_reset(task.task_id)
        if task.kind == P.GPU2STORAGE and result.ok and learn:
            self.storage.add(task.keys)
            if self.kv_events is not None:
                self.kv_events.stored(STORAGE, task.keys, None)
        elif task.kind == P.STORAGE2GPU:
            read = result.blocks if result.ok else 0
            found = self.storage.add(task.keys[:read]) if learn else []
            gone = self.storage.forget(task.keys[read:])  # missing or corrupt
            if self.kv_events is not None:
                self.kv_events.stored(STORAGE, found, None)
                self.kv_events.removed(STORAGE, gone)
