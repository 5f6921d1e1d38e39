"""The engine process: the only process that decides who may touch a block.

It owns request intake (the client API), the scheduler and the prefix cache, sends orders to
the worker and cache-transfer ranks over SPSC rings, reads every answer through one fan-in,
and publishes its counters in the ENGINE_STATS signal (for `kvrt status`) and to Prometheus.

The loop never blocks without a timeout: it waits on the fan-in for at most one tick (the
client I/O thread pokes it awake when requests arrive), then beats its heartbeat, expires
tasks whose ranks went silent, and checks the node status word. One step is in flight at a
time; the next is scheduled the moment every worker rank has answered.

Where KV comes from or goes to besides this node's own compute (a decode or prefill peer, or
nothing) is the KV connector's business (runtime/pd/): the engine picks it once from
the node's role and only calls its hooks.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from dataclasses import dataclass

from kvrt.ipc import protocol as P
from kvrt.ipc import sockets
from kvrt.ipc.channel import Receiver, Sender
from kvrt.ipc.errors import ChannelClosed, PeerDead, RingCorrupt, WaitTimeout
from kvrt.ipc.fanin import FanIn
from kvrt.ipc.member import Member
from kvrt.ipc.signals import Signal
from kvrt.ipc.storage_uri import parse_storage
from kvrt.ipc.topology import ENGINE, Topology
from kvrt.runtime.cache.event_secret import EventSecret
from kvrt.ipc.log_limit import limit_logs
from kvrt.runtime.cache.events import REPLAY_PER_S, KVEventPublisher
from kvrt.runtime.cache.policies.base import make_policy
from kvrt.runtime.cache.prefix_cache import PrefixCache
from kvrt.runtime.cache.storage_index import StorageIndex
from kvrt.runtime.client import api
from kvrt.runtime.engine.cache_tasks import CacheTasks
from kvrt.runtime.engine.client_api import ClientApi
from kvrt.runtime.engine.clients import Clients
from kvrt.runtime.engine.grammars import Grammars
from kvrt.runtime.grammar.limits import Limits
from kvrt.runtime.grammar.messages import Setup
from kvrt.runtime.engine.guide import guide_for
from kvrt.runtime.engine.metrics import Metrics
from kvrt.runtime.engine.ownership import OwnerSync, OwnerTable
from kvrt.runtime.engine.rank_inbox import RankInbox
from kvrt.runtime.engine.scheduler import Scheduler
from kvrt.runtime.engine.server import ApiServer
from kvrt.runtime.engine.stats import EngineStats
from kvrt.runtime.engine.step_runner import StepRunner, StepTimeout
from kvrt.runtime.engine.transfer import TransferClient
from kvrt.runtime.node.config import NodeConfig
from kvrt.runtime.pd.connector import ConnectorContext, KVConnector
from kvrt.runtime.pd.roles import connector_class

log = logging.getLogger("kvrt.engine")
TICK_S = 0.1


@dataclass
class StopRequest:
    """SIGTERM/SIGINT, recorded by the handler and acted on by the loop at its next tick (at
    most TICK_S later: the signal also cuts short a doorbell wait). The launcher sends SIGTERM
    when another process of the node died or hung, after writing why into the node's errors
    row, so the engine can fail every request in flight with that reason before it exits."""

    signal: str = ""

    def install(self) -> "StopRequest":
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._record)
        return self

    def _record(self, signum: int, _frame: object) -> None:
        self.signal = signal.Signals(signum).name


class Engine:
    """The engine's wiring and its loop. Each collaborator holds one part of the work: the
    client API (`api`), the book of clients and their answers (`clients`), the step in flight
    (`steps`), the cache tasks (`tasks`), the ranks' answers (`answers`) and the counters
    (`stats`); the loop only says in which order they act."""

    def __init__(self, member: Member, stop: StopRequest | None = None):
        self.member = member
        self.stop = stop if stop is not None else StopRequest()
        self.cfg = cfg = NodeConfig.from_dict(member.config.to_dict())
        kind = connector_class(cfg.role)
        self._open_rings()
        self.fan = FanIn([r.ring for r in self.inbound])  # one wait on every ring's shared doorbell
        self.fan.spin_s = cfg.wait_spin_s
        self.owners = self._owner_tables()
        self.transfer = TransferClient(self.to_transfer, cfg.rank_timeout, owners=self.owners)
        self.storage = StorageIndex(cfg.tp, parse_storage(cfg.storage).shared) if cfg.storage else None
        self.kv_events: KVEventPublisher | None = None  # opened in run(), where it is closed
        self.cache = PrefixCache(cfg.block_size, cfg.num_gpu_blocks, cfg.num_cpu_blocks,
                                 storage_lookup=self.storage.lookup if self.storage is not None else None,
                                 storage_known=self.storage.known if self.storage is not None else None,
                                 write_through=self.storage is not None,
                                 policy=make_policy(cfg.eviction), groups=cfg.kv_groups.side_windows)
        self.sched = Scheduler(self.cache, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.sched.max_guided = P.max_guided_rows(cfg.vocab_size)
        # guided decoding's grammars, compiled against the checkpoint's tokenizer by compile
        # processes that wake the loop when one is done
        self.grammars = Grammars(Setup(model_dir=cfg.model_dir, memory_bytes=cfg.grammar_memory_mib << 20),
                                 Limits(cfg.grammar_timeout, cfg.grammar_memory_mib << 20), cfg.grammar_workers,
                                 wake=self.fan.poke) if cfg.model_dir else None
        self.stats = EngineStats(Signal.attach(member.reg, P.ENGINE_STATS), self.cache, self.sched, self.transfer)
        self.metrics = Metrics(self.stats.array, self.ring_stats)
        self.clients = Clients(self.sched, self.stats, self.metrics)
        self.connector = self.sched.connector = self.clients.connector = self._make_connector(kind)
        sync = OwnerSync(self.owners, self.cache, self.sched, self.connector)
        self.tasks = CacheTasks(self.transfer, self.cache, self.sched, self.storage, sync, self.stats,
                                self.metrics, cfg.storage)
        workers = [P.slot_of(cfg.tp, P.ROLE_WORKER, r) for r in range(cfg.tp)]
        procs = member.procs.array
        self.steps = StepRunner(cfg, self.to_workers, self.sched, self.clients, sync, self.stats, TICK_S,
                                marks=lambda: tuple(procs[workers, P.PROC_MARKS].tolist()))
        self.api = ClientApi(cfg, self.clients, self.sched, self.cache, self.connector, self.tasks, self.stats,
                             self.grammars)
        self.answers = RankInbox(self.fan, self.inbound, {P.StepResult: self.steps.on_result,
                                                          P.TransferDone: self.tasks.on_done,
                                                          P.StorageKeys: self.tasks.on_storage_keys},
                                 self.connector, self.stats)
        self.stats.publish()

    def _open_rings(self) -> None:
        """The engine's typed ends of the node's channels, as the node's topology declares them:
        orders to each rank group (cache-messager[r] when the role's connector has ranks), every
        answer in."""
        reg, topo = self.member.reg, Topology.of(self.cfg)
        self.to_workers: list[Sender] = topo.senders(reg, ENGINE, to=P.ROLE_WORKER)
        self.to_transfer: list[Sender] = topo.senders(reg, ENGINE, to=P.ROLE_TRANSFER)
        self.to_messagers: list[Sender] = topo.senders(reg, ENGINE, to=P.ROLE_MESSAGER)
        self.inbound: list[Receiver] = [r for role in (P.ROLE_WORKER, P.ROLE_TRANSFER, P.ROLE_MESSAGER)
                                        for r in topo.receivers(reg, ENGINE, of=role)]

    def _make_connector(self, kind: type[KVConnector]) -> KVConnector:
        """The node's one KV connector; it sees the engine only through these callbacks."""
        clients = self.clients
        ctx = ConnectorContext(
            cfg=self.cfg, stats=self.stats.array, sched=self.sched, block_table=self.cache.block_table,
            reply=clients.reply, send_raw=clients.send_raw, finished=clients.finished,
            count_finished=self.stats.count_finished, count_failed=self.stats.count_failed,
            accepting=lambda: self.api.accepting, to_ranks=self.to_messagers,
            guide=lambda req: guide_for(req, self.grammars, self.cfg.vocab_size),
            group_tables=self.cache.group_tables)
        return kind(ctx)

    def _owner_tables(self) -> tuple[OwnerTable, OwnerTable] | None:
        """KVRT_CHECK_OWNERSHIP=1: the shared owner arrays the launcher created for this check."""
        if not self.cfg.check_ownership:
            return None
        reg = self.member.reg
        return (OwnerTable(Signal.attach(reg, P.OWNERS_DEVICE).array, "device"),
                OwnerTable(Signal.attach(reg, P.OWNERS_HOST).array, "host"))

    @property
    def server(self) -> ApiServer | None:
        """The client socket (opened in run(); none: answers to clients go nowhere)."""
        return self.clients.server

    @server.setter
    def server(self, server: ApiServer | None) -> None:
        self.clients.server = server

    def ring_stats(self) -> dict[str, dict]:
        return {end.name.split(".", 2)[2]: end.ring.stats()
                for end in self.to_workers + self.to_transfer + self.to_messagers + self.inbound}

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> int:
        self._open_outlets()
        self.member.set_ready()
        try:
            while not self.member.stopping() and not self.stop.signal:
                self.step()
                if why := self.member.orphaned():
                    log.error("exiting: %s", why)
                    self.fail_all(f"the node failed: {why}")
                    return 1
                if why := self.member.launcher_hung(TICK_S):  # the launcher reports it, if it runs again
                    log.error("exiting: %s", why)
                    self.member.record_error(why)
                    self.fail_all(f"the node failed: {why}")
                    return 1
            if self.stop.signal:
                return self.abort()
            return self.shutdown()
        except StepTimeout as e:  # the step's requests were told; the launcher stops the node
            log.error("exiting: %s", e)
            self.member.record_error(str(e))
            return 1
        except RingCorrupt as e:
            log.error("exiting: %s", e)
            self.member.record_error(str(e))
            self.fail_all(f"the engine failed: {e}")
            return 1
        finally:
            self._close_outlets()
            if self.grammars is not None:
                self.grammars.close()

    def step(self) -> None:
        """One turn of the loop: intake (a bounded batch of client messages: client_api.py),
        schedule, run, apply (then deadlines and counters).
        What the wait brought is acted on in the same turn, before the housekeeping: the
        messages that cut it short are taken in (a peer's kv-ready, a decode node's token to
        relay), and the next step is launched as soon as the last one's answers are applied
        (else each waited for the housekeeping and the next turn: ~0.4 ms a hop on 2 cores)."""
        self.member.beat()
        more = self.api.take_in()
        self._schedule()
        self.answers.dispatch(self.answers.wait(0.0 if more else TICK_S))  # (client messages waiting: no sleep)
        self.connector.build_orders()  # the transfer orders the applied steps made due
        self.api.take_in()
        self._schedule()
        self._housekeep()

    def _schedule(self) -> None:
        """Hold blocks for external KV (its source learns them before any wait), then launch
        the next step if none is in flight (requests wait for the storage listing: it can only
        hit more)."""
        self.sched.admit_external()
        if self.sched.inflight is None and self.tasks.storage_ready:
            step = self.sched.schedule()
            self.clients.apply(self.sched.take_failed())  # guided requests whose grammar failed
            self.tasks.issue()  # admission may have asked for swaps or storage reads
            if step is not None:
                self.steps.launch(step)

    def _housekeep(self) -> None:
        """Deadlines (tasks, connector, the step in flight), cache tasks, counters."""
        self.tasks.expire()
        self.sched.admit_external()
        self.connector.tick()
        self.steps.check_deadline()
        self.tasks.issue()
        self.stats.publish()
        if self.kv_events is not None:  # one batch per turn of the loop; then the replay requests
            self.kv_events.flush()
            self.kv_events.serve_replay()

    def _open_outlets(self) -> None:
        """Prometheus, the KV events publisher and the client socket, as configured; the last
        two on the node's private sockets, which the gateway process relays to the public ports
        (runtime/gateway/)."""
        cfg = self.cfg
        if cfg.metrics_port:
            self.metrics.serve(cfg.metrics_port)
        if cfg.kv_events_port:
            secret = EventSecret.load(cfg.events_secret_file) if cfg.events_secret_file else None
            private = (sockets.address(cfg.node, sockets.EVENTS), sockets.address(cfg.node, sockets.REPLAY))
            self.kv_events = self.tasks.kv_events = KVEventPublisher(cfg.host, cfg.kv_events_port, cfg.block_size,
                                                                     self.cache.cached_blocks, secret=secret,
                                                                     private=private, windows=cfg.kv_groups.windows,
                                                                     replay_per_s=cfg.kv_events_replay_rate or REPLAY_PER_S)
            self.cache.observe(self.kv_events)
            self.kv_events.cleared()  # batch 1: a subscriber that knew an earlier life of this node forgets it
        if cfg.port:
            self.server = ApiServer(cfg.node, self.fan.poke, max_message_bytes=api.max_message_bytes(cfg.max_model_len))

    def _close_outlets(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.kv_events is not None:
            self.kv_events.close()

    # ---- stopping ---------------------------------------------------------------------------
    def shutdown(self, grace_s: float = 5.0) -> int:
        """Stop intake, let running requests and tasks finish (bounded, and cut short by
        SIGTERM), fail what is left, then tell every child to exit."""
        self.api.accepting = False
        deadline = time.monotonic() + grace_s
        while (self.transfer.inflight or not self.sched.idle or self.connector.inflight) \
                and time.monotonic() < deadline and not self.stop.signal:
            self.step()
        self.connector.fail_all(f"node {self.cfg.node} is stopping")
        self.tasks.expire(now=float("inf"))
        failure = self.member.node_failure()
        self.clients.tell_all(api.FAILED if failure else api.STOPPING,
                              failure or f"the node stopped before the request finished (grace {grace_s:.3g}s)")
        self._tell_children_to_stop()
        log.info("engine stopped")
        return 0

    def _tell_children_to_stop(self) -> None:
        bye = P.Shutdown("node stopping")
        for end in self.to_workers + self.to_transfer + self.to_messagers:
            try:
                end.put(bye, 1.0)
            except (WaitTimeout, PeerDead, ChannelClosed) as e:
                log.warning("could not tell %s to stop: %s", end.name, e)

    def abort(self) -> int:
        """SIGTERM while serving: fail every request in flight at once, naming why (a dead or
        hung process, as the launcher wrote it), and exit; the launcher stops the others. No
        ring is touched: the process on the other side may be the one that died."""
        failure = self.member.node_failure()
        why = failure or f"the engine got {self.stop.signal} and stopped"
        (log.error if failure else log.info)("stopping at once: %s", why)
        self.fail_all(why)
        return 0

    def fail_all(self, why: str) -> None:
        """An error event for every request in flight (the connector's included)."""
        self.api.accepting = False
        self.clients.fail_all(why)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvrt.runtime.engine.engine", description="kvrt engine process (started by kvrt launch)")
    p.add_argument("--node", required=True)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s engine: %(message)s")
    limit_logs()  # a flood of bad input is not a flood of log lines
    stop = StopRequest().install()
    member = Member.join(args.node, P.ROLE_ENGINE, 0)
    try:
        return Engine(member, stop).run()
    except Exception as e:  # the launcher reports the engine's own words, not a bystander's
        log.exception("engine failed")
        member.record_error(f"{type(e).__name__}: {e}")
        return 1
    finally:
        member.leave()


if __name__ == "__main__":
    sys.exit(main())
