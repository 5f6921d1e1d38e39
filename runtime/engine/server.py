"""The engine's client socket: a ZeroMQ ROUTER served by one I/O thread.

Why a thread: the engine loop blocks on its fan-in doorbell (a POSIX semaphore), which ZeroMQ
cannot poll. The I/O thread blocks on the sockets instead; each client message is queued
(a deque: append and popleft are atomic) and the engine is woken through `wake` (the fan-in's
poke). Answers go the other way through an inproc PUSH/PULL pair, because a ZeroMQ socket
must only be used by one thread. The thread only moves bytes: decoding, validation and every
decision stay on the engine thread.

What a flood of messages cannot do: the thread stops reading once INBOX_MAX messages and
notices wait for the engine (malformed multi-frame messages count too), and libzmq's ROUTER
takes messages from its connections fair-queued (one from each connection with messages waiting,
in turn), so a well-behaved client's message waits behind at most INBOX_MAX others however many
the flooders send; the engine handles a bounded batch of them per turn of its loop. The rest of a
flood waits in libzmq's queue of each connection, where the fair queuing applies: INBOX_MAX is
kept small because a message in the inbox is served first come first served, so its size times
the cost of a costly message (a hostile one of a thousand nested levels takes half a millisecond)
is what another client waits.

What a client cannot do to the engine's memory: a frame over `max_message_bytes` is refused by
libzmq from its header, before anything is allocated (and the connection is dropped); a client
that stops reading has at most CLIENT_QUEUE answers queued (the ROUTER's send high-water mark);
past that its answers are dropped, except the final notices the engine marks `keep` (one per
request it cancels for that reason), which wait here until the client reads again or goes.

How a disconnect is seen: ROUTER_MANDATORY makes a send to a routing id without a connection
fail (EHOSTUNREACH) instead of vanishing, and the engine sends an empty message to each client
with requests in flight every PROBE_S (runtime/engine/clients.py), so every vanished client shows
up within that. ZMQ_ROUTER_NOTIFY would say it directly but is a draft option, absent from
released libzmq builds; a socket monitor names file descriptors, not routing ids, and descriptor
numbers are reused; client keep-alives would cancel the requests of a live client that is merely
busy. A connection whose peer machine vanished without closing it is closed by TCP itself: keep-
alive probes once it has been idle for KEEPALIVE_IDLE_S, and a limit on how long sent bytes may
stay unacknowledged (TCP_USER_TIMEOUT, libzmq's TCP_MAXRT) while answers are on their way.

Why no ZMTP heartbeats (libzmq's HEARTBEAT_IVL): libzmq 4.3 aborts the whole process on them.
Back-pressure (the thread above stops reading, a connection's queue reaches its high-water mark)
stops libzmq's reading of that connection; if the peer then resets the connection, libzmq marks
the stopped connection failed but keeps it until its queue drains, and the next heartbeat timer
of that connection writes on it and trips `Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)`. Floods from several sockets that close within a heartbeat
interval of their handshake did exactly that (tests/runtime/engine/test_flood.py); without the
timer, the failed connection is cleaned up when its queue drains.
"""
from __future__ import annotations

import errno
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import zmq

from kvrt.runtime.client.api import CLIENT_QUEUE
from kvrt.runtime.node.limits import ZMQ_HANDSHAKE_MS

log = logging.getLogger(__name__)
POLL_MS = 100  # longest the I/O thread blocks before checking whether it should stop


PEER = b"\x00peer!"  # prefix of the identities under which messages from a P node's decode peers arrive
INBOX_MAX = 128  # client messages and notices waiting for the engine before the I/O thread stops reading more
KEEPALIVE_IDLE_S = 10  # a connection silent this long gets TCP keep-alive probes ...
KEEPALIVE_PROBES = 4   # ... this many, KEEPALIVE_IDLE_S / 2 apart, before TCP closes it
UNACKED_MS = 30_000    # sent bytes unacknowledged this long: the peer is gone (TCP_USER_TIMEOUT)
_KEEP = b"k"  # third frame of an answer on the inproc pair: keep it for a client that is not reading

# what the I/O thread tells the engine about a client (ClientNotice.kind)
GONE = "gone"          # its connection is closed: its requests can be cancelled
OVERFLOW = "overflow"  # CLIENT_QUEUE answers wait for it: its requests must be cancelled
FRAMES = "frames"      # it sent a message of `frames` frames, not one


@dataclass
class ClientNotice:
    client: bytes
    kind: str
    frames: int = 0


def peer_identity(index: int) -> bytes:
    """The identity of decode peer `index` (its place in --decode-peer) on a prefill node."""
    return PEER + str(index).encode()


