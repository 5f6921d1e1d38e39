"""`kvrt bench copy`: how fast KV blocks move between a rank's device and host pools.

In one run, on the same pools:
- `memcpy`: one `np.copyto` of as many contiguous bytes as the swaps move: the memory
  bandwidth this machine gives one thread, the ceiling for everything below;
- `swap2cpu` / `swap2gpu`: the batched copy cache-transfer runs (random blocks, one
  `np.copyto` per run of consecutive pairs), with its ratio to the ceiling;
- `fancy`: the same blocks with fancy indexing (`host[dst] = dev[src]`), for contrast;
- `e2e swap`: a TransferTask sent through the ring to a real cache-transfer process until its
  TransferDone comes back, p50/p99 over many tasks for a few block counts; `copy p50` is the
  part of that spent copying (TransferDone.seconds), the rest is rings, codec and wake-ups.

On a CPU machine "device" is a shared-memory pool too, so swaps are host memcpys.
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

from ipc import protocol
from ipc.protocol import PROTOCOL, Shutdown, TransferTask
from ipc.registry import Registry, process_start_ms
from ipc.ring import Consumer, Producer
from ipc.signals import Signal
from runtime.config import NodeConfig
from workers.kv_pool import PoolMaker, attach_pools, copy_blocks, fmt_bytes

WAIT_S = 30.0
E2E_BYTES = 1 << 30  # cap on the bytes moved per end-to-end block count


@dataclass
class Row:
    case: str
    blocks: int
    mib: float
    gb_s: float
    vs_memcpy: float | None = None
    p50_us: float | None = None
    p99_us: float | None = None
    copy_p50_us: float | None = None


def best_gb_s(fn, nbytes: int, repeat: int) -> float:
    """Best of `repeat` timed calls (noise only ever slows a copy down); one untimed warm-up."""
    fn()
    best = min(_timed(fn) for _ in range(repeat))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def in_process(dev, host, n: int, repeat: int, rng: np.random.Generator) -> list[Row]:
    """memcpy ceiling, batched swaps both ways, fancy indexing: same pools, same byte count."""
    nbytes = n * dev.block_bytes
    mib = nbytes / 2**20

    def pick() -> tuple[np.ndarray, np.ndarray]:
        return (rng.choice(dev.num_blocks, n, replace=False), rng.choice(host.num_blocks, n, replace=False))

    src, dst = pick()
    memcpy = best_gb_s(lambda: np.copyto(host.array[:n], dev.array[:n]), nbytes, repeat)
    out = best_gb_s(lambda: copy_blocks(host, dev, dst, src), nbytes, repeat)
    back = best_gb_s(lambda: copy_blocks(dev, host, src, dst), nbytes, repeat)

    def fancy() -> None:
        host.array[dst] = dev.array[src]

    fancy_gb_s = best_gb_s(fancy, nbytes, repeat)
    return [Row("memcpy", n, mib, memcpy, 1.0), Row("swap2cpu", n, mib, out, out / memcpy),
            Row("swap2gpu", n, mib, back, back / memcpy), Row("fancy", n, mib, fancy_gb_s, fancy_gb_s / memcpy)]


class BenchNode:
    """The smallest node a cache-transfer process can join: this process is its launcher and
    engine; the pools are the ones the in-process rows use."""

    def __init__(self, cfg: NodeConfig):
        self.cfg = cfg
        self.reg = Registry.create(cfg.node)
        self.proc: subprocess.Popen | None = None
        try:
            protocol.publish_config(self.reg, cfg.to_dict())
            slots = len(protocol.proc_slots(1))
            procs = Signal.create(self.reg, protocol.PROCS, (slots, protocol.PROC_FIELDS), np.int64)
            Signal.create(self.reg, protocol.HEARTBEAT, slots, np.int64)
            self.ready = Signal.create(self.reg, protocol.READY, slots, np.int32)
            Signal.create(self.reg, protocol.NODE_STATUS, protocol.STATUS_FIELDS, np.int64)
            PoolMaker().create(self.reg, cfg, lambda line: None)
            self.reg.create_doorbell(protocol.ENGINE_BELL)
            protocol.transfer_orders(0).create(self.reg, 1 << 20)
            protocol.transfer_answers(0).create(self.reg, 1 << 20, bell=protocol.ENGINE_BELL)
            procs.array[0, protocol.PROC_START] = process_start_ms(os.getpid())
            procs.array[0, protocol.PROC_PID] = os.getpid()
            self.ready.array[0] = 1
            self.tasks = Producer.attach(self.reg, protocol.to_transfer(0))
            self.answers = Consumer.attach(self.reg, protocol.from_transfer(0))
        except BaseException:
            self.reg.unlink_all()
            raise

    def start_transfer(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "workers.cache_transfer", "--node",
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

    def swap(self, task: TransferTask) -> tuple[float, float]:
        """One task there and back: (end-to-end seconds, seconds the copy took)."""
        t0 = time.perf_counter()
        self.tasks.put(PROTOCOL.encode(task), WAIT_S)
        done = PROTOCOL.decode(self.answers.get(WAIT_S))
        t = time.perf_counter() - t0
        if not done.ok or done.task_id != task.task_id:
            raise RuntimeError(f"task {task.task_id} failed: {done}")
        return t, done.seconds

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
        self.reg.unlink_all()


def end_to_end(node: BenchNode, counts: list[int], tasks: int, block_bytes: int,
               rng: np.random.Generator) -> list[Row]:
    rows = []
    n_dev, n_host = node.cfg.num_gpu_blocks, node.cfg.num_cpu_blocks
    tid = 0
    for n in counts:
        k = max(10, min(tasks, E2E_BYTES // (n * block_bytes)))
        lat, copy = [], []
        for i in range(k + 2):  # the first two warm up the pages and the wake-up path
            tid += 1
            kind = protocol.SWAP2CPU if i % 2 == 0 else protocol.SWAP2GPU
            t = TransferTask(tid, kind, rng.choice(n_dev, n, replace=False).astype(np.int32),
                             rng.choice(n_host, n, replace=False).astype(np.int32))
            e2e, c = node.swap(t)
            if i >= 2:
                lat.append(e2e)
                copy.append(c)
        p50, p99, c50 = np.percentile(lat, 50), np.percentile(lat, 99), np.percentile(copy, 50)
        rows.append(Row("e2e swap", n, n * block_bytes / 2**20, n * block_bytes / p50 / 1e9,
                        p50_us=p50 * 1e6, p99_us=p99 * 1e6, copy_p50_us=c50 * 1e6))
    return rows


def print_table(rows: list[Row], block_bytes: int) -> None:
    print(f"block {fmt_bytes(block_bytes)}; GB/s = 1e9 bytes/s; best of repeats for copies, "
          f"percentiles over tasks for e2e")
    print(f"{'case':<10} {'blocks':>6} {'MiB':>8} {'GB/s':>7} {'vs memcpy':>9} {'p50 us':>9} "
          f"{'p99 us':>9} {'copy p50 us':>11}")

    def f(v, spec):
        return format(v, spec) if v is not None else format("-", spec[0] + spec[1:].split(".")[0])

    for r in rows:
        print(f"{r.case:<10} {r.blocks:>6} {r.mib:>8.1f} {r.gb_s:>7.2f} {f(r.vs_memcpy, '>9.2f')} "
              f"{f(r.p50_us, '>9.0f')} {f(r.p99_us, '>9.0f')} {f(r.copy_p50_us, '>11.0f')}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvrt bench copy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help='print {"rows": [...]} instead of a table')
    p.add_argument("--blocks", type=int, default=256, help="blocks per in-process copy (default 256)")
    p.add_argument("--pool-blocks", type=int, default=1024, help="blocks in each pool (default 1024)")
    p.add_argument("--num-layers", type=int, default=8, help="block shape: layers (default 8)")
    p.add_argument("--block-size", type=int, default=16, help="block shape: tokens (default 16)")
    p.add_argument("--num-kv-heads", type=int, default=8, help="block shape: KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="block shape: head dim (default 128)")
    p.add_argument("--dtype", default="float16", help="KV dtype (default float16: 512 KiB blocks)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs per in-process case (default 5)")
    p.add_argument("--e2e-blocks", default="1,16,256", help="block counts per end-to-end task")
    p.add_argument("--tasks", type=int, default=200, help="end-to-end tasks per block count (default 200)")
    args = p.parse_args(argv)
    try:
        counts = [int(c) for c in args.e2e_blocks.split(",") if c]
    except ValueError:
        p.error(f"--e2e-blocks must be comma-separated integers, got {args.e2e_blocks!r}")
    if max(counts + [args.blocks]) > args.pool_blocks:
        p.error(f"--blocks and --e2e-blocks must not exceed --pool-blocks ({args.pool_blocks})")
    cfg = NodeConfig(node=f"benchcopy{os.getpid()}", tp=1, num_gpu_blocks=args.pool_blocks,
                     num_cpu_blocks=args.pool_blocks, num_layers=args.num_layers, block_size=args.block_size,
                     num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, dtype=args.dtype).validate()
    rng = np.random.default_rng(0)
    node = BenchNode(cfg)
    try:
        dev, host = attach_pools(node.reg, 0, node.cfg)
        try:
            rows = in_process(dev, host, args.blocks, max(args.repeat, 1), rng)
        finally:
            dev.close()
            host.close()
        node.start_transfer()
        rows += end_to_end(node, counts, args.tasks, cfg.block_bytes, rng)
    finally:
        node.close()
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows]}))
    else:
        print_table(rows, cfg.block_bytes)
    return 0
