"""Prefill/decode disaggregation: the engine's side of the P->D handoff (REFERENCE_SYSTEM.md §4,
done the way its bugs say it must be).

P (`PrefillSide`), for a client request:
1. asks D to hold blocks (PdPrealloc); D answers with its block ids, the prompt tokens it
   already has cached, its ranks' transport descriptors and a lease (PdAllocated);
2. prefills like a mixed node, recording its own computed blocks in its own prefix cache
   after each chunk (the reference never did: its PD hit rate collapsed) and streams the
   first token to the client at once;
3. orders every cache-messager rank to write the blocks D lacks into D's block ids; when all
   ranks report them written, tells D "kv ready" with the first token, releases its request
   (its blocks stay cached) and relays D's tokens to the client.
D (`DecodeSide`) holds blocks under a lease, records the received blocks in its prefix cache
only at kv-ready (the reference's first fix recorded them before their KV existed), then
decodes like a mixed node, streaming to P.

Every wait has a deadline (`--pd-timeout`): P fails a request D does not allocate for or
stops answering for; D takes back blocks whose KV never came. Errors travel as messages and
fail one request, never the node.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ipc import protocol as P

from . import api
from .intake import validate
from .sequence import Sequence, SeqState

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)
LEASE_MARGIN_S = 1.0  # P starts a send only if it ends (at worst) this long before D's lease does


@dataclass
class _Pending:
    """P: a request waiting for D's blocks."""

    client: bytes
    req: api.GenerateRequest
    deadline: float
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class _Send:
    """P: a handoff being written by the cache-messager ranks."""

    seq: Sequence
    deadline: float
    answers: dict[int, P.SendDone] = field(default_factory=dict)


@dataclass
class _Relay:
    """P: a request now decoding on D; what P measured, to complete D's final answer."""

    seq: Sequence
    deadline: float


