"""The decode node's connector: a prefill node P computes each request's prompt KV and writes
it into blocks this node holds for it.

D holds blocks for a peer's request under a lease (matched against its own prefix cache first,
so only missing blocks travel), answers P with their ids, records the received blocks in its
prefix cache only at kv-ready (their KV did not exist here before), then decodes like a mixed
node, streaming to P. Blocks whose KV never came are taken back when the lease ends.

D's handshake port is reachable from the network, so D treats every peer as hostile until
proven otherwise: peer messages travel only inside an authenticated session (runtime/pd/auth.py: a
shared secret, HMAC per message, counters against replay), a peer touches only the requests it
created (D names them after the authenticated peer), and every field of every peer message is
checked before it touches any state: a bad one gets an error answer and changes nothing.

A peer's requests are hashed under a key root of that peer's own (peer.peer_key_root): D
cannot check the KV a peer writes, so the blocks a peer wrote serve only that peer's later
requests, never D's own clients or another peer (a forged block changes that peer's answers
only).

Quotas protect without refusing the legitimate. Each peer may hold at most its share of the
pool (worst case: prompt plus max_new_tokens, per request) and have at most
--pd-peer-max-preallocs preallocations waiting for kv-ready; a preallocation over either waits
in D's queue (it holds no block) until the peer's own requests give blocks back, at most until
its lease would have ended, and the error then says what it waited for. The share is max-min
fair over the peers that hold or ask for blocks: every other such peer keeps the blocks it needs
up to pool / (number of them), and the rest is this peer's. One peer alone may so use the whole
pool; with several, each is guaranteed its equal part as soon as others' requests end (no
preemption: leases bound how long that takes); --pd-peer-max-blocks caps it further. Only a
request that can never fit (more than that cap or the pool) is refused at once, and one P asked
not to queue (it has another decode node to try).
"""
from __future__ import annotations

import logging
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from kvrt.ipc import protocol as P
from kvrt.ipc.errors import ProtocolError
from kvrt.runtime.cache.keys import salted_root
from kvrt.runtime.client import api
from kvrt.runtime.engine.intake import is_int, is_number, request_pages, sampling_of, validate
from kvrt.runtime.engine.sequence import Sequence, SeqState
from kvrt.runtime.node.config import LEASE_MARGIN_S
from kvrt.runtime.pd import messages as wire
from kvrt.runtime.pd.auth import D2P, NONCE_BYTES, AuthError, Session, load_secret, session_key, welcome_mac

from kvrt.runtime.pd.connector import ConnectorContext, KVConnector
from kvrt.runtime.pd.peer import MAX_PEER_NAME, MAX_REASON, PEER_CLIENT, check_id as _check_id, \
    Refusals, peer_key_root

log = logging.getLogger(__name__)
MAX_PENDING_SESSIONS = 16  # hellos not yet followed by a sealed message
MAX_PEERS = 32
MAX_QUEUED = 4096  # preallocations one peer may have queued for its share (they hold no block)


@dataclass
class _Peer:
    """D: one authenticated prefill node: its current session and where to reach it."""

    name: str
    session: Session
    route: bytes  # the ZeroMQ identity its messages last came from

    @property
    def client(self) -> bytes:
        return PEER_CLIENT + self.name.encode()


@dataclass
class _Queued:
    """D: a peer's preallocation waiting for the peer's share of the pool (it holds no block)."""

    peer: str
    msg: wire.PdPrealloc
    need: int  # blocks, at worst (prompt and max_new_tokens)
    received: float = field(default_factory=time.monotonic)


@dataclass
class _Usage:
    """D: one peer's use of the pool."""

    held: int = 0     # blocks of its requests in the scheduler, at worst
    waiting: int = 0  # its preallocations not yet at kv-ready
    queued: int = 0   # blocks its queued preallocations ask for

    @property
    def demand(self) -> int:
        return self.held + self.queued


