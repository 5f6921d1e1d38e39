"""The prefill node's connector: every request's KV is computed here and handed to a decode
node D.

For a client request P
1. asks D to hold blocks (PdPrealloc); D answers with its block ids, the prompt tokens it
   already has cached, its ranks' transport descriptors and a lease (PdAllocated);
2. prefills like a mixed node, recording its own computed blocks in its own prefix cache
   after each chunk (so its hit rate holds up) and streams the first token to the client at
   once;
3. orders every cache-messager rank to write the blocks D lacks into D's block ids; when all
   ranks report them written, tells D "kv ready" with the first token, releases its request
   (its blocks stay cached) and relays D's tokens to the client.

Every wait has a deadline (`--pd-timeout`): P fails a request D does not allocate for or stops
answering for. Peer messages travel only inside an authenticated session (pd_auth.py), and
every field of D's messages is checked before it touches a request. P pings D while idle and
fails requests at once when D stopped answering, instead of after --pd-timeout each.
"""
from __future__ import annotations

import hmac
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from ipc import protocol as P
from ipc.errors import ProtocolError
from ipc.rank_group import RankGroup
from runtime import api
from runtime.config import LEASE_MARGIN_S
from runtime.intake import sampling_of
from runtime.pd_auth import NONCE_BYTES, P2D, AuthError, Session, check_bytes, load_secret, new_nonce, \
    session_key, welcome_mac
from runtime.sequence import Sequence
from runtime.server import PEER

from .base import ConnectorContext, KVConnector
from .peer import MAX_REASON, check_id as _check_id, is_int as _is_int, refused as _refused

log = logging.getLogger(__name__)
PING_EVERY_S = 0.5    # a ping (or a hello while no session) this often
DEAD_AFTER_S = 5.0    # D is gone after this long without any answer (at most --pd-timeout)
SEND_GRACE_S = 0.5    # the engine waits this long past a send order's deadline for the answer


@dataclass
class _Pending:
    """A request waiting for D's blocks."""

    client: bytes
    req: api.GenerateRequest
    deadline: float
    arrival: float = field(default_factory=time.monotonic)
    asked: bool = False  # the preallocation went out (it waits for a session otherwise)


@dataclass
class _Send:
    """A handoff being written by the cache-messager ranks."""

    seq: Sequence
    ranks: RankGroup[P.SendDone]


@dataclass
class _Relay:
    """A request now decoding on D; what P measured, to complete D's final answer."""

    seq: Sequence
    deadline: float


