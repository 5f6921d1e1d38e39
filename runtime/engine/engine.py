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
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np

from kvrt.ipc import protocol as P
from kvrt.ipc.errors import ChannelClosed, PeerDead, ProtocolError, RingCorrupt, WaitTimeout
from kvrt.ipc.fanin import FanIn
from kvrt.ipc.member import Member
from kvrt.ipc.rank_group import RankGroup
from kvrt.ipc.ring import Consumer, Producer
from kvrt.ipc.signals import Signal
from kvrt.ipc.storage_uri import parse_storage
from kvrt.ipc.topology import ENGINE, Topology
from kvrt.ipc.watchdog import Watchdog, pause_gap
from kvrt.runtime.cache import prefix_cache as pc
from kvrt.runtime.cache.events import STORAGE, KVEventPublisher
from kvrt.runtime.cache.policies.base import make_policy
from kvrt.runtime.cache.prefix_cache import PrefixCache
from kvrt.runtime.cache.storage_index import StorageIndex
from kvrt.runtime.client import api
from kvrt.runtime.engine.intake import is_int, sampling_of, show, validate
from kvrt.runtime.engine.metrics import Metrics
from kvrt.runtime.engine.ownership import OwnerTable, check_step
from kvrt.runtime.engine.scheduler import Scheduler, StepOutcome
from kvrt.runtime.engine.sequence import Sequence
from kvrt.runtime.engine.server import FRAMES, GONE, OVERFLOW, ApiServer, ClientNotice
from kvrt.runtime.engine.transfer import TaskResult, TransferClient
from kvrt.runtime.node.config import NodeConfig
from kvrt.runtime.pd.connector import ConnectorContext, KVConnector
from kvrt.runtime.pd.roles import connector_class

log = logging.getLogger("kvrt.engine")
TICK_S = 0.1
PEER_ONLY = (api.PdPrealloc, api.PdKvReady, api.PdAbort, api.PdAllocated, api.PdWelcome, api.PdRefused,
             api.PdPing, api.PdPong)  # valid only inside (or to open) an authenticated peer session
PROBE_S = 1.0  # how often each client with requests in flight is checked for a live connection
_CACHE_STATS = ("device_total", "device_free", "device_cached", "device_used", "host_total", "host_free",
                "host_cached", "host_used", "requests", "hit_requests", "query_tokens", "hit_tokens_device",
                "hit_tokens_host", "hit_tokens_storage")


