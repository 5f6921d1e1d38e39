"""The decode node's connector: a prefill node P computes each request's prompt KV and writes
it into blocks this node holds for it.

D holds blocks for a peer's request under a lease (matched against its own prefix cache first,
so only missing blocks travel), answers P with their ids, records the received blocks in its
prefix cache only at kv-ready (their KV did not exist here before), then decodes like a mixed
node, streaming to P. Blocks whose KV never came are taken back when the lease ends.

D's handshake port is reachable from the network, so D treats every peer as hostile until
proven otherwise: peer messages travel only inside an authenticated session (runtime/pd/auth.py: a
shared secret, HMAC per message, counters against replay), a peer touches only the requests it
created (D names them after the authenticated peer), each peer has quotas (blocks held,
preallocations waiting for kv-ready), and every field of every peer message is checked before
it touches any state: a bad one gets an error answer and changes nothing.
"""
from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvrt.ipc import protocol as P
from kvrt.ipc.errors import ProtocolError
from kvrt.runtime.client import api
from kvrt.runtime.engine.intake import is_int, is_number, sampling_of, validate
from kvrt.runtime.engine.sequence import Sequence, SeqState
from kvrt.runtime.pd import messages as wire
from kvrt.runtime.pd.auth import D2P, NONCE_BYTES, AuthError, Session, load_secret, session_key, welcome_mac

from kvrt.runtime.pd.connector import ConnectorContext, KVConnector
from kvrt.runtime.pd.peer import MAX_PEER_NAME, MAX_REASON, PEER_CLIENT, check_id as _check_id, \
    refused as _refused

log = logging.getLogger(__name__)
MAX_PENDING_SESSIONS = 16  # hellos not yet followed by a sealed message
MAX_PEERS = 32


@dataclass
class _Peer:
    """D: one authenticated prefill node: its current session and where to reach it."""

    name: str
    session: Session
    route: bytes  # the ZeroMQ identity its messages last came from

    @property
    def client(self) -> bytes:
        return PEER_CLIENT + self.name.encode()


