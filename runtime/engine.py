"""The engine process: the only process that decides who may touch a block.

It owns request intake (the client API), the scheduler and the prefix cache, sends orders to
the worker and cache-transfer ranks over SPSC rings, reads every answer through one fan-in,
and publishes its counters in the ENGINE_STATS signal (for `kvrt status`) and to Prometheus.

The loop never blocks without a timeout: it waits on the fan-in for at most one tick (the
client I/O thread pokes it awake when requests arrive), then beats its heartbeat, expires
tasks whose ranks went silent, and checks the node status word. One step is in flight at a
time; the next is scheduled the moment every worker rank has answered.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from dataclasses import dataclass

import numpy as np

from ipc import protocol as P
from ipc.channel import Receiver, Sender
from ipc.errors import ChannelClosed, PeerDead, ProtocolError, RingCorrupt, WaitTimeout
from ipc.fanin import FanIn
from ipc.member import Member
from ipc.ring import Consumer, Producer
from ipc.signals import Signal
from runtime.config import NodeConfig
from runtime.disagg import PEER_CLIENT, DecodeSide, PrefillSide
from runtime.metrics import Metrics
from runtime import api
from runtime.intake import is_int, show, validate
from runtime.ownership import OwnerTable, check_step
from runtime import prefix_cache as pc
from runtime.prefix_cache import PrefixCache
from runtime.scheduler import Scheduler, StepOutcome
from runtime.sequence import Sequence
from runtime.server import FRAMES, GONE, OVERFLOW, PEER, ApiServer, ClientNotice
from runtime.storage_index import StorageIndex
from runtime.transfer import TaskResult, TransferClient

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
        self.to_workers = [Sender.attach(reg, P.worker_orders(r)).ring for r in range(tp)]
        inbound = [Receiver.attach(reg, P.worker_answers(r)).ring for r in range(tp)]
        self.to_transfer: list[Producer] = []
        if self.cfg.needs_transfer:
            self.to_transfer = [Sender.attach(reg, P.transfer_orders(r)).ring for r in range(tp)]
            inbound += [Receiver.attach(reg, P.transfer_answers(r)).ring for r in range(tp)]
        self.to_messagers: list[Producer] = []
        if self.cfg.disaggregated:
            self.to_messagers = [Sender.attach(reg, P.messager_orders(r)).ring for r in range(tp)]
            inbound += [Receiver.attach(reg, P.messager_answers(r)).ring for r in range(tp)]
        self.inbound = inbound
        self.fan = FanIn(inbound)
        self.owners = self._owner_tables()
        self.transfer = TransferClient(self.to_transfer, self.cfg.rank_timeout, owners=self.owners)
        self.metrics = Metrics(self.stats.array, self.ring_stats)
        self.storage = StorageIndex(tp) if self.cfg.storage else None
        self.cache = PrefixCache(self.cfg.block_size, self.cfg.num_gpu_blocks, self.cfg.num_cpu_blocks,
                                 storage_lookup=self.storage.lookup if self.storage is not None else None,
                                 write_through=self.storage is not None)
        self.sched = Scheduler(self.cache, self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens)
        self._cache_task_of: dict[int, int] = {}  # transfer task id -> prefix-cache task id
        self._answers: dict[int, P.StepResult] = {}  # rank -> answer to the step in flight
        self._step_deadline = 0.0
        self.server: ApiServer | None = None
        self.accepting = True
        self._per_client: dict[bytes, int] = {}  # requests in flight per client (recounted every PROBE_S)
        self._next_probe = 0.0
        self.prefill = PrefillSide(self) if self.cfg.role == "prefill" else None
        self.decode = DecodeSide(self) if self.cfg.role == "decode" else None
        self.publish_stats()

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
        if self.decode is not None:  # blocks a P node is writing into: the cache-messager's
            dev[self.decode.remote_blocks()] = pc.ROLE_LOADING
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
            tid = self.transfer.submit(t.kind.value, t.device_blocks, t.host_blocks, t.keys)
            self._cache_task_of[tid] = t.task_id

    def ring_stats(self) -> dict[str, dict]:
        return {r.name.split(".", 2)[2]: r.stats()
                for r in self.to_workers + self.to_transfer + self.to_messagers + self.inbound}

    # ---- clients ----------------------------------------------------------------------------
    def reply(self, client: bytes, msg, keep: bool = False) -> None:
        if self.decode is not None and client.startswith(PEER_CLIENT):
            self.decode.deliver(client, msg)  # a prefill peer's request: sealed, under its own id
        elif self.server is not None and client:
            self.server.send(client, api.API.encode(msg), keep)

    def server_send(self, client: bytes, msg) -> None:
        """`msg` to a client socket as it is (the PD sides' sealed and handshake messages)."""
        if self.server is not None:
            self.server.send(client, api.API.encode(msg))

    def reply_peer(self, msg) -> None:
        """To the decode node (prefill role only)."""
        self.server_send(PEER, msg)

    def count_finished(self, seq: Sequence) -> None:
        s = self.stats.array
        s[P.STAT["finished_requests"]] += 1
        s[P.STAT["computed_prompt_tokens"]] += seq.computed_prompt_tokens

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
            if client == PEER and self.prefill is not None:
                self.prefill.on_peer(msg)
            elif isinstance(msg, (api.PdHello, api.PdSealed)):
                self._on_pd(client, msg)
            elif isinstance(msg, PEER_ONLY):  # a peer message outside a session: refused
                self.stats.array[P.STAT["pd_refused"]] += 1
                log.warning("unauthenticated %s refused", type(msg).__name__)
                self.reply(client, api.ErrorEvent(str(getattr(msg, "request_id", "")), api.BAD_REQUEST,
                                                  f"{type(msg).__name__} must come inside an authenticated "
                                                  f"peer session (PdHello, then PdSealed)"))
            elif isinstance(msg, api.GenerateRequest):
                self._on_generate(client, msg)
            elif isinstance(msg, api.CancelRequest):
                self._on_cancel(client, msg)
            elif isinstance(msg, api.InfoRequest):
                if not is_int(msg.nonce):
                    self.reply(client, api.ErrorEvent("", api.BAD_REQUEST,
                                                      f"nonce must be an integer, got {show(msg.nonce)}"))
                    continue
                c = self.cfg
                self.reply(client, api.InfoReply(msg.nonce, c.node, c.role, c.vocab_size, c.max_model_len,
                                                  c.block_size, -1))
            else:
                self.reply(client, api.ErrorEvent("", api.BAD_REQUEST, f"{type(msg).__name__} is not a request"))
        self._probe_clients()

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
        if self.prefill is not None:
            rids += [rid for rid, p in self.prefill.pending.items() if p.client == client]
            rids += [rid for rid, r in self.prefill.relays.items() if r.seq.client == client]
        return list(dict.fromkeys(rids))

    def _owner_of(self, rid: str) -> bytes | None:
        """The client that submitted request `rid`, or None if it is not in flight."""
        if (seq := self.sched.seqs.get(rid)) is not None:
            return seq.client
        if self.prefill is not None:
            if (p := self.prefill.pending.get(rid)) is not None:
                return p.client
            if (r := self.prefill.relays.get(rid)) is not None:
                return r.seq.client
        return None

    def _end_client(self, client: bytes, why: str) -> None:
        """Cancel every request of a client that is gone (`why` empty) or does not read (`why`
        goes to it with each request, kept until it reads). A decode node's blocks held for a
        prefill node stay until kv-ready or their lease: the prefill node may be writing them."""
        seqs = self.sched.seqs
        rids = [rid for rid in self._requests_of(client) if rid not in self.sched.remote_ids
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
        if self.prefill is not None:
            owners += [p.client for p in self.prefill.pending.values()]
            owners += [r.seq.client for r in self.prefill.relays.values()]
        self._per_client = {}
        for c in owners:
            self._per_client[c] = self._per_client.get(c, 0) + 1
        for c in self._per_client:
            if c and c != PEER and not c.startswith(PEER_CLIENT):  # a peer's requests: its session's
                self.server.probe(c)

    def _on_pd(self, client: bytes, msg) -> None:
        if self.decode is None:
            self.stats.array[P.STAT["pd_refused"]] += 1
            self.reply(client, api.ErrorEvent("", api.BAD_REQUEST,
                                              f"node {self.cfg.node} is not a decode node (role {self.cfg.role})"))
        elif isinstance(msg, api.PdHello):
            self.decode.on_peer_hello(client, msg)
        else:
            self.decode.on_sealed(client, msg, self.accepting)

    def _on_generate(self, client: bytes, req: api.GenerateRequest) -> None:
        rid = req.request_id
        problem = validate(req, self.cfg)
        if problem:
            self.reply(client, api.ErrorEvent("" if api.request_id_problem(rid) else rid, api.BAD_REQUEST, problem))
            return
        if not self.accepting:
            self.reply(client, api.ErrorEvent(rid, api.STOPPING, "the node is stopping and takes no new requests"))
            return
        if rid in self.sched.seqs or (self.prefill is not None and self.prefill.busy(rid)):
            self.reply(client, api.ErrorEvent(rid, api.DUPLICATE, f"request id {rid!r} is already in flight"))
            return
        if self._per_client.get(client, 0) >= api.MAX_REQUESTS_PER_CLIENT:
            self._per_client[client] = len(self._requests_of(client))  # the count is an upper bound
            if self._per_client[client] >= api.MAX_REQUESTS_PER_CLIENT:
                self.reply(client, api.ErrorEvent(rid, api.TOO_MANY, f"this client already has "
                                                  f"{api.MAX_REQUESTS_PER_CLIENT} requests in flight"))
                return
        self._per_client[client] = self._per_client.get(client, 0) + 1
        if self.prefill is not None and req.max_new_tokens > 1:
            self.prefill.on_generate(client, req)
            return
        self.sched.add(Sequence.new(rid, req.prompt, req.max_new_tokens, self.cfg.block_size, self.cfg.key_root,
                                    client=client,
                                    eos_token_id=req.eos_token_id, use_cache=req.use_cache, stream=req.stream))

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
        if self.prefill is not None and self.prefill.on_cancel(client, rid):
            return
        seq = self.sched.cancel(rid)
        if seq is not None:
            self.finished(seq)

    def finished(self, seq: Sequence) -> None:
        now = time.monotonic()
        self.count_finished(seq)
        if self.prefill is not None:
            self.prefill.ended_here(seq.request_id)
        ttft = (seq.first_token_at - seq.arrival) * 1e3 if seq.first_token_at else 0.0
        if seq.first_token_at:
            self.metrics.ttft_seconds.observe(ttft / 1e3)
        self.reply(seq.client, api.FinishedEvent(
            seq.request_id, seq.output.copy(), seq.finish_reason, seq.prompt_len, *seq.cached,
            seq.computed_prompt_tokens, seq.preemptions, ttft, (now - seq.arrival) * 1e3))

    def _apply(self, out: StepOutcome) -> None:
        s = self.stats.array
        for seq, index in out.emitted:
            s[P.STAT["generated_tokens"]] += 1
            if seq.stream:
                self.reply(seq.client, api.TokenEvent(seq.request_id, index, [int(seq.output[index])]))
        for seq in out.finished:
            self.finished(seq)
        for seq, why in out.failed:
            if self.prefill is not None:
                self.prefill.ended_here(seq.request_id)
            self.count_failed()
            self.reply(seq.client, api.ErrorEvent(seq.request_id, api.FAILED, why))
        for seq in out.handoff:
            self.prefill.start_send(seq)

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
        data = P.PROTOCOL.encode(batch)
        for ring in self.to_workers:
            ring.put(data, self.cfg.rank_timeout)
        self._answers.clear()
        self._step_deadline = time.monotonic() + self.cfg.rank_timeout
        self.stats.array[P.STAT["steps"]] += 1

    def _on_step_result(self, res: P.StepResult) -> None:
        step = self.sched.inflight
        if step is None or res.step_id != step.step_id:
            log.warning("answer to step %d from worker[%d] for no step in flight", res.step_id, res.rank)
            return
        self._answers[res.rank] = res
        if len(self._answers) < self.cfg.tp:
            return
        errors = [a.error for a in self._answers.values() if a.error]
        if errors:
            self._apply(self.sched.fail_step(step, "; ".join(errors)))
        else:
            self._apply(self.sched.finish_step(step, self._answers[0].tokens))

    def _check_step_deadline(self) -> None:
        step = self.sched.inflight
        if step is None or time.monotonic() < self._step_deadline:
            return
        missing = sorted(set(range(self.cfg.tp)) - set(self._answers))
        why = f"worker rank(s) {missing} did not answer step {step.step_id} within {self.cfg.rank_timeout:.3g}s"
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
        if isinstance(msg, P.StepResult):
            self._on_step_result(msg)
        elif isinstance(msg, P.SendDone) and self.prefill is not None:
            self.prefill.on_send_done(msg)
        elif isinstance(msg, P.MessagerHello):
            if self.decode is not None:
                self.decode.on_hello(msg)
        elif isinstance(msg, P.StorageKeys) and self.storage is not None:
            self.storage.listed(msg.rank, msg.keys, msg.last)
            if self.storage.ready:
                log.info("storage tier %s: %d blocks on every rank", self.cfg.storage, len(self.storage))
        elif isinstance(msg, P.TransferDone):
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
        if self.storage is not None:
            task = result.task
            if task.kind == P.GPU2STORAGE and result.ok:
                self.storage.add(task.keys)
            elif task.kind == P.STORAGE2GPU:
                self.storage.forget(task.keys[result.blocks if result.ok else 0:])  # missing or corrupt
        cache_id = self._cache_task_of.pop(result.task.task_id, None)
        if cache_id is not None:
            self.sched.on_task_outcome(self.cache.apply_task_result(cache_id, result.ok, result.blocks))

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> int:
        if self.cfg.metrics_port:
            self.metrics.serve(self.cfg.metrics_port)
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

    def step(self) -> None:
        self.member.beat()
        self._intake()
        if self.decode is not None:
            self.decode.pump()  # answer P as soon as blocks are held, before any wait
        if self.sched.inflight is None and (self.storage is None or self.storage.ready):
            self._launch_step()  # (requests wait for the storage listing: it can only hit more)
        try:
            got = self.fan.get(TICK_S)
            if got is not None:
                self._on_record(got[1], self.inbound[got[0]])
                for idx, rec in iter(self.fan.try_get, None):
                    self._on_record(rec, self.inbound[idx])
        except WaitTimeout:
            pass
        except PeerDead as e:
            log.error("%s", e)  # the launcher notices the death too and stops the node
        for result in self.transfer.expire():
            self._on_task_result(result)
        if self.prefill is not None:
            self.prefill.expire()
        if self.decode is not None:
            self.decode.pump()
        self._check_step_deadline()
        self.issue_cache_tasks()
        self.publish_stats()

    def shutdown(self, grace_s: float = 5.0) -> int:
        """Stop intake, let running requests and tasks finish (bounded, and cut short by
        SIGTERM), fail what is left, then tell every child to exit."""
        self.accepting = False
        deadline = time.monotonic() + grace_s
        while (self.transfer.inflight or not self.sched.idle or (self.prefill and self.prefill.sends)) \
                and time.monotonic() < deadline and not self.stop.signal:
            self.step()
        if self.prefill is not None:
            self.prefill.fail_all("the prefill node is stopping")
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
        """An error event for every request in flight (a prefill node's handoffs included)."""
        self.accepting = False
        if self.prefill is not None:
            self.prefill.fail_all(why)
        for seq in list(self.sched.seqs.values()):
            self.count_failed()
            self.reply(seq.client, api.ErrorEvent(seq.request_id, api.FAILED, why))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.engine", description="kvrt engine process (started by kvrt launch)")
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