class StepTimeout(RuntimeError):
    """A worker rank did not answer a step in time: the node is unhealthy; the engine exits."""


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
    def __init__(self, member: Member, stop: StopRequest | None = None):
        self.member = member
        self.stop = stop if stop is not None else StopRequest()
        self.cfg = NodeConfig.from_dict(member.config.to_dict())
        reg = member.reg
        tp = self.cfg.tp
        self.stats = Signal.attach(reg, P.ENGINE_STATS)
        topo = Topology.of(self.cfg)
        self.to_workers = [s.ring for s in topo.senders(reg, ENGINE, to=P.ROLE_WORKER)]
        self.to_transfer: list[Producer] = [s.ring for s in topo.senders(reg, ENGINE, to=P.ROLE_TRANSFER)]
        kind = connector_class(self.cfg.role)
        # the connector's own ranks (cache-messager[r]: the topology has them when the connector does)
        self.to_messagers: list[Producer] = [s.ring for s in topo.senders(reg, ENGINE, to=P.ROLE_MESSAGER)]
        inbound = [r.ring for role in (P.ROLE_WORKER, P.ROLE_TRANSFER, P.ROLE_MESSAGER)
                   for r in topo.receivers(reg, ENGINE, of=role)]
        self.inbound = inbound
        self.fan = FanIn(inbound)
        self.owners = self._owner_tables()
        self.transfer = TransferClient(self.to_transfer, self.cfg.rank_timeout, owners=self.owners)
        self.metrics = Metrics(self.stats.array, self.ring_stats)
        self.storage = StorageIndex(tp, parse_storage(self.cfg.storage).shared) if self.cfg.storage else None
        self.kv_events: KVEventPublisher | None = None  # bound in run(), where it is closed
        self.cache = PrefixCache(self.cfg.block_size, self.cfg.num_gpu_blocks, self.cfg.num_cpu_blocks,
                                 storage_lookup=self.storage.lookup if self.storage is not None else None,
                                 storage_known=self.storage.known if self.storage is not None else None,
                                 write_through=self.storage is not None,
                                 policy=make_policy(self.cfg.eviction))
        self.sched = Scheduler(self.cache, self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens)
        self.connector = self.sched.connector = self._make_connector(kind)
        self._step_answers: RankGroup[P.StepResult] | None = None  # answers to the step in flight
        # the step in flight is overdue after --rank-timeout of the engine's own running time, so
        # a node paused whole with a step in flight goes on with it when resumed
        self._step_watch: Watchdog[str] = Watchdog(pause_gap(self.cfg.rank_timeout, TICK_S))
        self.server: ApiServer | None = None
        self.accepting = True
        self._per_client: dict[bytes, int] = {}  # requests in flight per client (recounted every PROBE_S)
        self._next_probe = 0.0
        self._client_handlers = {api.GenerateRequest: self._on_generate, api.CancelRequest: self._on_cancel,
                                 api.InfoRequest: self._on_info, api.ResetPrefixCacheRequest: self._on_reset,
                                 api.PdHello: self._not_a_peer_node,
                                 api.PdSealed: self._not_a_peer_node}
        self._client_handlers.update({t: self._outside_session for t in PEER_ONLY})
        self._rank_handlers = {P.StepResult: self._on_step_result, P.TransferDone: self._on_transfer_done,
                               P.StorageKeys: self._on_storage_keys}
        self.publish_stats()

    def _make_connector(self, kind: type[KVConnector]) -> KVConnector:
        """The node's one KV connector; it sees the engine only through these callbacks."""
        ctx = ConnectorContext(
            cfg=self.cfg, stats=self.stats.array, sched=self.sched, block_table=self.cache.block_table,
            reply=self.reply, send_raw=self.server_send, finished=self.finished,
            count_finished=self.count_finished, count_failed=self.count_failed,
            accepting=lambda: self.accepting, to_ranks=self.to_messagers)
        return kind(ctx)

    def _owner_tables(self) -> tuple[OwnerTable, OwnerTable] | None:
        """KVRT_CHECK_OWNERSHIP=1: the shared owner arrays the launcher created for this check."""
        if not self.cfg.check_ownership:
            return None
        reg = self.member.reg
        return (OwnerTable(Signal.attach(reg, P.OWNERS_DEVICE).array, "device"),
                OwnerTable(Signal.attach(reg, P.OWNERS_HOST).array, "host"))

    def _sync_owners(self) -> np.ndarray | None:
        """Debug mode: owners from the prefix cache's account of every block (see ownership)."""
        if self.owners is None:
            return None
        dev, host = self.cache.block_roles()
        dev[self.sched.incoming_blocks()] = pc.ROLE_LOADING  # written from outside: not ours to touch
        # read by the connector's ranks: no step may write them (tree blocks are immutable anyway,
        # and may be read by a cache-transfer task at the same time)
        out = np.asarray(self.connector.outgoing_blocks(), dtype=np.int64)
        dev[out[np.isin(dev[out], (pc.ROLE_FREE, pc.ROLE_PRIVATE))]] = pc.ROLE_SAVING
        self.owners[0].sync(dev)
        if len(host):
            self.owners[1].sync(host)
        return dev

    def publish_stats(self) -> None:
        """Copy the prefix cache's and the scheduler's counters into ENGINE_STATS."""
        snap, s = self.cache.snapshot(), self.stats.array
        for name in _CACHE_STATS:
            s[P.STAT[name]] = snap[name]
        s[P.STAT["evictions"]] = snap["evicted_device_blocks"] + snap["evicted_host_blocks"]
        s[P.STAT["tasks_inflight"]] = self.transfer.inflight
        s[P.STAT["seqs_running"]] = len(self.sched.running)
        s[P.STAT["seqs_waiting"]] = len(self.sched.waiting)
        s[P.STAT["seqs_loading"]] = len(self.sched.loading)
        s[P.STAT["preemptions"]] = self.sched.preemptions

    def issue_cache_tasks(self) -> None:
        """Send the swap/storage tasks the prefix cache asked for to every cache-transfer rank."""
        self._sync_owners()
        for t in self.cache.take_tasks():
            self.transfer.submit(t)

    def ring_stats(self) -> dict[str, dict]:
        return {r.name.split(".", 2)[2]: r.stats()
                for r in self.to_workers + self.to_transfer + self.to_messagers + self.inbound}

    # ---- clients ----------------------------------------------------------------------------
    def reply(self, client: bytes, msg, keep: bool = False) -> None:
        if self.connector.deliver(client, msg):
            return  # a peer's request: the connector answers the peer
        if self.server is not None and client:
            self.server.send(client, api.API.encode(msg), keep)

    def server_send(self, client: bytes, msg) -> None:
        """`msg` to a client socket as it is (a connector's sealed and handshake messages)."""
        if self.server is not None:
            self.server.send(client, api.API.encode(msg))

    def count_finished(self, seq: Sequence) -> None:
        s = self.stats.array
        s[P.STAT["finished_requests"]] += 1
        s[P.STAT["computed_prompt_tokens"]] += seq.computed_prompt_tokens
        s[P.STAT["recomputed_prompt_tokens"]] += seq.recomputed_prompt_tokens

    def count_failed(self) -> None:
        self.stats.array[P.STAT["failed_requests"]] += 1

    def _intake(self) -> None:
        """Handle every queued client message (the I/O thread only queues bytes)."""
        if self.server is None:
            return
        notices = self.server.notices
        while notices:
            self._on_notice(notices.popleft())
        inbox = self.server.inbox
        while inbox:
            client, data = inbox.popleft()
            if not data:
                continue  # a liveness probe (a decode node probes its prefill node too)
            try:
                msg = api.API.decode(data)
            except ProtocolError as e:
                self.stats.array[P.STAT["protocol_errors"]] += 1
                self.reply(client, api.ErrorEvent("", api.BAD_REQUEST, f"malformed message: {str(e)[:200]}"))
                continue
            if not self.connector.on_peer_message(client, msg):
                self._client_handlers.get(type(msg), self._not_a_request)(client, msg)
        self._probe_clients()

    def _not_a_request(self, client: bytes, msg) -> None:
        self.reply(client, api.ErrorEvent("", api.BAD_REQUEST, f"{type(msg).__name__} is not a request"))

    def _not_a_peer_node(self, client: bytes, msg) -> None:
        """A peer handshake to a node whose connector takes no peers."""
        self.stats.array[P.STAT["pd_refused"]] += 1
        self.reply(client, api.ErrorEvent("", api.BAD_REQUEST,
                                          f"node {self.cfg.node} is not a decode node (role {self.cfg.role})"))

    def _outside_session(self, client: bytes, msg) -> None:
        """A peer message outside an authenticated session: refused."""
        self.stats.array[P.STAT["pd_refused"]] += 1
        log.warning("unauthenticated %s refused", type(msg).__name__)
        self.reply(client, api.ErrorEvent(str(getattr(msg, "request_id", "")), api.BAD_REQUEST,
                                          f"{type(msg).__name__} must come inside an authenticated "
                                          f"peer session (PdHello, then PdSealed)"))

    def _on_info(self, client: bytes, msg: api.InfoRequest) -> None:
        if not is_int(msg.nonce):
            self.reply(client, api.ErrorEvent("", api.BAD_REQUEST, f"nonce must be an integer, got {show(msg.nonce)}"))
            return
        c = self.cfg
        self.reply(client, api.InfoReply(msg.nonce, c.node, c.role, c.vocab_size, c.max_model_len, c.block_size, -1,
                                         model_dir=os.path.abspath(c.model_dir) if c.model_dir else ""))

    def _on_reset(self, client: bytes, msg: api.ResetPrefixCacheRequest) -> None:
        """Drop the prefix cache (runtime/cache/reset.py) and this node's view of a node-local
        storage tier (runtime/cache/storage_index.py). KV events subscribers get AllBlocksCleared,
        then, for a shared store the reset leaves as it is, the blocks it still holds."""
        if not is_int(msg.nonce):
            self.reply(client, api.ErrorEvent("", api.BAD_REQUEST, f"nonce must be an integer, got {show(msg.nonce)}"))
            return
        got = self.cache.reset()
        storage = 0
        if self.storage is not None:
            storage = self.storage.reset(got.storage_tasks)
            if self.storage.shared and self.kv_events is not None:
                self.kv_events.stored(STORAGE, self.storage.keys(), None)
        log.info("prefix cache reset: %d device and %d host blocks freed, %d and %d held until released, "
                 "%d storage keys forgotten", got.device, got.host, got.held_device, got.held_host, storage)
        self.reply(client, api.ResetPrefixCacheReply(msg.nonce, got.device, got.host, storage, got.held_device,
                                                     got.held_host))

    def _on_notice(self, n: ClientNotice) -> None:
        if n.kind == FRAMES:
            self.stats.array[P.STAT["protocol_errors"]] += 1
            self.reply(n.client, api.ErrorEvent("", api.BAD_REQUEST, f"a client message is one frame (one msgpack "
                                                                     f"map); this one had {n.frames} frames"))
        elif n.kind == OVERFLOW:
            self._end_client(n.client, f"this client stopped reading its answers ({api.CLIENT_QUEUE} were "
                                       f"waiting for it), so its requests were cancelled")
        elif n.kind == GONE:
            self._end_client(n.client, "")

    def _requests_of(self, client: bytes) -> list[str]:
        """Ids of the requests in flight that `client` submitted (one scan: used on rare events)."""
        rids = [rid for rid, seq in self.sched.seqs.items() if seq.client == client]
        rids += [rid for rid, c in self.connector.requests() if c == client]
        return list(dict.fromkeys(rids))

    def _owner_of(self, rid: str) -> bytes | None:
        """The client that submitted request `rid`, or None if it is not in flight."""
        if (seq := self.sched.seqs.get(rid)) is not None:
            return seq.client
        return next((c for r, c in self.connector.requests() if r == rid), None)

    def _end_client(self, client: bytes, why: str) -> None:
        """Cancel every request of a client that is gone (`why` empty) or does not read (`why`
        goes to it with each request, kept until it reads). Blocks held for external KV stay
        until it arrives or the connector gives up: it may be being written into them."""
        seqs = self.sched.seqs
        rids = [rid for rid in self._requests_of(client) if rid not in self.sched.external_ids
                and not (rid in seqs and seqs[rid].cancelled)]  # (those end with the step in flight)
        for rid in rids:
            if why:
                self.reply(client, api.ErrorEvent(rid, api.SLOW_CLIENT, why), keep=True)
            self._cancel(client, rid)
        self._per_client.pop(client, None)
        if rids:
            log.warning("client %s %s: cancelled its %d requests in flight", client.hex(),
                        "stopped reading" if why else "disconnected", len(rids))

    def _probe_clients(self) -> None:
        """Every PROBE_S: recount the requests of each client and probe each one that has some
        (a client that is gone is then noticed even while its requests wait for a step)."""
        now = time.monotonic()
        if now < self._next_probe:
            return
        self._next_probe = now + PROBE_S
        owners = [seq.client for seq in self.sched.seqs.values()]
        owners += [c for _, c in self.connector.requests()]
        self._per_client = {}
        for c in owners:
            self._per_client[c] = self._per_client.get(c, 0) + 1
        for c in self._per_client:
            if c and not self.connector.is_peer_client(c):  # a peer's requests: its session's
                self.server.probe(c)

    def _on_generate(self, client: bytes, req: api.GenerateRequest) -> None:
        rid = req.request_id
        problem = validate(req, self.cfg)
        if problem:
            self.reply(client, api.ErrorEvent("" if api.request_id_problem(rid) else rid, api.BAD_REQUEST, problem))
            return
        if not self.accepting:
            self.reply(client, api.ErrorEvent(rid, api.STOPPING, "the node is stopping and takes no new requests"))
            return
        if rid in self.sched.seqs or self.connector.busy(rid):
            self.reply(client, api.ErrorEvent(rid, api.DUPLICATE, f"request id {rid!r} is already in flight"))
            return
        if self._per_client.get(client, 0) >= api.MAX_REQUESTS_PER_CLIENT:
            self._per_client[client] = len(self._requests_of(client))  # the count is an upper bound
            if self._per_client[client] >= api.MAX_REQUESTS_PER_CLIENT:
                self.reply(client, api.ErrorEvent(rid, api.TOO_MANY, f"this client already has "
                                                  f"{api.MAX_REQUESTS_PER_CLIENT} requests in flight"))
                return
        self._per_client[client] = self._per_client.get(client, 0) + 1
        sampling = sampling_of(req)  # (picks the seed before a connector forwards the request)
        if self.connector.on_request(client, req):
            return
        self.sched.add(Sequence.new(rid, req.prompt, req.max_new_tokens, self.cfg.block_size, self.cfg.key_root,
                                    client=client,
                                    eos_token_id=req.eos_token_id, use_cache=req.use_cache, stream=req.stream,
                                    **sampling))

    def _on_cancel(self, client: bytes, req: api.CancelRequest) -> None:
        rid = req.request_id
        problem = api.request_id_problem(rid)
        if problem:
            self.reply(client, api.ErrorEvent("", api.BAD_REQUEST, problem))
        elif self._owner_of(rid) != client:  # another client's request is no more known than a missing one
            self.reply(client, api.ErrorEvent(rid, api.UNKNOWN, f"no request {rid!r} of this client in flight"))
        else:
            self._cancel(client, rid)

    def _cancel(self, client: bytes, rid: str) -> None:
        """Cancel `client`'s request `rid` (in flight: checked by the caller)."""
        if self.connector.cancel(client, rid):
            return
        seq = self.sched.cancel(rid)
        if seq is not None:
            self.finished(seq)

    def finished(self, seq: Sequence) -> None:
        now = time.monotonic()
        self.count_finished(seq)
        self.connector.request_finished(seq)
        ttft = (seq.first_token_at - seq.arrival) * 1e3 if seq.first_token_at else 0.0
        if seq.first_token_at:
            self.metrics.ttft_seconds.observe(ttft / 1e3)
        self.reply(seq.client, api.FinishedEvent(
            seq.request_id, seq.output.copy(), seq.finish_reason, seq.prompt_len, *seq.cached,
            seq.computed_prompt_tokens, seq.preemptions, ttft, (now - seq.arrival) * 1e3,
            list(seq.output_logprobs)))

    def _apply(self, out: StepOutcome) -> None:
        s = self.stats.array
        for seq, index in out.emitted:
            s[P.STAT["generated_tokens"]] += 1
            if seq.stream:
                self.reply(seq.client, api.TokenEvent(seq.request_id, index, [int(seq.output[index])],
                                                      seq.output_logprobs[index:index + 1]))
        for seq in out.finished:
            self.finished(seq)
        for seq, why in out.failed:
            self.connector.request_finished(seq)
            self.count_failed()
            self.reply(seq.client, api.ErrorEvent(seq.request_id, api.FAILED, why))

    # ---- steps ------------------------------------------------------------------------------
    def _launch_step(self) -> None:
        step = self.sched.schedule()
        self.issue_cache_tasks()  # admission may have asked for swaps or storage reads
        if step is None:
            return
        roles = self._sync_owners()
        bs = self.cfg.block_size
        tokens, tables = [], []
        for seq, chunk, start, table in zip(step.seqs, step.chunks, step.starts, step.tables):
            tokens.append(seq.tokens[start:start + chunk])
            tables.append(table)
            if roles is not None:
                t = np.asarray(table, dtype=np.int64)
                check_step(roles, t[start // bs:], t[:start // bs], f"step {step.step_id} ({seq.request_id})")
        batch = P.StepBatch(step.step_id, np.concatenate(tokens), np.array(step.chunks, dtype=np.int32),
                            np.array(step.starts, dtype=np.int32), np.concatenate(tables).astype(np.int32),
                            np.array([len(t) for t in tables], dtype=np.int32))
        if any(seq.temperature > 0 or seq.logprobs for seq in step.seqs):  # else all greedy: none sent
            batch.temperature = [seq.temperature for seq in step.seqs]
            batch.top_p = [seq.top_p for seq in step.seqs]
            batch.top_k = np.array([seq.top_k for seq in step.seqs], dtype=np.int32)
            batch.seed = [seq.seed for seq in step.seqs]
            batch.logprobs = np.array([seq.logprobs for seq in step.seqs], dtype=np.int32)
        data = P.PROTOCOL.encode(batch)
        for ring in self.to_workers:
            ring.put(data, self.cfg.rank_timeout)
        self._step_answers = RankGroup(self.cfg.tp, math.inf)  # overdue by _step_watch instead
        self.stats.array[P.STAT["steps"]] += 1

    def _on_step_result(self, res: P.StepResult) -> None:
        step, answers = self.sched.inflight, self._step_answers
        if step is None or answers is None or res.step_id != step.step_id or not 0 <= res.rank < answers.size:
            log.warning("answer to step %d from worker[%d] for no step in flight", res.step_id, res.rank)
            return
        if not answers.add(res.rank, res):
            return
        self._step_answers = None
        errors = [a.error for a in answers.answers if a.error]
        if errors:
            self._apply(self.sched.fail_step(step, "; ".join(errors)))
        else:
            first = answers.answers[0]
            self._apply(self.sched.finish_step(step, first.tokens, first.logprobs))

    def _check_step_deadline(self) -> None:
        """StepTimeout once the step in flight has waited --rank-timeout of the engine's running
        time for an answer (one round of the watch per call: once per turn of the loop)."""
        self._step_watch.tick()
        step, answers = self.sched.inflight, self._step_answers
        if step is None or answers is None:
            return
        if self._step_watch.observe("step", step.step_id) < self.cfg.rank_timeout:
            return
        why = (f"worker rank(s) {answers.missing()} did not answer step {step.step_id} "
               f"within {self.cfg.rank_timeout:.3g}s")
        for seq in step.seqs:
            self.reply(seq.client, api.ErrorEvent(seq.request_id, api.FAILED, why))
        raise StepTimeout(why)

    # ---- answers ----------------------------------------------------------------------------
    def _on_record(self, rec: bytes, ring: Consumer) -> None:
        try:
            msg = P.PROTOCOL.decode(rec)
        except ProtocolError as e:
            ring.report_protocol_error(log, e)
            self.stats.array[P.STAT["protocol_errors"]] += 1
            return
        handler = self._rank_handlers.get(type(msg))
        if handler is not None:
            handler(msg)
        elif not self.connector.on_rank_message(msg):
            log.warning("unexpected %s on %s", type(msg).__name__, ring.name)

    def _on_storage_keys(self, msg: P.StorageKeys) -> None:
        if self.storage is None:
            log.warning("storage listing from cache-transfer[%d] on a node without storage", msg.rank)
            return
        self.storage.listed(msg.rank, msg.keys, msg.last)
        if self.storage.ready:
            log.info("storage tier %s: %d blocks on every rank", self.cfg.storage, len(self.storage))

    def _on_transfer_done(self, msg: P.TransferDone) -> None:
        result = self.transfer.on_answer(msg)
        if result is not None:
            self._on_task_result(result)

    def _on_task_result(self, result: TaskResult) -> None:
        s = self.stats.array
        s[P.STAT["tasks_done" if result.ok else "tasks_failed"]] += 1
        s[P.STAT["swap_bytes"]] += result.nbytes
        self.metrics.swap_seconds.labels(result.task.kind).observe(result.seconds)
        if not result.ok:
            log.error("transfer task %d (%s) failed: %s", result.task.task_id, result.task.kind, result.error)
        if self.storage is not None:
            task = result.task
            s[P.STAT["storage_errors"]] += result.store_errors
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
        self.sched.on_task_outcome(self.cache.apply_task_result(result.task.task_id, result.ok, result.blocks))

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> int:
        if self.cfg.metrics_port:
            self.metrics.serve(self.cfg.metrics_port)
        if self.cfg.kv_events_port:
            self.kv_events = KVEventPublisher(self.cfg.host, self.cfg.kv_events_port, self.cfg.block_size,
                                              self.cache.cached_blocks)
            self.cache.observe(self.kv_events)
            self.kv_events.cleared()  # batch 1: a subscriber that knew an earlier life of this node forgets it
        if self.cfg.port:
            self.server = ApiServer(self.cfg.host, self.cfg.port, self.fan.poke, peer=self.cfg.decode_peer,
                                    max_message_bytes=api.max_message_bytes(self.cfg.max_model_len))
        self.member.set_ready()
        try:
            while not self.member.stopping() and not self.stop.signal:
                self.step()
                if why := self.member.orphaned():
                    log.error("exiting: %s", why)
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
            if self.server is not None:
                self.server.close()
            if self.kv_events is not None:
                self.kv_events.close()

    def step(self) -> None:
        """One turn of the loop: intake, schedule, run, apply (then deadlines and counters).
        What the wait brought is acted on in the same turn, before the housekeeping: the
        messages that cut it short are taken in (a peer's kv-ready, a decode node's token to
        relay), and the next step is launched as soon as the last one's answers are applied
        (else each waited for the housekeeping and the next turn: ~0.4 ms a hop on 2 cores)."""
        self.member.beat()
        self._intake()
        self._schedule()
        self._apply_answers(self._run())
        self._intake()
        self._schedule()
        self._housekeep()

    def _schedule(self) -> None:
        """Hold blocks for external KV (its source learns them before any wait), then launch
        the next step if none is in flight (requests wait for the storage listing: it can only
        hit more)."""
        self.sched.admit_external()
        if self.sched.inflight is None and (self.storage is None or self.storage.ready):
            self._launch_step()

    def _run(self) -> list[tuple[int, bytes]]:
        """The ranks work: wait at most one tick for their answers; every answer there is."""
        got: list[tuple[int, bytes]] = []
        try:
            first = self.fan.get(TICK_S)
            if first is not None:
                got.append(first)
                got.extend(iter(self.fan.try_get, None))
        except WaitTimeout:
            pass
        except PeerDead as e:
            log.error("%s", e)  # the launcher notices the death too and stops the node
        return got

    def _apply_answers(self, records: list[tuple[int, bytes]]) -> None:
        """Each answer to its handler; then the transfer orders the applied steps made due."""
        for idx, rec in records:
            self._on_record(rec, self.inbound[idx])
        self.connector.build_orders()

    def _housekeep(self) -> None:
        """Deadlines (tasks, connector, the step in flight), cache tasks, counters."""
        for result in self.transfer.expire():
            self._on_task_result(result)
        self.sched.admit_external()
        self.connector.tick()
        self._check_step_deadline()
        self.issue_cache_tasks()
        self.publish_stats()
        if self.kv_events is not None:  # one batch per turn of the loop; then the replay requests
            self.kv_events.flush()
            self.kv_events.serve_replay()

    def shutdown(self, grace_s: float = 5.0) -> int:
        """Stop intake, let running requests and tasks finish (bounded, and cut short by
        SIGTERM), fail what is left, then tell every child to exit."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while (self.transfer.inflight or not self.sched.idle or self.connector.inflight) \
                and time.monotonic() < deadline and not self.stop.signal:
            self.step()
        self.connector.fail_all(f"node {self.cfg.node} is stopping")
        for result in self.transfer.expire(now=float("inf")):
            self._on_task_result(result)
        failure = self.member.node_failure()
        for seq in list(self.sched.seqs.values()):
            self.reply(seq.client, api.ErrorEvent(seq.request_id, api.FAILED if failure else api.STOPPING,
                                                   failure or f"the node stopped before the request "
                                                   f"finished (grace {grace_s:.3g}s)"))
        bye = P.PROTOCOL.encode(P.Shutdown("node stopping"))
        for ring in self.to_workers + self.to_transfer + self.to_messagers:
            try:
                ring.put(bye, 1.0)
            except (WaitTimeout, PeerDead, ChannelClosed) as e:
                log.warning("could not tell %s to stop: %s", ring.name, e)
        log.info("engine stopped")
        return 0

    def abort(self) -> int:
        """SIGTERM while serving: fail every request in flight at once, naming why (a dead or
        hung process, as the launcher wrote it), and exit; the launcher stops the others. No
        ring is touched: the process on the other side may be the one that died."""
        self.accepting = False
        failure = self.member.node_failure()
        why = failure or f"the engine got {self.stop.signal} and stopped"
        (log.error if failure else log.info)("stopping at once: %s", why)
        self.fail_all(why)
        return 0

    def fail_all(self, why: str) -> None:
        """An error event for every request in flight (the connector's included)."""
        self.accepting = False
        self.connector.fail_all(why)
        for seq in list(self.sched.seqs.values()):
            self.count_failed()
            self.reply(seq.client, api.ErrorEvent(seq.request_id, api.FAILED, why))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvrt.runtime.engine.engine", description="kvrt engine process (started by kvrt launch)")
    p.add_argument("--node", required=True)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s engine: %(message)s")
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
