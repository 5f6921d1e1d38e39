"""`kvrt bench attacks`: another client's ordinary request while one client attacks a node.

For each attack, against a node it launches with the HTTP API (the reference model at its
default shape, or `--model DIR`), a probe client at another address (127.0.0.2) sends an
ordinary request (three token ids, 8 new tokens, greedy) every PROBE_GAP_S and times its answer,
before the attack (idle) and while it goes on; the table gives the probe's median and worst
time under the attack next to its worst when idle (the ratio: what the attack costs another
client; 1 would be nothing), how the attack's own requests were answered, how much the node's
launcher (where the HTTP server runs) grew, and whether the node was still up after it. The
attacks are those an attacker's rerun of kvrt found:

- `tokenize`, `long-prompt`: 4.6 MB of text to /tokenize, and as a prompt;
- `detokenize`: a million token ids to /detokenize;
- `messages`: a conversation of 100,000 messages;
- `logprobs`: one 80 KB request of 4 prompts x 4,000 tokens, n 16, prompt_logprobs 20;
- `burst`: 200 requests of 2,000 tokens each at once, held `--hold-s`;
- `unread`: 200 streams of 2,000 tokens each that nobody reads, held `--hold-s`;
- `big-answer`: the largest answer a node serves (a 4,000-token prompt scored with 20
  alternatives, n 12: about a million log-probabilities, 66 MiB of JSON);
- `via-router`: the same through a `kvrt route` it launches, with the probe through the router
  too; the growth is the router's.

The physical floor is the probe's own idle time; nothing here is a throughput figure.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from typing import Callable

import httpx2
import psutil

from kvrt.bench.interrupt import interrupt
from kvrt.bench.nodes import REPO, LaunchedNode
from kvrt.ipc.ports import free_port

PROBE_GAP_S = 0.1
PROBE = {"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}
TEXT = "hello world " * (4_600_000 // 12)
ATTACKS = ("tokenize", "long-prompt", "detokenize", "messages", "logprobs", "burst", "unread", "big-answer",
           "via-router")
BIGGEST = {"prompt": [(3 * j) % 200 + 1 for j in range(4000)], "n": 12, "prompt_logprobs": 20, "max_tokens": 1}


@dataclass
class Row:
    attack: str
    outcome: str          # how the attack's own requests were answered
    probes: int           # the probe's requests answered during the attack
    probe_p50_ms: float
    probe_max_ms: float
    idle_max_ms: float
    ratio: float          # probe_max_ms / idle_max_ms
    growth_mib: float     # the launcher's (or router's) resident memory, peak minus before
    alive: bool


class Probe:
    """The other client: an ordinary request every PROBE_GAP_S from 127.0.0.2, timed; the
    watched process's resident memory sampled beside it. Its first request is sent whenever the
    window ends: on a loaded machine setting its HTTP client up can outlast a short window, which
    then had no answer to measure."""

    def __init__(self, base: str, model: str, watched: int) -> None:
        self.base, self.model, self.watched = base, model, psutil.Process(watched)
        self.times: list[float] = []
        self.sent = 0
        self.peak = self.start_rss = self.watched.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Probe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(130)

    def _run(self) -> None:
        with httpx2.Client(transport=httpx2.HTTPTransport(local_address="127.0.0.2"), timeout=120) as c:
            while True:
                t0 = time.monotonic()
                self.sent += 1
                try:
                    r = c.post(self.base + "/v1/completions", json={"model": self.model, **PROBE})
                    if r.status_code == 200:
                        self.times.append(time.monotonic() - t0)
                except httpx2.HTTPError:
                    pass
                with contextlib.suppress(psutil.Error):
                    self.peak = max(self.peak, self.watched.memory_info().rss)
                if self._stop.wait(PROBE_GAP_S):
                    return


def _post(base: str, path: str, body: dict, timeout: float = 300) -> str:
    """One attacking request from 127.0.0.1: its status (and error code)."""
    try:
        with httpx2.Client(timeout=timeout) as c:
            r = c.post(base + path, json=body)
    except httpx2.HTTPError as e:
        return f"failed: {type(e).__name__}"
    code = ""
    if r.status_code != 200:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            code = f" {r.json()['error']['code']}"
    return f"{r.status_code}{code} ({len(r.content) / 2**20:.1f} MiB)"


def _held(port: int, model: str, n: int, stream: bool, hold_s: float) -> str:
    """`n` requests of 2,000 tokens on sockets that read nothing, held `hold_s`, then closed."""
    socks = []
    try:
        for i in range(n):
            raw = json.dumps({"model": model, "prompt": [1 + i % 200, 2, 3], "max_tokens": 2000, "ignore_eos": True,
                              "stream": stream}).encode()
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\n\r\n" % len(raw) + raw)
            socks.append(s)
        time.sleep(hold_s)
    finally:
        for s in socks:
            s.close()
    return f"{n} requests held {hold_s:g} s"


def _attack(name: str, base: str, port: int, model: str, hold_s: float) -> Callable[[], str]:
    return {
        "tokenize": lambda: _post(base, "/tokenize", {"model": model, "prompt": TEXT}),
        "long-prompt": lambda: _post(base, "/v1/completions", {"model": model, "prompt": TEXT, "max_tokens": 1}),
        "detokenize": lambda: _post(base, "/detokenize", {"model": model, "tokens": [5] * 1_000_000}),
        "messages": lambda: _post(base, "/v1/chat/completions", {
            "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}] * 100_000}),
        "logprobs": lambda: _post(base, "/v1/completions", {
            "model": model, "prompt": [[(7 * i + j) % 200 + 1 for j in range(4000)] for i in range(4)], "n": 16,
            "prompt_logprobs": 20, "max_tokens": 1}),
        "burst": lambda: _held(port, model, 200, False, hold_s),
        "unread": lambda: _held(port, model, 200, True, hold_s),
        "big-answer": lambda: _post(base, "/v1/completions", {"model": model, **BIGGEST}),
        "via-router": lambda: _post(base, "/v1/completions", {"model": model, **BIGGEST}),
    }[name]


def _idle(base: str, model: str, watched: int, seconds: float) -> float:
    with Probe(base, model, watched) as p:
        time.sleep(seconds)
    if not p.times:
        raise RuntimeError(f"the idle node answered none of the probe's {p.sent} requests")
    return max(p.times)


def _row(name: str, attack: Callable[[], str], base: str, model: str, watched: int, idle_max: float,
         alive: Callable[[], bool]) -> Row:
    with Probe(base, model, watched) as p:
        time.sleep(0.5)
        outcome = attack()
        time.sleep(0.5)
    times = p.times or [float("nan")]
    worst = max(times)
    return Row(name, outcome, len(p.times), statistics.median(times) * 1e3, worst * 1e3, idle_max * 1e3,
               worst / idle_max, (p.peak - p.start_rss) / 2**20, alive())


@contextlib.contextmanager
def _router(backend: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvrt.launcher", "route", "--port", str(port), "--backends",
                             backend, "--policy", "round-robin"], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if json.loads(r.read())["status"] == "ok":
                        break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("kvrt route did not become healthy within 30 s")
            time.sleep(0.1)  # waiting for another process
        yield base, proc
    finally:
        interrupt(proc, 20)


def run(attacks: list[str], model_dir: str, flags: list[str], hold_s: float, idle_s: float,
        say: Callable[[str], None]) -> list[Row]:
    http = free_port()
    args = ["--http-port", str(http), *(["--model", model_dir] if model_dir else []), *flags]
    node = LaunchedNode.ready(f"bench-attacks-{os.getpid()}", args, say)
    base = f"http://127.0.0.1:{http}"
    rows = []
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(base + "/v1/models", timeout=2) as r:
                    model = json.loads(r.read())["data"][0]["id"]
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("the node's HTTP API did not answer within 30 s")
            time.sleep(0.1)  # waiting for another process
        launcher = node.proc.pid
        idle = _idle(base, model, launcher, idle_s)
        say(f"idle: the probe's worst answer took {idle * 1e3:.0f} ms")
        for name in attacks:
            if node.proc.poll() is not None:
                say(f"the node stopped before {name}")
                break
            say(f"attack {name} ...")
            if name == "via-router":
                with _router(base) as (via, proc):
                    via_idle = _idle(via, model, proc.pid, idle_s)
                    rows.append(_row(name, _attack(name, via, http, model, hold_s), via, model, proc.pid, via_idle,
                                     lambda: node.proc.poll() is None and proc.poll() is None))
            else:
                rows.append(_row(name, _attack(name, base, http, model, hold_s), base, model, launcher, idle,
                                 lambda: node.proc.poll() is None))
            time.sleep(1.0)  # (what the attack left in flight is cancelled before the next)
    finally:
        node.stop()
    return rows


def print_table(rows: list[Row]) -> None:
    print(f"{'attack':12} {'probes':>6} {'p50 ms':>8} {'max ms':>8} {'idle max':>9} {'ratio':>6} {'growth MiB':>11} "
          f"{'alive':>5}  attack's answer")
    for r in rows:
        print(f"{r.attack:12} {r.probes:>6} {r.probe_p50_ms:>8.0f} {r.probe_max_ms:>8.0f} {r.idle_max_ms:>9.0f} "
              f"{r.ratio:>6.1f} {r.growth_mib:>11.0f} {str(r.alive):>5}  {r.outcome}")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvrt bench attacks", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="", help="a checkpoint directory to serve (default: the reference model)")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help=f"which, comma-separated (default: all: "
                                                                 f"{','.join(ATTACKS)})")
    ap.add_argument("--hold-s", type=float, default=15.0, help="how long the burst and the unread streams are held")
    ap.add_argument("--idle-s", type=float, default=3.0, help="how long the probe is timed before the attacks")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("launch_flags", nargs="*", help="more `kvrt launch` flags, after --")
    args = ap.parse_args(argv)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # (a line per request otherwise)
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = sorted(set(attacks) - set(ATTACKS))
    if unknown:
        ap.error(f"unknown attacks: {', '.join(unknown)} (known: {', '.join(ATTACKS)})")
    rows = run(attacks, args.model, args.launch_flags, args.hold_s, args.idle_s,
               lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        print_table(rows)
    return 0 if all(r.alive for r in rows) else 1
