"""`kvrt bench gateway`: what the gateway process costs a request (runtime/gateway/).

Every client from outside reaches the engine through the gateway, which relays its messages over
the node's private link; the node's own HTTP server reaches the engine's private socket directly.
This launches a node and sends the same requests both ways, one client at a time:

- `gateway`: a client on the node's public port (TCP), relayed by the gateway;
- `direct`: a client on the engine's private socket (ipc://, as the HTTP bridge), no gateway;
- `echo`: the limit: a pyzmq ROUTER in a child process that echoes each message at once, over
  TCP (a round trip through one Python process and libzmq, with no work at all).

Requests: `info` (the engine answers at its next turn: transport and intake only) and `generate`
of one token (a step of the node's model). Modes: `sequential` (one request in flight: its round
trip) and `pipelined` (WINDOW in flight: the rate one client reaches). The two paths are measured
in turn, `--rounds` times, and each figure is the median of its rounds. Per row: round-trip
percentiles, requests per second, and CPU time per request of the engine, the gateway and the
whole node (every process of it: psutil), so that its cost per CPU-second is independent of the
machine's load; ratios of `gateway` to `direct` and to `echo`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from dataclasses import asdict, dataclass

import numpy as np
import psutil

from kvrt.bench.nodes import REPO, LaunchedNode
from kvrt.ipc import sockets
from kvrt.ipc.ports import free_port
from kvrt.runtime.client.api import API, InfoRequest
from kvrt.runtime.client.client import Client
from kvrt.runtime.node.status import snapshot

WINDOW = 32
SHAPE = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16", "--block-size", "8",
         "--num-gpu-blocks", "256"]
ECHO = textwrap.dedent("""
    import sys, zmq
    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    r.bind(f"tcp://127.0.0.1:{sys.argv[1]}")
    print("ready", flush=True)
    while True:
        frames = r.recv_multipart()
        if frames[1] == b"stop":
            break
        r.send_multipart(frames)