class DecodeConnector(KVConnector):
    has_ranks = True  # cache-messager[r]: the P->D transport

    def __init__(self, ctx: ConnectorContext):
        super().__init__(ctx)
        self.lease_s = ctx.cfg.pd_timeout
        self.secret = load_secret(ctx.cfg.pd_secret_file)
        self.descriptors: dict[int, dict] = {}  # rank -> its cache-messager's transport descriptor
        self.deadlines: dict[str, float] = {}    # request -> when its reservation or lease ends
        self.peers: dict[str, _Peer] = {}        # peer name -> its current session
        self.sessions: dict[bytes, Session] = {}  # session id -> session (confirmed ones)
        self._hellos: OrderedDict[bytes, Session] = OrderedDict()  # not yet confirmed, oldest first
        self.owner: dict[str, tuple[str, str]] = {}  # internal request id -> (peer, P's request id)

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

    # ---- sessions -----------------------------------------------------------------------------
    def on_peer_hello(self, client: bytes, msg: wire.PdHello) -> None:
        """Open a session (unconfirmed until a sealed message proves P holds the secret)."""
        if not isinstance(msg.peer, str) or not 0 < len(msg.peer) <= MAX_PEER_NAME or \
                not isinstance(msg.nonce, bytes) or len(msg.nonce) != NONCE_BYTES:
            _refused(self.ctx.stats, "malformed hello")
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
            _refused(self.ctx.stats, str(e))
            self.ctx.reply(client, wire.PdRefused(sid, str(e)))
            return
        peer = self.peers.get(sess.peer)
        if sid in self._hellos:  # confirmed: it replaces the peer's earlier session (P restarted)
            if peer is None and len(self.peers) >= MAX_PEERS:
                _refused(self.ctx.stats, f"too many peers ({MAX_PEERS}); {sess.peer!r} refused")
                self.ctx.reply(client, wire.PdRefused(sid, "too many peers"))
                return
            del self._hellos[sid]
            if peer is not None:
                self.sessions.pop(peer.session.session, None)
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
            _refused(self.ctx.stats, f"{type(inner).__name__} is not a peer request")
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
        if not isinstance(msg.use_cache, bool):
            return "use_cache must be a boolean"
        return validate(api.GenerateRequest(**msg.generation()), cfg)

    def _held(self, peer: str) -> tuple[int, int]:
        """(blocks held, preallocations waiting for kv-ready) of one peer."""
        blocks = waiting = 0
        bs = self.ctx.cfg.block_size
        for internal, (owner, _) in self.owner.items():
            seq = self.ctx.sched.seqs.get(internal)
            if owner != peer or seq is None:
                continue
            blocks += -(-(seq.prompt_len + seq.max_new_tokens) // bs)
            waiting += internal in self.ctx.sched.external_ids
        return blocks, waiting

    def free_for(self, peer: str, taking: int = 0) -> int:
        """Blocks `peer` could get now: free or evictable blocks of the pool (as the engine last
        published them, less `taking` just allocated), within what is left of its quota. A
        prefill node with several decode nodes sends each request to the one that says most."""
        stats, cfg = self.ctx.stats, self.ctx.cfg
        room = int(stats[P.STAT["device_total"]]) - int(stats[P.STAT["device_used"]]) - taking
        return max(0, min(room, cfg.peer_max_blocks - self._held(peer)[0]))

    def on_prealloc(self, peer: _Peer, msg: wire.PdPrealloc) -> None:
        rid = msg.request_id
        problem = self._check_prealloc(msg)
        internal = self.internal_id(peer.name, rid) if not problem else ""
        cfg = self.ctx.cfg
        if not problem and internal in self.ctx.sched.seqs:
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
            _refused(self.ctx.stats, f"preallocation from {peer.name}: {problem}")
            self._error(peer, rid, api.BAD_REQUEST, problem)
            return
        seq = Sequence.new(internal, msg.prompt, int(msg.max_new_tokens), cfg.block_size, self.ctx.cfg.key_root,
                           client=peer.client, eos_token_id=int(msg.eos_token_id), use_cache=msg.use_cache,
                           guide=self.ctx.guide(msg), **sampling_of(msg))
        self.owner[internal] = (peer.name, rid)
        self.ctx.sched.add(seq)  # held for P's KV: see get_num_new_matched_tokens
        self.deadlines[internal] = time.monotonic() + self.lease_s

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
        """Blocks held for a peer's request: tell P their ids; its lease starts now."""
        self.deadlines[seq.request_id] = time.monotonic() + self.lease_s
        peer = self.owner.get(seq.request_id, ("", ""))[0]
        self.ctx.reply(seq.client, wire.PdAllocated(
            seq.request_id, np.asarray(blocks, dtype=np.int32), seq.num_computed,
            [self.descriptors[r] for r in range(self.ctx.cfg.tp)], self.lease_s,
            self.free_for(peer, taking=len(blocks))))

    def tick(self) -> None:
        """Expire leases; forget ended requests."""
        now = time.monotonic()
        for rid in [r for r, t in self.deadlines.items() if t <= now]:
            del self.deadlines[rid]
            seq = self.ctx.sched.seqs.get(rid)
            if seq is not None and rid in self.ctx.sched.external_ids:
                what = "blocks for" if seq.state is not SeqState.EXTERNAL else "the KV of"
                log.warning("lease of %s expired: no %s it within %gs; blocks returned", rid, what, self.lease_s)
                self.ctx.sched.drop(seq, "lease expired")
                self.ctx.count_failed()
                self.ctx.reply(seq.client, api.ErrorEvent(rid, api.FAILED, f"decode node: lease expired after "
                                                                           f"{self.lease_s:g}s waiting for {what} "
                                                                           f"{self.owner.get(rid, ('', rid))[1]}"))
        for internal in [i for i in self.owner if i not in self.ctx.sched.seqs]:
            del self.owner[internal]

    def on_kv_ready(self, peer: _Peer, msg: wire.PdKvReady) -> None:
        rid, token, logprob = msg.request_id, msg.first_token, msg.first_logprob
        if not is_int(token) or not 0 <= token < self.ctx.cfg.vocab_size or not is_number(logprob) or logprob > 0:
            _refused(self.ctx.stats, f"kv-ready from {peer.name} with first token {token!r}, logprob {logprob!r}")
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
            _refused(self.ctx.stats, f"kv-ready from {peer.name} with first alternatives {top!r:.80}")
            self._error(peer, rid, api.BAD_REQUEST, f"first_top must be [ids, logprobs] of {seq.top_logprobs} "
                                                    f"token ids and logprobs <= 0")
            return
        self.deadlines.pop(internal, None)
        if not self.ctx.sched.external_kv_arrived(seq, int(token), float(logprob), top if seq.top_logprobs else None):
            self.ctx.finished(seq)

    def on_abort(self, peer: _Peer, msg: wire.PdAbort) -> None:
        internal = self._owned(peer, msg.request_id)
        if internal is not None and internal in self.ctx.sched.external_ids:
            reason = msg.reason[:MAX_REASON] if isinstance(msg.reason, str) else ""
            log.info("%s aborted by the prefill node %s: %s", msg.request_id, peer.name, reason)
            self.deadlines.pop(internal, None)
            self.ctx.sched.drop(self.ctx.sched.seqs[internal], "aborted")

    def on_cancel(self, peer: _Peer, msg: api.CancelRequest) -> None:
        internal = self._owned(peer, msg.request_id)
        if internal is None:
            self._error(peer, msg.request_id, api.UNKNOWN, f"no request {msg.request_id!r} of this peer in flight")
            return
        seq = self.ctx.sched.cancel(internal)
        if seq is not None:
            self.ctx.finished(seq)


def _top_ok(top: object, k: int, vocab: int) -> bool:
    """A peer's [ids, logprobs] of k alternatives, each an id in the vocabulary and a logprob <= 0."""
    return (isinstance(top, list) and len(top) == 2 and all(isinstance(x, list) and len(x) == k for x in top)
            and all(is_int(t) and 0 <= t < vocab for t in top[0])
            and all(is_number(x) and x <= 0 for x in top[1]))
