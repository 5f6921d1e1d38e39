"""The life of a child process of a node, shared by every role in workers/.

A child is started by the launcher as the program `kvrt.workers.<role> --node NAME --rank R
--log-level L`, run as `python -m` would but without the working directory on sys.path (no
fork, nothing pickled; `runtime.node.supervisor.child_command`). It joins the node through
`ipc.member.Member` (PROCS row, HEARTBEAT, READY), serves, and leaves cleanly however it stops: an order
(Shutdown), a closed ring, SIGTERM (also what PR_SET_PDEATHSIG sends when the launcher dies),
or orphanhood.

It must never outlive its node: if the engine or the launcher is gone, nobody will send it an
order or unlink its memory, so it exits once either has been gone for ORPHAN_GRACE_S. `tick()`
is cheap enough for every loop iteration: it beats, and looks at other processes only every
CHECK_EVERY_S (a psutil look costs ~50 us).
"""
from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from kvrt.ipc.log_limit import limit_logs
from kvrt.ipc import protocol
from kvrt.ipc.channel import Receiver, Sender
from kvrt.ipc.config import NodeConfig
from kvrt.ipc.errors import ChannelClosed, IpcError, PeerDead, ProtocolError, RingCorrupt, WaitTimeout
from kvrt.ipc.member import Member
from kvrt.ipc.registry import Registry

log = logging.getLogger(__name__)

ORPHAN_GRACE_S = 2.0
CHECK_EVERY_S = 0.5
WAIT_S = 0.2  # longest ring wait between heartbeats and orphan checks
EXIT_OK, EXIT_FAILED, EXIT_ORPHAN = 0, 1, protocol.EXIT_ORPHAN


class Orphaned(IpcError):
    """The engine or the launcher is gone: nobody will send orders or unlink our memory."""


class Terminated(BaseException):
    """SIGTERM or SIGINT came. A BaseException so that no `except Exception` swallows it."""


@dataclass
class StopSignals:
    """SIGTERM and SIGINT ask for a stop between tasks, never in the middle of one.

    The handler only records the signal, and the main thread blocks both signals, so they are
    delivered to another thread (a helper parked for that) and never interrupt the main
    thread's semaphore waits, which posix_ipc would turn into an exception from inside a ring
    wait. CPython runs the handler in the main thread at its next bytecode, and the serving
    loop sees `requested` at its next tick (<= one ring wait slice)."""

    requested: threading.Event = field(default_factory=threading.Event)
    name: str = ""

    def start(self) -> "StopSignals":
        sigs = {signal.SIGTERM, signal.SIGINT}
        for s in sigs:
            signal.signal(s, self._record)
        threading.Thread(target=self.requested.wait, name="signals", daemon=True).start()
        signal.pthread_sigmask(signal.SIG_BLOCK, sigs)  # after the helper started: it keeps them open
        return self

    def _record(self, signum: int, frame: object) -> None:
        self.name = signal.Signals(signum).name
        self.requested.set()