""")


@dataclass
class Row:
    path: str
    kind: str
    mode: str
    n: int
    p50_us: float
    p99_us: float
    per_s: float
    engine_cpu_us: float | None  # CPU time per request, of that process ...
    gateway_cpu_us: float | None
    node_cpu_us: float | None  # ... and of every process of the node (the echo server's own for `echo`)


class Cpu:
    """CPU seconds (user + system) used by a set of processes since the last reading."""

    def __init__(self, pids: list[int]):
        self.procs = [psutil.Process(p) for p in pids]
        self.last = self._now()

    def _now(self) -> list[float]:
        return [sum(p.cpu_times()[:2]) for p in self.procs]

    def delta(self) -> list[float]:
        now = self._now()
        out = [b - a for a, b in zip(self.last, now)]
        self.last = now
        return out


def _sequential(call, n: int) -> tuple[list[float], float]:
    times = []
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return times, time.perf_counter() - t0


def _pipelined(sock, payload: bytes, n: int) -> tuple[list[float], float]:
    """`n` messages with WINDOW in flight on a raw DEALER: every answer is one message."""
    sent, got, times, stamps = 0, 0, [], []
    t0 = time.perf_counter()
    while got < n:
        while sent < n and sent - got < WINDOW:
            sock.send(payload)
            stamps.append(time.perf_counter())
            sent += 1
        if not sock.poll(30_000):
            raise RuntimeError(f"no answer within 30 s ({got} of {n} came)")
        sock.recv()
        times.append(time.perf_counter() - stamps[got])
        got += 1
    return times, time.perf_counter() - t0


def _row(path: str, kind: str, mode: str, times: list[float], wall: float, cpu: list[float] | None,
         gateway: bool) -> Row:
    n = len(times)
    us = np.asarray(times) * 1e6
    per = (lambda s: s / n * 1e6) if cpu is not None else None
    return Row(path, kind, mode, n, float(np.percentile(us, 50)), float(np.percentile(us, 99)), n / wall,
               per(cpu[0]) if per else None, per(cpu[1]) if per and gateway else None,
               per(sum(cpu) - (0.0 if gateway else cpu[1])) if per else None)


def measure_node(n: int, rounds: int, say) -> list[Row]:
    """Both paths in turn, `rounds` times (a machine's load drifts: each path gets its share of
    every stretch of it); a row per path, request and mode, each figure the rounds' median."""
    name = f"benchgw{uuid.uuid4().hex[:6]}"
    node = LaunchedNode.ready(name, SHAPE, say)
    runs: list[Row] = []
    try:
        procs = {p["role"]: p["pid"] for p in snapshot(name)["processes"]}
        pids = [procs["engine"], procs["gateway"], *(pid for role, pid in procs.items() if role not in ("engine", "gateway"))]
        prompt = np.arange(1, 9, dtype=np.int32)
        info = API.encode(InfoRequest(1))
        clients = {"gateway": Client(node.port, timeout=30), "direct": Client(sockets.address(name, sockets.API), timeout=30)}
        try:
            for c in clients.values():
                c.info()
                for _ in range(20):  # warm: the prompt's blocks are cached after the first
                    c.generate(prompt, 1)
            cpu = Cpu(pids)
            for _ in range(rounds):
                for path, c in clients.items():
                    for kind, call in (("info", c.info), ("generate", lambda: c.generate(prompt, 1))):
                        cpu.delta()
                        times, wall = _sequential(call, n if kind == "info" else max(n // 4, 10))
                        runs.append(_row(path, kind, "sequential", times, wall, cpu.delta(), path == "gateway"))
                    cpu.delta()
                    times, wall = _pipelined(c._sock, info, 4 * n)
                    runs.append(_row(path, "info", "pipelined", times, wall, cpu.delta(), path == "gateway"))
        finally:
            for c in clients.values():
                c.close()
    finally:
        node.stop()
    return _medians(runs)


def _medians(runs: list[Row]) -> list[Row]:
    """One row per (path, request, mode): every figure the median over the rounds."""
    out: dict[tuple[str, str, str], list[Row]] = {}
    for r in runs:
        out.setdefault((r.path, r.kind, r.mode), []).append(r)

    def med(rows: list[Row], field: str):
        values = [getattr(r, field) for r in rows]
        return None if values[0] is None else float(np.median(values))

    return [Row(*key, rows[0].n, *(med(rows, f) for f in ("p50_us", "p99_us", "per_s", "engine_cpu_us",
                                                            "gateway_cpu_us", "node_cpu_us")))
            for key, rows in out.items()]


def measure_echo(n: int) -> list[Row]:
    import zmq

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", ECHO, str(port)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    rows = []
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the echo server did not start")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        payload = API.encode(InfoRequest(1))

        def call() -> None:
            sock.send(payload)
            if not sock.poll(30_000):
                raise RuntimeError("the echo server did not answer within 30 s")
            sock.recv()

        cpu = Cpu([server.pid])
        for _ in range(100):
            call()
        cpu.delta()
        times, wall = _sequential(call, n)
        rows.append(_row("echo", "info", "sequential", times, wall, [0.0, 0.0, *cpu.delta()], False))
        times, wall = _pipelined(sock, payload, 4 * n)
        rows.append(_row("echo", "info", "pipelined", times, wall, [0.0, 0.0, *cpu.delta()], False))
        sock.send(b"stop")
        ctx.destroy(linger=1000)
        server.wait(10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    for r in rows:
        r.engine_cpu_us = None
    return rows


def ratios(rows: list[Row]) -> list[dict]:
    """gateway / direct and gateway / echo per request kind and mode, on p50 and on the node's
    CPU per request."""
    by = {(r.path, r.kind, r.mode): r for r in rows}
    out = []
    for (path, kind, mode), g in by.items():
        if path != "gateway":
            continue
        d, e = by.get(("direct", kind, mode)), by.get(("echo", kind, mode))
        out.append({"kind": kind, "mode": mode,
                    "p50_vs_direct": g.p50_us / d.p50_us if d else None,
                    "node_cpu_vs_direct": g.node_cpu_us / d.node_cpu_us if d and d.node_cpu_us else None,
                    "gateway_cpu_vs_echo": g.gateway_cpu_us / e.node_cpu_us if e and e.node_cpu_us else None,
                    "gateway_cpu_share": g.gateway_cpu_us / g.node_cpu_us if g.node_cpu_us else None})
    return out


def _n(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[Row], rat: list[dict]) -> None:
    print(f"{'path':<8} {'request':<9} {'mode':<11} {'n':>6} {'p50 us':>9} {'p99 us':>9} {'req/s':>9} "
          f"{'engine us':>10} {'gateway us':>11} {'node us':>9}   (CPU per request)")
    for r in rows:
        print(f"{r.path:<8} {r.kind:<9} {r.mode:<11} {r.n:>6} {r.p50_us:>9.0f} {r.p99_us:>9.0f} {r.per_s:>9.0f} "
              f"{_n(r.engine_cpu_us, '.0f'):>10} {_n(r.gateway_cpu_us, '.0f'):>11} {_n(r.node_cpu_us, '.0f'):>9}")
    print()
    print(f"{'request':<9} {'mode':<11} {'p50 vs direct':>14} {'node CPU vs direct':>19} "
          f"{'gateway CPU vs echo':>20} {'gateway share of node CPU':>26}")
    for x in rat:
        print(f"{x['kind']:<9} {x['mode']:<11} {_n(x['p50_vs_direct'], '.2f'):>14} "
              f"{_n(x['node_cpu_vs_direct'], '.2f'):>19} {_n(x['gateway_cpu_vs_echo'], '.2f'):>20} "
              f"{_n(x['gateway_cpu_share'], '.2f'):>26}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvrt bench gateway", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000,
                   help="sequential info requests per path (generate: a quarter; pipelined: 4x) (default 2000)")
    p.add_argument("--rounds", type=int, default=3,
                   help="times each path is measured, in turn with the other; each figure is the median (default 3)")
    p.add_argument("--json", action="store_true", help="print the rows and ratios as JSON")
    args = p.parse_args(argv)
    if args.requests < 10 or args.rounds < 1:
        p.error("--requests must be at least 10 and --rounds at least 1")

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    say(f"load average {os.getloadavg()[0]:.2f}")
    rows = measure_node(args.requests, args.rounds, say) + measure_echo(args.requests)
    rat = ratios(rows)
    if args.json:
        print(json.dumps({"load": os.getloadavg()[0], "window": WINDOW, "rounds": args.rounds,
                          "rows": [asdict(r) for r in rows],
                          "ratios": rat}))
    else:
        print_table(rows, rat)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
