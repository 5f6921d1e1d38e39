"""What a client may ask of the node: one handler per message of the client API.

Why a class of its own: the I/O thread only queues bytes; deciding what they mean (a request,
a cancel, an info or reset request, a peer's handshake to a node that takes none, a malformed
frame, a client gone or not reading) happens on the engine thread, here, once per turn of the
loop. A request that passes intake goes to the connector or the scheduler; every refusal is
one clear error event and changes nothing.

Any message survives: whatever its handling raises (a peer's or a client's, a bug of ours, a
recursion or memory error on a hostile value) becomes that message's error answer, counted and
logged, and the engine goes on with the next message; no exception of one message ends the
process that every client and request shares. Untrusted messages are decoded with a nesting
bound (ipc/codec.py), and a turn handles at most TAKE_MAX of them and for at most TAKE_S, so
messages that are costly to decode (big hostile maps) cannot hold the loop either.
"""
from __future__ import annotations

import logging
import os
import time

from kvrt.ipc.codec import MAX_DEPTH
from kvrt.ipc.errors import ProtocolError
from kvrt.runtime.cache.keys import salted_root
from kvrt.runtime.cache.prefix_cache import PrefixCache
from kvrt.runtime.client import api
from kvrt.runtime.engine.cache_tasks import CacheTasks
from kvrt.runtime.engine.clients import Clients
from kvrt.runtime.engine.grammars import Grammars
from kvrt.runtime.engine.guide import guide_for
from kvrt.runtime.engine.intake import is_int, sampling_of, show, validate
from kvrt.runtime.engine.scheduler import Scheduler
from kvrt.runtime.engine.sequence import Sequence
from kvrt.runtime.engine.server import FRAMES, GONE, OVERFLOW, ClientNotice
from kvrt.runtime.engine.stats import EngineStats
from kvrt.runtime.node.config import NodeConfig
from kvrt.runtime.pd import messages as wire
from kvrt.runtime.pd.connector import KVConnector

log = logging.getLogger("kvrt.engine")
TAKE_MAX = 256  # client messages handled per take_in (twice per turn of the loop) ...
TAKE_S = 0.05   # ... and for at most this long (then the rest wait for the next turn)
PEER_ONLY = (wire.PdPrealloc, wire.PdKvReady, wire.PdAbort, wire.PdAllocated, wire.PdWelcome, wire.PdRefused,
             wire.PdPing, wire.PdPong)  # valid only inside (or to open) an authenticated peer session


