"""The engine's client socket: the node's private ZeroMQ ROUTER and its link with the gateway,
served by one I/O thread.

Why no socket of the engine listens where outsiders reach it: libzmq 4.3 aborts the whole process
on bytes a hostile peer can send. A client that speaks raw ZeroMQ fills its connection's queue
(more messages than the ROUTER's high-water mark, which stops libzmq's reading of that connection),
sends a PING command and resets the connection: the reset marks the stopped connection failed,
and when the queue drains libzmq decodes the buffered PING and answers it on the failed connection:
`Assertion failed: !_io_error (src/stream_engine_base.cpp:310)`. Every bounded queue (any
RCVHWM), ROUTER_HANDOVER, IMMEDIATE, PROBE_ROUTER, ROUTER_MANDATORY or a smaller receive buffer
aborted alike; only a queue without bound did not, which lets a flood grow the process without
limit. So the gateway process (runtime/gateway/) owns every public socket and may die of it (the
launcher restarts it), and this socket listens only in the node's private socket directory
(ipc/sockets.py): the launcher's HTTP bridge connects there, and the gateway relays every outside
client and a prefill node's decode peers over the link (runtime/gateway/link.py). Their peers
are the node's own processes, which never send PINGs (no ZMTP heartbeats anywhere in kvrt).

Why a thread: the engine loop blocks on its fan-in doorbell (a POSIX semaphore), which ZeroMQ
cannot poll. The I/O thread blocks on the sockets instead; each client message is queued
(a deque: append and popleft are atomic) and the engine is woken through `wake` (the fan-in's
poke). Answers go the other way through an inproc PUSH/PULL pair, because a ZeroMQ socket
must only be used by one thread. The thread only moves bytes: decoding, validation and every
decision stay on the engine thread.

What a flood of messages cannot do: the thread stops taking more once INBOX_MAX messages and
notices wait for the engine (malformed multi-frame messages count too); it takes from the private
socket and from the gateway's batches in turn, and the gateway reads its public socket only while
fewer than link.WINDOW of its messages wait here, so the rest of a flood waits in libzmq's queue
of each public connection, which libzmq serves fair-queued (one from each connection with messages
waiting, in turn): a well-behaved client's message waits behind at most INBOX_MAX + WINDOW
others however many the flooders send; the engine handles a bounded batch of them per turn of
its loop. INBOX_MAX is kept small because a message in the inbox is served first come first
served, so its size times the cost of a costly message (a hostile one of a thousand nested
levels takes half a millisecond) is what another client waits.

What a client cannot do to the engine's memory: a frame over `max_message_bytes` is refused by
libzmq from its header, before anything is allocated (and the connection is dropped); a client
that stops reading has at most CLIENT_QUEUE answers queued (the ROUTER's send high-water mark,
here or at the gateway); past that its answers are dropped, except the final notices the engine
marks `keep` (one per request it cancels for that reason), which wait until the client reads
again or goes.

How a disconnect is seen: ROUTER_MANDATORY makes a send to a routing id without a connection
fail (EHOSTUNREACH) instead of vanishing (the gateway makes its sends the same way and says what
they found), and the engine sends an empty message to each client with requests in flight every
PROBE_S (runtime/engine/clients.py), so every vanished client shows up within that; a client of
a gateway that died is gone with its connection (a send to the gateway fails while none is
connected). ZMQ_ROUTER_NOTIFY would say it directly but is a draft option, absent from released
libzmq builds; a socket monitor names file descriptors, not routing ids, and descriptor numbers
are reused; client keep-alives would cancel the requests of a live client that is merely busy.

Why no ZMTP heartbeats (libzmq's HEARTBEAT_IVL), here or at the gateway: a heartbeat timer that
fires on a connection reset under back-pressure trips the same assertion as a peer's PING, from
any flood of sockets that close within a heartbeat interval of their handshake
(tests/runtime/engine/test_flood.py); TCP keep-alive and TCP_USER_TIMEOUT at the gateway close
connections whose peer machine vanished instead.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import zmq

from kvrt.ipc import sockets
from kvrt.runtime.client.api import CLIENT_QUEUE
from kvrt.runtime.gateway import link
from kvrt.runtime.gateway.kept_answers import KeptAnswers
from kvrt.runtime.gateway.link import FRAMES, GONE, OVERFLOW, PEER
from kvrt.runtime.node.limits import ZMQ_HANDSHAKE_MS

log = logging.getLogger(__name__)
POLL_MS = 100  # longest the I/O thread blocks before checking whether it should stop

INBOX_MAX = 128  # client messages and notices waiting for the engine before the I/O thread stops taking more
LINK_HWM = 10_000  # batches of answers queued for the gateway before the link counts it as not reading
LINK_LINGER_MS = 1_000  # at close: how long the last answers may take to reach the gateway


@dataclass
class ClientNotice:
    client: bytes
    kind: str
    frames: int = 0


class ApiServer:
    """Listens on the node's private API socket and on its end of the gateway link; `inbox`
    holds (client identity, message bytes) from both (link.py says which identity is whose)."""

    def __init__(self, node: str, wake: Callable[[], None], *, max_message_bytes: int = -1,
                 client_queue: int = CLIENT_QUEUE):
        self.address = sockets.address(node, sockets.API)
        self.inbox: deque[tuple[bytes, bytes]] = deque()
        self.notices: deque[ClientNotice] = deque()
        self._held: deque[tuple[bytes, bytes] | ClientNotice] = deque()  # the gateway's, waiting for room
        self._owed = 0  # the gateway's messages taken in that it was not told of yet (link.py: credit)
        self._gone: set[bytes] = set()  # clients found gone, not yet told to the engine
        self._wake = wake
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.HANDSHAKE_IVL, ZMQ_HANDSHAKE_MS)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sends fail (never block) for gone or full clients
        self._router.setsockopt(zmq.SNDHWM, client_queue)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._kept = KeptAnswers(self._router, self._gone.add)
        self._link = self._ctx.socket(zmq.DEALER)
        self._link.setsockopt(zmq.LINGER, LINK_LINGER_MS)
        self._link.setsockopt(zmq.SNDHWM, LINK_HWM)
        self._link.setsockopt(zmq.RCVHWM, 0)  # (bounded by the gateway's window)
        try:
            self._router.bind(self.address)
            self._link.bind(sockets.address(node, sockets.LINK))
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise OSError(f"the engine cannot listen on its private sockets ({self.address}): {e}") from None
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(f"inproc://answers-{id(self)}")
        self._push = self._ctx.socket(zmq.PUSH)  # used by the engine thread only
        self._push.connect(f"inproc://answers-{id(self)}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="api-io", daemon=True)
        self._thread.start()
        log.info("client API listening on %s (the gateway relays the public port)", self.address)

    def send(self, client: bytes, data: bytes, keep: bool = False) -> None:
        """Queue an answer to `client` (engine thread only; never blocks on the network). `keep`:
        if the client's queue is full, hold this one until it reads (the rest is dropped)."""
        self._push.send_multipart([client, data, link.KEEP] if keep else [client, data], copy=False)

    def probe(self, client: bytes) -> None:
        """Send `client` an empty message: if its connection is gone, a GONE notice follows."""
        self._push.send_multipart([client, b""])

    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in (self._router, self._link, self._pull):
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            room = self._waiting() < INBOX_MAX
            poller.modify(self._router, zmq.POLLIN if room else 0)
            poller.modify(self._link, zmq.POLLIN if len(self._held) < 2 * link.WINDOW else 0)
            ready = dict(poller.poll(POLL_MS))
            if self._link in ready:
                self._from_gateway()
            if self._pull in ready:
                self._forward()
            self._take(self._router in ready)
            self._kept.flush()
            self._tell_gone(False)
        self._forward()  # answers queued before close still go out

    # ---- answers: engine -> clients ----------------------------------------------------------
    def _forward(self) -> None:
        overflowed: set[bytes] = set()
        relay: list[bytes] = [link.ANSWERS, b""]  # (the credit: filled in when sent)
        while True:
            try:
                client, data, *keep = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if not client:
                continue  # close() waking the thread
            if link.relayed(client):
                relay += [client, data, link.KEEP if keep else b""]
            elif not self._kept.send(client, data, bool(keep)):
                overflowed.add(client)
        if len(relay) > 2:
            self._to_gateway(relay)
        self.notices.extend(ClientNotice(c, OVERFLOW) for c in overflowed)  # one each, however many dropped
        self._tell_gone(bool(overflowed))

    def _to_gateway(self, batch: list[bytes]) -> None:
        """Answers for the gateway's clients; when no gateway takes them (none connected: it died
        and the launcher is starting another; or it stopped reading), those clients' connections
        are gone with it, and a decode peer's message is lost (P's timeouts fail its requests)."""
        batch[1] = str(self._owed).encode()
        try:
            self._link.send_multipart(batch, zmq.NOBLOCK)
            self._owed = 0
            return
        except zmq.Again:
            pass
        clients = set(batch[2::3])
        peers = {c for c in clients if c.startswith(PEER)}
        if peers:
            log.warning("no gateway: %d message(s) to decode peer(s) dropped", len(peers))
        self._gone |= clients - peers

    def _tell_gone(self, wake: bool) -> None:
        """Queue one GONE notice per client found gone since the last call, and wake the engine
        if there is anything new for it."""
        self.notices.extend(ClientNotice(c, GONE) for c in self._gone)
        if self._gone or wake:
            self._gone.clear()
            self._wake()

    # ---- messages: clients -> engine -----------------------------------------------------------
    def _from_gateway(self) -> None:
        """The gateway's batches: its clients' messages wait in `_held` for room in the inbox;
        decode peers' messages and what the gateway's sends found go to the engine at once."""
        woke = False
        while True:
            try:
                frames = self._link.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            kind = frames[0] if frames else b""
            if kind == link.MESSAGES:
                self._held.extend(link.pairs(frames))
            elif kind == link.FRAMES_UP:
                self._held.extend(ClientNotice(c, FRAMES, link.count(n)) for c, n in link.pairs(frames))
            elif kind == link.PEERS:
                self.inbox.extend(link.pairs(frames))
                woke = True
            elif kind == link.NOTICES:
                self.notices.extend(ClientNotice(c, k.decode(errors="replace")) for c, k in link.pairs(frames))
                woke = True
            else:
                log.error("the gateway sent a link message of kind %r: dropped", kind[:8])
        if woke:
            self._wake()

    def _waiting(self) -> int:
        return len(self.inbox) + len(self.notices)

    def _take(self, router_ready: bool) -> None:
        """Fill the inbox up to INBOX_MAX from the gateway's held messages and the private
        socket in turn (neither side's flood shuts the other out), and give the gateway its
        window back for what was taken (link.py: credit)."""
        taken = got = 0
        turn_of_router = False
        while self._waiting() < INBOX_MAX and (self._held or router_ready):
            if self._held and not (turn_of_router and router_ready):
                item = self._held.popleft()
                if isinstance(item, ClientNotice):
                    self.notices.append(item)
                else:
                    self.inbox.append(item)
                taken += 1
            else:
                try:
                    frames = self._router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    router_ready = False
                    continue
                if len(frames) != 2:  # (a ROUTER always gives the identity frame first)
                    self.notices.append(ClientNotice(frames[0], FRAMES, len(frames) - 1))
                else:
                    self.inbox.append((frames[0], frames[1]))
            got += 1
            turn_of_router = not turn_of_router
        self._owed += taken
        if self._owed >= link.WINDOW // 2:  # (else it goes with the next answers)
            try:
                self._link.send_multipart([link.CREDIT, str(self._owed).encode()], zmq.NOBLOCK)
                self._owed = 0
            except zmq.Again:  # no gateway: a new one starts with its whole window
                pass
        if got:
            self._wake()

    def close(self) -> None:
        """Stop the thread (it forwards the answers already queued), then close the sockets: the
        link lingers up to LINK_LINGER_MS so the last answers reach the gateway."""
        self._stop.set()
        self._push.send_multipart([b"", b""])  # wake the thread from its poll
        self._thread.join(timeout=2 * POLL_MS / 1000 + 1)
        self._push.close(linger=0)
        self._link.close()
        self._ctx.destroy(linger=0)