@dataclass
class Child:
    """This process's membership plus the orphan watch with its grace period."""

    member: Member
    stop: StopSignals
    _gone_since: float | None = None
    _next_check: float = 0.0

    @property
    def reg(self) -> Registry:
        return self.member.reg

    @property
    def cfg(self) -> NodeConfig:
        return self.member.config

    @property
    def rank(self) -> int:
        return self.member.rank

    @property
    def name(self) -> str:
        return self.member.name

    def beat(self) -> None:
        self.member.beat()

    def set_ready(self) -> None:
        self.member.set_ready()

    def tick(self) -> None:
        """Beat; raise Terminated once SIGTERM/SIGINT came; at most every CHECK_EVERY_S, raise
        Orphaned once the engine or the launcher has been gone for ORPHAN_GRACE_S."""
        self.member.beat()
        if self.stop.requested.is_set():
            raise Terminated(self.stop.name)
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_EVERY_S
        why = self.member.orphaned()
        if not why:
            self._gone_since = None
            return
        if self._gone_since is None:
            self._gone_since = now
        if now - self._gone_since >= ORPHAN_GRACE_S:
            raise Orphaned(f"{why} (for {now - self._gone_since:.1f}s)")

    def answer(self, answers: Sender, msg: Any) -> None:
        """Publish `msg`; a full ring waits (never drops) while this process stays a member."""
        while True:
            try:
                answers.put(msg, WAIT_S)
                return
            except WaitTimeout:
                self.tick()

    def serve_orders(self, orders: Receiver, answers: Sender, handlers: dict[type, Callable[[Any], Any]]) -> int:
        """Until Shutdown: take each order (beating and watching for orphanhood meanwhile), run
        the handler of its type and publish what it returns. A malformed order, or one of a type
        this role does not take, is counted on the ring and skipped; a handler may refuse an
        order the same way by raising ProtocolError."""
        while True:
            self.tick()
            try:
                rec = orders.ring.get(WAIT_S)
            except WaitTimeout:
                continue
            try:
                msg = orders.decode(rec)
                if isinstance(msg, protocol.Shutdown):
                    log.info("shutdown ordered (%s)", msg.reason or "no reason given")
                    return EXIT_OK
                handler = handlers.get(type(msg))
                if handler is None:
                    raise ProtocolError(f"unexpected {type(msg).__name__} on {orders.name}")
                reply = handler(msg)
            except ProtocolError as e:
                orders.ring.report_protocol_error(log, e)
                continue
            self.answer(answers, reply)


class Server(Protocol):
    """What a role's process is: built from its Child, then `serve()` until stopped; `close()`
    always runs after."""

    def serve(self) -> int: ...

    def close(self) -> None: ...


def parse_args(role: int, argv: list[str] | None) -> argparse.Namespace:
    name = protocol.ROLE_NAMES[role]
    p = argparse.ArgumentParser(prog=f"python -m workers.{name.replace('-', '_')}",
                                description=f"kvrt {name} process of one rank (started by kvrt launch)")
    p.add_argument("--node", required=True, help="node name (its registry is kvrt.NODE.registry)")
    p.add_argument("--rank", type=int, required=True, help="tensor-parallel rank")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return p.parse_args(argv)


def setup_logging(tag: str, level: str) -> None:
    """One line per record on stderr, tagged with the process (the launcher decides where a
    child's stderr goes: the terminal or --log-dir)."""
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s {tag} %(name)s: %(message)s")
    limit_logs()  # a flood of bad input (a P/D peer's) is not a flood of log lines


def run_child(role: int, make: Callable[[Child], Server], argv: list[str] | None = None) -> int:
    """Parse the command line, join the node, build the role's server and serve, and leave
    cleanly (server closed, READY lowered) whatever happened. Returns the exit status: EXIT_OK for an ordered stop
    (Shutdown, a closed ring, SIGTERM), EXIT_ORPHAN when the engine or the launcher is gone,
    EXIT_FAILED when joining or serving failed."""
    args = parse_args(role, argv)
    tag = f"{protocol.ROLE_NAMES[role]}[{args.rank}]"
    setup_logging(tag, args.log_level)
    stop = StopSignals().start()
    try:
        member = Member.join(args.node, role, args.rank)
    except (IpcError, KeyError, ValueError) as e:
        log.error("cannot join node %s: %s", args.node, e)
        return EXIT_FAILED
    try:
        server = make(Child(member, stop))
        try:
            return server.serve()
        finally:
            server.close()
    except Terminated as e:
        log.info("stopping: %s", e)
        return EXIT_OK
    except RingCorrupt as e:  # before ChannelClosed: a broken ring is a failure, not a stop
        log.error("exiting: %s", e)
        member.record_error(str(e))
        return EXIT_FAILED
    except ChannelClosed as e:
        log.info("stopping: %s (the node is shutting down)", e)
        return EXIT_OK
    except (Orphaned, PeerDead) as e:
        log.error("orphaned, exiting: %s", e)
        member.record_error(f"orphaned: {e}")
        return EXIT_ORPHAN
    except Exception as e:
        log.exception("%s failed", tag)
        member.record_error(f"{type(e).__name__}: {e}")
        return EXIT_FAILED
    finally:
        member.leave()
