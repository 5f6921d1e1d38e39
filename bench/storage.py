"""`kvrt bench storage`: the storage tiers' batched I/O next to what the wire allows, and what
a shared store buys a node that did not compute a prompt itself.

I/O, batches of 64 blocks (the node's cache-transfer process moves a request's blocks in one
batch), fresh keys for every put, median over repeats:
- `mooncake`: the Mooncake Store tier (workers/storage/mooncake.py) against a `kvrt store
  start` in another process (master + the memory it lends), TCP over loopback: `put_many` from
  and `get_many` into a registered pool, as a cache-transfer rank does;
- `file`: the file tier (workers/storage/base.py) in a temporary directory (page cache, no fsync);
- `mooncake+mac`, `file+mac`: the same with a storage secret: every object signed on the way in
  and checked on the way out (keyed BLAKE2b, workers/storage/mac.py), a read landing in the
  backend's own buffer and copied into the pool once checked;
- `socket`: the limit for moving the same bytes to another process: a plain Python TCP socket
  over loopback to a server process that receives into (or sends from) its own buffer, one
  `sendall`/`recv_into` per block, one ack per batch.
Each tier's figures come with their ratio to the socket's.

Cross node: a store; node A computes `--requests` distinct prompts (written through to the
store) and stops; node B, started afterwards on the same store, serves the same prompts (storage
hits); node B again without the store computes them. Nodes A and B share a storage secret (a
node on a shared store needs one). TTFT as the client sees it.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvrt.bench.interrupt import interrupt
from kvrt.ipc.ports import free_port
from kvrt.bench.nodes import REPO, LaunchedNode
from kvrt.ipc.layout import KVLayout
from kvrt.ipc.storage_uri import parse_storage
from kvrt.runtime.client.client import Client

STORE_READY_S = 30.0
_OP = struct.Struct("<cqq")  # op (P: put, G: get, Q: quit), blocks, bytes per block


@dataclass
class IoRow:
    tier: str
    op: str              # put or get
    blocks: int
    mib: float
    gb_s: float          # median
    latency_ms: float    # median per batch
    latency_p90_ms: float
    vs_socket: float | None = None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---- a store for the benchmark --------------------------------------------------------------
class Store:
    """`kvrt store start` in a subprocess on a free port, stopped with SIGINT."""

    def __init__(self, memory: str):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvrt.launcher", "store", "start", "--port", str(self.port),
                                      "--memory", memory], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()  # its ready line, or "" when it exited (bounded: it
        if "mooncake master on" not in line:  # gives up on the master after MASTER_READY_S)
            self.stop()
            raise RuntimeError(f"kvrt store start did not come up (exit {self.proc.returncode}): {line!r}")
        self.uri = f"mooncake://127.0.0.1:{self.port}"
        self.secret_dir = tempfile.mkdtemp(prefix="kvrt-bench-store-")
        self.secret = os.path.join(self.secret_dir, "store.secret")  # the benchmark's node group's
        with open(os.open(self.secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))

    def stop(self) -> None:
        shutil.rmtree(getattr(self, "secret_dir", ""), ignore_errors=True)
        interrupt(self.proc, STORE_READY_S)


# ---- the raw socket baseline ------------------------------------------------------------------
def serve_socket() -> int:
    """The socket baseline's other process: prints its port, then serves puts and gets."""
    srv = socket.create_server(("127.0.0.1", 0))
    print(srv.getsockname()[1], flush=True)
    srv.settimeout(STORE_READY_S)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = np.empty(0, np.uint8)
    with conn:
        while True:
            head = _recv_into(conn, memoryview(bytearray(_OP.size)))
            if head is None:
                return 0
            op, n, bb = _OP.unpack(head)
            if op == b"Q":
                return 0
            if buf.nbytes < n * bb:
                buf = np.zeros(n * bb, np.uint8)
            for i in range(n):
                view = memoryview(buf[i * bb:(i + 1) * bb])
                if op == b"P":
                    if _recv_into(conn, view) is None:
                        return 0
                else:
                    conn.sendall(view)
            if op == b"P":
                conn.sendall(b"k")


def _recv_into(conn: socket.socket, view: memoryview) -> memoryview | None:
    got = 0
    while got < len(view):
        k = conn.recv_into(view[got:])
        if not k:
            return None
        got += k
    return view


