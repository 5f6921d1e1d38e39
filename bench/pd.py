"""`kvrt bench pd`: how fast a prefill node's KV blocks reach a decode node's pool.

In one run, the same random (source, destination) block pairs between two real pools in
shared memory (P's and D's device pools, each in its own node registry), median over repeats:
- `memcpy`: one `np.copyto` of as many contiguous bytes: the memory bandwidth one thread gets,
  the ceiling on one machine;
- `shm`: the shm transport, as a cache-messager on D's machine runs it (maps D's pool through
  D's registry, one copy per run of consecutive blocks); target >= 0.7 of memcpy;
- `mooncake`: the Mooncake transport over TCP loopback to a receiver in another process (D's
  side: its pool registered with its own engine); target >= 0.8 of the raw socket;
- `socket`: what a hand-written transport would get: a plain Python TCP socket over loopback
  to the same receiver process, the destination ids in a header, then `sendall` of each block
  and `recv_into` its destination block, one ack at the end.

Every case is checked once (destination blocks zeroed, written, compared with the sources).
An end-to-end section (TTFT of a P+D pair against a mixed node) plugs in through `E2E_SECTIONS`.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from kvrt.bench import pd_e2e
from kvrt.ipc import protocol
from kvrt.ipc.layout import KVLayout
from kvrt.ipc.registry import Registry
from kvrt.workers.backend import NumpyBackend, Pool, create_shm_pool
from kvrt.workers.kv_pool import coalesce, fmt_bytes
from kvrt.workers.transports.base import Endpoint, TransferError
from kvrt.workers.transports.factory import open_transport

WAIT_S = 60.0
_HDR = struct.Struct("<q")
CASES = ("memcpy", "shm", "mooncake", "socket")
TARGETS = {"shm": ("memcpy", 0.7), "mooncake": ("socket", 0.8)}  # case: (baseline, least ratio)


@dataclass
class Row:
    case: str
    blocks: int
    runs: float          # copies per transfer after coalescing (mean)
    mib: float
    gb_s: float          # median
    gb_s_min: float
    gb_s_max: float
    vs_memcpy: float
    vs_socket: float | None = None
    target: str = ""
    ok: bool | None = None


def print_extra(rows: list[dict]) -> None:
    """A generic table for the end-to-end rows: one column per key, in first-seen order."""
    if not rows:
        return
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    cells = [[_cell(r.get(c)) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print()
    print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths))))
    for row in cells:
        print("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))))


def _cell(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


# ---- D's side: a receiver process --------------------------------------------------------
def serve(node: str) -> int:
    """The receiving node's process: its pool behind a Mooncake engine and a plain socket.
    Prints one JSON line (descriptor, socket port), serves until stdin closes."""
    reg = Registry.attach(node)
    pool = NumpyBackend().open_device_pool(reg, protocol.device_pool(0))
    info: dict = {}
    mc = None
    try:
        mc = open_transport("mooncake", pool, Endpoint(node, 0, host="127.0.0.1"))
        info["mooncake"] = mc.descriptor()
    except TransferError as e:
        info["mooncake_error"] = str(e)
    srv = socket.create_server(("127.0.0.1", 0))
    info["socket_port"] = srv.getsockname()[1]
    threading.Thread(target=_socket_receiver, args=(srv, pool), daemon=True).start()
    print(json.dumps(info), flush=True)
    sys.stdin.read()  # until the bench closes our stdin
    if mc is not None:
        mc.close()
    srv.close()
    pool.close()
    reg.close()
    return 0


def _socket_receiver(srv: socket.socket, pool: Pool) -> None:
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while True:
            head = _recv_exact(conn, _HDR.size)
            if head is None:
                return
            (n,) = _HDR.unpack(head)
            ids = np.frombuffer(_recv_exact(conn, 8 * n), dtype=np.int64)
            for b in ids.tolist():
                view = memoryview(pool.array[b]).cast("B")
                got = 0
                while got < len(view):
                    k = conn.recv_into(view[got:])
                    if not k:
                        return
                    got += k
            conn.sendall(b"k")


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = conn.recv_into(view[got:])
        if not k:
            return None
        got += k
    return bytes(buf)


def socket_send(conn: socket.socket, pool: Pool, src: np.ndarray, dst: np.ndarray) -> None:
    conn.sendall(_HDR.pack(len(dst)) + np.asarray(dst, dtype=np.int64).tobytes())
    arr = pool.array
    for b in src.tolist():
        conn.sendall(memoryview(arr[b]).cast("B"))
    if conn.recv(1) != b"k":
        raise RuntimeError("socket receiver closed the connection")


# ---- P's side: the bench ------------------------------------------------------------------
class Pair:
    """Two node registries with one device pool each (P's and D's), and D's receiver process."""

    def __init__(self, shape: tuple, dtype: str, tag: str):
        self.p_node, self.d_node = f"benchpdp{tag}", f"benchpdd{tag}"
        self.regs: list[Registry] = []
        self.pools: list[Pool] = []
        self.proc: subprocess.Popen | None = None
        try:
            for node in (self.p_node, self.d_node):
                reg = Registry.create(node)
                self.regs.append(reg)
                create_shm_pool(reg, protocol.device_pool(0), shape, dtype,
                                {"backend": "numpy", "tier": "device", "rank": 0})
                self.pools.append(NumpyBackend().open_device_pool(reg, protocol.device_pool(0)))
        except BaseException:
            self.close()
            raise
        self.p, self.d = self.pools

    def start_receiver(self) -> dict:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvrt.bench.pd", "--serve", self.d_node],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"receiver process exited with code {self.proc.wait(WAIT_S)} during start-up")
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        for pool in self.pools:
            pool.close()
        for reg in self.regs:
            reg.unlink_all()
        self.pools, self.regs = [], []


