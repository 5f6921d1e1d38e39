"""The prefix-cache reset: every cached block nothing holds is freed at once, and nothing
cached before the reset is matched after it.

Why every node leaves the tree, held ones too: an operator resets to stop serving what was
cached (weights that change, a cold run, a cache they distrust), so a block that stayed
matchable because a request happened to hold it would defeat the call. A block a request reads,
or a task copies, cannot be freed under it, though: such a node leaves the tree at once
(DETACHED: unmatchable, counted as in use) and its blocks come back when its holder lets go.
Requests in flight keep reading their blocks and finish with the answers they would have given,
but record nothing more (what they computed began before the reset). The tree is then empty, so
the one AllBlocksCleared event a reset publishes leaves a KV events subscriber's view exactly
equal to the cache, with no per-block events.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvrt.ipc.protocol import TaskKind

from kvrt.runtime.cache.nodes import CHILD, CONT, DEV, GPU, HOST, NDEV, REF, RESET, ROOT, STATE, SWAP2GPU, NodeStore


@dataclass(frozen=True)
class ResetResult:
    """What a reset did: blocks freed per tier, blocks that left the tree but stay until their
    request or task lets go, and the storage tasks in flight (their results describe the store
    as it was before the reset)."""

    device: int
    host: int
    held_device: int
    held_host: int
    storage_tasks: frozenset[int]


class CacheReset(NodeStore):
    """The reset, mixed into PrefixCache (it frees through the pools, freezes requests and
    restarts deferred swap-ins the freed blocks make room for)."""

    def _reset(self) -> ResetResult:
        f = self._f
        live = np.flatnonzero(f[STATE] <= SWAP2GPU)  # in the tree: GPU, SWAP2CPU, CPU, SWAP2GPU
        live = live[live != ROOT]
        held = (f[REF, live] > 0) | (self._task[live] >= 0)
        keep, drop = live[held], live[~held]
        self._idle -= int(np.count_nonzero(f[STATE, drop] == GPU))  # (no reference: idle until now)
        held_device = int(np.count_nonzero(f[DEV, keep] >= 0))
        held_host = int(np.count_nonzero(f[HOST, keep] >= 0))
        for n, task_id in list(self._wanted_back.items()):
            if self._state_v[n] == GPU and self._ref_v[n] == 0:  # dropped, but a swap-out still
                self._tasks[task_id].dev_orphans.append(self._dev_v[n])  # reads its device block
                self._dev_v[n] = -1
                self._dev_cached -= 1
                del self._wanted_back[n]
                held_device += 1
        obs, self._obs = self._obs, None  # the one AllBlocksCleared below says it all
        try:
            for n in keep.tolist():
                self._detach(n)
        finally:
            self._obs = obs
        devs, hosts = f[DEV, drop], f[HOST, drop]
        devs, hosts = devs[devs >= 0].tolist(), hosts[hosts >= 0].tolist()
        self._dev_lru.discard(drop)
        self._host_lru.discard(drop)
        self._dev_cached -= len(devs)
        self._host_cached -= len(hosts)
        keys = self._keys
        for n in drop.tolist():
            keys[n] = None
        f[:, drop] = RESET[:, None]
        self._push_ids(drop.tolist())
        self._map.clear()
        f[CHILD, ROOT] = f[CONT, ROOT] = -1
        f[NDEV, ROOT] = 0
        for req in self._reqs.values():
            req.frozen = True
        self.device_pool.free(devs)
        self.host_pool.free(hosts)
        if obs is not None:
            obs.cleared()
        self._pump_deferred()  # the freed blocks may be the room deferred swap-ins wait for
        storage = frozenset(i for i, t in self._tasks.items()
                            if t.task.kind in (TaskKind.STORAGE2GPU, TaskKind.GPU2STORAGE))
        return ResetResult(len(devs), len(hosts), held_device, held_host, storage)
