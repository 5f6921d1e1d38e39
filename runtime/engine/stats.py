"""The engine's counters in the ENGINE_STATS signal, written in one place.

Why a signal and not attributes: `kvrt status` and Prometheus read the counters from shared
memory, so they still answer while the engine is hung. Every collaborator of the loop counts
its events here by name; `publish` copies the gauges the prefix cache, the scheduler and the
cache-transfer client keep themselves, once per turn of the loop.
"""
from __future__ import annotations

import numpy as np

from kvrt.ipc import protocol as P
from kvrt.ipc.signals import Signal
from kvrt.runtime.cache.prefix_cache import PrefixCache
from kvrt.runtime.engine.scheduler import Scheduler
from kvrt.runtime.engine.sequence import Sequence
from kvrt.runtime.engine.transfer import TransferClient

_CACHE_STATS = ("device_total", "device_free", "device_cached", "device_used", "host_total", "host_free",
                "host_cached", "host_used", "requests", "hit_requests", "query_tokens", "hit_tokens_device",
                "hit_tokens_host", "hit_tokens_storage")


class EngineStats:
    """ENGINE_STATS, counted by event name and refreshed from the objects that keep gauges."""

    def __init__(self, signal: Signal, cache: PrefixCache, sched: Scheduler, transfer: TransferClient):
        self.signal = signal  # held: the array is a view of its mapping
        self.array: np.ndarray = signal.array
        self._cache = cache
        self._sched = sched
        self._transfer = transfer

    def count(self, name: str, n: int = 1) -> None:
        self.array[P.STAT[name]] += n

    def count_finished(self, seq: Sequence) -> None:
        self.count("finished_requests")
        self.count("computed_prompt_tokens", seq.computed_prompt_tokens)
        self.count("recomputed_prompt_tokens", seq.recomputed_prompt_tokens)

    def count_failed(self) -> None:
        self.count("failed_requests")

    def publish(self) -> None:
        """Copy the prefix cache's and the scheduler's counters into ENGINE_STATS."""
        snap, s, sched = self._cache.snapshot(), self.array, self._sched
        for name in _CACHE_STATS:
            s[P.STAT[name]] = snap[name]
        s[P.STAT["evictions"]] = snap["evicted_device_blocks"] + snap["evicted_host_blocks"]
        s[P.STAT["tasks_inflight"]] = self._transfer.inflight
        s[P.STAT["seqs_running"]] = len(sched.running)
        s[P.STAT["seqs_waiting"]] = len(sched.waiting)
        s[P.STAT["seqs_loading"]] = len(sched.loading)
        s[P.STAT["preemptions"]] = sched.preemptions
