"""The engine's client socket: a ZeroMQ ROUTER served by one I/O thread.

Why a thread: the engine loop blocks on its fan-in doorbell (a POSIX semaphore), which ZeroMQ
cannot poll. The I/O thread blocks on the sockets instead; each client message is queued
(a deque: append and popleft are atomic) and the engine is woken through `wake` (the fan-in's
poke). Answers go the other way through an inproc PUSH/PULL pair, because a ZeroMQ socket
must only be used by one thread. The thread only moves bytes: decoding, validation and every
decision stay on the engine thread.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

import zmq

log = logging.getLogger(__name__)
POLL_MS = 100  # longest the I/O thread blocks before checking whether it should stop


PEER = b"\x00peer!"  # the identity under which messages from the decode peer (a P node's D) arrive


class ApiServer:
    """Listens on tcp://host:port; `inbox` holds (client identity, message bytes). With a
    `peer` address (a prefill node's decode node) it also keeps a DEALER connected there:
    its messages arrive with identity PEER, and `send(PEER, ...)` goes to it."""

    def __init__(self, host: str, port: int, wake: Callable[[], None], peer: str = ""):
        self.address = f"tcp://{host}:{port}"
        self.inbox: deque[tuple[bytes, bytes]] = deque()
        self._wake = wake
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished client: drop, never block
        self._router.setsockopt(zmq.SNDHWM, 0)  # a slow client queues; a ROUTER drops past its HWM
        try:
            self._router.bind(self.address)
        except zmq.ZMQError as e:
            self._ctx.destroy(linger=0)
            raise OSError(f"client API cannot listen on {self.address}: {e}") from None
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(f"inproc://answers-{id(self)}")
        self._push = self._ctx.socket(zmq.PUSH)  # used by the engine thread only
        self._push.connect(f"inproc://answers-{id(self)}")
        self._dealer = None
        if peer:
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(peer)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="api-io", daemon=True)
        self._thread.start()
        log.info("client API listening on %s", self.address)

    def send(self, client: bytes, data: bytes) -> None:
        """Queue an answer to `client` (engine thread only; never blocks on the network)."""
        self._push.send_multipart([client, data], copy=False)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        if self._dealer is not None:
            poller.register(self._dealer, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(POLL_MS):
                if sock is self._router:
                    self._receive()
                elif sock is self._dealer:
                    self._receive_peer()
                else:
                    self._forward()
        self._forward()  # answers queued before close still go out

    def _forward(self) -> None:
        while True:
            try:
                client, data = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if client == PEER and self._dealer is not None:
                try:
                    self._dealer.send(data, zmq.NOBLOCK)
                except zmq.Again:  # the peer is gone and its queue is full: P's timeouts fail the requests
                    log.warning("decode peer not reachable: a message to it was dropped")
            else:
                self._router.send_multipart([client, data])

    def _receive_peer(self) -> None:
        while True:
            try:
                data = self._dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.inbox.append((PEER, data))
        self._wake()

    def _receive(self) -> None:
        got = False
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2 or not frames[0]:
                log.warning("dropped a client message of %d frames (expected identity + 1)", len(frames))
                continue
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
