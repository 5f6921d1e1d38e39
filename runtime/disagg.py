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

D's handshake port is reachable from the network, so D treats every peer as hostile until
proven otherwise: peer messages travel only inside an authenticated session (pd_auth.py: a
shared secret, HMAC per message, counters against replay), a peer touches only the requests it
created (D names them after the authenticated peer), each peer has quotas (blocks held,
preallocations waiting for kv-ready), and every field of every peer message is checked before
it touches any state: a bad one gets an error answer and changes nothing. P pings D while idle
and fails requests at once when D stopped answering, instead of after --pd-timeout each.
"""
from __future__ import annotations

import hmac
import itertools
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ipc import protocol as P
from ipc.errors import ProtocolError

from . import api
from .config import LEASE_MARGIN_S
from .intake import validate
from .pd_auth import (D2P, NONCE_BYTES, P2D, AuthError, Session, check_bytes, load_secret, new_nonce,
                      session_key, welcome_mac)
from .sequence import Sequence, SeqState

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)
PING_EVERY_S = 0.5    # P: a ping (or a hello while no session) this often
DEAD_AFTER_S = 5.0    # P: D is gone after this long without any answer (at most --pd-timeout)
SEND_GRACE_S = 0.5    # P: the engine waits this long past a send order's deadline for the answer
PEER_CLIENT = b"\x00pd:"  # D: client identity of a peer's requests (ZeroMQ never gives one with \x00)
MAX_PEER_NAME = 64
MAX_REQUEST_ID = 256
MAX_REASON = 512
MAX_PENDING_SESSIONS = 16  # D: hellos not yet followed by a sealed message
MAX_PEERS = 32


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _check_id(rid) -> str:
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID:
        return f"request_id must be a string of 1..{MAX_REQUEST_ID} characters"
    return ""


def _refused(engine: "Engine", why: str) -> None:
    engine.stats.array[P.STAT["pd_refused"]] += 1
    log.warning("peer message refused: %s", why)


@dataclass
class _Pending:
    """P: a request waiting for D's blocks."""

    client: bytes
    req: api.GenerateRequest
    deadline: float
    arrival: float = field(default_factory=time.monotonic)
    asked: bool = False  # the preallocation went out (it waits for a session otherwise)


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
        self.secret = load_secret(engine.cfg.pd_secret_file)
        self.pending: dict[str, _Pending] = {}
        self.sends: dict[int, _Send] = {}
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

    # ---- the link to D ----------------------------------------------------------------------
    def gone(self) -> str:
        """Why D counts as gone (no session and no answer for dead_after), or ""."""
        silent = time.monotonic() - self._silent_since
        if self.link is None and silent > self.dead_after:
            return f"the decode node has not answered for {silent:.1f}s ({self.e.cfg.decode_peer})"
        return ""

    def _send(self, msg) -> None:
        """To D, sealed; dropped while there is no session (D's leases take back its blocks)."""
        if self.link is None:
            log.warning("no session with the decode node: %s dropped", type(msg).__name__)
            return
        self.e.reply_peer(self.link.seal(msg))

    def _hello(self) -> None:
        nonce = new_nonce()
        self._nonces[nonce] = None
        while len(self._nonces) > 8:
            self._nonces.popitem(last=False)
        self.e.reply_peer(api.PdHello(self.e.cfg.node, nonce))

    def _welcome(self, msg: api.PdWelcome) -> None:
        try:
            nonce = check_bytes(msg.nonce, NONCE_BYTES, "nonce")
            session = check_bytes(msg.session, NONCE_BYTES, "session")
            mac = check_bytes(msg.mac, 32, "mac")
        except AuthError as e:
            _refused(self.e, f"welcome: {e}")
            return
        if nonce not in self._nonces:
            if self.link is None:  # an answer to an earlier hello once a session is up is expected
                _refused(self.e, "welcome to a hello this node did not send")
            return
        peer = self.e.cfg.node
        if not hmac.compare_digest(mac, welcome_mac(self.secret, nonce, session, peer)):
            _refused(self.e, "welcome not signed with the shared secret: check --pd-secret-file on both nodes")
            return
        self._nonces.clear()  # D may still answer hellos sent before this one: those are stale now
        if self.link is not None:
            self._link_lost("the decode node opened a new session (it restarted?)")
        self.link = Session(session, session_key(self.secret, nonce, session, peer), peer, P2D)
        self._silent_since = time.monotonic()
        log.info("session with the decode node %s is up", self.e.cfg.decode_peer)
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
            self.e.count_failed()
            self.e.reply(p.client, api.ErrorEvent(rid, api.FAILED, f"decode node lost: {why}"))
        for rid in list(self.relays):
            r = self.relays.pop(rid)
            self.e.count_failed()
            self.e.reply(r.seq.client, api.ErrorEvent(rid, api.FAILED, f"decode node lost: {why}"))
        for rid in list(self.leases):  # still prefilling here: the handoff will fail at start_send
            self.lost.setdefault(rid, api.ErrorEvent(rid, api.FAILED, why))

    def tick(self) -> None:
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
    def on_generate(self, client: bytes, req: api.GenerateRequest) -> None:
        if why := self.gone():
            self.e.count_failed()
            self.e.reply(client, api.ErrorEvent(req.request_id, api.FAILED, f"decode node unreachable: {why}"))
            return
        p = self.pending[req.request_id] = _Pending(client, req, time.monotonic() + self.timeout)
        if self.link is not None:
            self._ask(p)

    def _ask(self, p: _Pending) -> None:
        p.asked = True
        req = p.req
        self._send(api.PdPrealloc(req.request_id, req.prompt, req.max_new_tokens, req.eos_token_id, req.use_cache))

    def on_cancel(self, client: bytes, request_id: str) -> bool:
        """True if the request is one of P's handoffs (then it is handled here)."""
        if (p := self.pending.pop(request_id, None)) is not None:
            if p.asked:
                self._send(api.PdAbort(request_id, "cancelled by the client"))
            self.e.reply(p.client, api.FinishedEvent(request_id, np.empty(0, np.int32), "cancelled",
                                                     len(p.req.prompt)))
            return True
        if request_id in self.relays:
            self._send(api.CancelRequest(request_id))
            return True
        self.ended_here(request_id)  # still prefilling here (if at all): D can let go now
        return False

    def ended_here(self, request_id: str) -> None:
        """A handoff request ended on P before its handoff (EOS as the first token, a failed
        step, a cancel): D can give its blocks back now instead of at the lease's end."""
        if self.leases.pop(request_id, None) is not None:
            self.lost.pop(request_id, None)
            self._send(api.PdAbort(request_id, "the request ended on the prefill node"))

    # ---- messages from D ------------------------------------------------------------------
    def on_peer(self, msg) -> None:
        if isinstance(msg, api.PdWelcome):
            self._welcome(msg)
            return
        if isinstance(msg, api.PdRefused):
            if self.link is not None and msg.session == self.link.session:
                self._link_lost(f"the decode node refused the session: {str(msg.reason)[:MAX_REASON]}")
                self._next_ping = 0.0  # hello again at once
            return
        if not isinstance(msg, api.PdSealed) or self.link is None:
            _refused(self.e, f"unauthenticated {type(msg).__name__} from the decode peer")
            return
        try:
            inner = self.link.open(msg)
        except ProtocolError as e:
            _refused(self.e, f"from the decode peer: {e}")
            return
        self._silent_since = time.monotonic()
        problem = self._check(inner)
        if problem:
            _refused(self.e, f"{type(inner).__name__} from the decode node: {problem}")
            return
        rid = getattr(inner, "request_id", "")
        if isinstance(inner, api.PdAllocated):
            self._allocated(inner)
        elif isinstance(inner, api.TokenEvent):
            if (r := self.relays.get(rid)) is not None:
                r.deadline = time.monotonic() + self.timeout
                if r.seq.stream:
                    self.e.reply(r.seq.client, inner)
        elif isinstance(inner, api.FinishedEvent):
            if (r := self.relays.pop(rid, None)) is not None:
                seq = r.seq
                inner.cached_device, inner.cached_host, inner.cached_storage = seq.cached
                inner.computed_prompt_tokens, inner.preemptions = seq.computed_prompt_tokens, seq.preemptions
                inner.ttft_ms = (seq.first_token_at - seq.arrival) * 1e3
                inner.e2e_ms = (time.monotonic() - seq.arrival) * 1e3
                self.e.count_finished(seq)
                self.e.reply(seq.client, inner)
        elif isinstance(inner, api.ErrorEvent):
            self._peer_error(inner)
        elif not isinstance(inner, api.PdPong):
            log.warning("unexpected %s from the decode node", type(inner).__name__)

    def _check(self, msg) -> str:
        """The first problem with a message from D, or "" (D is authenticated, but a bug there
        must not corrupt a request here)."""
        vocab, cfg = self.e.cfg.vocab_size, self.e.cfg
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
        elif isinstance(msg, api.FinishedEvent):
            out = msg.output_token_ids
            if len(out) > cfg.max_model_len or (len(out) and (out.min() < 0 or out.max() >= vocab)):
                return "output token ids out of range"
            if not isinstance(msg.finish_reason, str) or not _is_int(msg.prompt_tokens):
                return "finish_reason and prompt_tokens"
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
        req, cfg = p.req, self.e.cfg
        if len(msg.descriptors) != cfg.tp or len(msg.block_ids) < -(-len(req.prompt) // cfg.block_size) \
                or msg.cached_tokens > len(req.prompt):
            self._fail_pending(p, f"decode node answered with {len(msg.descriptors)} rank(s), "
                                  f"{len(msg.block_ids)} blocks and {msg.cached_tokens} cached tokens; this "
                                  f"prefill node has --tp {cfg.tp} and a prompt of {len(req.prompt)} tokens")
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
            self.e.count_failed()
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
        if p.asked:
            self._send(api.PdAbort(p.req.request_id, why))
        self.e.count_failed()
        self.e.reply(p.client, api.ErrorEvent(p.req.request_id, api.FAILED, why))

    # ---- sending blocks ---------------------------------------------------------------------
    def start_send(self, seq: Sequence) -> None:
        """The prefill is done (first token out): write the blocks D lacks into D's blocks."""
        alloc: api.PdAllocated = seq.remote
        rid = seq.request_id
        lease_end = self.leases.pop(rid, 0.0)
        lost = self.lost.pop(rid, None)
        now = time.monotonic()
        if lost is not None or self.link is None or now + self.e.cfg.rank_timeout + LEASE_MARGIN_S > lease_end:
            why = (f"decode node: {lost.message}" if lost is not None else
                   "no session with the decode node" if self.link is None else
                   f"the decode node's lease on the blocks of {rid} ends before a handoff could finish "
                   f"(prefill took too long; raise --pd-timeout)")
            if lost is None:
                self._send(api.PdAbort(rid, why))
            self.e.sched.drop(seq, "error")
            self.e.count_failed()
            self.e.reply(seq.client, api.ErrorEvent(rid, api.FAILED, why))
            return
        bs = self.e.cfg.block_size
        first, last = alloc.cached_tokens // bs, -(-seq.prompt_len // bs)
        src = np.asarray(self.e.cache.block_table(seq.request_id)[first:last], dtype=np.int32)
        dst = np.asarray(alloc.block_ids[first:last], dtype=np.int32)
        task_id = next(self._task_ids)
        # The rank must not touch D's blocks after this (P's clock; the check above keeps it
        # LEASE_MARGIN_S before D's lease ends); the engine gives up a little later, so an
        # answer "expired" still arrives before it tells D to let the blocks go.
        deadline = min(now + self.e.cfg.rank_timeout, lease_end - LEASE_MARGIN_S)
        self.sends[task_id] = _Send(seq, deadline + SEND_GRACE_S)
        data = P.PROTOCOL.encode(P.SendBlocks(task_id, seq.request_id, list(alloc.descriptors), src, dst,
                                              deadline))
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
        if not error and self.link is None:
            error = "the session with the decode node was lost during the handoff"
        if error or seq.cancelled:
            why = error or "cancelled by the client"
            self._send(api.PdAbort(rid, why))
            if seq.cancelled and not error:
                seq.finish_reason = "cancelled"
                self.e.finished(seq)
            else:
                self.e.count_failed()
                self.e.reply(seq.client, api.ErrorEvent(rid, api.FAILED, f"KV handoff to the decode node failed: {why}"))
            return
        self._send(api.PdKvReady(rid, int(seq.output[0])))
        self.relays[rid] = _Relay(seq, time.monotonic() + self.timeout)

    # ---- deadlines ----------------------------------------------------------------------------
    def expire(self) -> None:
        self.tick()
        now = time.monotonic()
        for rid in [r for r, p in self.pending.items() if p.deadline <= now]:
            p = self.pending.pop(rid)
            self._fail_pending(p, f"the decode node did not allocate blocks for {rid} within {self.timeout:g}s "
                                  f"(--pd-timeout)" if p.asked else f"no session with the decode node within "
                                  f"{self.timeout:g}s (--pd-timeout); is --pd-secret-file the same on both nodes?")
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


@dataclass
class _Peer:
    """D: one authenticated prefill node: its current session and where to reach it."""

    name: str
    session: Session
    route: bytes  # the ZeroMQ identity its messages last came from

    @property
    def client(self) -> bytes:
        return PEER_CLIENT + self.name.encode()


class DecodeSide:
    def __init__(self, engine: "Engine"):
        self.e = engine
        self.lease_s = engine.cfg.pd_timeout
        self.secret = load_secret(engine.cfg.pd_secret_file)
        self.descriptors: dict[int, dict] = {}  # rank -> its cache-messager's transport descriptor
        self.deadlines: dict[str, float] = {}    # request -> when its reservation or lease ends
        self.peers: dict[str, _Peer] = {}        # peer name -> its current session
        self.sessions: dict[bytes, Session] = {}  # session id -> session (confirmed ones)
        self._hellos: OrderedDict[bytes, Session] = OrderedDict()  # not yet confirmed, oldest first
        self.owner: dict[str, tuple[str, str]] = {}  # internal request id -> (peer, P's request id)

    def on_hello(self, hello: P.MessagerHello) -> None:
        self.descriptors[hello.rank] = hello.descriptor

    # ---- sessions -----------------------------------------------------------------------------
    def on_peer_hello(self, client: bytes, msg: api.PdHello) -> None:
        """Open a session (unconfirmed until a sealed message proves P holds the secret)."""
        if not isinstance(msg.peer, str) or not 0 < len(msg.peer) <= MAX_PEER_NAME or \
                not isinstance(msg.nonce, bytes) or len(msg.nonce) != NONCE_BYTES:
            _refused(self.e, "malformed hello")
            self.e.reply(client, api.ErrorEvent("", api.BAD_REQUEST, "malformed hello"))
            return
        session = secrets.token_bytes(NONCE_BYTES)
        self._hellos[session] = Session(session, session_key(self.secret, msg.nonce, session, msg.peer),
                                        msg.peer, D2P)
        while len(self._hellos) > MAX_PENDING_SESSIONS:
            self._hellos.popitem(last=False)
        self.e.reply(client, api.PdWelcome(msg.nonce, session, welcome_mac(self.secret, msg.nonce, session, msg.peer)))

    def on_sealed(self, client: bytes, msg: api.PdSealed, accepting: bool) -> None:
        sid = msg.session if isinstance(msg.session, bytes) else b""
        sess = self.sessions.get(sid) or self._hellos.get(sid)
        try:
            if sess is None:
                raise AuthError("unknown session (this decode node restarted, or it was never opened)")
            inner = sess.open(msg)
        except ProtocolError as e:
            _refused(self.e, str(e))
            self.e.reply(client, api.PdRefused(sid, str(e)))
            return
        peer = self.peers.get(sess.peer)
        if sid in self._hellos:  # confirmed: it replaces the peer's earlier session (P restarted)
            if peer is None and len(self.peers) >= MAX_PEERS:
                _refused(self.e, f"too many peers ({MAX_PEERS}); {sess.peer!r} refused")
                self.e.reply(client, api.PdRefused(sid, "too many peers"))
                return
            del self._hellos[sid]
            if peer is not None:
                self.sessions.pop(peer.session.session, None)
            peer = self.peers[sess.peer] = _Peer(sess.peer, sess, client)
            self.sessions[sid] = sess
            log.info("prefill peer %s authenticated", sess.peer)
        peer.route = client  # P's socket may have reconnected
        if isinstance(inner, api.PdPing):
            self._to_peer(peer, api.PdPong(inner.nonce if _is_int(inner.nonce) else 0))
        elif isinstance(inner, api.PdPrealloc):
            if accepting:
                self.on_prealloc(peer, inner)
            else:
                self._to_peer(peer, api.ErrorEvent(str(inner.request_id), api.STOPPING, "the decode node is stopping"))
        elif isinstance(inner, api.PdKvReady):
            self.on_kv_ready(peer, inner)
        elif isinstance(inner, api.PdAbort):
            self.on_abort(peer, inner)
        elif isinstance(inner, api.CancelRequest):
            self.on_cancel(peer, inner)
        else:
            _refused(self.e, f"{type(inner).__name__} is not a peer request")
            self._to_peer(peer, api.ErrorEvent("", api.BAD_REQUEST, f"{type(inner).__name__} is not a peer request"))

    def _to_peer(self, peer: _Peer, msg) -> None:
        self.e.server_send(peer.route, peer.session.seal(msg))

    def deliver(self, client: bytes, msg) -> None:
        """An answer to a peer's request (engine.reply for PEER_CLIENT identities): back under
        P's own request id, sealed in the peer's current session."""
        peer = self.peers.get(client[len(PEER_CLIENT):].decode(errors="replace"))
        if peer is None:
            return
        rid = getattr(msg, "request_id", None)
        if isinstance(rid, str) and rid in self.owner:
            msg.request_id = self.owner[rid][1]
        self._to_peer(peer, msg)

    def is_peer_request(self, request_id) -> bool:
        """A request a peer created (nobody else may cancel it)."""
        return isinstance(request_id, str) and request_id in self.owner

    @staticmethod
    def internal_id(peer: str, request_id: str) -> str:
        return f"pd:{peer}:{request_id}"

    # ---- requests -------------------------------------------------------------------------------
    def _error(self, peer: _Peer, rid, code: str, why: str) -> None:
        self._to_peer(peer, api.ErrorEvent(rid if isinstance(rid, str) else "", code, f"decode node: {why}"))

    def _check_prealloc(self, msg: api.PdPrealloc) -> str:
        cfg = self.e.cfg
        if problem := _check_id(msg.request_id):
            return problem
        if not _is_int(msg.max_new_tokens) or not _is_int(msg.eos_token_id) or not -1 <= msg.eos_token_id < cfg.vocab_size:
            return "max_new_tokens and eos_token_id must be integers (eos_token_id -1 or in the vocabulary)"
        if not isinstance(msg.use_cache, bool):
            return "use_cache must be a boolean"
        return validate(api.GenerateRequest(msg.request_id, msg.prompt, int(msg.max_new_tokens),
                                            int(msg.eos_token_id), msg.use_cache), cfg)

    def _held(self, peer: str) -> tuple[int, int]:
        """(blocks held, preallocations waiting for kv-ready) of one peer."""
        blocks = waiting = 0
        bs = self.e.cfg.block_size
        for internal, (owner, _) in self.owner.items():
            seq = self.e.sched.seqs.get(internal)
            if owner != peer or seq is None:
                continue
            blocks += -(-(seq.prompt_len + seq.max_new_tokens) // bs)
            waiting += internal in self.e.sched.remote_ids
        return blocks, waiting

    def on_prealloc(self, peer: _Peer, msg: api.PdPrealloc) -> None:
        rid = msg.request_id
        problem = self._check_prealloc(msg)
        internal = self.internal_id(peer.name, rid) if not problem else ""
        cfg = self.e.cfg
        if not problem and internal in self.e.sched.seqs:
            problem = f"request id {rid!r} is already in flight on the decode node"
        if not problem:
            blocks, waiting = self._held(peer.name)
            need = -(-(len(msg.prompt) + msg.max_new_tokens) // cfg.block_size)
            if waiting >= cfg.pd_peer_max_preallocs:
                problem = f"peer {peer.name} already has {waiting} preallocations waiting (--pd-peer-max-preallocs)"
            elif blocks + need > cfg.peer_max_blocks:
                problem = (f"peer {peer.name} holds {blocks} blocks; {need} more exceed its quota of "
                           f"{cfg.peer_max_blocks} (--pd-peer-max-blocks)")
        if not problem and len(self.descriptors) < cfg.tp:
            problem = "the decode node's cache-messagers are not ready"
        if problem:
            _refused(self.e, f"preallocation from {peer.name}: {problem}")
            self._error(peer, rid, api.BAD_REQUEST, problem)
            return
        seq = Sequence.new(internal, msg.prompt, int(msg.max_new_tokens), cfg.block_size, self.e.cfg.key_root,
                           client=peer.client, eos_token_id=int(msg.eos_token_id), use_cache=msg.use_cache)
        self.owner[internal] = (peer.name, rid)
        self.e.sched.reserve(seq)
        self.deadlines[internal] = time.monotonic() + self.lease_s

    def _owned(self, peer: _Peer, rid) -> str | None:
        """The internal id of `peer`'s request `rid`, if it is one of its requests in flight."""
        if _check_id(rid):
            return None
        internal = self.internal_id(peer.name, rid)
        return internal if internal in self.owner and internal in self.e.sched.seqs else None

    def pump(self) -> None:
        """Answer P for every reservation that now holds its blocks; expire leases; forget
        ended requests."""
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
                                                                         f"{self.lease_s:g}s waiting for {what} "
                                                                         f"{self.owner.get(rid, ('', rid))[1]}"))
        for internal in [i for i in self.owner if i not in self.e.sched.seqs]:
            del self.owner[internal]

    def on_kv_ready(self, peer: _Peer, msg: api.PdKvReady) -> None:
        rid, token = msg.request_id, msg.first_token
        if not _is_int(token) or not 0 <= token < self.e.cfg.vocab_size:
            _refused(self.e, f"kv-ready from {peer.name} with first token {token!r}")
            self._error(peer, rid, api.BAD_REQUEST, f"first_token must be an integer in [0, {self.e.cfg.vocab_size})")
            return
        internal = self._owned(peer, rid)
        seq = self.e.sched.seqs.get(internal) if internal else None
        if seq is None or seq.state is not SeqState.REMOTE:
            self._error(peer, rid, api.FAILED, f"it holds no blocks for {rid!r} (lease expired?)")
            return
        self.deadlines.pop(internal, None)
        if not self.e.sched.resume_remote(seq, int(token)):
            self.e.finished(seq)

    def on_abort(self, peer: _Peer, msg: api.PdAbort) -> None:
        internal = self._owned(peer, msg.request_id)
        if internal is not None and internal in self.e.sched.remote_ids:
            reason = msg.reason[:MAX_REASON] if isinstance(msg.reason, str) else ""
            log.info("%s aborted by the prefill node %s: %s", msg.request_id, peer.name, reason)
            self.deadlines.pop(internal, None)
            self.e.sched.drop(self.e.sched.seqs[internal], "aborted")

    def on_cancel(self, peer: _Peer, msg: api.CancelRequest) -> None:
        internal = self._owned(peer, msg.request_id)
        if internal is None:
            self._error(peer, msg.request_id, api.UNKNOWN, f"no request {msg.request_id!r} of this peer in flight")
            return
        seq = self.e.sched.cancel(internal)
        if seq is not None:
            self.e.finished(seq)

    def remote_blocks(self) -> list[int]:
        """Blocks P is writing into (held under a lease): nobody here may read or write them."""
        out: list[int] = []
        bs = self.e.cfg.block_size
        for rid in self.e.sched.remote_ids:
            seq = self.e.sched.seqs[rid]
            if seq.state is SeqState.REMOTE:
                out += self.e.cache.block_table(rid)[seq.num_computed // bs:-(-seq.prompt_len // bs)]
        return out
