"""The "mooncake" P->D transport: the Mooncake Transfer Engine, TCP (default) or RDMA, in P2P
handshake mode (no metadata server).

Each end runs one TransferEngine: `initialize(host, "P2PHANDSHAKE", protocol, device)`, which
opens a handshake (RPC) port, `get_rpc_port()`, and its pool registered once as a whole with
`register_memory(base, nbytes)`. The receiver's descriptor carries its session "host:port" and
the pool's base address; a write is one `transfer_submit_write(session, src, dst, len)` per run
of consecutive blocks, at most _WINDOW runs in flight, each polled with
`transfer_check_status(batch)` until confirmed.

Why submit + poll rather than `batch_transfer_sync_write`: the sync call busy-polls the batch
status in the calling thread until done (a full core), which on a small machine starves the
engine's own I/O threads. Sleeping between polls, sized to the bytes still outstanding, costs
~0.03 of a core and measured 1.5-2.5x the throughput on 2 cores (`kvrt bench pd`: 0.47-0.56 of
a raw socket with the sync call, 0.75-0.86 this way, back to back). It also lets this module
bound the wait itself. Why one run per batch id: `batch_transfer_async_write` puts many under
one id, but `transfer_check_status` reads only the batch's first transfer (a 256-run batch read
as done before any of its bytes landed) and `get_batch_transfer_status` busy-waits a core.

What the Python binding does, and what this module does about it:
- Errors are return codes, never exceptions: initialize / register / unregister return 0 or
  negative; a failed submit returns batch id 0; a status is 1 done, 0 pending, -1 failed,
  -2 timed out. Every one is checked; any failure is a TransferError naming the peer.
- A batch id is a pointer the engine frees once its status is read as done or failed: it is
  never polled again after that.
- The engine queues at most MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (1024) transfers per peer;
  with 3000 runs submitted at once most were never confirmed (20 s), hence the window.
- First contact with a session does a handshake over a fresh TCP connection; to a process that
  accepts but never answers (stopped, hung, not Mooncake) it waits ~60 s. So the first write
  to a session probes it (`send_probe`, which releases the GIL) in a helper thread, bounded by
  `connect_timeout_s`. Writes are bounded by `timeout_s`; on expiry the unconfirmed runs are
  abandoned (they may still land until the connection breaks) and close() waits briefly for
  them.
- Anyone who reaches the engine's ports can write into the registered pool: Mooncake has no
  authentication. The pool's session and base address travel only inside kvrt's authenticated
  peer session, and the engine is asked to bind the node's `--host` (MC_TCP_BIND_ADDRESS);
  builds that ignore it (0.3.x: they listen on every interface whatever `host` says) are
  reported in the log (`wide_open`): firewall those ports or run PD pairs on a trusted network.
- It logs through glog to stderr; MC_LOG_LEVEL defaults to ERROR here (set it to INFO to see
  the handshakes).
- The non-CUDA wheel cannot touch GPU memory: a CuPy pool needs the CUDA build.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

import numpy as np

from kvrt.ipc.ports import WILDCARDS, listening_wider_than

from kvrt.workers.backend import Pool
from kvrt.workers.transports.base import (Endpoint, TransferError, Transport, TransportUnavailable, check_descriptor,
                        check_same_layout, plan_runs)

log = logging.getLogger(__name__)

INSTALL_HINT = ('install it with `pip install -e ".[pd]"` (the mooncake-transfer-engine-non-cuda wheel; '
                "`pip install mooncake-transfer-engine` on CUDA machines) and "
                "`apt-get install libibverbs1 librdmacm1 libnuma1` (needed even for TCP)")
PROTOCOLS = ("tcp", "rdma")
_DONE, _PENDING, _FAILED, _TIMED_OUT = 1, 0, -1, -2
_NAP_MIN_S, _NAP_MAX_S = 50e-6, 2e-3  # sleep between status polls, sized to the bytes left
_RATE_GUESS = 8e9  # bytes/s
_WINDOW = 256      # runs in flight per write
_CLOSE_GRACE_S = 2.0
# Engines whose helper thread may still be inside a handshake at close(): destroying the C++
# engine under that thread would crash the process, so they are kept until it exits.
_PARKED: list[Any] = []


def load_engine_module():
    """`mooncake.engine`, or TransportUnavailable with what to install."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        import mooncake.engine as engine
    except ImportError as e:
        raise TransportUnavailable(f"the mooncake transport needs the Mooncake Transfer Engine, which "
                                   f"does not import here ({e}); {INSTALL_HINT}") from None
    return engine


