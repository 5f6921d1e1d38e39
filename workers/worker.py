"""worker[r]: the model runner of rank r. It reads and writes only its rank's device KV pool,
and only the blocks of the step batch the engine just sent it (the ownership rule).

This process joins the node, maps its device pool and serves its ring; step batches arrive
with the engine and model (issue: engine and worker)."""
from __future__ import annotations

import argparse
import logging
import sys

from ipc import protocol as P
from ipc.errors import ChannelClosed, ProtocolError, WaitTimeout
from ipc.member import Member
from ipc.ring import Consumer, Producer

log = logging.getLogger("kvrt.worker")
TICK_S = 0.5


def serve(member: Member) -> int:
    reg = member.reg
    orders = Consumer.attach(reg, P.to_worker(member.rank))
    answers = Producer.attach(reg, P.from_worker(member.rank))
    member.set_ready()
    try:
        while True:
            member.beat()
            try:
                rec = orders.get(TICK_S)
            except WaitTimeout:
                if why := member.orphaned():
                    log.error("exiting: %s", why)
                    return 1
                continue
            except ChannelClosed:
                return 0
            try:
                msg = P.PROTOCOL.decode(rec)
            except ProtocolError as e:
                orders.count_protocol_error()
                log.warning("bad message: %s", e)
                continue
            if isinstance(msg, P.Shutdown):
                log.info("%s stopping: %s", member.name, msg.reason)
                return 0
            log.warning("unexpected %s", type(msg).__name__)
    finally:
        orders.detach()
        answers.detach()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.worker", description="kvrt worker process (started by kvrt launch)")
    p.add_argument("--node", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s worker[{args.rank}]: %(message)s")
    member = Member.join(args.node, P.ROLE_WORKER, args.rank)
    try:
        return serve(member)
    finally:
        member.leave()


if __name__ == "__main__":
    sys.exit(main())