class DecodeConnector(KVConnector):
    has_ranks = True  # cache-messager[r]: the P->D transport

    def __init__(self, ctx: ConnectorContext):
        super().__init__(ctx)
        self.lease_s = ctx.cfg.pd_timeout
        # how long a request may wait for blocks: its P (same --pd-timeout) hears why before it gives up
        self.wait_s = self.lease_s - LEASE_MARGIN_S
        self._refused = Refusals(ctx.stats)
        self.secret = load_secret(ctx.cfg.pd_secret_file)
        self.descriptors: dict[int, dict] = {}  # rank -> its cache-messager's transport descriptor
        self.deadlines: dict[str, float] = {}    # request -> when its reservation or lease ends
        self.peers: dict[str, _Peer] = {}        # peer name -> its current session
        self.sessions: dict[bytes, Session] = {}  # session id -> session (confirmed ones)
        self._hellos: OrderedDict[bytes, Session] = OrderedDict()  # not yet confirmed, oldest first
        self.owner: dict[str, tuple[str, str]] = {}  # internal request id -> (peer, P's request id)
        self.queued: OrderedDict[str, _Queued] = OrderedDict()  # internal id -> over its peer's share, oldest first
        self.queued_of: Counter[str] = Counter()  # peer -> its preallocations in `queued`
        self.received: dict[str, float] = {}  # internal id -> when its preallocation came, until it has blocks

    def on_rank_message(self, msg: object) -> bool:
        """A cache-messager rank's hello carries its transport descriptor (P's ranks need it)."""
        if not isinstance(msg, P.MessagerHello):
            return False
        self.descriptors[msg.rank] = msg.descriptor
        return True

    def on_peer_message(self, client: bytes, msg: object) -> bool:
        """A peer opens a session with PdHello; everything else it sends is sealed."""
        if isinstance(msg, wire.PdHello):
            self.on_peer_hello(client, msg)
        elif isinstance(msg, wire.PdSealed):
            self.on_sealed(client, msg)
        else:
            return False
        return True

    def is_peer_client(self, client: bytes) -> bool:
        return client.startswith(PEER_CLIENT)

    def busy(self, request_id: str) -> bool:
        return request_id in self.queued

    def requests(self) -> Iterable[tuple[str, bytes]]:
        """Queued preallocations (the scheduler's requests are listed by the engine)."""
        yield from ((internal, PEER_CLIENT + q.peer.encode()) for internal, q in self.queued.items())

    # ---- sessions -----------------------------------------------------------------------------
    def on_peer_hello(self, client: bytes, msg: wire.PdHello) -> None:
        """Open a session (unconfirmed until a sealed message proves P holds the secret)."""
        if not isinstance(msg.peer, str) or not 0 < len(msg.peer) <= MAX_PEER_NAME or \
                not isinstance(msg.nonce, bytes) or len(msg.nonce) != NONCE_BYTES:
            self._refused("malformed hello")
            self.ctx.reply(client, api.ErrorEvent("", api.BAD_REQUEST, "malformed hello"))
            return
        session = secrets.token_bytes(NONCE_BYTES)
        self._hellos[session] = Session(session, session_key(self.secret, msg.nonce, session, msg.peer),
                                        msg.peer, D2P)
        while len(self._hellos) > MAX_PENDING_SESSIONS:
            self._hellos.popitem(last=False)
        self.ctx.reply(client, wire.PdWelcome(msg.nonce, session, welcome_mac(self.secret, msg.nonce, session, msg.peer)))

    def on_sealed(self, client: bytes, msg: wire.PdSealed) -> None:
        sid = msg.session if isinstance(msg.session, bytes) else b""
        sess = self.sessions.get(sid) or self._hellos.get(sid)
        try:
            if sess is None:
                raise AuthError("unknown session (this decode node restarted, or it was never opened)")
            inner = sess.open(msg)
        except ProtocolError as e:
            self._refused(str(e))
            self.ctx.reply(client, wire.PdRefused(sid, str(e)))
            return
        peer = self.peers.get(sess.peer)
        if sid in self._hellos:  # confirmed: it replaces the peer's earlier session (P restarted)
            if peer is None and len(self.peers) >= MAX_PEERS:
                self._refused(f"too many peers ({MAX_PEERS}); {sess.peer!r} refused")
                self.ctx.reply(client, wire.PdRefused(sid, "too many peers"))
                return
            del self._hellos[sid]
            if peer is not None:
                self.sessions.pop(peer.session.session, None)
                self._forget_queued(sess.peer)  # P forgot what it asked in the old session
            peer = self.peers[sess.peer] = _Peer(sess.peer, sess, client)
            self.sessions[sid] = sess
            log.info("prefill peer %s authenticated", sess.peer)
        peer.route = client  # P's socket may have reconnected
        if isinstance(inner, wire.PdPing):
            self._to_peer(peer, wire.PdPong(inner.nonce if is_int(inner.nonce) else 0, self.free_for(peer.name)))
        elif isinstance(inner, wire.PdPrealloc):
            if self.ctx.accepting():
                self.on_prealloc(peer, inner)
            else:
                self._to_peer(peer, api.ErrorEvent(str(inner.request_id), api.STOPPING, "the decode node is stopping"))
        elif isinstance(inner, wire.PdKvReady):
            self.on_kv_ready(peer, inner)
        elif isinstance(inner, wire.PdAbort):
            self.on_abort(peer, inner)
        elif isinstance(inner, api.CancelRequest):
            self.on_cancel(peer, inner)
        else:
            self._refused(f"{type(inner).__name__} is not a peer request")
            self._to_peer(peer, api.ErrorEvent("", api.BAD_REQUEST, f"{type(inner).__name__} is not a peer request"))

    def _to_peer(self, peer: _Peer, msg) -> None:
        self.ctx.send_raw(peer.route, peer.session.seal(msg))

    def deliver(self, client: bytes, msg: object) -> bool:
        """An answer to a peer's request (a PEER_CLIENT identity): back under P's own request
        id, sealed in the peer's current session."""
        if not client.startswith(PEER_CLIENT):
            return False
        peer = self.peers.get(client[len(PEER_CLIENT):].decode(errors="replace"))
        if peer is None:
            return True
        rid = getattr(msg, "request_id", None)
        if isinstance(rid, str) and rid in self.owner:
            msg.request_id = self.owner[rid][1]
        self._to_peer(peer, msg)
        return True

    @staticmethod
    def internal_id(peer: str, request_id: str) -> str:
        return f"pd:{peer}:{request_id}"

    # ---- requests -------------------------------------------------------------------------------
    def _error(self, peer: _Peer, rid, code: str, why: str) -> None:
        self._to_peer(peer, api.ErrorEvent(rid if isinstance(rid, str) else "", code, f"decode node: {why}"))

    def _check_prealloc(self, msg: wire.PdPrealloc) -> str:
        cfg = self.ctx.cfg
        if problem := _check_id(msg.request_id):
            return problem
        if not is_int(msg.max_new_tokens) or not is_int(msg.eos_token_id) or not -1 <= msg.eos_token_id < cfg.vocab_size:
            return "max_new_tokens and eos_token_id must be integers (eos_token_id -1 or in the vocabulary)"
        if not isinstance(msg.use_cache, bool) or not isinstance(msg.wait, bool):
            return "use_cache and wait must be booleans"
        return validate(api.GenerateRequest(**msg.generation()), cfg)

    def _usage(self) -> dict[str, _Usage]:
        """Every peer's use of the pool now."""
        out = {name: _Usage() for name in self.peers}
        bs = self.ctx.cfg.block_size
        for internal, (owner, _) in self.owner.items():
            seq = self.ctx.sched.seqs.get(internal)
            if seq is not None and owner in out:
                out[owner].held += request_pages(self.ctx.cfg, -(-(seq.prompt_len + seq.max_new_tokens) // bs))
                out[owner].waiting += internal in self.ctx.sched.external_ids
        for q in self.queued.values():
            out[q.peer].queued += q.need
        return out

    def _limit(self) -> int:
        """The most blocks one peer may ever hold: the pool, or less (--pd-peer-max-blocks)."""
        total = self.ctx.cfg.num_gpu_blocks
        return min(self.ctx.cfg.pd_peer_max_blocks or total, total)

    def share(self, peer: str, usage: dict[str, _Usage]) -> int:
        """The blocks `peer` may hold now (see fair_share)."""
        return fair_share(self.ctx.cfg.num_gpu_blocks, self._limit(),
                          [u.demand for name, u in usage.items() if name != peer])

    def _over(self, peer: str, need: int, usage: dict[str, _Usage]) -> str:
        """Why `peer` may not hold `need` more blocks now, or ""."""
        u, cfg = usage[peer], self.ctx.cfg
        if u.waiting >= cfg.pd_peer_max_preallocs:
            return f"{u.waiting} preallocations waiting for kv-ready (--pd-peer-max-preallocs {cfg.pd_peer_max_preallocs})"
        if u.held + need > (share := self.share(peer, usage)):
            peers = sum(x.demand > 0 or name == peer for name, x in usage.items())
            return (f"it holds {u.held} blocks; {need} more exceed its share of {share} "
                    f"({peers} peer(s) use the pool of {cfg.num_gpu_blocks})")
        return ""

    def free_for(self, peer: str, taking: int = 0) -> int:
        """Blocks `peer` could get now: free or evictable blocks of the pool (as the engine last
        published them, less `taking` just allocated), within what is left of its share. A
        prefill node with several decode nodes sends each request to the one that says most."""
        stats = self.ctx.stats
        room = int(stats[P.STAT["device_total"]]) - int(stats[P.STAT["device_used"]]) - taking
        usage = self._usage()
        u = usage.get(peer, _Usage())
        usage.setdefault(peer, u)
        return max(0, min(room, self.share(peer, usage) - u.demand))

    def on_prealloc(self, peer: _Peer, msg: wire.PdPrealloc) -> None:
        """Hold blocks for a peer's request now, or queue it while the peer is over its share."""
        rid = msg.request_id
        problem = self._check_prealloc(msg)
        internal = self.internal_id(peer.name, rid) if not problem else ""
        cfg = self.ctx.cfg
        if not problem and (internal in self.ctx.sched.seqs or internal in self.queued):
            problem = f"request id {rid!r} is already in flight on the decode node"
        need = request_pages(cfg, -(-(len(msg.prompt) + msg.max_new_tokens) // cfg.block_size)) if not problem else 0
        if not problem and need > self._limit():
            problem = (f"it needs {need} blocks, more than one peer may ever hold here ({self._limit()}: "
                       f"--pd-peer-max-blocks or the pool)")
        if not problem and len(self.descriptors) < cfg.tp:
            problem = "the decode node's cache-messagers are not ready"
        if not problem:
            ahead = self.queued_of[peer.name]  # (queued behind them: no need to weigh its share)
            over = f"{ahead} of its preallocations are queued before it" if ahead else \
                self._over(peer.name, need, self._usage())
            if over and not msg.wait:
                problem = f"peer {peer.name} is over its share: {over}"
            elif over and ahead >= MAX_QUEUED:
                problem = f"peer {peer.name} has {ahead} preallocations queued for its share: {over}"
            elif over:
                self.queued[internal] = _Queued(peer.name, msg, need)
                self.queued_of[peer.name] += 1
                self.deadlines[internal] = time.monotonic() + self.wait_s
                return
        if problem:
            self._refused(f"preallocation from {peer.name}: {problem}")
            self._error(peer, rid, api.BAD_REQUEST, problem)
            return
        self._start(peer, msg, internal, time.monotonic())

    def _start(self, peer: _Peer, msg: wire.PdPrealloc, internal: str, received: float) -> None:
        """A preallocation within its peer's share: the scheduler holds blocks for it."""
        cfg = self.ctx.cfg
        seq = Sequence.new(internal, msg.prompt, int(msg.max_new_tokens), cfg.block_size,
                           salted_root(peer_key_root(cfg.key_root, peer.name), msg.cache_salt),
                           client=peer.client,
                           eos_token_id=int(msg.eos_token_id), use_cache=msg.use_cache, guide=self.ctx.guide(msg),
                           **sampling_of(msg))
        self.owner[internal] = (peer.name, msg.request_id)
        self.ctx.sched.add(seq)  # held for P's KV: see get_num_new_matched_tokens
        self.deadlines[internal] = received + self.wait_s
        self.received[internal] = received

    def _admit_queued(self) -> None:
        """Start the queued preallocations now within their peers' shares: oldest first, each
        peer's in the order they came (one that does not fit holds its peer's later ones back)."""
        if not self.queued:
            return
        usage = self._usage()
        held_back: set[str] = set()
        for internal, q in list(self.queued.items()):
            name = q.peer
            if name in held_back or self._over(name, q.need, usage):
                held_back.add(name)
                continue
            self._dequeue(internal)
            u = usage[name]
            u.queued -= q.need
            u.held += q.need
            u.waiting += 1
            self._start(self.peers[name], q.msg, internal, q.received)

    def _owned(self, peer: _Peer, rid) -> str | None:
        """The internal id of `peer`'s request `rid`, if it is one of its requests in flight."""
        if _check_id(rid):
            return None
        internal = self.internal_id(peer.name, rid)
        return internal if internal in self.owner and internal in self.ctx.sched.seqs else None

    def get_num_new_matched_tokens(self, seq: Sequence) -> tuple[int, bool]:
        """A peer's request: P supplies its whole prompt (what this node has cached stays)."""
        return (seq.prompt_len, True) if seq.request_id in self.owner else (0, False)

    def update_state_after_alloc(self, seq: Sequence, blocks: list[int]) -> None:
        """Blocks held for a peer's request: tell P their ids and how long the request waited
        for them here; its lease starts now."""
        now = time.monotonic()
        self.deadlines[seq.request_id] = now + self.lease_s
        waited = now - self.received.pop(seq.request_id, now)
        peer = self.owner.get(seq.request_id, ("", ""))[0]
        groups = [g[:len(blocks)] for g in self.ctx.group_tables(seq.request_id)]
        self.ctx.reply(seq.client, wire.PdAllocated(
            seq.request_id, np.asarray(blocks, dtype=np.int32), seq.num_computed,
            [self.descriptors[r] for r in range(self.ctx.cfg.tp)], self.lease_s,
            self.free_for(peer, taking=len(blocks)), waited,
            np.asarray(sum(groups, []), dtype=np.int32)))

    def tick(self) -> None:
        """Expire leases and waits for blocks; forget ended requests; start queued
        preallocations that now fit their peers' shares."""
        now = time.monotonic()
        for rid in [r for r, t in self.deadlines.items() if t <= now]:
            del self.deadlines[rid]
            if (q := self._dequeue(rid)) is not None:
                self._expire_queued(q, now)
                continue
            seq = self.ctx.sched.seqs.get(rid)
            if seq is not None and rid in self.ctx.sched.external_ids:
                if seq.state is SeqState.EXTERNAL:
                    why = f"lease expired after {self.lease_s:g}s waiting for the KV of {self.owner.get(rid, ('', rid))[1]}"
                else:
                    why = (f"waited {self.wait_s:g}s (--pd-timeout less {LEASE_MARGIN_S:g}s) for free blocks "
                           f"for {self.owner.get(rid, ('', rid))[1]}: the pool is full")
                log.warning("%s: %s; blocks returned", rid, why)
                self.ctx.sched.drop(seq, "lease expired")
                self.ctx.count_failed()
                self.ctx.reply(seq.client, api.ErrorEvent(rid, api.FAILED, f"decode node: {why}"))
        for internal in [i for i in self.owner if i not in self.ctx.sched.seqs]:
            del self.owner[internal]
            self.received.pop(internal, None)
        self._admit_queued()

    def _expire_queued(self, q: _Queued, now: float) -> None:
        """A queued preallocation waited as long as it may: it fails, naming what it waited for."""
        peer = self.peers[q.peer]
        over = self._over(q.peer, q.need, self._usage()) or "the requests queued before it"
        why = (f"waited {now - q.received:.3g}s (--pd-timeout less {LEASE_MARGIN_S:g}s) for peer {q.peer}'s "
               f"share of the pool: {over}")
        log.warning("preallocation %s of %s: %s", q.msg.request_id, q.peer, why)
        self.ctx.count_failed()
        self._error(peer, q.msg.request_id, api.FAILED, why)

    def on_kv_ready(self, peer: _Peer, msg: wire.PdKvReady) -> None:
        rid, token, logprob = msg.request_id, msg.first_token, msg.first_logprob
        if not is_int(token) or not 0 <= token < self.ctx.cfg.vocab_size or not is_number(logprob) or logprob > 0:
            self._refused(f"kv-ready from {peer.name} with first token {token!r}, logprob {logprob!r}")
            self._error(peer, rid, api.BAD_REQUEST, f"first_token must be an integer in [0, {self.ctx.cfg.vocab_size}) "
                                                    f"and first_logprob a number <= 0")
            return
        internal = self._owned(peer, rid)
        seq = self.ctx.sched.seqs.get(internal) if internal else None
        if seq is None or seq.state is not SeqState.EXTERNAL:
            self._error(peer, rid, api.FAILED, f"it holds no blocks for {rid!r} (lease expired?)")
            return
        top = msg.first_top
        if seq.top_logprobs and not _top_ok(top, seq.top_logprobs, self.ctx.cfg.vocab_size):
            self._refused(f"kv-ready from {peer.name} with first alternatives {top!r:.80}")
            self._error(peer, rid, api.BAD_REQUEST, f"first_top must be [ids, logprobs] of {seq.top_logprobs} "
                                                    f"token ids and logprobs <= 0")
            return
        self.deadlines.pop(internal, None)
        if not self.ctx.sched.external_kv_arrived(seq, int(token), float(logprob), top if seq.top_logprobs else None):
            self.ctx.finished(seq)

    def on_abort(self, peer: _Peer, msg: wire.PdAbort) -> None:
        if not _check_id(msg.request_id) and self._dequeue(self.internal_id(peer.name, msg.request_id)):
            return  # it held nothing yet
        internal = self._owned(peer, msg.request_id)
        if internal is not None and internal in self.ctx.sched.external_ids:
            reason = msg.reason[:MAX_REASON] if isinstance(msg.reason, str) else ""
            log.info("%s aborted by the prefill node %s: %s", msg.request_id, peer.name, reason)
            self.deadlines.pop(internal, None)
            self.ctx.sched.drop(self.ctx.sched.seqs[internal], "aborted")

    def on_cancel(self, peer: _Peer, msg: api.CancelRequest) -> None:
        internal = self._owned(peer, msg.request_id)
        if internal is None and not _check_id(msg.request_id) and \
                (q := self._dequeue(self.internal_id(peer.name, msg.request_id))) is not None:
            self._to_peer(peer, api.FinishedEvent(q.msg.request_id, np.empty(0, np.int32), "cancelled",
                                                  len(q.msg.prompt)))
            return
        if internal is None:
            self._error(peer, msg.request_id, api.UNKNOWN, f"no request {msg.request_id!r} of this peer in flight")
            return
        seq = self.ctx.sched.cancel(internal)
        if seq is not None:
            self.ctx.finished(seq)

    def _dequeue(self, internal: str) -> _Queued | None:
        """Take a preallocation out of the queue (and its wait's deadline), if it is there."""
        q = self.queued.pop(internal, None)
        if q is not None:
            self.deadlines.pop(internal, None)
            self.queued_of[q.peer] -= 1
            if not self.queued_of[q.peer]:
                del self.queued_of[q.peer]
        return q

    def _forget_queued(self, peer: str) -> None:
        for internal in [i for i, q in self.queued.items() if q.peer == peer]:
            self._dequeue(internal)

    def fail_all(self, why: str) -> None:
        """The node stops: queued preallocations fail (the scheduler's requests are told by the engine)."""
        for internal in list(self.queued):
            q = self._dequeue(internal)
            self._error(self.peers[q.peer], q.msg.request_id, api.STOPPING, why)


def fair_share(total: int, limit: int, others: list[int]) -> int:
    """The blocks of a pool of `total` one peer may hold now, when the other peers need
    `others` blocks each (held and queued): max-min fair. Every other peer that needs blocks
    keeps what it needs up to an equal part of the pool (total // the peers that need blocks,
    this one included), and the rest is this peer's, within `limit`. So one peer alone may use
    the whole pool, and each of n peers is guaranteed total // n whatever the others ask."""
    needing = [d for d in others if d > 0]
    part = total // (len(needing) + 1)
    return max(0, min(limit, total - sum(min(d, part) for d in needing)))


def _top_ok(top: object, k: int, vocab: int) -> bool:
    """A peer's [ids, logprobs] of k alternatives, each an id in the vocabulary and a logprob <= 0."""
    return (isinstance(top, list) and len(top) == 2 and all(isinstance(x, list) and len(x) == k for x in top)
            and all(is_int(t) and 0 <= t < vocab for t in top[0])
            and all(is_number(x) and x <= 0 for x in top[1]))