def unavailable_reason() -> str | None:
    """Why the mooncake transport cannot run here, or None if it can."""
    try:
        load_engine_module()
    except TransportUnavailable as e:
        return str(e)
    return None


def pool_pointer(pool: Pool) -> int:
    """Address of block 0 of `pool` (host address, or device address of a CuPy pool)."""
    arr = pool.array
    if hasattr(arr, "__cuda_array_interface__"):
        return int(arr.data.ptr)
    return int(arr.ctypes.data)


def _bad_batch(bid: int) -> bool:
    return bid <= 0 or bid >= 1 << 63  # 0 (or -1 seen unsigned) means the submit failed


class MooncakeTransport(Transport):
    name = "mooncake"

    def __init__(self, pool: Pool, local: Endpoint, protocol: str = "tcp", device: str = "",
                 timeout_s: float = 30.0, connect_timeout_s: float = 5.0):
        super().__init__(pool, local)
        if protocol not in PROTOCOLS:
            raise ValueError(f"mooncake transport: protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
        mod = load_engine_module()
        on_gpu = hasattr(pool.array, "__cuda_array_interface__")
        if on_gpu and not getattr(mod, "SUPPORT_CUDA", False):
            raise TransportUnavailable(f"mooncake transport of {self.who}: pool {pool.name} is in GPU memory "
                                       f"and this Mooncake build has no CUDA support; "
                                       f"`pip install mooncake-transfer-engine` (the CUDA build)")
        self.protocol = protocol
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.host = local.host
        bind = local.bind or self.host
        if bind not in WILDCARDS:
            os.environ["MC_TCP_BIND_ADDRESS"] = bind  # honoured by builds that support it
        self._engine = mod.TransferEngine()
        rc = self._engine.initialize(self.host, "P2PHANDSHAKE", protocol, device)
        if rc != 0:
            raise TransferError(f"mooncake transport of {self.who}: the engine did not start on {self.host} "
                                f"({protocol}{', devices ' + device if device else ''}): initialize returned {rc}")
        self.port = int(self._engine.get_rpc_port())
        self.wide_open = listening_wider_than(bind)
        if self.wide_open:
            log.warning("mooncake transport of %s: this Mooncake build listens on %s although the node is "
                        "configured for %s (it has no option to bind one interface); anyone who reaches those "
                        "ports can write into the registered pool: firewall them", self.who,
                        ", ".join(self.wide_open), bind)
        self.session = f"{self.host}:{self.port}"
        self.base = pool_pointer(pool)
        self.nbytes = int(pool.array.nbytes)
        location = f"cuda:{pool.array.device.id}" if on_gpu else "*"  # "*": the engine finds the NUMA node
        rc = self._engine.register_memory(self.base, self.nbytes, location)
        if rc != 0:
            self._engine = None
            raise TransferError(f"mooncake transport of {self.who}: registering pool {pool.name} "
                                f"({self.nbytes} bytes at {self.base:#x}) failed with {rc}")
        self._known: set[str] = set()       # sessions that answered a probe
        self._probes: list[threading.Thread] = []
        self._abandoned: list[int] = []     # batch ids given up on after a timeout

    def descriptor(self) -> dict:
        return {"transport": self.name, "node": self.local.node, "rank": self.local.rank,
                "session": self.session, "protocol": self.protocol, "base": self.base, "nbytes": self.nbytes,
                **self.layout()}

    # ---- writing ---------------------------------------------------------------------------
    def write_blocks(self, peer: dict, src_ids: np.ndarray, dst_ids: np.ndarray,
                     deadline: float | None = None) -> int:
        self._check_open()
        p = check_descriptor(peer, self.name, ("session", "base", "nbytes", "block_bytes", "num_blocks"))
        session = str(p["session"])
        who = f"node {p.get('node', '?')} rank {p.get('rank', '?')} at {session}"
        if p.get("protocol", self.protocol) != self.protocol:
            raise TransferError(f"mooncake transport: {who} speaks {p['protocol']}, {self.who} {self.protocol}")
        check_same_layout(self.layout(), f"{self.who} ({self.pool.name})", p, who)
        base, nbytes, bb = int(p["base"]), int(p["nbytes"]), self.pool.block_bytes
        if int(p["num_blocks"]) * bb > nbytes:
            raise TransferError(f"descriptor of {who} is inconsistent: {p['num_blocks']} blocks of {bb} bytes "
                                f"do not fit its {nbytes}-byte registration")
        runs, n = plan_runs(src_ids, dst_ids, self.pool.num_blocks, int(p["num_blocks"]), who)
        if not runs:
            return 0
        give_up = time.monotonic() + self.timeout_s
        self._connect(session, who)
        submit = self._engine.transfer_submit_write
        check = self._engine.transfer_check_status
        window: list[tuple[int, int]] = []  # (batch id, bytes) submitted, not yet confirmed
        failed = unconfirmed = 0
        submit_error = ""
        left = n * bb
        nxt = 0
        while nxt < len(runs) or window:
            # keep at most _WINDOW runs in flight: the engine's per-peer queue is bounded
            # (runs beyond it measured never to complete)
            while nxt < len(runs) and len(window) < _WINDOW and not submit_error:
                if deadline is not None and time.monotonic() >= deadline:  # D may reuse the blocks now
                    submit_error = (f"the order expired before run {nxt + 1} of {len(runs)} was submitted "
                                    f"(the peer may have reused its blocks)")
                    break
                s, d, k = runs[nxt]
                bid = submit(session, self.base + s * bb, base + d * bb, k * bb)
                if _bad_batch(bid):
                    submit_error = f"submitting run {nxt + 1} of {len(runs)} ({k} blocks to block {d}) was refused"
                    break
                window.append((bid, k * bb))
                nxt += 1
            if submit_error:
                nxt = len(runs)  # submit nothing more; confirm what is in flight, then fail
            if not window:
                break
            bid, size = window[0]
            st = check(bid)
            if st == _PENDING:
                if time.monotonic() > give_up:
                    self._abandoned += [b for b, _ in window]
                    unconfirmed = len(window) + len(runs) - nxt
                    break
                time.sleep(min(_NAP_MAX_S, max(_NAP_MIN_S, left / _RATE_GUESS)))
                continue
            window.pop(0)
            left -= size
            if st != _DONE:
                failed += 1
                if st != _FAILED:
                    self._abandoned.append(bid)  # timed-out ids are not freed by the engine
        if submit_error or failed or unconfirmed:
            self._known.discard(session)  # probe it again before the next write
            what = submit_error or (f"{failed} of {len(runs)} runs failed (refused by the peer, e.g. a stale "
                                    f"descriptor, or the connection broke)" if failed else
                                    f"{unconfirmed} of {len(runs)} runs not confirmed within {self.timeout_s:g}s")
            raise TransferError(f"mooncake write of {n} blocks from {self.who} to {who} failed: {what} "
                                f"({self._diagnose(session)})")
        return n * bb

    def _connect(self, session: str, who: str) -> None:
        """First contact with `session`: a probe in a helper thread, bounded by connect_timeout_s."""
        if session in self._known:
            return
        self._probes = [t for t in self._probes if t.is_alive()]
        result: list[int] = []
        engine = self._engine

        def probe() -> None:
            result.append(engine.send_probe(session))

        t = threading.Thread(target=probe, name=f"mooncake-probe-{session}", daemon=True)
        t.start()
        t.join(self.connect_timeout_s)
        if t.is_alive():
            self._probes.append(t)
            raise TransferError(f"mooncake handshake with {who} got no answer within {self.connect_timeout_s:g}s "
                                f"({self._diagnose(session)}; something accepts connections there but does "
                                f"not answer: a stopped or hung process, or not a Mooncake engine)")
        if result[0] != 0:
            raise TransferError(f"mooncake handshake with {who} failed with {result[0]} "
                                f"({self._diagnose(session)})")
        self._known.add(session)

    @staticmethod
    def _diagnose(session: str) -> str:
        """One plain TCP connect to the session's handshake port, to say which side is wrong."""
        host, _, port = session.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                return f"{session} accepts connections"
        except (OSError, ValueError) as e:
            return f"nothing answers at {session}: {e}"

    # ---- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        engine, self._engine = self._engine, None
        if engine is None:
            return
        deadline = time.monotonic() + _CLOSE_GRACE_S
        pending = self._abandoned
        while pending and time.monotonic() < deadline:
            pending = [b for b in pending if engine.transfer_check_status(b) == _PENDING]
            if pending:
                time.sleep(1e-3)
        for t in self._probes:
            t.join(max(0.0, deadline - time.monotonic()))
        probes = sum(t.is_alive() for t in self._probes)
        rc = engine.unregister_memory(self.base)
        if rc != 0:
            log.warning("mooncake transport of %s: unregistering pool %s returned %d", self.who, self.pool.name, rc)
        if pending or probes:
            # A thread or a transfer may still be inside the engine: keep it alive (the process
            # exit ends it) rather than destroy it under their feet.
            log.warning("mooncake transport of %s: closed with %d transfers and %d handshakes still in "
                        "flight; its engine is kept until the process exits", self.who, len(pending), probes)
            _PARKED.append(engine)
        self._probes = []
        self._abandoned = []
