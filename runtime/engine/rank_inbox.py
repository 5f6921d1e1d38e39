"""Every rank's answers, read through the engine's one fan-in and handed to their handlers.

Why a class of its own: worker, cache-transfer and cache-messager ranks all answer through one
fan-in, so that the loop waits in one place. Reading what arrived within one turn and routing
each message by its type (the rest to the connector, whose ranks speak its own messages) is
the loop's "receive" half, kept apart from what any answer means.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from kvrt.ipc import protocol as P
from kvrt.ipc.errors import PeerDead, ProtocolError, WaitTimeout
from kvrt.ipc.fanin import FanIn
from kvrt.ipc.ring import Consumer
from kvrt.runtime.engine.stats import EngineStats
from kvrt.runtime.pd.connector import KVConnector

log = logging.getLogger("kvrt.engine")


class RankInbox:
    """The fan-in over `rings` (in fan-in order) and a handler per message type."""

    def __init__(self, fan: FanIn, rings: list[Consumer], handlers: dict[type, Callable[[object], None]],
                 connector: KVConnector, stats: EngineStats):
        self.fan = fan
        self.rings = rings
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
            self._on_record(rec, self.rings[idx])

    def _on_record(self, rec: bytes, ring: Consumer) -> None:
        try:
            msg = P.PROTOCOL.decode(rec)
        except ProtocolError as e:
            ring.report_protocol_error(log, e)
            self.stats.count("protocol_errors")
            return
        handler = self.handlers.get(type(msg))
        if handler is not None:
            handler(msg)
        elif not self.connector.on_rank_message(msg):
            log.warning("unexpected %s on %s", type(msg).__name__, ring.name)
