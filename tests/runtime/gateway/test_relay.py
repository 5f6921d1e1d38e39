"""The gateway's client relay and the engine's socket, joined by the real private link in one
process (real ZeroMQ sockets: a public TCP port, the node's ipc:// directory), with the test as
the engine: identities both ways, what the gateway's sends find (a client gone, a message of
several frames), and the window: however much one client floods, the engine holds at most
INBOX_MAX of the gateway's messages, the link at most a window more, and another client's
message waits behind no more than those."""
from __future__ import annotations

import threading
import time

import pytest
import zmq

from kvrt.ipc.ports import free_port
from kvrt.ipc.sockets import LINK, address, make_socket_dir, remove_socket_dir
from kvrt.runtime.engine.server import FRAMES, GONE, INBOX_MAX, ApiServer
from kvrt.runtime.gateway import link
from kvrt.runtime.gateway.client_relay import ClientRelay

WAIT_S = 10.0


class Relay:
    """ApiServer (the engine's end) and ClientRelay (the gateway) on the node's private link,
    the relay served by a thread as the gateway process serves it."""

    def __init__(self, node: str):
        make_socket_dir(node)
        self.node = node
        self.woken = threading.Event()
        self.server = ApiServer(node, self.woken.set)
        self.port = free_port()
        self.gateway = ClientRelay("127.0.0.1", self.port, address(node, LINK))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self.ctx = zmq.Context()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self.gateway.serve(10)

    def client(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{self.port}")
        return s

    def take(self) -> tuple[bytes, bytes]:
        """The next message the engine would take in (waiting for the I/O thread to queue it)."""
        deadline = time.monotonic() + WAIT_S
        while not self.server.inbox:
            assert time.monotonic() < deadline, "no message reached the engine"
            time.sleep(0.001)  # a test standing in for the engine loop's wait
        return self.server.inbox.popleft()

    def notice(self, kind: str, timeout: float = WAIT_S):
        """The next notice of `kind` the engine would take in (None after `timeout` s)."""
        deadline = time.monotonic() + timeout
        while True:
            while self.server.notices:
                n = self.server.notices.popleft()
                if n.kind == kind:
                    return n
            if time.monotonic() > deadline:
                return None
            time.sleep(0.001)  # a test standing in for the engine loop's wait

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        self.ctx.destroy(linger=0)
        self.gateway.close()
        self.server.close()
        remove_socket_dir(self.node)


@pytest.fixture
def relay(node):
    r = Relay(node)
    yield r
    r.close()


def test_a_clients_message_and_its_answer_cross_the_relay(relay):
    c = relay.client()
    c.send(b"hello")
    client, data = relay.take()
    assert data == b"hello" and client[:1] == link.RELAYED and link.relayed(client)
    relay.server.send(client, b"answer")
    assert c.poll(int(WAIT_S * 1000)) and c.recv() == b"answer"
    c.send_multipart([b"a", b"b", b"c"])  # a message is one frame: the engine is told, not handed it
    n = relay.notice(FRAMES)
    assert n is not None and n.client == client and n.frames == 3


def test_a_client_gone_is_told_to_the_engine(relay):
    c = relay.client()
    c.send(b"hello")
    client, _ = relay.take()
    c.close(linger=0)
    deadline = time.monotonic() + WAIT_S
    while True:  # the engine probes it, as it probes every client with requests in flight
        relay.server.probe(client)
        if (n := relay.notice(GONE, timeout=0.1)) is not None:
            assert n.client == client
            return
        assert time.monotonic() < deadline, "the gateway never found the client gone"


def test_the_window_bounds_what_a_flood_puts_ahead_of_another_client(relay):
    flooder, good = relay.client(), relay.client()
    flood = 2000
    for i in range(flood):
        flooder.send(b"f%d" % i)
    deadline = time.monotonic() + WAIT_S
    while len(relay.server.inbox) < INBOX_MAX or relay.gateway.outstanding < link.WINDOW:
        assert time.monotonic() < deadline, (len(relay.server.inbox), relay.gateway.outstanding)
        time.sleep(0.001)  # the engine takes nothing: the inbox, then the window, fill up
    time.sleep(0.2)  # (and nothing more comes: the gateway stopped reading)
    assert len(relay.server.inbox) == INBOX_MAX and relay.gateway.outstanding == link.WINDOW
    good.send(b"good")
    time.sleep(0.2)  # it waits in the gateway's queue of its connection
    ahead, got = 0, []
    while True:
        _, data = relay.take()
        if data == b"good":
            break
        got.append(data)
        ahead += 1
    assert ahead <= INBOX_MAX + link.WINDOW + 1, ahead
    while len(got) < flood:  # ... and the flood itself arrives whole and in order
        got.append(relay.take()[1])
    assert got == [b"f%d" % i for i in range(flood)]
