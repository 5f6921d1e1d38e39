"""The gateway's half of the client API: the public ROUTER (and a prefill node's decode peers'
DEALERs), relayed to the engine over the private link (runtime/gateway/link.py).

What it keeps of the engine's socket as it was before the gateway (runtime/engine/server.py says
why each is so): a frame over `max_message_bytes` refused by libzmq from its header; the ROUTER
read fair-queued and only while the window has room, so a flood waits in each connection's own
queue; ROUTER_MANDATORY, so a send to a client that is gone fails and the engine is told (GONE);
a client that stops reading gets at most `client_queue` answers queued and the engine is told
(OVERFLOW), except the final notices the engine marks to keep, which wait here until it reads or
goes; TCP keep-alive and TCP_USER_TIMEOUT for peers whose machine vanished; no ZMTP heartbeats.

All of it runs on the gateway's one thread: this process does nothing else, and when libzmq
aborts it on a hostile peer's bytes, the launcher starts another (runtime/node/supervisor.py).
"""
from __future__ import annotations

import logging

import zmq

from kvrt.runtime.client.api import CLIENT_QUEUE
from kvrt.runtime.gateway import link
from kvrt.runtime.gateway.kept_answers import KeptAnswers
from kvrt.runtime.node.limits import ZMQ_HANDSHAKE_MS

log = logging.getLogger(__name__)

KEEPALIVE_IDLE_S = 10  # a connection silent this long gets TCP keep-alive probes ...
KEEPALIVE_PROBES = 4   # ... this many, KEEPALIVE_IDLE_S / 2 apart, before TCP closes it
UNACKED_MS = 30_000    # sent bytes unacknowledged this long: the peer is gone (TCP_USER_TIMEOUT)


class ClientRelay:
    """Listens on tcp://host:port for clients (and, with `peers`, the comma-separated addresses
    of a prefill node's decode nodes, keeps a DEALER connected to each) and relays both ways
    between them and the engine's end of the link at `link_address`."""

    def __init__(self, host: str, port: int, link_address: str, peers: str = "", *, max_message_bytes: int = -1,
                 client_queue: int = CLIENT_QUEUE, window: int = link.WINDOW):
        self.address = f"tcp://{host}:{port}"
        self.window = window
        self.outstanding = 0  # counted messages sent up that the engine has not credited yet
        self._notices: dict[tuple[bytes, bytes], None] = {}  # (engine id, kind) for the next NOTICES batch
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        r = self._router
        r.setsockopt(zmq.LINGER, 0)
        r.setsockopt(zmq.HANDSHAKE_IVL, ZMQ_HANDSHAKE_MS)  # idle connections that never speak
        r.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sends fail (never block) for gone or full clients
        r.setsockopt(zmq.SNDHWM, client_queue)
        r.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        r.setsockopt(zmq.TCP_KEEPALIVE, 1)  # (never ZMTP heartbeats: runtime/engine/server.py)
        r.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
        r.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_IDLE_S // 2)
        r.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
        r.setsockopt(zmq.TCP_MAXRT, UNACKED_MS)
        try:
            r.bind(self.address)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise OSError(f"client API cannot listen on {self.address}: {e}") from None
        # the engine's end: unbounded queues, since the window bounds what goes up and the engine
        # what comes down (it drops and ends the clients when this process does not read)
        self._link = self._ctx.socket(zmq.DEALER)
        self._link.setsockopt(zmq.LINGER, 0)
        self._link.setsockopt(zmq.SNDHWM, 0)
        self._link.setsockopt(zmq.RCVHWM, 0)
        self._link.connect(link_address)
        self._dealers: dict[bytes, zmq.Socket] = {}
        for i, address in enumerate(a.strip() for a in peers.split(",") if a.strip()):
            dealer = self._dealers[link.peer_identity(i)] = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(address)
        self._by_socket = {dealer: identity for identity, dealer in self._dealers.items()}
        self._poller = zmq.Poller()
        for sock in (self._router, self._link, *self._by_socket):
            self._poller.register(sock, zmq.POLLIN)
        self._kept = KeptAnswers(r, self._tell_gone)  # (public ids)
        log.info("client API listening on %s", self.address)

    def serve(self, timeout_ms: int) -> None:
        """One round: wait up to `timeout_ms` for anything, then move what came both ways."""
        self._poller.modify(self._router, zmq.POLLIN if self.outstanding < self.window else 0)
        ready = dict(self._poller.poll(timeout_ms))
        if self._link in ready:
            self._from_engine()
        if self._router in ready:
            self._from_clients()
        peers = [link.PEERS]
        for sock, identity in self._by_socket.items():
            if sock in ready:
                peers += self._drain_peer(sock, identity)
        if len(peers) > 1:
            self._up(peers)
        self._kept.flush()
        if self._notices:
            self._up([link.NOTICES, *(f for notice in self._notices for f in notice)])
            self._notices = {}

    # ---- up: clients and peers -> engine -------------------------------------------------------
    def _from_clients(self) -> None:
        messages, frames = [link.MESSAGES], [link.FRAMES_UP]
        while self.outstanding < self.window:
            try:
                got = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            client = link.RELAYED + got[0]
            if len(got) == 2:  # (a ROUTER always gives the identity frame first)
                messages += [client, got[1]]
            else:
                frames += [client, str(len(got) - 1).encode()]
            self.outstanding += 1
        for batch in (messages, frames):
            if len(batch) > 1:
                self._up(batch)

    def _drain_peer(self, dealer: zmq.Socket, identity: bytes) -> list[bytes]:
        out = []
        while True:
            try:
                out += [identity, dealer.recv(zmq.NOBLOCK)]
            except zmq.Again:
                return out

    def _up(self, batch: list[bytes]) -> None:
        self._link.send_multipart(batch)  # (unbounded: never blocks; small frames: copying is cheaper)

    # ---- down: engine -> clients and peers ----------------------------------------------------------
    def _from_engine(self) -> None:
        overflowed: set[bytes] = set()
        while True:
            try:
                frames = self._link.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            kind = frames[0] if len(frames) >= 2 else b""
            if kind in (link.CREDIT, link.ANSWERS):
                self.outstanding = max(0, self.outstanding - link.count(frames[1]))
            if kind == link.ANSWERS:
                for client, data, keep in link.pairs(frames, 3, head=2):
                    if not self._answer(client, data, keep == link.KEEP):
                        overflowed.add(client)
            elif kind != link.CREDIT:
                log.error("the engine sent a link message of kind %r: dropped", kind[:8])
        self._notices.update(dict.fromkeys((c, link.OVERFLOW.encode()) for c in overflowed))

    def _answer(self, client: bytes, data: bytes, keep: bool) -> bool:
        """Send or keep `data` for the engine's `client`; False if it was dropped because the
        client's queue is full."""
        if (dealer := self._dealers.get(client)) is not None:
            try:
                dealer.send(data, zmq.NOBLOCK)
            except zmq.Again:  # the peer is gone and its queue is full: P's timeouts fail the requests
                log.warning("decode peer %s not reachable: a message to it was dropped", client[len(link.PEER):])
            return True
        if client[:1] != link.RELAYED:
            log.error("an answer for %r, not a client of the gateway: dropped", client[:16])
            return True
        return self._kept.send(client[1:], data, keep)

    def _tell_gone(self, public: bytes) -> None:
        self._notices[(link.RELAYED + public, link.GONE.encode())] = None

    def close(self) -> None:
        self._ctx.destroy(linger=0)
