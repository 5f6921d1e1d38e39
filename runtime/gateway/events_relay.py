"""The gateway's half of the KV events: the public PUB and replay ports, forwarded to and from
the engine's private sockets by libzmq's own proxy (runtime/cache/events.py says what the events
and the replay are).

Why libzmq's proxy here, and no Python per message: nothing in these two relays needs to learn
from a failed send (a subscriber that does not keep up loses batches and sees the gap; a replay
answer for a subscriber that left is dropped), so each is one `zmq_proxy_steerable` in a thread
of its own, the events an XPUB (public) over an XSUB (the engine's PUB: subscriptions go up, so
the engine publishes only while someone listens), the replay a ROUTER (public) over a DEALER
(the engine's ROUTER sees the DEALER's identity first, then the subscriber's). With the node's
secret the public sockets are CURVE servers that admit its holders only, the ZAP handler on a
context of this relay's own (runtime/cache/event_secret.py); the engine still blinds the keys.
"""
from __future__ import annotations

import logging
import threading

import zmq

from kvrt.runtime.cache.event_secret import EventSecret
from kvrt.runtime.cache.events import CURVE_MAXMSGSIZE, REPLAY_MAXMSGSIZE, SNDHWM
from kvrt.runtime.node.limits import ZMQ_HANDSHAKE_MS

log = logging.getLogger(__name__)
STOP_S = 2.0  # longest wait for a proxy thread to end once told


class EventsRelay:
    """PUB on tcp://host:port and replay on port + 1, relayed to the engine's private events and
    replay sockets at `events_address` and `replay_address`."""

    def __init__(self, host: str, port: int, events_address: str, replay_address: str,
                 secret: EventSecret | None = None):
        self._ctx = zmq.Context()
        self._auth = secret.authenticator(self._ctx) if secret is not None else None
        self._threads: list[tuple[threading.Thread, zmq.Socket]] = []
        sockets: list[zmq.Socket] = []
        try:
            pub, up = self._socket(zmq.XPUB, sockets), self._socket(zmq.XSUB, sockets)
            front, back = self._socket(zmq.ROUTER, sockets), self._socket(zmq.DEALER, sockets)
            for s in (pub, front):
                s.setsockopt(zmq.HANDSHAKE_IVL, ZMQ_HANDSHAKE_MS)
                s.setsockopt(zmq.SNDHWM, SNDHWM)
                if secret is not None:
                    secret.serve(s)
            # a replay request is one 8-byte number: anything larger is cut off before it is
            # buffered (CURVE's handshake commands count too)
            front.setsockopt(zmq.MAXMSGSIZE, REPLAY_MAXMSGSIZE if secret is None else CURVE_MAXMSGSIZE)
            pub.bind(f"tcp://{host}:{port}")
            front.bind(f"tcp://{host}:{port + 1}")
            up.connect(events_address)
            back.connect(replay_address)
        except zmq.ZMQError as e:
            for s in sockets:
                s.close(0)
            self._stop_auth()
            self._ctx.term()
            raise OSError(f"--kv-events-port: cannot bind {host}:{port} and {port + 1}: {e}") from None
        self._start("kv-events", up, pub)
        self._start("kv-replay", front, back)
        log.info("KV events on tcp://%s:%d, replay on %d", host, port, port + 1)

    def _socket(self, kind: int, made: list[zmq.Socket]) -> zmq.Socket:
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        made.append(s)
        return s

    def _start(self, name: str, frontend: zmq.Socket, backend: zmq.Socket) -> None:
        """Run libzmq's proxy between the two sockets in a thread, steered by an inproc pair
        (the sockets are the thread's alone from now on)."""
        address = f"inproc://{name}-{id(self)}"
        control = self._ctx.socket(zmq.PAIR)
        control.bind(address)
        steer = self._ctx.socket(zmq.PAIR)
        steer.connect(address)

        def run() -> None:
            try:
                zmq.proxy_steerable(frontend, backend, None, steer)
            except zmq.ZMQError as e:
                log.error("%s relay ended: %s", name, e)
            finally:
                for s in (frontend, backend, steer):
                    s.close(0)

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self._threads.append((thread, control))

    def close(self) -> None:
        for thread, control in self._threads:
            control.send(b"TERMINATE")
            thread.join(STOP_S)
            if thread.is_alive():
                log.warning("the %s relay did not stop within %g s", thread.name, STOP_S)
            control.close(0)
        self._threads = []
        self._stop_auth()
        self._ctx.destroy(linger=0)

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
