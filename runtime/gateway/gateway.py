"""The gateway process: every socket of the node that outsiders reach, relayed to the engine.

Why a process of its own: libzmq 4.3 aborts the process that reads a hostile peer's bytes
(runtime/engine/server.py says how), and nothing inside a process prevents it. This process holds
no node state (no block, request or cache: only sockets and what is in flight through them), so
when it dies, nothing of the node goes with it.

Its life: the launcher starts it as it starts every child (`python -m kvrt.runtime.gateway.gateway
--node NAME`); it joins the node (ipc/member.py: its row, heartbeat and ready flag), binds the
public ports (a port in use fails the node's start, naming it), connects to the engine's private
sockets (ipc/sockets.py), and relays until SIGTERM, its node stopping once the engine is gone, or
its launcher or engine gone. When it dies or hangs once the node runs, the launcher logs why and
starts another after a back-off, counted in `kvrt status` (runtime/node/supervisor.py): the engine
and its requests live on. Clients reconnect (a ZeroMQ DEALER does so by itself); a request whose
answers were lost in the crash ends at its client, whose liveness check hears nothing for
api.LIVENESS_S and ends it with node_silent (runtime/client/client.py), and at the engine, whose
probes find the client gone (its connection went with the old gateway) and cancel it.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time

from kvrt.ipc import protocol as P
from kvrt.ipc import sockets
from kvrt.ipc.log_limit import limit_logs
from kvrt.ipc.member import Member
from kvrt.runtime.cache.event_secret import EventSecret
from kvrt.runtime.client import api
from kvrt.runtime.gateway.client_relay import ClientRelay
from kvrt.runtime.gateway.events_relay import EventsRelay

log = logging.getLogger("kvrt.gateway")
POLL_MS = 100  # the loop's longest wait: its heartbeat runs at least this often
STOPPING_POLL_MS = 10  # ... and once its node stops, so that it exits soon after the engine
CHECK_EVERY_S = 0.5  # how often it looks whether its launcher and engine are still there


class Gateway:
    """The relays the node's configuration asks for, and the loop that beats for them."""

    def __init__(self, member: Member, stop: threading.Event):
        self.member = member
        self.stop = stop
        cfg = member.config
        node = cfg.node
        self.clients: ClientRelay | None = None
        self.events: EventsRelay | None = None
        try:
            if cfg.port:
                self.clients = ClientRelay(cfg.host, cfg.port, sockets.address(node, sockets.LINK), cfg.decode_peer,
                                           max_message_bytes=api.max_message_bytes(cfg.max_model_len))
            if cfg.kv_events_port:
                secret = EventSecret.load(cfg.events_secret_file) if cfg.events_secret_file else None
                self.events = EventsRelay(cfg.host, cfg.kv_events_port, sockets.address(node, sockets.EVENTS),
                                          sockets.address(node, sockets.REPLAY), secret)
        except BaseException:
            self.close()
            raise

    def run(self) -> int:
        """Relay until told to stop; the exit status (EXIT_ORPHAN when the node went away)."""
        self.member.set_ready()
        next_check = 0.0
        while not self.stop.is_set():
            self.member.beat()
            stopping = self.member.stopping()
            wait_ms = STOPPING_POLL_MS if stopping else POLL_MS  # (a node's stop waits for this process)
            if self.clients is not None:
                self.clients.serve(wait_ms)
            else:
                self.stop.wait(wait_ms / 1000)
            if stopping and not self.member.engine_alive():
                log.info("the node stopped and its engine is gone: exiting")
                return 0
            if (now := time.monotonic()) < next_check:
                continue
            next_check = now + CHECK_EVERY_S
            if why := self.member.orphaned():
                log.error("exiting: %s", why)
                return P.EXIT_ORPHAN
        return 0

    def close(self) -> None:
        for relay in (self.clients, self.events):
            if relay is not None:
                relay.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvrt.runtime.gateway.gateway",
                                description="kvrt gateway process (started by kvrt launch)")
    p.add_argument("--node", required=True)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s gateway: %(message)s")
    limit_logs()  # a flood of bad input is not a flood of log lines
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    member = Member.join(args.node, P.ROLE_GATEWAY, 0)
    gateway = None
    try:
        gateway = Gateway(member, stop)
        return gateway.run()
    except Exception as e:  # the launcher reports the gateway's own words (a port in use, ...)
        log.exception("gateway failed")
        member.record_error(f"{type(e).__name__}: {e}")
        return 1
    finally:
        if gateway is not None:
            gateway.close()
        member.leave()


if __name__ == "__main__":
    sys.exit(main())
