"""worker[r]: the model runner of rank r. It reads and writes only its rank's device KV pool,
and only the blocks of the step batch the engine just sent it (the ownership rule).

This process joins the node, maps its device pool and serves its ring; step batches arrive
with the engine and model (the engine-and-worker issue)."""
from __future__ import annotations

import logging
import sys

from ipc import protocol as P
from ipc.errors import ProtocolError, WaitTimeout
from ipc.ring import Consumer, Producer

from .child import Child, run_child
from .kv_pool import attach_pools

log = logging.getLogger("workers.worker")
WAIT_S = 0.2  # longest ring wait between heartbeats and orphan checks


def serve(child: Child) -> int:
    device, host = attach_pools(child.reg, child.rank, child.cfg)
    orders = Consumer.attach(child.reg, P.to_worker(child.rank))
    answers = Producer.attach(child.reg, P.from_worker(child.rank))
    child.set_ready()
    try:
        while True:
            child.tick()
            try:
                rec = orders.get(WAIT_S)
            except WaitTimeout:
                continue
            try:
                msg = P.PROTOCOL.decode(rec)
            except ProtocolError as e:
                orders.count_protocol_error()
                log.warning("malformed message on %s skipped: %s", orders.name, e)
                continue
            if isinstance(msg, P.Shutdown):
                log.info("shutdown ordered (%s)", msg.reason or "no reason given")
                return 0
            log.warning("unexpected %s on %s", type(msg).__name__, orders.name)
    finally:
        answers.close()
        orders.detach()
        for pool in (device, host):
            if pool is not None:
                pool.close()


def main(argv: list[str] | None = None) -> int:
    return run_child(P.ROLE_WORKER, serve, argv)


if __name__ == "__main__":
    sys.exit(main())