class PrefillSide:
    def __init__(self, engine: "Engine"):
        self.e = engine
        self.timeout = engine.cfg.pd_timeout
        self.pending: dict[str, _Pending] = {}
        self.sends: dict[int, _Send] = {}
        self.relays: dict[str, _Relay] = {}
        self.leases: dict[str, float] = {}  # request -> when D's hold on its blocks ends (P's clock)
        self.lost: dict[str, api.ErrorEvent] = {}  # requests D gave up on while P still prefills
        self._task_ids = itertools.count(1)

    def busy(self, request_id: str) -> bool:
        return request_id in self.pending or request_id in self.relays

    # ---- client side ----------------------------------------------------------------------
    def on_generate(self, client: bytes, req: api.GenerateRequest) -> None:
        self.pending[req.request_id] = _Pending(client, req, time.monotonic() + self.timeout)
        self.e.send_peer(api.PdPrealloc(req.request_id, req.prompt, req.max_new_tokens,
                                        req.eos_token_id, req.use_cache))

    def on_cancel(self, client: bytes, request_id: str) -> bool:
        """True if the request is one of P's handoffs (then it is handled here)."""
        if (p := self.pending.pop(request_id, None)) is not None:
            self.e.send_peer(api.PdAbort(request_id, "cancelled by the client"))
            self.e.reply(p.client, api.FinishedEvent(request_id, np.empty(0, np.int32), "cancelled",
                                                     len(p.req.prompt)))
            return True
        if request_id in self.relays:
            self.e.send_peer(api.CancelRequest(request_id))
            return True
        self.ended_here(request_id)  # still prefilling here (if at all): D can let go now
        return False

    def ended_here(self, request_id: str) -> None:
        """A handoff request ended on P before its handoff (EOS as the first token, a failed
        step, a cancel): D can give its blocks back now instead of at the lease's end."""
        if self.leases.pop(request_id, None) is not None:
            self.lost.pop(request_id, None)
            self.e.send_peer(api.PdAbort(request_id, "the request ended on the prefill node"))

    # ---- messages from D ------------------------------------------------------------------
    def on_peer(self, msg) -> None:
        rid = getattr(msg, "request_id", "")
        if isinstance(msg, api.PdAllocated):
            self._allocated(msg)
        elif isinstance(msg, api.TokenEvent):
            if (r := self.relays.get(rid)) is not None:
                r.deadline = time.monotonic() + self.timeout
                if r.seq.stream:
                    self.e.reply(r.seq.client, msg)
        elif isinstance(msg, api.FinishedEvent):
            if (r := self.relays.pop(rid, None)) is not None:
                seq = r.seq
                msg.cached_device, msg.cached_host, msg.cached_storage = seq.cached
                msg.computed_prompt_tokens, msg.preemptions = seq.computed_prompt_tokens, seq.preemptions
                msg.ttft_ms = (seq.first_token_at - seq.arrival) * 1e3
                msg.e2e_ms = (time.monotonic() - seq.arrival) * 1e3
                self.e.count_finished(seq)
                self.e.reply(seq.client, msg)
        elif isinstance(msg, api.ErrorEvent):
            self._peer_error(msg)
        else:
            log.warning("unexpected %s from the decode node", type(msg).__name__)

    def _allocated(self, msg: api.PdAllocated) -> None:
        p = self.pending.pop(msg.request_id, None)
        if p is None:  # timed out or cancelled meanwhile: give the blocks back
            self.e.send_peer(api.PdAbort(msg.request_id, "the prefill node no longer has the request"))
            return
        req, cfg = p.req, self.e.cfg
        if len(msg.descriptors) != cfg.tp or len(msg.block_ids) < -(-len(req.prompt) // cfg.block_size):
            self._fail_pending(p, f"decode node answered with {len(msg.descriptors)} rank(s) and "
                                  f"{len(msg.block_ids)} blocks; this prefill node has --tp {cfg.tp}")
            return
        seq = Sequence.new(req.request_id, req.prompt, req.max_new_tokens, cfg.block_size, cfg.key_root,
                           client=p.client,
                           eos_token_id=req.eos_token_id, use_cache=req.use_cache, stream=req.stream,
                           handoff=True, remote=msg, arrival=p.arrival)
        self.leases[req.request_id] = p.arrival + msg.lease_s  # D's lease began after our ask: safe side
        self.e.sched.add(seq)

    def _peer_error(self, msg: api.ErrorEvent) -> None:
        rid = msg.request_id
        if (p := self.pending.pop(rid, None)) is not None:
            self.e.reply(p.client, msg)
        elif (r := self.relays.pop(rid, None)) is not None:
            self.e.count_failed()
            self.e.reply(r.seq.client, msg)
        elif rid in self.leases:  # D let the blocks go while P prefills: never write into them
            log.warning("decode node gave up %s before the handoff: %s", rid, msg.message)
            self.lost[rid] = msg
        else:
            log.warning("decode node error for %s: %s: %s", rid or "(no request)", msg.code, msg.message)

    def _fail_pending(self, p: _Pending, why: str) -> None:
        self.e.send_peer(api.PdAbort(p.req.request_id, why))
        self.e.count_failed()
        self.e.reply(p.client, api.ErrorEvent(p.req.request_id, api.FAILED, why))

    # ---- sending blocks ---------------------------------------------------------------------
    def start_send(self, seq: Sequence) -> None:
        """The prefill is done (first token out): write the blocks D lacks into D's blocks."""
        alloc: api.PdAllocated = seq.remote
        rid = seq.request_id
        lease_end = self.leases.pop(rid, 0.0)
        lost = self.lost.pop(rid, None)
        if lost is not None or time.monotonic() + self.e.cfg.rank_timeout + LEASE_MARGIN_S > lease_end:
            why = (f"decode node: {lost.message}" if lost is not None else
                   f"the decode node's lease on the blocks of {rid} ends before a handoff could finish "
                   f"(prefill took too long; raise --pd-timeout)")
            if lost is None:
                self.e.send_peer(api.PdAbort(rid, why))
            self.e.sched.drop(seq, "error")
            self.e.count_failed()
            self.e.reply(seq.client, api.ErrorEvent(rid, api.FAILED, why))
            return
        bs = self.e.cfg.block_size
        first, last = alloc.cached_tokens // bs, -(-seq.prompt_len // bs)
        src = np.asarray(self.e.cache.block_table(seq.request_id)[first:last], dtype=np.int32)
        dst = np.asarray(alloc.block_ids[first:last], dtype=np.int32)
        task_id = next(self._task_ids)
        self.sends[task_id] = _Send(seq, time.monotonic() + self.e.cfg.rank_timeout)
        data = P.PROTOCOL.encode(P.SendBlocks(task_id, seq.request_id, list(alloc.descriptors), src, dst))
        for ring in self.e.to_messagers:
            ring.put(data, self.e.cfg.rank_timeout)

    def on_send_done(self, done: P.SendDone) -> None:
        s = self.sends.get(done.task_id)
        if s is None:
            log.warning("answer to unknown or expired send %d from cache-messager[%d]", done.task_id, done.rank)
            return
        s.answers[done.rank] = done
        if len(s.answers) < self.e.cfg.tp:
            return
        del self.sends[done.task_id]
        stats = self.e.stats.array
        stats[P.STAT["pd_sent_bytes"]] += sum(a.nbytes for a in s.answers.values())
        errors = [a.error for a in s.answers.values() if not a.ok]
        self._sent(s.seq, "; ".join(errors))

    def _sent(self, seq: Sequence, error: str) -> None:
        rid = seq.request_id
        self.e.sched.drop(seq, seq.finish_reason or "handoff")
        if error or seq.cancelled:
            why = error or "cancelled by the client"
            self.e.send_peer(api.PdAbort(rid, why))
            if seq.cancelled and not error:
                seq.finish_reason = "cancelled"
                self.e.finished(seq)
            else:
                self.e.count_failed()
                self.e.reply(seq.client, api.ErrorEvent(rid, api.FAILED, f"KV handoff to the decode node failed: {why}"))
            return
        self.e.send_peer(api.PdKvReady(rid, int(seq.output[0])))
        self.relays[rid] = _Relay(seq, time.monotonic() + self.timeout)

    # ---- deadlines ----------------------------------------------------------------------------
    def expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, p in self.pending.items() if p.deadline <= now]:
            self._fail_pending(self.pending.pop(rid), f"the decode node did not allocate blocks for "
                                                      f"{rid} within {self.timeout:g}s (--pd-timeout)")
        for tid in [t for t, s in self.sends.items() if s.deadline <= now]:
            s = self.sends.pop(tid)
            missing = sorted(set(range(self.e.cfg.tp)) - set(s.answers))
            self._sent(s.seq, f"cache-messager rank(s) {missing} did not answer within {self.e.cfg.rank_timeout:g}s")
        for rid in [r for r, x in self.relays.items() if x.deadline <= now]:
            r = self.relays.pop(rid)
            self.e.count_failed()
            self.e.reply(r.seq.client, api.ErrorEvent(rid, api.FAILED, f"the decode node stopped answering for "
                                                                       f"{rid} ({self.timeout:g}s, --pd-timeout)"))

    def fail_all(self, why: str) -> None:
        for p in list(self.pending.values()):
            self._fail_pending(p, why)
        self.pending.clear()
        for r in self.relays.values():
            self.e.reply(r.seq.client, api.ErrorEvent(r.seq.request_id, api.STOPPING, why))
        self.relays.clear()


