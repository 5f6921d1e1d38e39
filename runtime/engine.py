"""The engine process: the only process that decides who may touch a block.

It owns the prefix cache and the scheduler, sends orders to the worker and cache-transfer
ranks over SPSC rings, reads every answer through one fan-in, and publishes its counters in
the ENGINE_STATS signal (for `kvrt status`) and to Prometheus.

The loop never blocks without a timeout: it waits on the fan-in for at most one tick, then
beats its heartbeat, expires tasks whose ranks went silent, and checks the node status word.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

from ipc import protocol as P
from ipc.errors import ChannelClosed, PeerDead, ProtocolError, WaitTimeout
from ipc.fanin import FanIn
from ipc.member import Member
from ipc.ring import Consumer, Producer
from ipc.signals import Signal
from runtime.config import NodeConfig
from runtime.metrics import Metrics
from runtime.ownership import OwnerTable
from runtime.prefix_cache import PrefixCache
from runtime.transfer import TaskResult, TransferClient

log = logging.getLogger("kvrt.engine")
TICK_S = 0.1
_CACHE_STATS = ("device_total", "device_free", "device_cached", "device_used", "host_total", "host_free",
                "host_cached", "host_used", "requests", "hit_requests", "query_tokens", "hit_tokens_device",
                "hit_tokens_host", "hit_tokens_storage")


class Engine:
    def __init__(self, member: Member):
        self.member = member
        self.cfg = NodeConfig.from_dict(member.config)
        reg = member.reg
        tp = self.cfg.tp
        self.stats = Signal.attach(reg, P.ENGINE_STATS)
        self.to_workers = [Producer.attach(reg, P.to_worker(r)) for r in range(tp)]
        inbound = [Consumer.attach(reg, P.from_worker(r)) for r in range(tp)]
        self.to_transfer: list[Producer] = []
        if self.cfg.needs_transfer:
            self.to_transfer = [Producer.attach(reg, P.to_transfer(r)) for r in range(tp)]
            inbound += [Consumer.attach(reg, P.from_transfer(r)) for r in range(tp)]
        self.inbound = inbound
        self.fan = FanIn(inbound)
        self.transfer = TransferClient(self.to_transfer, self.cfg.rank_timeout, owners=self._owner_tables())
        self.metrics = Metrics(self.stats.array, self.ring_stats)
        self.cache = PrefixCache(self.cfg.block_size, self.cfg.num_gpu_blocks, self.cfg.num_cpu_blocks)
        self._cache_task_of: dict[int, int] = {}  # transfer task id -> prefix-cache task id
        self.publish_stats()

    def _owner_tables(self) -> tuple[OwnerTable, OwnerTable] | None:
        """KVRT_CHECK_OWNERSHIP=1: the shared owner arrays the launcher created for this check."""
        if not self.cfg.check_ownership:
            return None
        reg = self.member.reg
        return (OwnerTable(Signal.attach(reg, P.OWNERS_DEVICE).array, "device"),
                OwnerTable(Signal.attach(reg, P.OWNERS_HOST).array, "host"))

    def publish_stats(self) -> None:
        """Copy the prefix cache's counters into ENGINE_STATS (read by status and Prometheus)."""
        snap, s = self.cache.snapshot(), self.stats.array
        for name in _CACHE_STATS:
            s[P.STAT[name]] = snap[name]
        s[P.STAT["evictions"]] = snap["evicted_device_blocks"] + snap["evicted_host_blocks"]
        s[P.STAT["tasks_inflight"]] = self.transfer.inflight

    def issue_cache_tasks(self) -> None:
        """Send the swap/storage tasks the prefix cache asked for to every cache-transfer rank."""
        for t in self.cache.take_tasks():
            tid = self.transfer.submit(t.kind.value, t.device_blocks, t.host_blocks, t.keys)
            self._cache_task_of[tid] = t.task_id

    def ring_stats(self) -> dict[str, dict]:
        return {r.name.split(".", 2)[2]: r.stats() for r in self.to_workers + self.to_transfer + self.inbound}

    # ---- answers ----------------------------------------------------------------------
    def _on_record(self, rec: bytes, ring: Consumer) -> None:
        try:
            msg = P.PROTOCOL.decode(rec)
        except ProtocolError as e:
            ring.count_protocol_error()
            self.stats.array[P.STAT["protocol_errors"]] += 1
            log.warning("bad message on %s: %s", ring.name, e)
            return
        if isinstance(msg, P.TransferDone):
            result = self.transfer.on_answer(msg)
            if result is not None:
                self._on_task_result(result)
        else:
            log.warning("unexpected %s on %s", type(msg).__name__, ring.name)

    def _on_task_result(self, result: TaskResult) -> None:
        s = self.stats.array
        s[P.STAT["tasks_done" if result.ok else "tasks_failed"]] += 1
        s[P.STAT["swap_bytes"]] += result.nbytes
        self.metrics.swap_seconds.labels(result.task.kind).observe(result.seconds)
        if not result.ok:
            log.error("transfer task %d (%s) failed: %s", result.task.task_id, result.task.kind, result.error)
        cache_id = self._cache_task_of.pop(result.task.task_id, None)
        if cache_id is not None:
            outcome = self.cache.apply_task_result(cache_id, result.ok, result.blocks)
            for rid in outcome.failed:
                log.error("request %s lost its cached prefix (task %d failed)", rid, cache_id)

    # ---- the loop ----------------------------------------------------------------------
    def run(self) -> int:
        if self.cfg.metrics_port:
            self.metrics.serve(self.cfg.metrics_port)
        self.member.set_ready()
        while not self.member.stopping():
            self.step()
            if why := self.member.orphaned():
                log.error("exiting: %s", why)
                return 1
        return self.shutdown()

    def step(self) -> None:
        self.member.beat()
        try:
            idx, rec = self.fan.get(TICK_S)
            self._on_record(rec, self.inbound[idx])
            for idx, rec in iter(self.fan.try_get, None):
                self._on_record(rec, self.inbound[idx])
        except WaitTimeout:
            pass
        except PeerDead as e:
            log.error("%s", e)  # the launcher notices the death too and stops the node
        for result in self.transfer.expire():
            self._on_task_result(result)
        self.issue_cache_tasks()
        self.publish_stats()

    def shutdown(self, grace_s: float = 5.0) -> int:
        """Let in-flight tasks finish (bounded), then tell every child to exit."""
        deadline = time.monotonic() + grace_s
        while self.transfer.inflight and time.monotonic() < deadline:
            self.step()
        for result in self.transfer.expire(now=float("inf")):
            self._on_task_result(result)
        bye = P.PROTOCOL.encode(P.Shutdown("node stopping"))
        for ring in self.to_workers + self.to_transfer:
            try:
                ring.put(bye, 1.0)
            except (WaitTimeout, PeerDead, ChannelClosed) as e:
                log.warning("could not tell %s to stop: %s", ring.name, e)
        log.info("engine stopped")
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.engine", description="kvrt engine process (started by kvrt launch)")
    p.add_argument("--node", required=True)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s engine: %(message)s")
    member = Member.join(args.node, P.ROLE_ENGINE, 0)
    try:
        return Engine(member).run()
    finally:
        member.leave()


if __name__ == "__main__":
    sys.exit(main())