class ApiServer:
    """Listens on tcp://host:port; `inbox` holds (client identity, message bytes). With `peer`
    addresses (a prefill node's decode nodes, comma-separated) it also keeps a DEALER connected
    to each: messages of the i-th arrive with identity peer_identity(i), and sends to that
    identity go to it."""

    def __init__(self, host: str, port: int, wake: Callable[[], None], peer: str = "", *,
                 max_message_bytes: int = -1, client_queue: int = CLIENT_QUEUE):
        self.address = f"tcp://{host}:{port}"
        self.inbox: deque[tuple[bytes, bytes]] = deque()
        self.notices: deque[ClientNotice] = deque()
        self._backlog: dict[bytes, deque[bytes]] = {}  # kept answers of clients whose queue is full
        self._gone: set[bytes] = set()  # clients found gone, not yet told to the engine
        self._wake = wake
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.HANDSHAKE_IVL, ZMQ_HANDSHAKE_MS)  # idle connections that never speak
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sends fail (never block) for gone or full clients
        self._router.setsockopt(zmq.SNDHWM, client_queue)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._router.setsockopt(zmq.TCP_KEEPALIVE, 1)  # (never ZMTP heartbeats: module docstring)
        self._router.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
        self._router.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_IDLE_S // 2)
        self._router.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_PROBES)
        self._router.setsockopt(zmq.TCP_MAXRT, UNACKED_MS)
        try:
            self._router.bind(self.address)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise OSError(f"client API cannot listen on {self.address}: {e}") from None
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(f"inproc://answers-{id(self)}")
        self._push = self._ctx.socket(zmq.PUSH)  # used by the engine thread only
        self._push.connect(f"inproc://answers-{id(self)}")
        self._dealers: dict[bytes, zmq.Socket] = {}
        for i, address in enumerate(a.strip() for a in peer.split(",") if a.strip()):
            dealer = self._dealers[peer_identity(i)] = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="api-io", daemon=True)
        self._thread.start()
        log.info("client API listening on %s", self.address)

    def send(self, client: bytes, data: bytes, keep: bool = False) -> None:
        """Queue an answer to `client` (engine thread only; never blocks on the network). `keep`:
        if the client's queue is full, hold this one until it reads (the rest is dropped)."""
        self._push.send_multipart([client, data, _KEEP] if keep else [client, data], copy=False)

    def probe(self, client: bytes) -> None:
        """Send `client` an empty message: if its connection is gone, a GONE notice follows."""
        self._push.send_multipart([client, b""])

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        by_socket = {dealer: identity for identity, dealer in self._dealers.items()}
        for dealer in by_socket:
            poller.register(dealer, zmq.POLLIN)
        while not self._stop.is_set():
            poller.modify(self._router, zmq.POLLIN if self._waiting() < INBOX_MAX else 0)
            for sock, _ in poller.poll(POLL_MS):
                if sock is self._router:
                    self._receive()
                elif sock in by_socket:
                    self._receive_peer(by_socket[sock])
                else:
                    self._forward()
            self._flush_backlogs()
        self._forward()  # answers queued before close still go out

    def _forward(self) -> None:
        overflowed: set[bytes] = set()
        while True:
            try:
                client, data, *keep = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if (dealer := self._dealers.get(client)) is not None:
                try:
                    dealer.send(data, zmq.NOBLOCK)
                except zmq.Again:  # the peer is gone and its queue is full: P's timeouts fail the requests
                    log.warning("decode peer %s not reachable: a message to it was dropped", client[len(PEER):])
            elif not self._to_client(client, data, bool(keep)):
                overflowed.add(client)
        self.notices.extend(ClientNotice(c, OVERFLOW) for c in overflowed)  # one each, however many dropped
        self._tell_gone(bool(overflowed))

    def _to_client(self, client: bytes, data: bytes, keep: bool) -> bool:
        """Send or keep `data`; False if it was dropped because the client's queue is full."""
        backlog = self._backlog.get(client)
        if backlog is None:
            if self._send_now(client, data):
                return True
            backlog = self._backlog[client] = deque()
        if keep:  # bounded: the engine keeps one notice per request it ends, and bounds requests
            backlog.append(data)
            return True
        return False

    def _send_now(self, client: bytes, data: bytes) -> bool:
        """Send without waiting; False when the client's queue is full. A client that is gone
        takes nothing: its backlog is dropped and a GONE notice queued."""
        try:
            self._router.send_multipart([client, data], zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            self._backlog.pop(client, None)
            self._gone.add(client)
        return True

    def _tell_gone(self, wake: bool) -> None:
        """Queue one GONE notice per client found gone since the last call, and wake the engine
        if there is anything new for it."""
        self.notices.extend(ClientNotice(c, GONE) for c in self._gone)
        if self._gone or wake:
            self._gone.clear()
            self._wake()

    def _flush_backlogs(self) -> None:
        """Kept answers go out once their client reads again; a client with none left is back to
        normal (its next answer that does not fit starts a backlog again)."""
        for client, backlog in list(self._backlog.items()):
            while backlog and self._send_now(client, backlog[0]):
                if self._backlog.get(client) is not backlog:
                    break  # the client is gone, and its backlog with it
                backlog.popleft()
            if not backlog:
                self._backlog.pop(client, None)
        self._tell_gone(False)

    def _receive_peer(self, identity: bytes) -> None:
        dealer = self._dealers[identity]
        while True:
            try:
                data = dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.inbox.append((identity, data))
        self._wake()

    def _waiting(self) -> int:
        return len(self.inbox) + len(self.notices)

    def _receive(self) -> None:
        got = False
        while self._waiting() < INBOX_MAX:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:  # (a ROUTER always gives the identity frame first)
                self.notices.append(ClientNotice(frames[0], FRAMES, len(frames) - 1))
            else:
                self.inbox.append((frames[0], frames[1]))
            got = True
        if got:
            self._wake()

    def close(self) -> None:
        """Stop the thread (it forwards the answers already queued), then close the sockets."""
        self._stop.set()
        self._thread.join(timeout=2 * POLL_MS / 1000 + 1)
        self._push.close(linger=0)
        self._ctx.destroy(linger=0)
