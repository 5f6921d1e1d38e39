"""The prefill node's connector: every request's KV is computed here and handed to a decode
node D.

For a client request P
1. asks D to hold blocks (PdPrealloc); D answers with its block ids, the prompt tokens it
   already has cached, its ranks' transport descriptors and a lease (PdAllocated);
2. meanwhile prefills like a mixed node (the round trip to D is hidden behind the prefill
   instead of adding to the first token's latency), recording its own computed blocks in its
   own prefix cache after each chunk (so its hit rate holds up), and streams the first token
   to the client at once; a request whose prefill ends before D answered waits for D,
   holding its blocks;
3. once D answered, orders every cache-messager rank to write the full blocks the prefill
   completed so far (those D lacks) into D's block ids, then after each chunk the blocks it
   completed, so the transfer overlaps the rest of the prefill; once the prefill is done it
   orders the rest (the last, partial block), before the first token goes to the client; when
   every send is reported written, tells D "kv ready" with the first token, releases its
   request (its blocks stay cached) and relays D's tokens to the client.

While a send is in flight its blocks are the cache-messagers' to read and D's blocks are being
written: the request is not preempted, a request that ends meanwhile (cancelled, failed, EOS as
its first token) keeps its blocks until its sends are answered (Scheduler.release_held), and D
is told to let its blocks go only then.

Every wait has a deadline (`--pd-timeout`): P fails a request D does not allocate for or stops
answering for (one whose step is in flight fails when that step ends: its blocks are the
worker's until then). Peer messages travel only inside an authenticated session (runtime/pd/auth.py), and
every field of D's messages is checked before it touches a request. P pings D while idle and
fails requests at once when D stopped answering, instead of after --pd-timeout each; D's
silence is counted in P's own running time (ipc/watchdog.py), so P paused and resumed does not
take D for gone before D's answers queued meanwhile are read.

With several decode nodes (`--decode-peer` lists them) P keeps one session with each and sends
each request to the one that last said it has the most free blocks (D says so in every pong
and allocation answer; P counts down what it asked for since, so a burst spreads). A request
that a decode node refuses, or whose decode node is lost before it allocated, is asked of the
next one it has not tried; once blocks are allocated the request stays with that node.
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

from kvrt.ipc import protocol as P
from kvrt.ipc.channel import broadcast
from kvrt.ipc.errors import ProtocolError
from kvrt.ipc.rank_group import RankGroup
from kvrt.ipc.watchdog import Watchdog, pause_gap
from kvrt.runtime.cache.keys import salted_root
from kvrt.runtime.client import api
from kvrt.runtime.engine.intake import is_int, sampling_of
from kvrt.runtime.node.config import LEASE_MARGIN_S
from kvrt.runtime.pd import messages as wire
from kvrt.runtime.pd.auth import NONCE_BYTES, P2D, AuthError, Session, check_bytes, load_secret, new_nonce, \
    session_key, welcome_mac
from kvrt.runtime.engine.sequence import Sequence, SeqState
from kvrt.runtime.gateway.link import PEER, peer_identity

from kvrt.runtime.pd.connector import ConnectorContext, KVConnector
from kvrt.runtime.pd.peer import MAX_REASON, check_id as _check_id, Refusals

log = logging.getLogger(__name__)
PING_EVERY_S = 0.5    # a ping (or a hello while no session) this often
HELLO_FIRST_S = 0.02  # the first hellos without a session come this soon, doubling up to PING_EVERY_S:
                      # a hello sent before the gateway's link is up is lost, and a node's first
                      # requests would otherwise prefill with no decode node to stream to
SEND_GRACE_S = 0.5    # the engine waits this long past a send order's deadline for the answer


@dataclass
class _Link:
    """P's side of one decode node: where it is, its session, and its last word on free blocks."""

    index: int
    address: str
    session: Session | None = None
    nonces: OrderedDict[bytes, None] = field(default_factory=OrderedDict)  # hellos sent, newest last
    news: int = 0  # times P heard from D or the session changed: D is silent since the last
    next_ping: float = 0.0
    hello_after: float = HELLO_FIRST_S  # the wait before the next hello while there is no session
    free_blocks: int = -1  # as D last said, less what P asked of it since; -1: not said yet

    @property
    def identity(self) -> bytes:
        return peer_identity(self.index)


