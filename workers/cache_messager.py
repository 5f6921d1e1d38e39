"""cache-messager[r]: the P->D transport of rank r (one process per rank, so each rank's share of
the KV heads travels in parallel).

On both sides it opens the configured transport (workers/transports/base.py) over its rank's
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

from kvrt.ipc import protocol as P
from kvrt.ipc.topology import Topology

from kvrt.workers.child import Child, run_child
from kvrt.workers.kv_pool import attach_pools
from kvrt.workers.transports.base import Endpoint, TransferError
from kvrt.workers.transports.factory import open_transport

log = logging.getLogger("kvrt.workers.cache_messager")


class CacheMessager:
    def __init__(self, child: Child):
        self.child = child
        cfg, reg, rank = child.cfg, child.reg, child.rank
        self.rank = rank
        self.device, self.host = attach_pools(reg, rank, cfg)
        # a write must end before the engine gives up on it (and so before D's lease ends)
        options = {"timeout_s": cfg.rank_timeout} if cfg.pd_transport == "mooncake" else {}
        host = advertised_host(cfg.host, peer_addresses(cfg.decode_peer))
        log.info("rank %d publishes %s to its P/D peers", rank, host)
        self.transport = open_transport(cfg.pd_transport, self.device,
                                        Endpoint(cfg.node, rank, host=host,
                                                 bind=host if cfg.decode_peer else cfg.host,
                                                 instance=f"{reg.owner_pid}:{reg.owner_start_ms}"),
                                        **options)
        me, topo = (P.ROLE_MESSAGER, rank), Topology.of(cfg)
        [self.orders], [self.answers] = topo.receivers(reg, me), topo.senders(reg, me)

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


_WILDCARDS = ("", "0.0.0.0", "::", "*")


def peer_addresses(decode_peer: str) -> list[tuple[str, int]]:
    """(host, port) of each decode node in `--decode-peer` (tcp://HOST:PORT, comma-separated);
    entries that do not parse are left out (the launcher refused them already)."""
    out = []
    for item in decode_peer.split(","):
        host, _, port = item.strip().removeprefix("tcp://").rpartition(":")
        if host and port.isdigit():
            out.append((host.strip("[]"), int(port)))
    return out


def advertised_host(host: str, peers: list[tuple[str, int]]) -> str:
    """The address this rank's transport publishes (and binds) for its P/D peers.

    A prefill node (`peers`: its decode nodes) uses the local address of its route to the
    first decode node: its `--host` serves clients and is often loopback, which says nothing
    about the interface D's traffic comes in on. A decode node uses `--host`; with a wildcard
    it publishes its hostname's address only if that address is on one of its own interfaces
    and not loopback (a hostname mapped to 127.0.0.1, or resolving to an address of another
    network namespace, would send every P to the wrong place), else the first non-loopback
    IPv4 address of an interface that is up."""
    for peer in peers[:1]:
        if (local := _route_source(*peer)) is not None:
            return local
    if host not in _WILDCARDS:
        return host
    local = _interface_addresses()
    try:
        named = socket.gethostbyname(socket.gethostname())
    except OSError:
        named = ""
    if named in local and not named.startswith("127."):
        return named
    if local:
        chosen = next(iter(local))
        log.warning("the hostname resolves to %s, not an address of this machine's interfaces: publishing %s "
                    "to P/D peers (give --host to choose)", named or "nothing", chosen)
        return chosen
    return named or "127.0.0.1"


def _route_source(host: str, port: int) -> str | None:
    """The local address the kernel picks to reach host:port (a UDP connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])
            return s.getsockname()[0]
    except (OSError, IndexError) as e:
        log.warning("no route to the decode node %s:%d (%s): publishing the --host address instead", host, port, e)
        return None


def _interface_addresses() -> dict[str, str]:
    """Non-loopback IPv4 addresses of the interfaces that are up -> interface name, in the
    order the system lists them."""
    import psutil

    up = {name for name, st in psutil.net_if_stats().items() if st.isup}
    return {a.address: name for name, addrs in psutil.net_if_addrs().items() if name in up
            for a in addrs if a.family == socket.AF_INET and not a.address.startswith("127.")}


def main(argv: list[str] | None = None) -> int:
    return run_child(P.ROLE_MESSAGER, CacheMessager, argv)


if __name__ == "__main__":
    sys.exit(main())