class ClientApi:
    """The client messages the server queued, each to its handler. `accepting` turns False
    once the node stops taking requests."""

    def __init__(self, cfg: NodeConfig, clients: Clients, sched: Scheduler, cache: PrefixCache,
                 connector: KVConnector, tasks: CacheTasks, stats: EngineStats, grammars: Grammars | None = None):
        self.cfg = cfg
        self.grammars = grammars
        self.clients = clients
        self.sched = sched
        self.cache = cache
        self.connector = connector
        self.tasks = tasks
        self.stats = stats
        self.accepting = True
        self._handlers = {api.GenerateRequest: self.on_generate, api.CancelRequest: self.on_cancel,
                          api.InfoRequest: self.on_info, api.ResetPrefixCacheRequest: self.on_reset,
                          wire.PdHello: self._not_a_peer_node, wire.PdSealed: self._not_a_peer_node}
        self._handlers.update({t: self._outside_session for t in PEER_ONLY})

    def take_in(self, limit: int = TAKE_MAX) -> bool:
        """Handle at most `limit` queued client messages and notices (the I/O thread only queues
        bytes); True when more are waiting. Bounded so that no flood of messages delays the
        loop's heartbeat or its steps: the rest wait for the next turn, in the order the I/O
        thread took them (fair between connections: server.py)."""
        server = self.clients.server
        if server is None:
            return False
        notices, inbox = server.notices, server.inbox
        deadline = time.monotonic() + TAKE_S
        while notices and limit > 0:
            notice = notices.popleft()
            limit -= 1
            try:
                self._on_notice(notice)
            except Exception as e:  # noqa: BLE001 - one notice's failure never ends the engine
                self._failed(notice.client, f"{notice.kind} notice", e)
        while inbox and limit > 0 and time.monotonic() < deadline:
            limit -= 1
            client, data = inbox.popleft()
            if not data:
                continue  # a liveness probe (a decode node probes its prefill node too)
            try:
                self._take(client, data)
            except Exception as e:  # noqa: BLE001 - one message's failure is its own answer (module docstring)
                self._failed(client, f"message of {len(data)} bytes", e)
        self.clients.probe()
        return bool(notices or inbox)

    def _take(self, client: bytes, data: bytes) -> None:
        """One message from a client or a peer, to its handler (a malformed one gets an error)."""
        try:
            msg = api.API.decode(data, max_depth=MAX_DEPTH)
        except ProtocolError as e:
            self.stats.count("protocol_errors")
            self.clients.reply(client, api.ErrorEvent("", api.BAD_REQUEST, f"malformed message: {str(e)[:200]}"))
            return
        try:
            if not self.connector.on_peer_message(client, msg):
                self._handlers.get(type(msg), self._not_a_request)(client, msg)
        except Exception as e:  # noqa: BLE001 - answered for the request it names (module docstring)
            rid = getattr(msg, "request_id", "")
            self._failed(client, type(msg).__name__, e, "" if api.request_id_problem(rid) else rid)

    def _failed(self, client: bytes, what: str, e: Exception, request_id: str = "") -> None:
        """The answer to a message whose handling raised: an error naming the exception's type
        (its text may quote the hostile value), counted, and logged with its traceback."""
        self.stats.count("intake_errors")
        log.warning("a client's %s could not be handled: %s", what, type(e).__name__, exc_info=True)
        try:
            self.clients.reply(client, api.ErrorEvent(request_id, api.BAD_REQUEST, f"the node could not handle "
                                                      f"this {what} ({type(e).__name__}; see the node's log)"))
        except Exception:  # noqa: BLE001 - the answer itself failed (a broken peer session): logged above
            log.warning("no error answer could be sent for it", exc_info=True)

    def on_generate(self, client: bytes, req: api.GenerateRequest) -> None:
        rid, reply = req.request_id, self.clients.reply
        problem = validate(req, self.cfg)
        if problem:
            reply(client, api.ErrorEvent("" if api.request_id_problem(rid) else rid, api.BAD_REQUEST, problem))
            return
        if not self.accepting:
            reply(client, api.ErrorEvent(rid, api.STOPPING, "the node is stopping and takes no new requests"))
            return
        if rid in self.sched.seqs or self.connector.busy(rid):
            reply(client, api.ErrorEvent(rid, api.DUPLICATE, f"request id {rid!r} is already in flight"))
            return
        key = self.clients.quota_key(client, req.on_behalf_of)
        if self.clients.at_limit(client, key):
            who = f"client {req.on_behalf_of}" if req.on_behalf_of else "this client"
            reply(client, api.ErrorEvent(rid, api.TOO_MANY, f"{who} already has "
                                         f"{api.MAX_REQUESTS_PER_CLIENT} requests in flight"))
            return
        self.clients.admitted(key, rid, client)
        sampling = sampling_of(req)  # (picks the seed before a connector forwards the request)
        if self.connector.on_request(client, req):
            return
        self.sched.add(Sequence.new(rid, req.prompt, req.max_new_tokens, self.cfg.block_size,
                                    salted_root(self.cfg.key_root, req.cache_salt),
                                    client=client, owner=key,
                                    eos_token_id=req.eos_token_id, use_cache=req.use_cache, stream=req.stream,
                                    prompt_logprobs=req.prompt_logprobs,
                                    guide=guide_for(req, self.grammars, self.cfg.vocab_size, key), **sampling))

    def on_cancel(self, client: bytes, req: api.CancelRequest) -> None:
        rid = req.request_id
        problem = api.request_id_problem(rid)
        if problem:
            self.clients.reply(client, api.ErrorEvent("", api.BAD_REQUEST, problem))
        elif self.clients.owner_of(rid) != client:  # another client's request is no more known than a missing one
            self.clients.reply(client, api.ErrorEvent(rid, api.UNKNOWN, f"no request {rid!r} of this client in flight"))
        else:
            self.clients.cancel(client, rid)

    def on_info(self, client: bytes, msg: api.InfoRequest) -> None:
        if not is_int(msg.nonce):
            self.clients.reply(client, api.ErrorEvent("", api.BAD_REQUEST,
                                                      f"nonce must be an integer, got {show(msg.nonce)}"))
            return
        c = self.cfg
        self.clients.reply(client, api.InfoReply(msg.nonce, c.node, c.role, c.vocab_size, c.max_model_len,
                                                 c.block_size, -1,
                                                 model_dir=os.path.abspath(c.model_dir) if c.model_dir else ""))

    def on_reset(self, client: bytes, msg: api.ResetPrefixCacheRequest) -> None:
        """Drop the prefix cache (runtime/cache/reset.py) and this node's view of a node-local
        storage tier (runtime/cache/storage_index.py). KV events subscribers get AllBlocksCleared,
        then, for a shared store the reset leaves as it is, the blocks it still holds."""
        if not is_int(msg.nonce):
            self.clients.reply(client, api.ErrorEvent("", api.BAD_REQUEST,
                                                      f"nonce must be an integer, got {show(msg.nonce)}"))
            return
        got = self.cache.reset()
        storage = self.tasks.reset_storage(got.storage_tasks)
        log.info("prefix cache reset: %d device and %d host blocks freed, %d and %d held until released, "
                 "%d storage keys forgotten", got.device, got.host, got.held_device, got.held_host, storage)
        self.clients.reply(client, api.ResetPrefixCacheReply(msg.nonce, got.device, got.host, storage,
                                                             got.held_device, got.held_host))

    def _on_notice(self, n: ClientNotice) -> None:
        if n.kind == FRAMES:
            self.stats.count("protocol_errors")
            self.clients.reply(n.client, api.ErrorEvent("", api.BAD_REQUEST, f"a client message is one frame "
                                                        f"(one msgpack map); this one had {n.frames} frames"))
        elif n.kind == OVERFLOW:
            self.clients.end_client(n.client, f"this client stopped reading its answers ({api.CLIENT_QUEUE} "
                                              f"were waiting for it), so its requests were cancelled")
        elif n.kind == GONE:
            self.clients.end_client(n.client, "")

    def _not_a_request(self, client: bytes, msg) -> None:
        self.clients.reply(client, api.ErrorEvent("", api.BAD_REQUEST, f"{type(msg).__name__} is not a request"))

    def _not_a_peer_node(self, client: bytes, msg) -> None:
        """A peer handshake to a node whose connector takes no peers."""
        self.stats.count("pd_refused")
        self.clients.reply(client, api.ErrorEvent("", api.BAD_REQUEST, f"node {self.cfg.node} is not a decode "
                                                                       f"node (role {self.cfg.role})"))

    def _outside_session(self, client: bytes, msg) -> None:
        """A peer message outside an authenticated session: refused."""
        self.stats.count("pd_refused")
        log.warning("unauthenticated %s refused", type(msg).__name__)
        self.clients.reply(client, api.ErrorEvent(str(getattr(msg, "request_id", "")), api.BAD_REQUEST,
                                                  f"{type(msg).__name__} must come inside an authenticated "
                                                  f"peer session (PdHello, then PdSealed)"))