class DecodeSide:
    def __init__(self, engine: "Engine"):
        self.e = engine
        self.lease_s = engine.cfg.pd_timeout
        self.descriptors: dict[int, dict] = {}  # rank -> its cache-messager's transport descriptor
        self.deadlines: dict[str, float] = {}    # request -> when its reservation or lease ends

    def on_hello(self, hello: P.MessagerHello) -> None:
        self.descriptors[hello.rank] = hello.descriptor

    def on_prealloc(self, client: bytes, msg: api.PdPrealloc) -> None:
        rid = msg.request_id
        req = api.GenerateRequest(rid, msg.prompt, msg.max_new_tokens, msg.eos_token_id, msg.use_cache)
        problem = validate(req, self.e.cfg)
        if not problem and rid in self.e.sched.seqs:
            problem = f"request id {rid!r} is already in flight on the decode node"
        if not problem and len(self.descriptors) < self.e.cfg.tp:
            problem = "the decode node's cache-messagers are not ready"
        if problem:
            self.e.reply(client, api.ErrorEvent(rid, api.BAD_REQUEST, f"decode node: {problem}"))
            return
        seq = Sequence.new(rid, msg.prompt, msg.max_new_tokens, self.e.cfg.block_size, self.e.cfg.key_root,
                           client=client,
                           eos_token_id=msg.eos_token_id, use_cache=msg.use_cache)
        self.e.sched.reserve(seq)
        self.deadlines[rid] = time.monotonic() + self.lease_s

    def pump(self) -> None:
        """Answer P for every reservation that now holds its blocks; expire leases."""
        for seq in self.e.sched.take_reserved():
            self.deadlines[seq.request_id] = time.monotonic() + self.lease_s
            bs = self.e.cfg.block_size
            table = self.e.cache.block_table(seq.request_id)[:-(-seq.prompt_len // bs)]
            self.e.reply(seq.client, api.PdAllocated(
                seq.request_id, np.asarray(table, dtype=np.int32), seq.num_computed,
                [self.descriptors[r] for r in range(self.e.cfg.tp)], self.lease_s))
        now = time.monotonic()
        for rid in [r for r, t in self.deadlines.items() if t <= now]:
            del self.deadlines[rid]
            seq = self.e.sched.seqs.get(rid)
            if seq is not None and seq.state in (SeqState.RESERVING, SeqState.LOADING, SeqState.REMOTE):
                what = "blocks for" if seq.state is not SeqState.REMOTE else "the KV of"
                log.warning("lease of %s expired: no %s it within %gs; blocks returned", rid, what, self.lease_s)
                self.e.sched.drop(seq, "lease expired")
                self.e.count_failed()
                self.e.reply(seq.client, api.ErrorEvent(rid, api.FAILED, f"decode node: lease expired after "
                                                                         f"{self.lease_s:g}s waiting for {what} {rid}"))

    def on_kv_ready(self, client: bytes, msg: api.PdKvReady) -> None:
        seq = self.e.sched.seqs.get(msg.request_id)
        self.deadlines.pop(msg.request_id, None)
        if seq is None or seq.state is not SeqState.REMOTE:
            self.e.reply(client, api.ErrorEvent(msg.request_id, api.FAILED,
                                                f"decode node holds no blocks for {msg.request_id} (lease expired?)"))
            return
        if not self.e.sched.resume_remote(seq, int(msg.first_token)):
            self.e.finished(seq)

    def on_abort(self, msg: api.PdAbort) -> None:
        seq = self.e.sched.seqs.get(msg.request_id)
        self.deadlines.pop(msg.request_id, None)
        if seq is not None and msg.request_id in self.e.sched.remote_ids:
            log.info("%s aborted by the prefill node: %s", msg.request_id, msg.reason)
            self.e.sched.drop(seq, "aborted")

    def remote_blocks(self) -> list[int]:
        """Blocks P is writing into (held under a lease): nobody here may read or write them."""
        out: list[int] = []
        bs = self.e.cfg.block_size
        for rid in self.e.sched.remote_ids:
            seq = self.e.sched.seqs[rid]
            if seq.state is SeqState.REMOTE:
                out += self.e.cache.block_table(rid)[seq.num_computed // bs:-(-seq.prompt_len // bs)]
        return out