class PrefillConnector(KVConnector):
    has_ranks = True  # cache-messager[r]: the P->D transport

    def __init__(self, ctx: ConnectorContext):
        super().__init__(ctx)
        self.timeout = ctx.cfg.pd_timeout
        self.secret = load_secret(ctx.cfg.pd_secret_file)
        self.pending: dict[str, _Pending] = {}
        self.sends: dict[int, _Send] = {}
        self.dest: dict[str, api.PdAllocated] = {}  # request prefilling here -> D's blocks for it
        self._due: list[Sequence] = []  # prefilled (first token out), their send not yet ordered
        self.relays: dict[str, _Relay] = {}
        self.leases: dict[str, float] = {}  # request -> when D's hold on its blocks ends (P's clock)
        self.lost: dict[str, api.ErrorEvent] = {}  # requests D gave up on while P still prefills
        self._task_ids = itertools.count(1)
        self.link: Session | None = None
        self._nonces: OrderedDict[bytes, None] = OrderedDict()  # hellos sent, newest last
        self.dead_after = min(DEAD_AFTER_S, self.timeout)
        self._silent_since = time.monotonic()  # no session since (or last heard from D at)
        self._next_ping = 0.0

    def busy(self, request_id: str) -> bool:
        return request_id in self.pending or request_id in self.relays

    def requests(self) -> Iterable[tuple[str, bytes]]:
        yield from ((rid, p.client) for rid, p in self.pending.items())
        yield from ((rid, r.seq.client) for rid, r in self.relays.items())

    def is_peer_client(self, client: bytes) -> bool:
        return client == PEER

    @property
    def inflight(self) -> bool:
        return bool(self.sends)

    def _to_d(self, msg) -> None:
        self.ctx.send_raw(PEER, msg)

    # ---- the link to D ----------------------------------------------------------------------
    def gone(self) -> str:
        """Why D counts as gone (no session and no answer for dead_after), or ""."""
        silent = time.monotonic() - self._silent_since
        if self.link is None and silent > self.dead_after:
            return f"the decode node has not answered for {silent:.1f}s ({self.ctx.cfg.decode_peer})"
        return ""

    def _send(self, msg) -> None:
        """To D, sealed; dropped while there is no session (D's leases take back its blocks)."""
        if self.link is None:
            log.warning("no session with the decode node: %s dropped", type(msg).__name__)
            return
        self._to_d(self.link.seal(msg))

    def _hello(self) -> None:
        nonce = new_nonce()
        self._nonces[nonce] = None
        while len(self._nonces) > 8:
            self._nonces.popitem(last=False)
        self._to_d(api.PdHello(self.ctx.cfg.node, nonce))

    def _welcome(self, msg: api.PdWelcome) -> None:
        try:
            nonce = check_bytes(msg.nonce, NONCE_BYTES, "nonce")
            session = check_bytes(msg.session, NONCE_BYTES, "session")
            mac = check_bytes(msg.mac, 32, "mac")
        except AuthError as e:
            _refused(self.ctx.stats, f"welcome: {e}")
            return
        if nonce not in self._nonces:
            if self.link is None:  # an answer to an earlier hello once a session is up is expected
                _refused(self.ctx.stats, "welcome to a hello this node did not send")
            return
        peer = self.ctx.cfg.node
        if not hmac.compare_digest(mac, welcome_mac(self.secret, nonce, session, peer)):
            _refused(self.ctx.stats, "welcome not signed with the shared secret: check --pd-secret-file on both nodes")
            return
        self._nonces.clear()  # D may still answer hellos sent before this one: those are stale now
        if self.link is not None:
            self._link_lost("the decode node opened a new session (it restarted?)")
        self.link = Session(session, session_key(self.secret, nonce, session, peer), peer, P2D)
        self._silent_since = time.monotonic()
        log.info("session with the decode node %s is up", self.ctx.cfg.decode_peer)
        for p in self.pending.values():
            if not p.asked:
                self._ask(p)

    def _link_lost(self, why: str) -> None:
        """D is gone or forgot the session: fail what it held; say hello again."""
        log.warning("lost the decode node: %s", why)
        self.link = None
        self._silent_since = time.monotonic()
        self._next_ping = 0.0
        for rid in [r for r, p in self.pending.items() if p.asked]:
            p = self.pending.pop(rid)
            self.ctx.count_failed()
            self.ctx.reply(p.client, api.ErrorEvent(rid, api.FAILED, f"decode node lost: {why}"))
        for rid in list(self.relays):
            r = self.relays.pop(rid)
            self.ctx.count_failed()
            self.ctx.reply(r.seq.client, api.ErrorEvent(rid, api.FAILED, f"decode node lost: {why}"))
        for rid in list(self.leases):  # still prefilling here: the handoff will fail at start_send
            self.lost.setdefault(rid, api.ErrorEvent(rid, api.FAILED, why))

    def _ping(self) -> None:
        now = time.monotonic()
        if now < self._next_ping:
            return
        self._next_ping = now + PING_EVERY_S
        if self.link is None:
            self._hello()
        elif now - self._silent_since > self.dead_after:
            self._link_lost(f"no answer to pings for {now - self._silent_since:.1f}s")
            self._hello()
        else:
            self._send(api.PdPing())

    # ---- client side ----------------------------------------------------------------------
    def on_request(self, client: bytes, req: api.GenerateRequest) -> bool:
        """A request of more than one token is handed off: it waits here for D's blocks."""
        if req.max_new_tokens <= 1:
            return False
        if why := self.gone():
            self.ctx.count_failed()
            self.ctx.reply(client, api.ErrorEvent(req.request_id, api.FAILED, f"decode node unreachable: {why}"))
            return True
        p = self.pending[req.request_id] = _Pending(client, req, time.monotonic() + self.timeout)
        if self.link is not None:
            self._ask(p)
        return True

    def _ask(self, p: _Pending) -> None:
        p.asked = True
        req = p.req
        self._send(api.PdPrealloc(req.request_id, req.prompt, req.max_new_tokens, req.eos_token_id, req.use_cache,
                                  req.temperature, req.top_p, req.top_k, req.seed, req.stop_token_ids,
                                  req.logprobs))

    def cancel(self, client: bytes, request_id: str) -> bool:
        """True if the request is one of P's handoffs (then it is handled here)."""
        if (p := self.pending.pop(request_id, None)) is not None:
            if p.asked:
                self._send(api.PdAbort(request_id, "cancelled by the client"))
            self.ctx.reply(p.client, api.FinishedEvent(request_id, np.empty(0, np.int32), "cancelled",
                                                       len(p.req.prompt)))
            return True
        if request_id in self.relays:
            self._send(api.CancelRequest(request_id))
            return True
        self.ended_here(request_id)  # still prefilling here (if at all): D can let go now
        return False

    def request_finished(self, seq: Sequence) -> None:
        self.ended_here(seq.request_id)

    def ended_here(self, request_id: str) -> None:
        """A handoff request ended on P before its handoff (EOS as the first token, a failed
        step, a cancel): D can give its blocks back now instead of at the lease's end."""
        self.dest.pop(request_id, None)
        if self.leases.pop(request_id, None) is not None:
            self.lost.pop(request_id, None)
            self._send(api.PdAbort(request_id, "the request ended on the prefill node"))

    # ---- messages from D ------------------------------------------------------------------
    def on_peer_message(self, client: bytes, msg: object) -> bool:
        """Everything from the decode peer's socket is the connector's."""
        if client != PEER:
            return False
        self._on_peer(msg)
        return True

    def on_rank_message(self, msg: object) -> bool:
        if isinstance(msg, P.SendDone):
            self._on_send_done(msg)
        return isinstance(msg, (P.SendDone, P.MessagerHello))  # P's ranks' hellos are for D only

    def _on_peer(self, msg) -> None:
        if isinstance(msg, api.PdWelcome):
            self._welcome(msg)
            return
        if isinstance(msg, api.PdRefused):
            if self.link is not None and msg.session == self.link.session:
                self._link_lost(f"the decode node refused the session: {str(msg.reason)[:MAX_REASON]}")
                self._next_ping = 0.0  # hello again at once
            return
        if not isinstance(msg, api.PdSealed) or self.link is None:
            _refused(self.ctx.stats, f"unauthenticated {type(msg).__name__} from the decode peer")
            return
        try:
            inner = self.link.open(msg)
        except ProtocolError as e:
            _refused(self.ctx.stats, f"from the decode peer: {e}")
            return
        self._silent_since = time.monotonic()
        problem = self._check(inner)
        if problem:
            _refused(self.ctx.stats, f"{type(inner).__name__} from the decode node: {problem}")
            return
        rid = getattr(inner, "request_id", "")
        if isinstance(inner, api.PdAllocated):
            self._allocated(inner)
        elif isinstance(inner, api.TokenEvent):
            if (r := self.relays.get(rid)) is not None:
                r.deadline = time.monotonic() + self.timeout
                if r.seq.stream:
                    self.ctx.reply(r.seq.client, inner)
        elif isinstance(inner, api.FinishedEvent):
            if (r := self.relays.pop(rid, None)) is not None:
                seq = r.seq
                inner.cached_device, inner.cached_host, inner.cached_storage = seq.cached
                inner.computed_prompt_tokens, inner.preemptions = seq.computed_prompt_tokens, seq.preemptions
                inner.ttft_ms = (seq.first_token_at - seq.arrival) * 1e3
                inner.e2e_ms = (time.monotonic() - seq.arrival) * 1e3
                self.ctx.count_finished(seq)
                self.ctx.reply(seq.client, inner)
        elif isinstance(inner, api.ErrorEvent):
            self._peer_error(inner)
        elif not isinstance(inner, api.PdPong):
            log.warning("unexpected %s from the decode node", type(inner).__name__)

    def _check(self, msg) -> str:
        """The first problem with a message from D, or "" (D is authenticated, but a bug there
        must not corrupt a request here)."""
        vocab, cfg = self.ctx.cfg.vocab_size, self.ctx.cfg
        if isinstance(msg, (api.PdAllocated, api.TokenEvent, api.FinishedEvent, api.ErrorEvent)):
            if problem := _check_id(msg.request_id):
                return problem
        if isinstance(msg, api.PdAllocated):
            if not _is_int(msg.cached_tokens) or msg.cached_tokens < 0:
                return f"cached_tokens {msg.cached_tokens!r}"
            if not isinstance(msg.lease_s, (int, float)) or isinstance(msg.lease_s, bool) or not 0 < msg.lease_s < 1e6:
                return f"lease_s {msg.lease_s!r}"
            if not isinstance(msg.descriptors, list) or not all(isinstance(d, dict) for d in msg.descriptors):
                return "descriptors must be a list of maps"
            if len(msg.block_ids) and (msg.block_ids.min() < 0 or msg.block_ids.max() >= 1 << 30):
                return "block ids out of range"
        elif isinstance(msg, api.TokenEvent):
            if not _is_int(msg.index) or msg.index < 0 or not isinstance(msg.token_ids, list) or \
                    not all(_is_int(t) and 0 <= t < vocab for t in msg.token_ids):
                return "index and token ids must be in range"
            if not _logprobs_ok(msg.logprobs, len(msg.token_ids)):
                return "logprobs must be a list of numbers, at most one per token"
        elif isinstance(msg, api.FinishedEvent):
            out = msg.output_token_ids
            if len(out) > cfg.max_model_len or (len(out) and (out.min() < 0 or out.max() >= vocab)):
                return "output token ids out of range"
            if not isinstance(msg.finish_reason, str) or not _is_int(msg.prompt_tokens):
                return "finish_reason and prompt_tokens"
            if not _logprobs_ok(msg.output_logprobs, len(out)):
                return "output logprobs must be a list of numbers, at most one per token"
        elif isinstance(msg, api.ErrorEvent):
            if not isinstance(msg.code, str) or not isinstance(msg.message, str):
                return "code and message must be strings"
            msg.message = msg.message[:MAX_REASON]
        return ""

    def _allocated(self, msg: api.PdAllocated) -> None:
        p = self.pending.pop(msg.request_id, None)
        if p is None:  # timed out or cancelled meanwhile: give the blocks back
            self._send(api.PdAbort(msg.request_id, "the prefill node no longer has the request"))
            return
        req, cfg = p.req, self.ctx.cfg
        if len(msg.descriptors) != cfg.tp or len(msg.block_ids) < -(-len(req.prompt) // cfg.block_size) \
                or msg.cached_tokens > len(req.prompt):
            self._fail_pending(p, f"decode node answered with {len(msg.descriptors)} rank(s), "
                                  f"{len(msg.block_ids)} blocks and {msg.cached_tokens} cached tokens; this "
                                  f"prefill node has --tp {cfg.tp} and a prompt of {len(req.prompt)} tokens")
            return
        seq = Sequence.new(req.request_id, req.prompt, req.max_new_tokens, cfg.block_size, cfg.key_root,
                           client=p.client,
                           eos_token_id=req.eos_token_id, use_cache=req.use_cache, stream=req.stream,
                           arrival=p.arrival, **sampling_of(req))
        self.dest[req.request_id] = msg
        self.leases[req.request_id] = p.arrival + msg.lease_s  # D's lease began after our ask: safe side
        self.ctx.sched.add(seq)

    def _peer_error(self, msg: api.ErrorEvent) -> None:
        rid = msg.request_id
        if (p := self.pending.pop(rid, None)) is not None:
            self.ctx.count_failed()
            self.ctx.reply(p.client, msg)
        elif (r := self.relays.pop(rid, None)) is not None:
            self.ctx.count_failed()
            self.ctx.reply(r.seq.client, msg)
        elif rid in self.leases:  # D let the blocks go while P prefills: never write into them
            log.warning("decode node gave up %s before the handoff: %s", rid, msg.message)
            self.lost[rid] = msg
        else:
            log.warning("decode node error for %s: %s: %s", rid or "(no request)", msg.code, msg.message)

    def _fail_pending(self, p: _Pending, why: str) -> None:
        if p.asked:
            self._send(api.PdAbort(p.req.request_id, why))
        self.ctx.count_failed()
        self.ctx.reply(p.client, api.ErrorEvent(p.req.request_id, api.FAILED, why))

    # ---- sending blocks ---------------------------------------------------------------------
    def takes_over(self, seq: Sequence) -> bool:
        """A handoff request's first token is out: it stops here, holding its blocks, until
        its KV is in D (its send is ordered in build_orders)."""
        if seq.request_id not in self.dest:
            return False
        self._due.append(seq)
        return True

    def build_orders(self) -> None:
        due, self._due = self._due, []
        for seq in due:
            self._start_send(seq)

    def _start_send(self, seq: Sequence) -> None:
        """The prefill is done (first token out): write the blocks D lacks into D's blocks."""
        rid = seq.request_id
        alloc = self.dest.pop(rid)
        lease_end = self.leases.pop(rid, 0.0)
        lost = self.lost.pop(rid, None)
        now = time.monotonic()
        if lost is not None or self.link is None or now + self.ctx.cfg.rank_timeout + LEASE_MARGIN_S > lease_end:
            why = (f"decode node: {lost.message}" if lost is not None else
                   "no session with the decode node" if self.link is None else
                   f"the decode node's lease on the blocks of {rid} ends before a handoff could finish "
                   f"(prefill took too long; raise --pd-timeout)")
            if lost is None:
                self._send(api.PdAbort(rid, why))
            self.ctx.sched.drop(seq, "error")
            self.ctx.count_failed()
            self.ctx.reply(seq.client, api.ErrorEvent(rid, api.FAILED, why))
            return
        bs = self.ctx.cfg.block_size
        first, last = alloc.cached_tokens // bs, -(-seq.prompt_len // bs)
        src = np.asarray(self.ctx.block_table(seq.request_id)[first:last], dtype=np.int32)
        dst = np.asarray(alloc.block_ids[first:last], dtype=np.int32)
        task_id = next(self._task_ids)
        # The rank must not touch D's blocks after this (P's clock; the check above keeps it
        # LEASE_MARGIN_S before D's lease ends); the engine gives up a little later, so an
        # answer "expired" still arrives before it tells D to let the blocks go.
        deadline = min(now + self.ctx.cfg.rank_timeout, lease_end - LEASE_MARGIN_S)
        self.sends[task_id] = _Send(seq, RankGroup(self.ctx.cfg.tp, deadline + SEND_GRACE_S))
        data = P.PROTOCOL.encode(P.SendBlocks(task_id, seq.request_id, list(alloc.descriptors), src, dst,
                                              deadline))
        for ring in self.ctx.to_ranks:
            ring.put(data, self.ctx.cfg.rank_timeout)

    def _on_send_done(self, done: P.SendDone) -> None:
        s = self.sends.get(done.task_id)
        if s is None or not 0 <= done.rank < s.ranks.size:
            log.warning("answer to unknown or expired send %d from cache-messager[%d]", done.task_id, done.rank)
            return
        if not s.ranks.add(done.rank, done):
            return
        del self.sends[done.task_id]
        self.ctx.stats[P.STAT["pd_sent_bytes"]] += sum(a.nbytes for a in s.ranks.answers)
        errors = [a.error for a in s.ranks.answers if not a.ok]
        self._sent(s.seq, "; ".join(errors))

    def _sent(self, seq: Sequence, error: str) -> None:
        rid = seq.request_id
        self.ctx.sched.drop(seq, seq.finish_reason or "handoff")
        if not error and self.link is None:
            error = "the session with the decode node was lost during the handoff"
        if error or seq.cancelled:
            why = error or "cancelled by the client"
            self._send(api.PdAbort(rid, why))
            if seq.cancelled and not error:
                seq.finish_reason = "cancelled"
                self.ctx.finished(seq)
            else:
                self.ctx.count_failed()
                self.ctx.reply(seq.client, api.ErrorEvent(rid, api.FAILED, f"KV handoff to the decode node failed: {why}"))
            return
        self._send(api.PdKvReady(rid, int(seq.output[0]), seq.output_logprobs[0] if seq.logprobs else 0.0))
        self.relays[rid] = _Relay(seq, time.monotonic() + self.timeout)

    # ---- deadlines ----------------------------------------------------------------------------
    def tick(self) -> None:
        self._ping()
        now = time.monotonic()
        for rid in [r for r, p in self.pending.items() if p.deadline <= now]:
            p = self.pending.pop(rid)
            self._fail_pending(p, f"the decode node did not allocate blocks for {rid} within {self.timeout:g}s "
                                  f"(--pd-timeout)" if p.asked else f"no session with the decode node within "
                                  f"{self.timeout:g}s (--pd-timeout); is --pd-secret-file the same on both nodes?")
        for tid in [t for t, s in self.sends.items() if s.ranks.expired(now)]:
            s = self.sends.pop(tid)
            missing = s.ranks.missing()
            self._sent(s.seq, f"cache-messager rank(s) {missing} did not answer within {self.ctx.cfg.rank_timeout:g}s")
        for rid in [r for r, x in self.relays.items() if x.deadline <= now]:
            r = self.relays.pop(rid)
            self.ctx.count_failed()
            self.ctx.reply(r.seq.client, api.ErrorEvent(rid, api.FAILED, f"the decode node stopped answering for "
                                                                         f"{rid} ({self.timeout:g}s, --pd-timeout)"))

    def fail_all(self, why: str) -> None:
        for p in list(self.pending.values()):
            self._fail_pending(p, why)
        self.pending.clear()
        for r in self.relays.values():
            self.ctx.reply(r.seq.client, api.ErrorEvent(r.seq.request_id, api.STOPPING, why))
        self.relays.clear()


def _logprobs_ok(logprobs: object, tokens: int) -> bool:
    """A list of at most `tokens` log-probabilities (numbers <= 0) from the decode node."""
    return isinstance(logprobs, list) and len(logprobs) <= tokens and all(
        isinstance(x, float) and x <= 0.0 for x in logprobs)