def fill_random(pool: Pool, seed: int) -> None:
    flat = pool.array.reshape(-1).view(np.uint8)
    rng = np.random.default_rng(seed)
    step = 64 << 20
    for i in range(0, flat.size, step):
        chunk = flat[i:i + step]
        chunk[:] = rng.integers(0, 256, chunk.size, dtype=np.uint8)


def _layout(args: argparse.Namespace) -> KVLayout:
    """The blocks both pools hold (all KV heads in one rank's pool)."""
    return KVLayout(args.num_layers, args.block_size, args.num_kv_heads, args.head_dim, np.dtype(args.dtype).name)


def measure(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    shape = _layout(args).pool_shape(args.pool_blocks)
    notes: list[str] = []
    pair = Pair(shape, args.dtype, str(os.getpid()))
    senders: list = []
    conn: socket.socket | None = None
    try:
        p, d = pair.p, pair.d
        n, bb = args.blocks, p.block_bytes
        fill_random(p, 1)
        remote = pair.start_receiver()
        shm_rx = open_transport("shm", d, Endpoint(pair.d_node, 0))
        senders.append(shm_rx)
        shm_tx = open_transport("shm", p, Endpoint(pair.p_node, 0))
        senders.append(shm_tx)
        shm_desc = shm_rx.descriptor()
        fns: dict[str, Callable[[np.ndarray, np.ndarray], object]] = {
            "memcpy": lambda s, t: np.copyto(d.array[:n], p.array[:n]),
            "shm": lambda s, t: shm_tx.write_blocks(shm_desc, s, t),
        }
        if "mooncake" in remote:
            mc_tx = open_transport("mooncake", p, Endpoint(pair.p_node, 0, host="127.0.0.1"),
                                   timeout_s=WAIT_S)
            senders.append(mc_tx)
            fns["mooncake"] = lambda s, t: mc_tx.write_blocks(remote["mooncake"], s, t)
        else:
            notes.append(f"mooncake: skipped: {remote.get('mooncake_error')}")
        conn = socket.create_connection(("127.0.0.1", remote["socket_port"]))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        fns["socket"] = lambda s, t: socket_send(conn, p, s, t)

        rng = np.random.default_rng(0)

        def pick() -> tuple[np.ndarray, np.ndarray]:
            return (rng.choice(args.pool_blocks, n, replace=False), rng.choice(args.pool_blocks, n, replace=False))

        # check each case once (memcpy is the contiguous copy, nothing to check), which also warms up
        for case, fn in fns.items():
            s, t = pick()
            if case == "memcpy":
                fn(s, t)
                continue
            d.array[t] = 0
            fn(s, t)
            if not np.array_equal(d.array[t].view(np.uint8), p.array[s].view(np.uint8)):
                raise RuntimeError(f"{case}: destination blocks differ from the sources")
        times: dict[str, list[float]] = {c: [] for c in fns}
        runs: list[int] = []
        for _ in range(args.repeat):  # round-robin, so drift hits every case alike
            s, t = pick()
            runs.append(len(coalesce(s, t)))
            for case, fn in fns.items():
                t0 = time.perf_counter()
                fn(s, t)
                times[case].append(time.perf_counter() - t0)
    finally:
        if conn is not None:
            conn.close()
        for tr in senders:
            tr.close()
        pair.close()
    nbytes = n * bb
    rates = {c: np.array([nbytes / x / 1e9 for x in ts]) for c, ts in times.items()}
    med = {c: float(np.median(r)) for c, r in rates.items()}
    rows = []
    for case in CASES:
        if case not in rates:
            continue
        r = rates[case]
        row = Row(case, n, float(np.mean(runs)) if case != "memcpy" else 1.0, nbytes / 2**20, med[case],
                  float(r.min()), float(r.max()), med[case] / med["memcpy"],
                  med[case] / med["socket"] if case in ("mooncake", "socket") else None)
        if case in TARGETS:
            base, least = TARGETS[case]
            row.target = f">= {least:.2f} of {base}"
            row.ok = med[case] / med[base] >= least
        rows.append(row)
    return rows, notes


def print_table(rows: list[Row], notes: list[str], args: argparse.Namespace, block_bytes: int) -> None:
    runs = next((r.runs for r in rows if r.case != "memcpy"), 0)
    print(f"{args.blocks} random blocks of {fmt_bytes(block_bytes)} per transfer ({runs:.0f} runs after "
          f"coalescing, {fmt_bytes(args.blocks * block_bytes)}), pools of {args.pool_blocks} blocks; median "
          f"(min-max) of {args.repeat}; GB/s = 1e9 bytes/s; mooncake and socket over TCP loopback to "
          f"another process")
    print(f"{'case':<9} {'GB/s':>7} {'min-max':>12} {'vs memcpy':>9} {'vs socket':>9}  target")
    for r in rows:
        vs_sock = f"{r.vs_socket:>9.2f}" if r.vs_socket is not None else f"{'-':>9}"
        verdict = "" if r.ok is None else ("  met" if r.ok else "  MISSED")
        print(f"{r.case:<9} {r.gb_s:>7.2f} {f'{r.gb_s_min:.2f}-{r.gb_s_max:.2f}':>12} {r.vs_memcpy:>9.2f} "
              f"{vs_sock}  {r.target}{verdict}")
    for note in notes:
        print(note)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        return serve(argv[1])
    p = argparse.ArgumentParser(prog="kvrt bench pd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help='print {"rows": [...], "e2e": [...]} instead of tables')
    p.add_argument("--blocks", type=int, default=256, help="blocks per transfer (default 256)")
    p.add_argument("--pool-blocks", type=int, default=1024, help="blocks in each pool (default 1024)")
    p.add_argument("--num-layers", type=int, default=8, help="block shape: layers (default 8)")
    p.add_argument("--block-size", type=int, default=16, help="block shape: tokens (default 16)")
    p.add_argument("--num-kv-heads", type=int, default=8, help="block shape: KV heads per rank (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="block shape: head dim (default 128)")
    p.add_argument("--dtype", default="float16", help="KV dtype (default float16: 512 KiB blocks)")
    p.add_argument("--repeat", type=int, default=9, help="timed transfers per case (default 9)")
    p.add_argument("--e2e-requests", type=int, default=12,
                   help="end to end: requests per case of 1,024-token prompts (default 12; longer prompts get "
                        "as many tokens in all, at least 3 requests)")
    p.add_argument("--e2e-prompt", type=pd_e2e.prompt_lengths, default=[1024, 4096],
                   help="end to end: prompt tokens, comma-separated (default 1024,4096)")
    p.add_argument("--e2e-new", type=int, default=8, help="end to end: new tokens per request (default 8)")
    p.add_argument("--no-e2e", action="store_true", help="only the transfer table (no nodes launched)")
    args = p.parse_args(argv)
    if args.blocks > args.pool_blocks or args.blocks < 1:
        p.error(f"--blocks must be 1..--pool-blocks ({args.pool_blocks})")
    args.repeat = max(args.repeat, 1)
    rows, notes = measure(args)
    extra = [] if args.no_e2e else pd_e2e.rows(args)
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "e2e": extra, "notes": notes}))
    else:
        print_table(rows, notes, args, _layout(args).block_bytes)
        print_extra(extra)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