class SocketTier:
    """The client side of the socket baseline, shaped like a storage tier's batch calls."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvrt.bench.storage", "--serve-socket"], cwd=REPO,
                                     stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        port = int(self.proc.stdout.readline())
        self.conn = socket.create_connection(("127.0.0.1", port), timeout=STORE_READY_S)
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def put_many(self, keys: list[bytes], blocks: list[np.ndarray]) -> int:
        self.conn.sendall(_OP.pack(b"P", len(blocks), blocks[0].nbytes))
        for b in blocks:
            self.conn.sendall(memoryview(b.reshape(-1).view(np.uint8)))
        if self.conn.recv(1) != b"k":
            raise RuntimeError("the socket baseline's server closed the connection")
        return sum(b.nbytes for b in blocks)

    def get_many(self, keys: list[bytes], outs: list[np.ndarray]) -> int:
        self.conn.sendall(_OP.pack(b"G", len(outs), outs[0].nbytes))
        for o in outs:
            if _recv_into(self.conn, memoryview(o.reshape(-1).view(np.uint8))) is None:
                raise RuntimeError("the socket baseline's server closed the connection")
        return len(outs)

    def close(self) -> None:
        try:
            self.conn.sendall(_OP.pack(b"Q", 0, 0))
        except OSError:
            pass
        self.conn.close()
        try:
            self.proc.wait(STORE_READY_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- I/O --------------------------------------------------------------------------------------
def _time_tier(name: str, tier, pool: np.ndarray, args: argparse.Namespace) -> list[IoRow]:
    """put then get of `args.batch` blocks, `args.repeat` times (fresh keys for each put)."""
    n = args.batch
    src, dst = pool[:n], pool[n:2 * n]
    rows = []
    puts, gets = [], []
    for rep in range(args.repeat + 1):  # the first round warms connections up and is not counted
        keys = [os.urandom(16) for _ in range(n)]
        t0 = time.perf_counter()
        tier.put_many(keys, list(src))
        t1 = time.perf_counter()
        dst[:] = 0
        t2 = time.perf_counter()
        got = tier.get_many(keys, list(dst))
        t3 = time.perf_counter()
        if got != n or not np.array_equal(dst, src):
            raise RuntimeError(f"{name}: read back {got} of {n} blocks, or other bytes than were written")
        if rep:
            puts.append(t1 - t0)
            gets.append(t3 - t2)
    nbytes = src.nbytes
    for op, times in (("put", puts), ("get", gets)):
        med = statistics.median(times)
        rows.append(IoRow(name, op, n, nbytes / 2**20, nbytes / med / 1e9, med * 1e3,
                          float(np.percentile(times, 90)) * 1e3))
    return rows


def io_rows(args: argparse.Namespace, store: Store | None) -> list[IoRow]:
    from kvrt.workers.storage.base import FileStorage
    from kvrt.workers.storage.mac import BlockMac
    from kvrt.workers.storage.mooncake import MooncakeStorage

    layout = KVLayout.of_node(args.num_layers, args.block_size, args.num_kv_heads, args.head_dim, args.dtype, 1)
    pool = np.random.default_rng(0).standard_normal((2 * args.batch, *layout.block_shape)).astype(args.dtype)
    _say(f"I/O: batches of {args.batch} blocks of {layout.block_bytes // 1024} KiB "
         f"({args.batch * layout.block_bytes / 2**20:.0f} MiB), {args.repeat} repeats")
    rows: list[IoRow] = []
    sock = SocketTier()
    try:
        rows += _time_tier("socket", sock, pool, args)
    finally:
        sock.close()
    mac = BlockMac(secrets.token_bytes(32), b"kvrt bench storage")
    if store is not None:
        for tier, signer in (("mooncake", None), ("mooncake+mac", mac)):
            mc = MooncakeStorage(parse_storage(store.uri), rank=0, mac=signer)
            try:
                mc.register(pool)
                rows += _time_tier(tier, mc, pool, args)
            finally:
                mc.close()
    for tier, signer in (("file", None), ("file+mac", mac)):
        with tempfile.TemporaryDirectory(prefix="kvrt-bench-storage-") as d:
            rows += _time_tier(tier, FileStorage(d, 0, mac=signer), pool, args)
    base = {r.op: r.gb_s for r in rows if r.tier == "socket"}
    for r in rows:
        r.vs_socket = r.gb_s / base[r.op]
    return rows


# ---- cross node -------------------------------------------------------------------------------
def _ttfts(port: int, prompts: list[np.ndarray], new: int) -> tuple[list[float], int]:
    """Client-side TTFT (ms) of each prompt in turn, and the prompt tokens served from storage."""
    out, storage = [], 0
    with Client(port, timeout=60) as c:
        c.generate(np.arange(3, 35, dtype=np.int32), 2, use_cache=False)  # warm-up, nothing cached
        for p in prompts:
            t0 = time.perf_counter()
            first = None
            with c.stream(p, new) as gen:
                for _ in gen:
                    first = first or time.perf_counter() - t0
            out.append(first * 1e3)
            storage += gen.result.cached_storage
    return out, storage


def cross_node_rows(args: argparse.Namespace, store: Store) -> list[dict]:
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 512, args.prompt).astype(np.int32) for _ in range(args.requests)]
    tag = f"bs{os.getpid()}"
    _say(f"cross node: {args.requests} prompts of {args.prompt} tokens computed on node A, then asked of node B")
    rows = []
    shared = ["--storage", store.uri, "--storage-secret-file", store.secret]
    for name, case, opts in (("a", "node A computes (store)", shared),
                             ("b", "node B, store hit", shared),
                             ("c", "node B, no store", [])):
        node = LaunchedNode.ready(tag + name, opts, _say)
        try:
            ttft, storage = _ttfts(node.port, prompts, args.new)
        finally:
            node.stop()  # (node A's stop waits for its write-through)
        rows.append({"case": case, "ttft_p50_ms": statistics.median(ttft), "ttft_mean_ms": statistics.fmean(ttft),
                     "storage_tokens": storage, "prompt_tokens": sum(len(p) for p in prompts)})
    ref = rows[2]["ttft_p50_ms"]
    for r in rows:
        r["ttft_vs_no_store"] = r["ttft_p50_ms"] / ref
    return rows


# ---- main -------------------------------------------------------------------------------------
def print_tables(io: list[IoRow], cross: list[dict], notes: list[str]) -> None:
    print(f"{'tier':<12} {'op':<4} {'MiB':>6} {'GB/s':>7} {'ms p50':>8} {'ms p90':>8} {'vs socket':>10}")
    for r in io:
        print(f"{r.tier:<12} {r.op:<4} {r.mib:>6.0f} {r.gb_s:>7.2f} {r.latency_ms:>8.2f} {r.latency_p90_ms:>8.2f} "
              f"{r.vs_socket:>10.2f}")
    if cross:
        print(f"\n{'cross node':<26} {'TTFT p50 ms':>12} {'mean ms':>9} {'from storage':>13} {'vs no store':>12}")
        for r in cross:
            share = f"{r['storage_tokens'] / r['prompt_tokens']:.0%}"
            print(f"{r['case']:<26} {r['ttft_p50_ms']:>12.1f} {r['ttft_mean_ms']:>9.1f} {share:>13} "
                  f"{r['ttft_vs_no_store']:>12.2f}")
    for note in notes:
        print(note)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve-socket"]:
        return serve_socket()
    p = argparse.ArgumentParser(prog="kvrt bench storage", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help='print {"io": [...], "cross_node": [...], "notes": [...]}')
    p.add_argument("--batch", type=int, default=64, help="blocks per put/get batch (default 64)")
    p.add_argument("--repeat", type=int, default=9, help="timed batches per tier and op (default 9)")
    p.add_argument("--num-layers", type=int, default=8, help="block shape: layers (default 8)")
    p.add_argument("--block-size", type=int, default=16, help="block shape: tokens (default 16)")
    p.add_argument("--num-kv-heads", type=int, default=8, help="block shape: KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="block shape: head dim (default 128)")
    p.add_argument("--dtype", default="float16", help="KV dtype (default float16: 512 KiB blocks)")
    p.add_argument("--memory", default="2G", help="memory the benchmark's store lends the pool (default 2G)")
    p.add_argument("--requests", type=int, default=8, help="cross node: prompts (default 8)")
    p.add_argument("--prompt", type=int, default=1024, help="cross node: prompt tokens (default 1024)")
    p.add_argument("--new", type=int, default=4, help="cross node: new tokens per request (default 4)")
    p.add_argument("--no-cross-node", action="store_true", help="only the I/O table (no nodes launched)")
    args = p.parse_args(argv)
    args.repeat = max(args.repeat, 1)
    notes: list[str] = []
    from kvrt.workers.storage.mooncake import unavailable_reason

    why = unavailable_reason()
    store = None
    if why:
        notes.append(f"mooncake rows skipped: {why}")
    else:
        store = Store(args.memory)
    try:
        io = io_rows(args, store)
        cross = [] if args.no_cross_node or store is None else cross_node_rows(args, store)
    finally:
        if store is not None:
            store.stop()
    if args.json:
        print(json.dumps({"io": [asdict(r) for r in io], "cross_node": cross, "notes": notes}))
    else:
        print_tables(io, cross, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
