"""Every rank's answers, read through the engine's one fan-in and handed to their handlers.

Why a class of its own: worker, cache-transfer and cache-messager ranks all answer through one
fan-in, so that the loop waits in one place. Reading what arrived within one turn and routing
each message by its type (the rest to the connector, whose ranks speak its own messages) is
the loop's "receive" half, kept apart from what any answer means.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from kvrt.ipc.channel import Receiver
from kvrt.ipc.errors import PeerDead, ProtocolError, WaitTimeout
from kvrt.ipc.fanin import FanIn
from kvrt.runtime.engine.stats import EngineStats
from kvrt.runtime.pd.connector import KVConnector

log = logging.getLogger("kvrt.engine")


class RankInbox:
    """The fan-in over the `receivers`' rings (in fan-in order) and a handler per message type.
    The fan-in reads bytes from whichever ring has some (it waits on their shared doorbell,
    which one channel end cannot); each record is decoded by the receiver of the ring it came
    from, so a message of a type its channel does not carry is refused like an undecodable one."""

    def __init__(self, fan: FanIn, receivers: list[Receiver], handlers: dict[type, Callable[[object], None]],
                 connector: KVConnector, stats: EngineStats):
        self.fan = fan
        self.receivers = receivers
        self.handlers = handlers
        self.connector = connector
        self.stats = stats

    def wait(self, timeout: float) -> list[tuple[int, bytes]]:
        """The ranks work: wait at most `timeout` for their answers; every answer there is."""
        got: list[tuple[int, bytes]] = []
        try:
            first = self.fan.get(timeout)
            if first is not None:
                got.append(first)
                got.extend(iter(self.fan.try_get, None))
        except WaitTimeout:
            pass
        except PeerDead as e:
            log.error("%s", e)  # the launcher notices the death too and stops the node
        return got

    def dispatch(self, records: list[tuple[int, bytes]]) -> None:
        """Each answer to its handler, in the order they arrived."""
        for idx, rec in records:
            self._on_record(rec, self.receivers[idx])

    def _on_record(self, rec: bytes, receiver: Receiver) -> None:
        try:
            msg = receiver.decode(rec)
        except ProtocolError as e:
            receiver.ring.report_protocol_error(log, e)
            self.stats.count("protocol_errors")
            return
        handler = self.handlers.get(type(msg))
        if handler is not None:
            handler(msg)
        elif not self.connector.on_rank_message(msg):
            log.warning("unexpected %s on %s", type(msg).__name__, receiver.name)
