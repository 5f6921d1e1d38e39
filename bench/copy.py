"""`kvrt bench copy`: how fast KV blocks move between a rank's device and host pools.

In one run, on the same pools, each direction (h2d: host to device, SWAP2GPU's; d2h: device
to host, SWAP2CPU's) next to its limit:
- `limit`: one copy of as many contiguous bytes as the swaps move (one `np.copyto` on a CPU,
  one `cudaMemcpyAsync` into the pinned host pool on a GPU): the ceiling for everything below;
- `loop`: the same bytes as random blocks, one copy per block and one wait at the end, in this
  process: what the copies themselves cost, without kvrt;
- `swap2cpu` / `swap2gpu`: kvrt's copy (`copy_blocks`: runs of consecutive pairs coalesced),
  in this process;
- `fancy` (CPU only): the same blocks by fancy indexing (`host[dst] = dev[src]`), for contrast;
- `e2e swap2cpu` / `e2e swap2gpu`: a TransferTask sent through the ring to a real
  cache-transfer process until its TransferDone comes back, p50/p99 over many tasks for a few
  block counts; `copy p50` is the part of that spent in the task (TransferDone.seconds), the
  rest is rings, codec and wake-ups; `limit us` is the single copy of the same bytes;
- `e2e burst`: one-block tasks sent back to back, BURST (16) at a time, time per task (the
  cache-transfer takes queued tasks together).

`vs limit` is GB/s over the limit's GB/s for the same direction (for e2e rows: the single
copy's time over the task's p50). With `--device cuda` the device pool is GPU memory (CuPy),
the host pool is pinned as kvrt pins its own, and the default block is the real-model shape
(32 layers x 16 tokens x 8 KV heads x 128 dims fp16 = 2 MiB); on a CPU both pools are
shared memory and every copy is a memcpy. The code is the same: the array backend is the only
difference.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvrt.ipc import protocol
from kvrt.ipc.protocol import PROTOCOL, Shutdown, TransferTask
from kvrt.ipc.registry import Registry, process_start_ms
from kvrt.ipc.ring import Consumer, Producer
from kvrt.ipc.topology import ENGINE, Topology
from kvrt.runtime.node.config import NodeConfig
from kvrt.workers.backend import BackendUnavailable, Pool, get_backend
from kvrt.bench.timing import best_seconds
from kvrt.workers.kv_pool import PoolMaker, attach_pools, copy_blocks, fmt_bytes

WAIT_S = 30.0
E2E_BYTES = 1 << 30  # cap on the bytes moved per end-to-end block count
BURST = 16  # one-block tasks sent back to back in the burst row
# block shape defaults per device: (layers, pool blocks); 512 KiB blocks on a CPU, 2 MiB on a GPU
SHAPES = {"cpu": (8, 1024), "cuda": (32, 512)}


@dataclass
class Row:
    case: str
    blocks: int
    mib: float
    gb_s: float
    vs_limit: float | None = None
    p50_us: float | None = None
    p99_us: float | None = None
    copy_p50_us: float | None = None
    limit_us: float | None = None


def limit_seconds(dev: Pool, host: Pool, n: int, repeat: int) -> dict[str, float]:
    """One contiguous copy of n blocks each way: the link's (or memory's) limit for n blocks.
    Each call copies other blocks than the last, so a CPU's caches do not flatter small copies
    (a task's random blocks are cold too)."""
    b, spots = dev.backend, max(min(dev.num_blocks, host.num_blocks) // n, 1)
    calls = iter(range(1 << 30))

    def one(dst: Pool, src: Pool) -> None:
        at = next(calls) % spots * n
        b.copy_runs(dst, src, [(at, at, n)])

    return {"h2d": best_seconds(lambda: one(dev, host), repeat), "d2h": best_seconds(lambda: one(host, dev), repeat)}


def in_process(dev: Pool, host: Pool, n: int, repeat: int, rng: np.random.Generator) -> list[Row]:
    """Limit, per-block loop and kvrt's copy each way, fancy indexing on a CPU: same pools,
    same byte count, this process."""
    bb = dev.block_bytes
    nbytes, mib = n * bb, n * bb / 2**20
    src = rng.choice(dev.num_blocks, n, replace=False)
    dst = rng.choice(host.num_blocks, n, replace=False)
    b = dev.backend
    limit = limit_seconds(dev, host, n, repeat)
    gb = {d: nbytes / s / 1e9 for d, s in limit.items()}
    d2h_loop = [(int(s), int(d), 1) for s, d in zip(src, dst)]
    h2d_loop = [(int(d), int(s), 1) for s, d in zip(src, dst)]
    cases = [("limit h2d", "h2d", limit["h2d"]), ("limit d2h", "d2h", limit["d2h"]),
             ("loop h2d", "h2d", best_seconds(lambda: b.copy_runs(dev, host, h2d_loop), repeat)),
             ("loop d2h", "d2h", best_seconds(lambda: b.copy_runs(host, dev, d2h_loop), repeat)),
             ("swap2gpu", "h2d", best_seconds(lambda: copy_blocks(dev, host, src, dst), repeat)),
             ("swap2cpu", "d2h", best_seconds(lambda: copy_blocks(host, dev, dst, src), repeat))]
    if isinstance(dev.array, np.ndarray):  # both pools in host memory: one array module

        def fancy() -> None:
            host.array[dst] = dev.array[src]

        cases.append(("fancy", "d2h", best_seconds(fancy, repeat)))
    rows = []
    for case, direction, s in cases:
        rows.append(Row(case, n, mib, nbytes / s / 1e9, nbytes / s / 1e9 / gb[direction],
                        limit_us=limit[direction] * 1e6))
    return rows


class BenchNode:
    """The smallest node a cache-transfer process can join: this process is its launcher and
    engine; the pools are the ones the in-process rows use."""

    def __init__(self, cfg: NodeConfig):
        self.cfg = cfg
        self.reg = Registry.create(cfg.node)
        self.proc: subprocess.Popen | None = None
        self.maker = PoolMaker()  # keeps a GPU pool's allocation alive while the node runs
        try:
            protocol.publish_config(self.reg, cfg.to_dict())
            topo = Topology.of(cfg, roles=[protocol.ROLE_TRANSFER])
            sig = topo.create(self.reg, 1 << 20)
            procs, self.ready = sig[protocol.PROCS], sig[protocol.READY]
            self.maker.create(self.reg, cfg, lambda line: None)
            procs.array[0, protocol.PROC_START] = process_start_ms(os.getpid())
            procs.array[0, protocol.PROC_PID] = os.getpid()
            self.ready.array[0] = 1
            [orders], [answers] = topo.sends(ENGINE), topo.receives(ENGINE)
            self.tasks = Producer.attach(self.reg, orders.channel.obj)
            self.answers = Consumer.attach(self.reg, answers.channel.obj)
            self.answers.spin_s = cfg.wait_spin_s  # as the engine's fan-in waits
        except BaseException:
            self.maker.created.close()
            self.reg.unlink_all()
            raise

    def local_pools(self) -> tuple[Pool, Pool]:
        """Rank 0's pools opened in this process. A GPU pool is the allocation this process
        made (CUDA refuses to open an IPC handle in the process that exported it)."""
        if self.cfg.device == "cpu":
            dev, host = attach_pools(self.reg, 0, self.cfg)
            return dev, host
        backend = get_backend(self.cfg.device)
        cp, (mem,) = backend.xp, self.maker.created.keep
        layout = self.cfg.kv_layout
        arr = cp.ndarray(layout.pool_shape(self.cfg.num_gpu_blocks), np.dtype(layout.dtype),
                         cp.cuda.MemoryPointer(mem, 0))
        dev = Pool(protocol.device_pool(0), arr, backend, True, lambda: None)
        return dev, backend.open_host_pool(self.reg, protocol.host_pool(0))

    def start_transfer(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvrt.workers.cache_transfer", "--node",
                                      self.cfg.node, "--rank", "0", "--log-level", "WARNING"])
        slot = protocol.slot_of(1, protocol.ROLE_TRANSFER, 0)
        deadline = time.monotonic() + WAIT_S
        while not self.ready.array[slot]:
            try:
                code = self.proc.wait(0.02)  # also the pause between looks
                raise RuntimeError(f"cache-transfer exited with code {code} during start-up")
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"cache-transfer not ready within {WAIT_S}s")

    def send(self, task: TransferTask) -> None:
        self.tasks.put(PROTOCOL.encode(task), WAIT_S)

    def answer(self, task_id: int) -> float:
        """The next answer, which must be task `task_id`'s and ok: its copy seconds."""
        done = PROTOCOL.decode(self.answers.get(WAIT_S))
        if not done.ok or done.task_id != task_id:
            raise RuntimeError(f"task {task_id} failed: {done}")
        return done.seconds

    def swap(self, task: TransferTask) -> tuple[float, float]:
        """One task there and back: (end-to-end seconds, seconds the copy took)."""
        t0 = time.perf_counter()
        self.send(task)
        c = self.answer(task.task_id)
        return time.perf_counter() - t0, c

    def close(self) -> None:
        if self.proc is not None:
            self.tasks.put(PROTOCOL.encode(Shutdown("bench done")), WAIT_S)
            try:
                self.proc.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.tasks.detach()
        self.answers.detach()
        self.ready.close()
        self.maker.created.close()
        self.reg.unlink_all()


