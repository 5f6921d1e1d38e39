"""`kvrt stress ring`: several producer processes stream checksummed records into one
consumer through a fan-in of SPSC rings; the consumer proves zero loss, zero duplication
and per-producer order, and (with --kill-after) that a SIGKILLed producer is reported as
dead within a bounded time while its ring stays usable for a replacement.

Producers are real processes started with `python -m kvrt.bench.stress_ring --producer ...`
(no fork of the consumer, no pickle).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import struct
import subprocess
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field

from kvrt.ipc.errors import PeerDead, WaitTimeout
from kvrt.ipc.fanin import FanIn
from kvrt.ipc.registry import Registry
from kvrt.ipc.ring import Consumer, Producer, Ring

log = logging.getLogger(__name__)
# producer id, sequence number, crc32 of payload, flags (1 = end of stream; payload = count)
REC = struct.Struct("<IQII")
END = 1


@dataclass
class StressResult:
    producers: int
    received: int = 0
    bytes: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    sent: dict[int, int] = field(default_factory=dict)
    got: dict[int, int] = field(default_factory=dict)
    dead_detected_s: float | None = None
    replacement_received: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors and all(self.got.get(p) == n for p, n in self.sent.items())


def produce(node: str, ring: str, pid_tag: int, messages: int, duration: float, max_size: int,
            seed: int) -> int:
    """Producer process body: stream records until `messages` sent or `duration` elapsed."""
    reg = Registry.attach(node)
    prod = Producer.attach(reg, ring)
    rng = random.Random(seed)
    limit = min(max_size, prod.max_record) - REC.size
    deadline = time.monotonic() + duration if duration else None
    seq = 0
    while (messages and seq < messages) or (deadline and time.monotonic() < deadline):
        n = limit if rng.random() < 0.01 else rng.randint(0, limit)
        payload = rng.randbytes(n)
        prod.put(REC.pack(pid_tag, seq, zlib.crc32(payload), 0) + payload, timeout=30.0)
        seq += 1
    prod.put(REC.pack(pid_tag, seq, 0, END), timeout=30.0)
    prod.close()
    reg.close()
    return 0


def _spawn(node: str, ring: str, tag: int, args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvrt.bench.stress_ring", "--producer", node, ring, str(tag),
           "--messages", str(args.messages), "--duration", str(args.duration),
           "--max-size", str(args.max_size), "--seed", str(args.seed + tag)]
    return subprocess.Popen(cmd)


def run_stress(args) -> StressResult:
    node = args.node or f"stress{os.getpid()}"
    res = StressResult(producers=args.producers)
    procs: dict[int, subprocess.Popen] = {}
    with Registry.create(node) as reg:
        reg.create_doorbell("stress.bell")
        names = [f"stress.{i}" for i in range(args.producers)]
        for name in names:
            Ring.create(reg, name, capacity=args.capacity, bell="stress.bell")
        consumers = [Consumer.attach(reg, n) for n in names]
        fan = FanIn(consumers, check_every=0.05)
        expect = {i: 0 for i in range(args.producers)}  # next seq per producer tag
        ring_of = {i: i for i in range(args.producers)}  # producer tag -> ring index
        ended: set[int] = set()
        for i in range(args.producers):
            procs[i] = _spawn(node, names[i], i, args)
        killed_at = None
        t0 = time.monotonic()
        try:
            while len(ended) < len(procs):
                if args.kill_after and killed_at is None and time.monotonic() - t0 > args.kill_after:
                    procs[0].send_signal(signal.SIGKILL)
                    procs[0].wait()
                    killed_at = time.monotonic()
                    log.info("SIGKILLed producer 0 (pid %d)", procs[0].pid)
                try:
                    idx, rec = fan.get(timeout=args.timeout)
                except PeerDead as e:
                    if killed_at is None or e.index != 0:
                        res.errors.append(f"unexpected dead producer: {e}")
                        break
                    res.dead_detected_s = time.monotonic() - killed_at
                    tag = len(procs)  # the replacement streams under a fresh tag on ring 0
                    res.sent[0] = res.got.get(0, 0)
                    ended.add(0)
                    expect[tag] = 0
                    ring_of[tag] = 0
                    procs[tag] = _spawn(node, names[0], tag, args)
                    continue
                except WaitTimeout as e:
                    res.errors.append(str(e))
                    break
                _check(rec, idx, expect, ring_of, ended, res)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                p.wait()
        res.seconds = time.monotonic() - t0
        if killed_at is not None:
            res.replacement_received = res.got.get(len(procs) - 1, 0)
            if res.dead_detected_s is None:
                res.errors.append("killed producer was never reported dead")
        for c in consumers:
            c.detach()
    return res


def _check(rec: bytes, idx: int, expect: dict, ring_of: dict, ended: set, res: StressResult) -> None:
    tag, seq, crc, flags = REC.unpack_from(rec)
    if tag not in expect or ring_of[tag] != idx:
        res.errors.append(f"record from unknown producer {tag} on ring {idx}")
        return
    if seq != expect[tag]:
        res.errors.append(f"producer {tag}: got seq {seq}, expected {expect[tag]} (loss/dup/reorder)")
    expect[tag] = seq + 1
    if flags & END:
        res.sent[tag] = seq
        ended.add(tag)
        return
    payload = rec[REC.size:]
    if zlib.crc32(payload) != crc:
        res.errors.append(f"producer {tag} seq {seq}: checksum mismatch")
    res.got[tag] = res.got.get(tag, 0) + 1
    res.received += 1
    res.bytes += len(rec)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrt stress ring", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--producers", type=int, default=3, help="producer processes (default 3)")
    p.add_argument("--messages", type=int, default=0, help="records per producer (0: use --duration)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds to stream when --messages is 0")
    p.add_argument("--max-size", type=int, default=1 << 15, help="largest record in bytes (capped at the ring's maximum)")
    p.add_argument("--capacity", type=int, default=1 << 16, help="ring data bytes (power of two)")
    p.add_argument("--kill-after", type=float, default=0.0, help="SIGKILL producer 0 after this many seconds and start a replacement")
    p.add_argument("--timeout", type=float, default=10.0, help="longest wait for any record before failing")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--node", default="", help="node name for the shared objects (default: stress<pid>)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--producer", nargs=3, metavar=("NODE", "RING", "TAG"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.producer:
        node, ring, tag = args.producer
        return produce(node, ring, int(tag), args.messages, args.duration if not args.messages else 0,
                       args.max_size, args.seed)
    if args.producers < 1:
        print("kvrt stress ring: --producers must be >= 1", file=sys.stderr)
        return 2
    res = run_stress(args)
    if args.json:
        print(json.dumps(asdict(res) | {"ok": res.ok}))
    else:
        rate = res.received / res.seconds if res.seconds else 0.0
        print(f"producers {res.producers}  records {res.received}  bytes {res.bytes}  "
              f"seconds {res.seconds:.1f}  records/s {rate:,.0f}")
        if res.dead_detected_s is not None:
            print(f"killed producer reported dead after {res.dead_detected_s * 1000:.0f} ms; "
                  f"replacement delivered {res.replacement_received} records on the same ring")
        print("OK: no loss, no duplication, order kept, checksums match" if res.ok
              else "FAILED:\n  " + "\n  ".join(res.errors[:20]))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
