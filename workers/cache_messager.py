"""cache-messager[r]: the P->D transport of rank r (one process per rank, so each rank's share of
the KV heads travels in parallel).

On both sides it opens the configured transport (workers/transport.py) over its rank's
device pool and tells its engine how peers reach that pool (MessagerHello: the transport's
descriptor, which a D engine hands to P in the handshake). On a P node it then executes
SendBlocks orders: write these local blocks into those blocks of the D node's pool, and
answer with done or failed. Between the order and the answer, the source blocks are this
process's to read (P's engine holds the request, so nothing frees or rewrites them) and the
destination blocks on D are held under D's lease (nothing on D reads them before kv-ready) --
but only until the order's deadline: an order that waited too long (this process was paused,
the ring was full) is answered "expired" without touching a block, because by then P gave up
and D may have given the blocks to another request.

A failed write (D gone, unreachable, a bad id) is an answer with the reason, never an exit:
one bad peer fails its requests, not the node.
"""
from __future__ import annotations

import logging
import socket
import sys
import time

from ipc import protocol as P
from ipc.channel import Receiver, Sender

from .child import Child, run_child
from .kv_pool import attach_pools
from .transport import Endpoint, TransferError, open_transport

log = logging.getLogger("workers.cache_messager")


class CacheMessager:
    def __init__(self, child: Child):
        self.child = child
        cfg, reg, rank = child.cfg, child.reg, child.rank
        self.rank = rank
        self.device, self.host = attach_pools(reg, rank, cfg)
        # a write must end before the engine gives up on it (and so before D's lease ends)
        options = {"timeout_s": cfg.rank_timeout} if cfg.pd_transport == "mooncake" else {}
        self.transport = open_transport(cfg.pd_transport, self.device,
                                        Endpoint(cfg.node, rank, host=_reachable(cfg.host), bind=cfg.host,
                                                 instance=f"{reg.owner_pid}:{reg.owner_start_ms}"),
                                        **options)
        self.orders = Receiver.attach(reg, P.messager_orders(rank))
        self.answers = Sender.attach(reg, P.messager_answers(rank))

    def serve(self) -> int:
        self.child.answer(self.answers, P.MessagerHello(self.rank, self.transport.descriptor()))
        log.info("serving %s over the %s transport", self.orders.name, self.transport.name)
        self.child.set_ready()
        return self.child.serve_orders(self.orders, self.answers, {P.SendBlocks: self.send})

    def send(self, order: P.SendBlocks) -> P.SendDone:
        t0 = time.perf_counter()
        what = f"send {order.task_id} ({order.request_id}, {len(order.src_blocks)} blocks) from rank {self.rank}"
        try:
            if not isinstance(order.deadline, (int, float)) or isinstance(order.deadline, bool):
                raise TransferError(f"deadline {order.deadline!r} is not a time")
            if order.deadline and time.monotonic() >= order.deadline:
                raise TransferError(f"expired {time.monotonic() - order.deadline:.3g}s before it could start: "
                                    f"the decode node may have reused the blocks; nothing written")
            if not 0 <= self.rank < len(order.peers):
                raise TransferError(f"no peer descriptor for rank {self.rank} ({len(order.peers)} given)")
            nbytes = self.transport.write_blocks(order.peers[self.rank], order.src_blocks, order.dst_blocks,
                                                 deadline=order.deadline or None)
        except TransferError as e:
            log.warning("%s failed: %s", what, e)
            return P.SendDone(order.task_id, self.rank, False, 0, time.perf_counter() - t0, f"{what}: {e}")
        except Exception as e:  # an order must never take the process down
            log.exception("%s failed unexpectedly", what)
            return P.SendDone(order.task_id, self.rank, False, 0, time.perf_counter() - t0,
                              f"{what}: {type(e).__name__}: {e}")
        return P.SendDone(order.task_id, self.rank, True, nbytes, time.perf_counter() - t0)

    def close(self) -> None:
        self.answers.close()
        self.orders.detach()
        self.transport.close()
        for pool in (self.device, self.host):
            if pool is not None:
                pool.close()


def _reachable(host: str) -> str:
    """The address peers use to reach this machine: `host`, unless it is a wildcard (a node
    listening on every interface still has to publish one address that P can dial)."""
    if host in ("", "0.0.0.0", "::", "*"):
        return socket.gethostbyname(socket.gethostname())
    return host


def main(argv: list[str] | None = None) -> int:
    return run_child(P.ROLE_MESSAGER, CacheMessager, argv)


if __name__ == "__main__":
    sys.exit(main())