@dataclass
class _Pending:
    """A request waiting for D's blocks; it prefills meanwhile."""

    client: bytes
    req: api.GenerateRequest
    seq: Sequence  # in the scheduler since it came
    deadline: float
    link: _Link | None = None  # the decode node asked (it waits for a session otherwise)
    asked_at: float = 0.0      # when it was asked (P's clock): D's lease cannot begin earlier
    tried: set[int] = field(default_factory=set)  # decode nodes that refused it or were lost
    last_error: api.ErrorEvent | None = None  # why the last one tried did not take it
    prefilled: bool = False  # the first token is out: it waits for D holding its blocks

    @property
    def asked(self) -> bool:
        return self.link is not None


@dataclass
class _Handoff:
    """One request's KV on its way to its decode node, from D's allocation to kv-ready: its
    blocks are ordered as the prefill's steps write them, each order a send in flight."""

    seq: Sequence
    link: _Link
    alloc: wire.PdAllocated
    lease_end: float  # when D's hold on the blocks ends (P's clock)
    next_block: int   # the first block not ordered yet
    prefilled: bool = False  # the first token is out: the last blocks are ordered, kv-ready follows
    tasks: set[int] = field(default_factory=set)  # its sends in flight
    error: str = ""   # the first failure: nothing more is ordered and the handoff fails
    lost: api.ErrorEvent | None = None  # D gave the blocks up, or was lost, while P prefilled
    ended: bool = False      # the request ended on P first: D is told once no send is in flight


@dataclass
class _Send:
    """Blocks of one handoff being written by the cache-messager ranks."""

    handoff: _Handoff
    task_id: int
    ranks: RankGroup[P.SendDone]
    src: np.ndarray  # P's blocks the ranks read
    early: bool      # ordered before the prefill ended


@dataclass
class _Relay:
    """A request now decoding on D; what P measured, to complete D's final answer."""

    seq: Sequence
    deadline: float
    link: _Link