class Tasks:
    """Random swap tasks over the node's pools, numbered in order."""

    def __init__(self, cfg: NodeConfig, rng: np.random.Generator):
        self.n_dev, self.n_host, self.rng, self.tid = cfg.num_gpu_blocks, cfg.num_cpu_blocks, rng, 0

    def make(self, kind: str, n: int) -> TransferTask:
        self.tid += 1
        return TransferTask(self.tid, kind, self.rng.choice(self.n_dev, n, replace=False).astype(np.int32),
                            self.rng.choice(self.n_host, n, replace=False).astype(np.int32))


def end_to_end(node: BenchNode, counts: list[int], tasks: int, limits: dict[int, dict[str, float]],
               rng: np.random.Generator) -> list[Row]:
    """Per block count and kind: p50/p99 of tasks one at a time; then the burst row."""
    rows = []
    bb = node.cfg.block_bytes
    make = Tasks(node.cfg, rng)
    for n in counts:
        k = max(10, min(tasks, E2E_BYTES // (n * bb)))
        for kind, direction in ((protocol.SWAP2CPU, "d2h"), (protocol.SWAP2GPU, "h2d")):
            lat, copy = [], []
            for i in range(k + 2):  # the first two warm up the pages and the wake-up path
                e2e, c = node.swap(make.make(kind, n))
                if i >= 2:
                    lat.append(e2e)
                    copy.append(c)
            p50, p99, c50 = np.percentile(lat, 50), np.percentile(lat, 99), np.percentile(copy, 50)
            limit = limits[n][direction]
            rows.append(Row(f"e2e {kind}", n, n * bb / 2**20, n * bb / p50 / 1e9, limit / p50,
                            p50_us=p50 * 1e6, p99_us=p99 * 1e6, copy_p50_us=c50 * 1e6, limit_us=limit * 1e6))
    per_task = []
    for i in range(max(10, tasks // BURST) + 1):
        burst = [make.make(protocol.SWAP2CPU if j % 2 == 0 else protocol.SWAP2GPU, 1) for j in range(BURST)]
        t0 = time.perf_counter()
        for t in burst:
            node.send(t)
        for t in burst:
            node.answer(t.task_id)
        if i:  # the first warms up
            per_task.append((time.perf_counter() - t0) / BURST)
    p50, p99 = np.percentile(per_task, 50), np.percentile(per_task, 99)
    limit = (limits[1]["d2h"] + limits[1]["h2d"]) / 2
    rows.append(Row("e2e burst", 1, bb / 2**20, bb / p50 / 1e9, limit / p50, p50_us=p50 * 1e6,
                    p99_us=p99 * 1e6, limit_us=limit * 1e6))
    return rows


def print_table(device: str, rows: list[Row], block_bytes: int) -> None:
    print(f"device {device}; block {fmt_bytes(block_bytes)}; GB/s = 1e9 bytes/s; best of repeats for "
          f"copies, percentiles over tasks for e2e ('e2e burst': {BURST} one-block tasks at a time, per task)")
    print(f"{'case':<13} {'blocks':>6} {'MiB':>7} {'GB/s':>7} {'vs limit':>8} {'p50 us':>9} "
          f"{'p99 us':>9} {'copy p50 us':>11} {'limit us':>9}")

    def f(v: float | None, spec: str) -> str:
        return format(v, spec) if v is not None else format("-", spec[0] + spec[1:].split(".")[0])

    for r in rows:
        print(f"{r.case:<13} {r.blocks:>6} {r.mib:>7.1f} {r.gb_s:>7.2f} {f(r.vs_limit, '>8.2f')} "
              f"{f(r.p50_us, '>9.0f')} {f(r.p99_us, '>9.0f')} {f(r.copy_p50_us, '>11.0f')} "
              f"{f(r.limit_us, '>9.0f')}")


def cuda_missing() -> str:
    """Why `--device cuda` cannot run here ('' when it can)."""
    try:
        rt = get_backend("cuda").rt
    except BackendUnavailable as e:
        return str(e)
    try:
        if rt.getDeviceCount() > 0:
            return ""
    except Exception as e:  # CuPy raises its own CUDARuntimeError when there is no driver
        return f"no CUDA device ({type(e).__name__}: {e})"
    return "no CUDA device"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvrt bench copy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help='print {"device", "block_bytes", "rows": [...]} '
                                                       'instead of a table')
    p.add_argument("--device", choices=sorted(SHAPES), default="cpu",
                   help="where the device pool lives: cpu (shared memory) or cuda (CuPy; default cpu)")
    p.add_argument("--blocks", type=int, default=256, help="blocks per in-process copy (default 256)")
    p.add_argument("--pool-blocks", type=int, default=None,
                   help="blocks in each pool (default 1024 on cpu, 512 on cuda)")
    p.add_argument("--num-layers", type=int, default=None, help="block shape: layers (default 8 on cpu, 32 on cuda)")
    p.add_argument("--block-size", type=int, default=16, help="block shape: tokens (default 16)")
    p.add_argument("--num-kv-heads", type=int, default=8, help="block shape: KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="block shape: head dim (default 128)")
    p.add_argument("--dtype", default="float16", help="KV dtype (default float16)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per in-process case (default 5)")
    p.add_argument("--e2e-blocks", default="1,16,256", help="block counts per end-to-end task")
    p.add_argument("--tasks", type=int, default=200, help="end-to-end tasks per block count and kind (default 200)")
    p.add_argument("--wait-spin-us", type=int, default=-1,
                   help="as kvrt launch's: how long the cache-transfer's and this process's (the engine's) waits spin, "
                   "and a swap's wait polls its copy's event, before sleeping (default -1: 250 on cuda, 0 on cpu)")
    args = p.parse_args(argv)
    try:
        counts = [int(c) for c in args.e2e_blocks.split(",") if c]
    except ValueError:
        p.error(f"--e2e-blocks must be comma-separated integers, got {args.e2e_blocks!r}")
    layers, pool_blocks = SHAPES[args.device]
    layers = args.num_layers or layers
    pool_blocks = args.pool_blocks or pool_blocks
    if min(counts + [args.blocks]) < 1 or max(counts + [args.blocks]) > pool_blocks:
        p.error(f"--blocks and --e2e-blocks must be between 1 and --pool-blocks ({pool_blocks})")
    if args.device == "cuda" and (why := cuda_missing()):
        print(f"kvrt bench copy: --device cuda cannot run here: {why}", file=sys.stderr)
        return 2
    cfg = NodeConfig(node=f"benchcopy{os.getpid()}", tp=1, device=args.device, num_gpu_blocks=pool_blocks,
                     num_cpu_blocks=pool_blocks, num_layers=layers, block_size=args.block_size,
                     num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, dtype=args.dtype,
                     wait_spin_us=args.wait_spin_us).validate()
    rng = np.random.default_rng(0)
    repeat = max(args.repeat, 1)
    node = BenchNode(cfg)
    try:
        dev, host = node.local_pools()
        try:
            rows = in_process(dev, host, args.blocks, repeat, rng)
            limits = {n: limit_seconds(dev, host, n, repeat) for n in sorted(set(counts) | {1})}
        finally:
            dev.close()
            host.close()
        node.start_transfer()
        rows += end_to_end(node, counts, args.tasks, limits, rng)
    finally:
        node.close()
    if args.json:
        print(json.dumps({"device": args.device, "block_bytes": cfg.block_bytes, "wait_spin_s": cfg.wait_spin_s,
                          "rows": [asdict(r) for r in rows]}))
    else:
        print_table(args.device, rows, cfg.block_bytes)
    return 0