class PrefillConnector(KVConnector):
    has_ranks = True  # cache-messager[r]: the P->D transport

    def __init__(self, ctx: ConnectorContext):
        super().__init__(ctx)
        self.timeout = ctx.cfg.pd_timeout
        self._refused = Refusals(ctx.stats)
        self.secret = load_secret(ctx.cfg.pd_secret_file)
        self.links = [_Link(i, address) for i, address in enumerate(ctx.cfg.decode_peers)]
        self._by_identity = {link.identity: link for link in self.links}
        self.pending: dict[str, _Pending] = {}
        self.sends: dict[int, _Send] = {}
        self.handoffs: dict[str, _Handoff] = {}  # requests prefilling here for a decode node
        # requests that failed before D allocated while their step was in flight: ended when it ends
        self.failing: dict[str, tuple[Sequence, api.ErrorEvent]] = {}
        self.relays: dict[str, _Relay] = {}
        self._task_ids = itertools.count(1)
        self.dead_after = min(ctx.cfg.pd_dead_after, self.timeout)  # D is gone after this long without any answer
        self.link_watch: Watchdog[int] = Watchdog(pause_gap(self.dead_after, PING_EVERY_S))  # news by link

    def busy(self, request_id: str) -> bool:
        return request_id in self.pending or request_id in self.relays or request_id in self.handoffs

    def requests(self) -> Iterable[tuple[str, bytes]]:
        """Relayed requests (those waiting for D's blocks, or sending, are in the scheduler)."""
        yield from ((rid, r.seq.client) for rid, r in self.relays.items())

    def is_peer_client(self, client: bytes) -> bool:
        return client.startswith(PEER)

    @property
    def inflight(self) -> bool:
        return bool(self.sends)

    def reading(self, seq: Sequence) -> bool:
        h = self.handoffs.get(seq.request_id)
        return h is not None and h.seq is seq and bool(h.tasks)

    def outgoing_blocks(self) -> list[int]:
        return [b for s in self.sends.values() for b in s.src.tolist()]

    # ---- the links to the decode nodes -------------------------------------------------------
    def gone(self) -> str:
        """Why every decode node counts as gone (no session and no answer for dead_after), or ""."""
        if any(link.session is not None or self._silent(link) <= self.dead_after for link in self.links):
            return ""
        silent = min(self._silent(link) for link in self.links)
        which = "the decode node has" if len(self.links) == 1 else f"none of the {len(self.links)} decode nodes has"
        return f"{which} not answered for {silent:.1f}s ({self.ctx.cfg.decode_peer})"

    def _silent(self, link: _Link) -> float:
        """P's running seconds since it last heard from `link`'s D (or its session changed)."""
        return self.link_watch.observe(link.index, link.news)

    def _send(self, link: _Link, msg) -> None:
        """To one D, sealed; dropped while there is no session (D's leases take back its blocks)."""
        if link.session is None:
            log.warning("no session with the decode node %s: %s dropped", link.address, type(msg).__name__)
            return
        self.ctx.send_raw(link.identity, link.session.seal(msg))

    def _hello(self, link: _Link) -> None:
        nonce = new_nonce()
        link.nonces[nonce] = None
        while len(link.nonces) > 8:
            link.nonces.popitem(last=False)
        self.ctx.send_raw(link.identity, wire.PdHello(self.ctx.cfg.node, nonce))

    def _welcome(self, link: _Link, msg: wire.PdWelcome) -> None:
        try:
            nonce = check_bytes(msg.nonce, NONCE_BYTES, "nonce")
            session = check_bytes(msg.session, NONCE_BYTES, "session")
            mac = check_bytes(msg.mac, 32, "mac")
        except AuthError as e:
            self._refused(f"welcome: {e}")
            return
        if nonce not in link.nonces:
            if link.session is None:  # an answer to an earlier hello once a session is up is expected
                self._refused("welcome to a hello this node did not send")
            return
        peer = self.ctx.cfg.node
        if not hmac.compare_digest(mac, welcome_mac(self.secret, nonce, session, peer)):
            self._refused("welcome not signed with the shared secret: check --pd-secret-file on both nodes")
            return
        link.nonces.clear()  # D may still answer hellos sent before this one: those are stale now
        if link.session is not None:
            self._link_lost(link, "the decode node opened a new session (it restarted?)")
        link.session = Session(session, session_key(self.secret, nonce, session, peer), peer, P2D)
        link.news += 1
        link.free_blocks = -1
        link.next_ping = 0.0  # ping at once: its pong says how many free blocks it has
        self._count_sessions()
        log.info("session with the decode node %s is up", link.address)
        for p in list(self.pending.values()):
            if not p.asked:
                self._ask(p)

    def _count_sessions(self) -> None:
        self.ctx.stats[P.STAT["pd_sessions"]] = sum(link.session is not None for link in self.links)

    def _link_lost(self, link: _Link, why: str) -> None:
        """A decode node is gone or forgot the session: what it allocated for or decodes fails;
        requests it had not allocated for yet go to another decode node; say hello again."""
        log.warning("lost the decode node %s: %s", link.address, why)
        link.session = None
        link.news += 1
        link.next_ping = 0.0
        link.hello_after = HELLO_FIRST_S
        link.free_blocks = -1
        self._count_sessions()
        for p in [p for p in self.pending.values() if p.link is link]:
            self._retry(p, api.ErrorEvent(p.req.request_id, api.FAILED, f"decode node lost: {why}"))
        for rid in [r for r, x in self.relays.items() if x.link is link]:
            r = self.relays.pop(rid)
            self.ctx.count_failed()
            self.ctx.reply(r.seq.client, api.ErrorEvent(rid, api.FAILED, f"decode node lost: {why}"))
        for h in self.handoffs.values():  # the handoff fails once its sends are answered
            if h.link is link and h.lost is None:
                h.lost = api.ErrorEvent(h.seq.request_id, api.FAILED, why)

    def _ping(self) -> None:
        self.link_watch.tick()
        now = time.monotonic()
        for link in self.links:
            if now < link.next_ping:
                continue
            if link.session is None:
                link.next_ping = now + link.hello_after
                link.hello_after = min(PING_EVERY_S, 2 * link.hello_after)
                self._hello(link)
                continue
            link.next_ping = now + PING_EVERY_S
            if (silent := self._silent(link)) > self.dead_after:
                self._link_lost(link, f"no answer to pings for {silent:.1f}s")
                self._hello(link)
            else:
                self._send(link, wire.PdPing())

    # ---- client side ----------------------------------------------------------------------
    def on_request(self, client: bytes, req: api.GenerateRequest) -> bool:
        """A request of more than one token is handed off: D is asked for blocks, and the
        request prefills here meanwhile."""
        if req.max_new_tokens <= 1:
            return False
        if why := self.gone():
            self.ctx.count_failed()
            self.ctx.reply(client, api.ErrorEvent(req.request_id, api.FAILED, f"decode node unreachable: {why}"))
            return True
        cfg = self.ctx.cfg
        seq = Sequence.new(req.request_id, req.prompt, req.max_new_tokens, cfg.block_size,
                           salted_root(cfg.key_root, req.cache_salt),
                           client=client,
                           eos_token_id=req.eos_token_id, use_cache=req.use_cache, stream=req.stream,
                           prompt_logprobs=req.prompt_logprobs,
                           guide=self.ctx.guide(req), **sampling_of(req))
        p = self.pending[req.request_id] = _Pending(client, req, seq, time.monotonic() + self.timeout)
        self.ctx.sched.add(seq)
        self._ask(p)
        return True

    def _ask(self, p: _Pending) -> None:
        """Ask the decode node with the most free blocks among those with a session that have not
        refused the request yet. None now: the request waits for a session (its deadline bounds
        that), or fails when every decode node has been tried."""
        req = p.req
        up = [link for link in self.links if link.session is not None and link.index not in p.tried]
        if not up:
            if len(p.tried) == len(self.links) and p.last_error is not None:
                self._give_up(p, p.last_error)
            return
        link = max(up, key=lambda x: x.free_blocks)  # the first listed among equals
        p.link, p.asked_at = link, time.monotonic()
        if link.free_blocks >= 0:
            link.free_blocks = max(0, link.free_blocks - -(-(len(req.prompt) + req.max_new_tokens)
                                                           // self.ctx.cfg.block_size))
        # over this peer's share, a decode node queues the request only if no other is left to ask
        self._send(link, wire.PdPrealloc(**req.generation(), wait=len(up) == 1))

    def _retry(self, p: _Pending, error: api.ErrorEvent) -> None:
        """The decode node asked for `p` refused it or was lost (`error` says which): ask the
        next one; the request fails with `error` when none is left."""
        if p.link is not None:
            p.tried.add(p.link.index)
            if len(self.links) > 1:
                log.info("%s: %s; trying another decode node", p.req.request_id, error.message)
        p.link, p.last_error = None, error
        p.deadline = time.monotonic() + self.timeout  # the next decode node has --pd-timeout too
        self._ask(p)

    def cancel(self, client: bytes, request_id: str) -> bool:
        """True if the request is one of P's handoffs (then it is handled here)."""
        if (p := self.pending.pop(request_id, None)) is not None:
            if p.link is not None:
                self._send(p.link, wire.PdAbort(request_id, "cancelled by the client"))
            if not p.prefilled:
                return False  # the scheduler cancels it (now, or when its step ends)
            p.seq.cancelled = True  # parked for D's blocks: no step has it
            self.ctx.sched.drop(p.seq, "cancelled")
            self.ctx.finished(p.seq)
            return True
        if (r := self.relays.get(request_id)) is not None:
            self._send(r.link, api.CancelRequest(request_id))
            return True
        self.ended_here(request_id)  # still prefilling here (if at all): D can let go now
        return False

    def request_finished(self, seq: Sequence) -> None:
        self.ended_here(seq.request_id)

    def ended_here(self, request_id: str) -> None:
        """A handoff request ended on P before its handoff (EOS as the first token, a failed
        step, a cancel): D can give its blocks back instead of at the lease's end, once no
        send writes into them. (A prefilled one ends when its last send is answered.)"""
        if (p := self.pending.pop(request_id, None)) is not None and p.link is not None:
            self._send(p.link, wire.PdAbort(request_id, "the request ended on the prefill node"))
        h = self.handoffs.get(request_id)
        if h is not None and not h.prefilled:
            h.ended = True
            self._settle(h)

    # ---- messages from D ------------------------------------------------------------------
    def on_peer_message(self, client: bytes, msg: object) -> bool:
        """Everything from a decode peer's socket is the connector's."""
        if not client.startswith(PEER):
            return False
        if (link := self._by_identity.get(client)) is None:
            self._refused(f"a message from an unknown decode peer socket {client!r}")
        else:
            self._on_peer(link, msg)
        return True

    def on_rank_message(self, msg: object) -> bool:
        if isinstance(msg, P.SendDone):
            self._on_send_done(msg)
        return isinstance(msg, (P.SendDone, P.MessagerHello))  # P's ranks' hellos are for D only

    def _on_peer(self, link: _Link, msg) -> None:
        if isinstance(msg, wire.PdWelcome):
            self._welcome(link, msg)
            return
        if isinstance(msg, wire.PdRefused):
            if link.session is not None and msg.session == link.session.session:
                self._link_lost(link, f"the decode node refused the session: {str(msg.reason)[:MAX_REASON]}")
                link.next_ping = 0.0  # hello again at once
            return
        if not isinstance(msg, wire.PdSealed) or link.session is None:
            self._refused(f"unauthenticated {type(msg).__name__} from the decode peer {link.address}")
            return
        try:
            inner = link.session.open(msg)
        except ProtocolError as e:
            self._refused(f"from the decode peer {link.address}: {e}")
            return
        link.news += 1
        problem = self._check(inner)
        if problem:
            self._refused(f"{type(inner).__name__} from the decode node {link.address}: {problem}")
            return
        rid = getattr(inner, "request_id", "")
        if isinstance(inner, (wire.PdPong, wire.PdAllocated)) and inner.free_blocks >= 0:
            if link.free_blocks < 0:
                log.info("decode node %s: %d free blocks", link.address, inner.free_blocks)
            link.free_blocks = int(inner.free_blocks)
        if isinstance(inner, wire.PdAllocated):
            self._allocated(link, inner)
        elif isinstance(inner, api.TokenEvent):
            if (r := self.relays.get(rid)) is not None and r.link is link:
                r.deadline = time.monotonic() + self.timeout
                if r.seq.stream:
                    self.ctx.reply(r.seq.client, inner)
        elif isinstance(inner, api.FinishedEvent):
            if (r := self.relays.get(rid)) is not None and r.link is link:
                del self.relays[rid]
                seq = r.seq
                inner.cached_device, inner.cached_host, inner.cached_storage = seq.cached
                inner.computed_prompt_tokens, inner.preemptions = seq.computed_prompt_tokens, seq.preemptions
                inner.prompt_logprobs, inner.prompt_ranks, inner.prompt_top = seq.prompt_lps, seq.prompt_ranks, \
                    seq.prompt_top
                inner.ttft_ms = (seq.first_token_at - seq.arrival) * 1e3
                inner.e2e_ms = (time.monotonic() - seq.arrival) * 1e3
                self.ctx.count_finished(seq)
                self.ctx.reply(seq.client, inner)
        elif isinstance(inner, api.ErrorEvent):
            self._peer_error(link, inner)
        elif not isinstance(inner, wire.PdPong):
            log.warning("unexpected %s from the decode node %s", type(inner).__name__, link.address)

    def _check(self, msg) -> str:
        """The first problem with a message from D, or "" (D is authenticated, but a bug there
        must not corrupt a request here)."""
        vocab, cfg = self.ctx.cfg.vocab_size, self.ctx.cfg
        if isinstance(msg, (wire.PdAllocated, api.TokenEvent, api.FinishedEvent, api.ErrorEvent)):
            if problem := _check_id(msg.request_id):
                return problem
        if isinstance(msg, (wire.PdAllocated, wire.PdPong)):
            if not is_int(msg.free_blocks) or not -1 <= msg.free_blocks < 1 << 31:
                return f"free_blocks {msg.free_blocks!r}"
        if isinstance(msg, wire.PdAllocated):
            if not is_int(msg.cached_tokens) or msg.cached_tokens < 0:
                return f"cached_tokens {msg.cached_tokens!r}"
            if not isinstance(msg.lease_s, (int, float)) or isinstance(msg.lease_s, bool) or not 0 < msg.lease_s < 1e6:
                return f"lease_s {msg.lease_s!r}"
            if not isinstance(msg.waited_s, (int, float)) or isinstance(msg.waited_s, bool) or \
                    not 0 <= msg.waited_s < 1e6:
                return f"waited_s {msg.waited_s!r}"
            if not isinstance(msg.descriptors, list) or not all(isinstance(d, dict) for d in msg.descriptors):
                return "descriptors must be a list of maps"
            if len(msg.block_ids) and (msg.block_ids.min() < 0 or msg.block_ids.max() >= 1 << 30):
                return "block ids out of range"
            side = len(cfg.kv_groups.windows) - 1
            if len(msg.group_ids) != side * len(msg.block_ids) or (
                    len(msg.group_ids) and (msg.group_ids.min() < -1 or msg.group_ids.max() >= 1 << 30)):
                return f"group ids: {len(msg.group_ids)}, not {side} layer group(s) of {len(msg.block_ids)} in range"
        elif isinstance(msg, api.TokenEvent):
            if not is_int(msg.index) or msg.index < 0 or not isinstance(msg.token_ids, list) or \
                    not all(is_int(t) and 0 <= t < vocab for t in msg.token_ids):
                return "index and token ids must be in range"
            if not _logprobs_ok(msg.logprobs, len(msg.token_ids)):
                return "logprobs must be a list of numbers, at most one per token"
        elif isinstance(msg, api.FinishedEvent):
            out = msg.output_token_ids
            if len(out) > cfg.max_model_len or (len(out) and (out.min() < 0 or out.max() >= vocab)):
                return "output token ids out of range"
            if not isinstance(msg.finish_reason, str) or not is_int(msg.prompt_tokens):
                return "finish_reason and prompt_tokens"
            if not _logprobs_ok(msg.output_logprobs, len(out)):
                return "output logprobs must be a list of numbers, at most one per token"
        elif isinstance(msg, api.ErrorEvent):
            if not isinstance(msg.code, str) or not isinstance(msg.message, str):
                return "code and message must be strings"
            msg.message = msg.message[:MAX_REASON]
        return ""

    def _allocated(self, link: _Link, msg: wire.PdAllocated) -> None:
        p = self.pending.get(msg.request_id)
        if p is None or p.link is not link:  # timed out, cancelled or asked elsewhere meanwhile
            self._send(link, wire.PdAbort(msg.request_id, "the prefill node no longer has the request"))
            return
        req, cfg = p.req, self.ctx.cfg
        if len(msg.descriptors) != cfg.tp or len(msg.block_ids) < -(-len(req.prompt) // cfg.block_size) \
                or msg.cached_tokens > len(req.prompt):
            self._fail_pending(p, f"decode node answered with {len(msg.descriptors)} rank(s), "
                                  f"{len(msg.block_ids)} blocks and {msg.cached_tokens} cached tokens; this "
                                  f"prefill node has --tp {cfg.tp} and a prompt of {len(req.prompt)} tokens")
            return
        if problem := _layout_problem(msg.descriptors, cfg):
            self._fail_pending(p, problem)
            return
        del self.pending[msg.request_id]
        # D's lease began after our ask plus the time D kept it queued: its end on P's clock
        # is on the safe side
        h = self.handoffs[req.request_id] = _Handoff(p.seq, link, msg, p.asked_at + msg.waited_s + msg.lease_s,
                                                     msg.cached_tokens // cfg.block_size, p.prefilled)
        # what the prefill wrote so far goes now, not at the next step's end (a prefilled
        # request has no step to wait for)
        self._order_due(h)
        if h.prefilled:
            self._settle(h)

    def _peer_error(self, link: _Link, msg: api.ErrorEvent) -> None:
        rid = msg.request_id
        if (p := self.pending.get(rid)) is not None and p.link is link:  # refused: D holds nothing for it
            self._retry(p, msg)
        elif (r := self.relays.get(rid)) is not None and r.link is link:
            del self.relays[rid]
            self.ctx.count_failed()
            self.ctx.reply(r.seq.client, msg)
        elif (h := self.handoffs.get(rid)) is not None and h.link is link:  # D let the blocks go
            log.warning("decode node %s gave up %s before the handoff: %s", link.address, rid, msg.message)
            h.lost = h.lost or msg
        else:
            log.warning("decode node %s error for %s: %s: %s", link.address, rid or "(no request)", msg.code,
                        msg.message)

    def _fail_pending(self, p: _Pending, why: str) -> None:
        if p.link is not None:
            self._send(p.link, wire.PdAbort(p.req.request_id, why))
        self._give_up(p, api.ErrorEvent(p.req.request_id, api.FAILED, why))

    def _give_up(self, p: _Pending, error: api.ErrorEvent) -> None:
        """`p` fails with `error` before D allocated: its prefill ends here, at once or, while
        its step is in flight (the worker writes its blocks), when that step ends."""
        self.pending.pop(p.req.request_id, None)
        step = self.ctx.sched.inflight
        if step is not None and p.seq in step.seqs:
            self.failing[p.req.request_id] = (p.seq, error)
            return
        self._fail_seq(p.seq, error)

    def _fail_seq(self, seq: Sequence, error: api.ErrorEvent) -> None:
        self.ctx.sched.drop(seq, "failed")
        self.ctx.count_failed()
        self.ctx.reply(seq.client, error)

    # ---- sending blocks ---------------------------------------------------------------------
    def takes_over(self, seq: Sequence) -> bool:
        """A handoff request sampled its first token: it stops here, holding its blocks, until
        its KV is in D. Its last blocks are ordered now, before the token is sent to the
        client, so that the cache-messagers start writing them first (kv-ready waits for them;
        the token only has to reach the client). One that D has not allocated for yet waits
        for D's answer; one that failed meanwhile ends once the step is applied."""
        rid = seq.request_id
        if (h := self.handoffs.get(rid)) is not None and h.seq is seq and not h.ended:
            h.prefilled = True
            self._order_due(h)
            return True
        if (p := self.pending.get(rid)) is not None and p.seq is seq:
            p.prefilled = True
            return True
        return rid in self.failing and self.failing[rid][0] is seq

    def build_orders(self) -> None:
        """After the step's answers: end the requests that failed during it; order the blocks
        each handoff's prefill completed since its last order (all that is left once the
        prefill is done)."""
        step = self.ctx.sched.inflight
        for rid, (seq, error) in list(self.failing.items()):
            if step is None or seq not in step.seqs:
                del self.failing[rid]
                if seq.state is not SeqState.FINISHED:  # (else it ended in the step and was told)
                    self._fail_seq(seq, error)
        for h in list(self.handoffs.values()):
            self._order_due(h)
            if h.prefilled:
                self._settle(h)

    def _order_due(self, h: _Handoff) -> None:
        """Order the blocks of `h` its prefill completed and no order covers yet."""
        seq, bs = h.seq, self.ctx.cfg.block_size
        if h.ended or h.error or h.lost is not None:
            return
        if h.prefilled:
            upto = -(-seq.prompt_len // bs)
        elif seq.state is SeqState.RUNNING:  # full blocks only: the next chunk writes the partial one
            upto = min(seq.num_computed, seq.prompt_len) // bs
        else:
            upto = 0
        if upto > h.next_block:
            self._order(h, upto)

    def _order(self, h: _Handoff, upto: int) -> None:
        """Order every rank to write blocks [next_block, upto) of the request into D's blocks,
        if that write can finish before D's lease ends (else the handoff fails)."""
        rid, now, cfg = h.seq.request_id, time.monotonic(), self.ctx.cfg
        if h.link.session is None:
            h.error = "no session with the decode node"
            return
        if now + cfg.rank_timeout + LEASE_MARGIN_S > h.lease_end:
            h.error = (f"the decode node's lease on the blocks of {rid} ends before a handoff could finish "
                       f"(prefill took too long; raise --pd-timeout)")
            return
        src, dst = self._pages(h, upto)
        task_id = next(self._task_ids)
        # The rank must not touch D's blocks after this (P's clock; the check above keeps it
        # LEASE_MARGIN_S before D's lease ends); the engine gives up a little later, so an
        # answer "expired" still arrives before it tells D to let the blocks go.
        deadline = min(now + cfg.rank_timeout, h.lease_end - LEASE_MARGIN_S)
        self.sends[task_id] = _Send(h, task_id, RankGroup(cfg.tp, deadline + SEND_GRACE_S), src, not h.prefilled)
        h.tasks.add(task_id)
        h.next_block = upto
        broadcast(self.ctx.to_ranks, P.SendBlocks(task_id, rid, list(h.alloc.descriptors), src, dst, deadline),
                  cfg.rank_timeout)

    def _pages(self, h: _Handoff, upto: int) -> tuple[np.ndarray, np.ndarray]:
        """P's pages of blocks [next_block, upto) and D's for them: group 0's, then each other
        layer group's that D reads from the first token on (a sliding group: its last window
        only; D allocated no page for the others, runtime/cache/groups.py)."""
        rid, cfg = h.seq.request_id, self.ctx.cfg
        src = [np.asarray(self.ctx.block_table(rid)[h.next_block:upto], dtype=np.int64)]
        dst = [h.alloc.block_ids[h.next_block:upto].astype(np.int64)]
        n = len(h.alloc.block_ids)
        for g, (window, table) in enumerate(zip(cfg.kv_groups.side_windows, self.ctx.group_tables(rid))):
            first = max(h.next_block, (h.seq.prompt_len - window + 1) // cfg.block_size if window else 0)
            theirs = h.alloc.group_ids[g * n + first:g * n + upto]
            mine = np.asarray(table[first:upto], dtype=np.int64)
            src.append(mine[theirs >= 0])
            dst.append(theirs[theirs >= 0].astype(np.int64))
        return np.concatenate(src).astype(np.int32), np.concatenate(dst).astype(np.int32)

    def _on_send_done(self, done: P.SendDone) -> None:
        s = self.sends.get(done.task_id)
        if s is None or not 0 <= done.rank < s.ranks.size:
            log.warning("answer to unknown or expired send %d from cache-messager[%d]", done.task_id, done.rank)
            return
        if not s.ranks.add(done.rank, done):
            return
        del self.sends[done.task_id]
        self._sent(s, "; ".join(a.error for a in s.ranks.answers if not a.ok))

    def _sent(self, s: _Send, error: str) -> None:
        """Every rank answered send `s` (or the engine gave up on the missing ones)."""
        h, stats = s.handoff, self.ctx.stats
        h.tasks.discard(s.task_id)
        nbytes = sum(a.nbytes for a in s.ranks.answers)
        stats[P.STAT["pd_sent_bytes"]] += nbytes
        if error:
            h.error = h.error or error
        elif s.early:
            stats[P.STAT["pd_early_blocks"]] += len(s.src)
            stats[P.STAT["pd_early_bytes"]] += nbytes
        self._settle(h)

    def _settle(self, h: _Handoff) -> None:
        """End a handoff that has nothing in flight and nothing left to order: kv-ready, or an
        abort to D when it failed or the request ended on P (blocks freed on both sides)."""
        if h.tasks:
            return  # D's blocks are being written and P's read: nobody lets them go yet
        seq, link = h.seq, h.link
        rid = seq.request_id
        if h.ended:
            del self.handoffs[rid]
            self.ctx.sched.release_held(seq)
            if h.lost is None:
                self._send(link, wire.PdAbort(rid, "the request ended on the prefill node"))
            return
        if not h.prefilled or (h.next_block < -(-seq.prompt_len // self.ctx.cfg.block_size)
                               and not h.error and h.lost is None):
            return  # still prefilling, or its last blocks are ordered by build_orders
        del self.handoffs[rid]
        self.ctx.sched.drop(seq, seq.finish_reason or "handoff")
        error = h.error or (f"decode node: {h.lost.message}" if h.lost is not None else "")
        if not error and link.session is None:
            error = "the session with the decode node was lost during the handoff"
        if error or seq.cancelled:
            why = error or "cancelled by the client"
            if h.lost is None:
                self._send(link, wire.PdAbort(rid, why))
            if seq.cancelled and not error:
                seq.finish_reason = "cancelled"
                self.ctx.finished(seq)
            else:
                self.ctx.count_failed()
                self.ctx.reply(seq.client, api.ErrorEvent(rid, api.FAILED, f"KV handoff to the decode node failed: {why}"))
            return
        self._send(link, wire.PdKvReady(rid, int(seq.output[0]), seq.output_logprobs[0] if seq.logprobs else 0.0,
                                        seq.output_top[0] if seq.top_logprobs else []))
        self.relays[rid] = _Relay(seq, time.monotonic() + self.timeout, link)

    # ---- deadlines ----------------------------------------------------------------------------
    def tick(self) -> None:
        self._ping()
        now = time.monotonic()
        for rid in [r for r, p in self.pending.items() if p.deadline <= now]:
            p = self.pending[rid]
            self._fail_pending(p, f"the decode node did not allocate blocks for {rid} within {self.timeout:g}s "
                                  f"(--pd-timeout)" if p.asked else f"no session with the decode node within "
                                  f"{self.timeout:g}s (--pd-timeout); is --pd-secret-file the same on both nodes?")
        for tid in [t for t, s in self.sends.items() if s.ranks.expired(now)]:
            s = self.sends.pop(tid)
            missing = s.ranks.missing()
            self._sent(s, f"cache-messager rank(s) {missing} did not answer within {self.ctx.cfg.rank_timeout:g}s")
        for rid in [r for r, x in self.relays.items() if x.deadline <= now]:
            r = self.relays.pop(rid)
            self.ctx.count_failed()
            self.ctx.reply(r.seq.client, api.ErrorEvent(rid, api.FAILED, f"the decode node stopped answering for "
                                                                         f"{rid} ({self.timeout:g}s, --pd-timeout)"))

    def fail_all(self, why: str) -> None:
        """D lets go of what it holds for requests not handed off yet; their clients are told
        by the engine (their sequences are the scheduler's)."""
        for p in self.pending.values():
            if p.link is not None:
                self._send(p.link, wire.PdAbort(p.req.request_id, why))
        self.pending.clear()
        self.failing.clear()
        for r in self.relays.values():
            self.ctx.reply(r.seq.client, api.ErrorEvent(r.seq.request_id, api.STOPPING, why))
        self.relays.clear()


def _layout_problem(descriptors: list, cfg) -> str:
    """Why a decode node's ranks cannot take this node's blocks ("" if they can): each rank's
    pool must hold blocks of this node's KV layout (shape, element type, bytes), or the bytes
    sent would mean something else there (an FP8 block read as float16, say). Checked before
    anything is sent; the cache-messager's transport checks the pool itself again."""
    layout = cfg.kv_layout
    want = (list(layout.block_shape), layout.storage_dtype.str, layout.block_bytes)
    for rank, d in enumerate(descriptors):
        got = (d.get("block_shape"), d.get("dtype"), d.get("block_bytes"))
        if got != want:
            return (f"decode node rank {rank} holds blocks of shape {got[0]}, element {got[1]!r}, {got[2]} bytes; "
                    f"this prefill node's are {want[0]}, {want[1]!r} ({layout.dtype}), {want[2]} bytes: "
                    f"the two nodes must serve the same model with the same --kv-cache-dtype and --dtype")
    return ""


def _logprobs_ok(logprobs: object, tokens: int) -> bool:
    """A list of at most `tokens` log-probabilities (numbers <= 0) from the decode node."""
    return isinstance(logprobs, list) and len(logprobs) <= tokens and all(
        isinstance(x, float) and x <= 0.0 for x in logprobs)
