"""kvrt bench route: N nodes behind `kvrt route`, the conversation trace replayed over HTTP once
per routing policy, next to one node holding all the cache.

It launches N nodes (HTTP and KV events on, small device pools so that the cache, not compute,
decides) and, beside them, one node with the N pools' blocks together. For each policy
(cache-aware, round-robin, least-load) a router starts in front of the N nodes and the first
--limit trace requests go through its /v1/completions (token-id prompts, streamed, --concurrency
in flight, in trace order); then the single node takes the same requests directly: the hit rate
one cache of the same total size reaches, which cache-aware routing should approach and
round-robin cannot (it spreads a conversation's turns over nodes that would each have to hold
every conversation). The nodes are launched once: each run's prompts are the trace's with every
token id shifted by a run-specific constant modulo the vocabulary (a bijection, so the trace's
sharing is kept exactly), so no run hits blocks an earlier run left behind, and every run starts
with the nodes' prefix caches reset: an earlier run's blocks are not simply the first to go (the
default eviction policy's reuse bonus keeps blocks that were reused over fresh ones), so without
the reset each run would start from what the runs before it left, and later runs hit less.

Reported per policy: the token hit rate from the nodes' own counters (prompt tokens served by
their prefix caches over prompt tokens asked, every tier, summed over the nodes), TTFT p50/p99
(time to the first streamed token, queueing included), throughput, failures, and the ideal hit
rate for the same requests (an unlimited single cache, one request at a time). Trace ids are
scaled to --tokens-per-id tokens as in `kvrt bench replay`, which keeps the trace's sharing.

`--peer sglang-router` (bench/peer_router.py) runs the same requests through SGLang's router
(cache-aware) beside `kvrt route`, in front of the same nodes, twice: with roomy pools (the
default size) and with pools too small for the working set (--small-blocks); prompts go as
text then (SGLang's router refuses token ids), one byte per token. Then each router's own cost:
one node, one request at a time (one new token, not streamed), sent directly, through `kvrt
route` and through the peer in turn; its overhead is its p50 latency minus the direct one's, and
its CPU per request the CPU time its process used over those requests. `--cost-only` runs just
that part, in front of one node, or with `--cost-backend instant` in front of a backend that
answers at once (bench/instant_backend.py: no node's time, and its jitter, in the measure).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import numpy as np

from kvrt.bench.interrupt import interrupt
from kvrt.ipc.ports import free_port, free_port_pair
from kvrt.bench.nodes import REPO, LaunchedNode
from kvrt.bench.peer_router import PEER_POLICY, PEERS, PeerRouter, installed
from kvrt.bench.synthetic import PREFIX, TRACES, synthetic
from kvrt.runtime.cache.keys import BlockHasher
from kvrt.runtime.client.replay import PromptSpec, add_trace_args, check_trace_args, fmt, load_requests, pct, trace_prompts
from kvrt.runtime.client.trace import ideal_hit_tokens
from kvrt.runtime.node.status import snapshot

POLICIES = ("cache-aware", "round-robin", "least-load")
ONE_NODE = "one node, all the cache"
MODEL = "kvrt-reference"
VOCAB = 512
MAX_MODEL_LEN = 4096
READY_S = 120.0
SHAPE = ("--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16")  # 4 KiB blocks: pools launch fast


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvrt bench route", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_args(p, limit=400, tokens_per_id=8, concurrency=4, cap=4, speed=0.0)
    p.add_argument("--nodes", type=int, default=4, metavar="N", help="nodes behind the router (default 4)")
    p.add_argument("--block-size", type=int, default=8,
                   help="tokens per KV block (default 8: a trace id's 8 tokens, so the trace's sharing shows "
                        "at this scale)")
    p.add_argument("--num-gpu-blocks", type=int, default=0, metavar="B",
                   help="device blocks per node (default 0: the run's distinct prompt blocks x 1.2 / N, plus room "
                        "for the requests in flight; the one-node row gets N x B)")
    p.add_argument("--policies", default=",".join(POLICIES), metavar="P,P",
                   help=f"policies to run, comma-separated (default {','.join(POLICIES)})")
    p.add_argument("--peer", choices=PEERS, default=None,
                   help="also run the requests through this router (cache-aware) in front of the same nodes, with "
                        "roomy and with small pools, and compare each router's own cost per request; skipped, with "
                        "a message, when it is not installed")
    p.add_argument("--small-blocks", type=int, default=0, metavar="B",
                   help="--peer: device blocks per node of the small pools (default 0: a third of the roomy ones)")
    p.add_argument("--overhead-requests", type=int, default=150, metavar="N",
                   help="--peer: requests sent one at a time to each of direct, kvrt route and the peer to "
                        "measure each router's own cost (default 150; 0: skip)")
    p.add_argument("--cost-only", action="store_true",
                   help="only each router's own cost per request (one node; --peer's router beside kvrt route when "
                        "given and installed): no trace is replayed")
    p.add_argument("--cost-backend", choices=("node", "instant"), default="node",
                   help="--cost-only: the backend behind the routers: a node, or a backend that answers every "
                        "completion at once, without computing (default node)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    name = str(args.trace or "")
    args.synthetic = name[len(PREFIX):] if name.startswith(PREFIX) else ""
    if args.synthetic:  # a generated trace (bench/synthetic.py): checked here, not as a file
        family, _, seed = args.synthetic.partition(":")
        if family not in TRACES or (seed and not seed.isdigit()):
            p.error(f"--trace {name}: known synthetic traces are {', '.join(TRACES)} (optionally NAME:SEED)")
        args.trace = None
    if not args.cost_only:  # (which replays no trace)
        check_trace_args(p, args)
    elif not args.timeout > 0:
        p.error(f"--timeout must be > 0, got {args.timeout}")
    if args.synthetic:
        args.trace = Path(PREFIX + args.synthetic)
    if args.nodes < 1:
        p.error(f"--nodes must be >= 1, got {args.nodes}")
    args.policies = [x for x in args.policies.split(",") if x]
    bad = [x for x in args.policies if x not in POLICIES]
    if bad:
        p.error(f"unknown policy {bad[0]!r}: one of {', '.join(POLICIES)}")
    if args.small_blocks < 0 or args.overhead_requests < 0:
        p.error("--small-blocks and --overhead-requests must be >= 0")
    if args.cost_only and not args.overhead_requests:
        p.error("--cost-only measures with --overhead-requests requests: give it > 0")
    if args.cost_backend != "node" and not args.cost_only:
        p.error("--cost-backend goes with --cost-only")
    args.parser = p
    return args


def distinct_blocks(specs: list[PromptSpec], block_size: int) -> int:
    """Distinct full prompt blocks of the run (what an unlimited cache would end up holding)."""
    keys: set[bytes] = set()
    for s in specs:
        keys.update(BlockHasher(block_size).update(s.prompt))
    return len(keys)


def pool_blocks(specs: list[PromptSpec], args: argparse.Namespace) -> int:
    if args.num_gpu_blocks > 0:
        return args.num_gpu_blocks
    longest = max(-(-(len(s.prompt) + s.max_new_tokens) // args.block_size) for s in specs)
    return -(-distinct_blocks(specs, args.block_size) * 12 // (10 * args.nodes)) + args.concurrency * (longest + 1)


class Fleet:
    """N nodes with HTTP and KV events (and, for a policy, a router in front); all stopped on exit."""

    def __init__(self, n: int, blocks: int, block_size: int, say, tag: str):
        self.say = say
        self.blocks = blocks
        self.nodes: list[LaunchedNode] = []
        self.http: list[int] = []
        for i in range(n):
            h = free_port()
            ev = free_port_pair()
            self.nodes.append(LaunchedNode(f"broute{os.getpid()}{tag}{i}", free_port(), [
                "--block-size", str(block_size), "--num-gpu-blocks", str(blocks), "--http-port", str(h),
                "--kv-events-port", str(ev), "--max-model-len", str(MAX_MODEL_LEN), *SHAPE], say, READY_S))
            self.http.append(h)
        self.router: subprocess.Popen | None = None
        self._router_log = None

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{h}" for h in self.http]

    def wait_ready(self) -> None:
        for node, h in zip(self.nodes, self.http):
            node.wait_ready()
            _wait_http(f"http://127.0.0.1:{h}", f"node {node.name}")

    def route(self, policy: str, urls: list[str] | None = None) -> str:
        """Start `kvrt route` in front of the nodes (or of `urls`); its base URL once healthy."""
        port = free_port()
        self._router_log = tempfile.NamedTemporaryFile("w+", prefix="kvrt-bench-route-", suffix=".log", delete=False)
        self.router = subprocess.Popen([sys.executable, "-m", "kvrt.launcher", "route", "--port", str(port), "--backends",
                                        ",".join(urls or self.urls), "--policy", policy], cwd=REPO, stdout=self._router_log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        _wait_http(base, "the router", self.router)
        return base

    def reset_caches(self) -> None:
        """Empty every node's prefix cache (`POST /reset_prefix_cache`), so that a run starts as
        the first one did: see the module docstring."""
        for url in self.urls:
            r = httpx2.post(url + "/reset_prefix_cache", timeout=READY_S)
            if r.status_code != 200:
                raise RuntimeError(f"{url} did not reset its prefix cache: HTTP {r.status_code}: {r.text[:200]}")

    def counters(self) -> tuple[list[int], list[int], list[int]]:
        """Per node: prompt tokens asked, prompt tokens served from a cache, requests finished."""
        asked, hit, done = [], [], []
        for node in self.nodes:
            e = snapshot(node.name)["engine"]
            asked.append(e["query_tokens"])
            hit.append(e["hit_tokens_device"] + e["hit_tokens_host"] + e["hit_tokens_storage"])
            done.append(e["finished_requests"])
        return asked, hit, done

    def stop_router(self) -> None:
        if self.router is None:
            return
        if not interrupt(self.router, 20):
            self.say("the router did not stop within 20 s of SIGINT: killed it")
        self._router_log.close()
        if self.router.returncode == 0:
            Path(self._router_log.name).unlink(missing_ok=True)
        else:
            self.say(f"note: the router exited with code {self.router.returncode}; log: {self._router_log.name}")
        self.router = None

    def stop(self) -> None:
        self.stop_router()
        for node in self.nodes:
            rc = node.stop()
            if rc not in (0, None):
                self.say(f"note: node {node.name} exited with code {rc}; log: {node.log_path}")


def _wait_http(base: str, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + READY_S
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            if httpx2.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx2.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} at {base} was not healthy within {READY_S:g} s")
        time.sleep(0.1)  # waiting for another process to start


def as_text(prompt: np.ndarray) -> str:
    """A token-id prompt as text the byte tokenizer reads back one token per id: printable ASCII,
    so equal prefixes stay equal (and unequal ones of a block's length differ but by chance)."""
    return "".join(chr(33 + int(t) % 94) for t in prompt)


def _first_token(line: str) -> bool:
    """Whether an event-stream line carries generated tokens (token ids or text)."""
    if not line.startswith("data: {"):
        return False
    flat = line.replace(" ", "")
    return ('"token_ids":[' in flat and '"token_ids":[]' not in flat) or ('"text":"' in flat and '"text":""' not in flat)


def send_all(base: str, specs: list[PromptSpec], concurrency: int, timeout: float, text: bool = False) -> dict:
    """Every request through `base` (streamed, `concurrency` in flight, in order; prompts as
    text when `text`): TTFTs, failures."""
    ttfts: list[float] = []
    failed: list[str] = []
    lock = threading.Lock()
    client = httpx2.Client(timeout=httpx2.Timeout(timeout, connect=10.0),
                          limits=httpx2.Limits(max_connections=concurrency * 2))

    def one(spec: PromptSpec) -> None:
        body = {"model": MODEL, "prompt": as_text(spec.prompt) if text else spec.prompt.tolist(),
                "max_tokens": spec.max_new_tokens,
                "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        first = None
        try:
            with client.stream("POST", base + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                for line in r.iter_lines():
                    if first is None and _first_token(line):
                        first = time.perf_counter() - t0
            with lock:
                if first is None:
                    failed.append("no token streamed")
                else:
                    ttfts.append(first * 1e3)
        except (httpx2.HTTPError, RuntimeError) as e:
            with lock:
                failed.append(str(e) or type(e).__name__)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, specs))
    wall = time.perf_counter() - t0
    client.close()
    return {"ttfts": ttfts, "failed": failed, "wall_s": wall}


def shifted(specs: list[PromptSpec], k: int) -> list[PromptSpec]:
    """The same requests with every token id + 97k modulo the vocabulary: equal prefixes stay equal,
    and no block key of one run equals one of another run."""
    return [PromptSpec((s.prompt.astype(np.int64) + 97 * k) % VOCAB, s.max_new_tokens, s.arrival_s, s.eos_token_id,
                       s.tag, s.trace) for s in specs]


def measure(name: str, fleet: Fleet, base: str, specs: list[PromptSpec], args: argparse.Namespace, say,
            ideal: float | None, text: bool = False, pool: str | None = None) -> dict:
    """Send `specs` through `base`; the hit rate from `fleet`'s counters over this run."""
    say(f"{name}: {len(fleet.nodes)} node(s) x {fleet.blocks} device blocks, {len(specs)} requests")
    fleet.reset_caches()
    before = fleet.counters()
    sent = send_all(base, specs, args.concurrency, args.timeout, text)
    time.sleep(0.3)  # the engines publish their counters once per loop turn
    after = fleet.counters()
    # how the requests spread over the nodes, from the nodes' own counts (a router's may differ: retries)
    routed = [int(a - b) for a, b in zip(after[2], before[2])] if len(fleet.nodes) > 1 else None
    node_asked = [a - b for a, b in zip(after[0], before[0])]
    node_hit = [a - b for a, b in zip(after[1], before[1])]
    asked, hit = sum(node_asked), sum(node_hit)
    # each node's own hit rate: how evenly a placement lets the nodes' caches keep their reuse
    node_rates = [h / a if a else None for h, a in zip(node_hit, node_asked)] if len(fleet.nodes) > 1 else None
    t = np.asarray(sent["ttfts"]) if sent["ttfts"] else None
    if sent["failed"]:
        say(f"{name}: {len(sent['failed'])} failed, e.g. {sent['failed'][0]}")
    return {"policy": name, **({"pool": pool} if pool else {}), "nodes": len(fleet.nodes), "blocks_per_node": fleet.blocks,
            "hit_token_rate": hit / asked if asked else None, "ideal_hit_token_rate": ideal,
            "ttft_p50_ms": float(np.percentile(t, 50)) if t is not None else None,
            "ttft_p99_ms": float(np.percentile(t, 99)) if t is not None else None,
            "requests": len(specs), "failed": len(sent["failed"]), "wall_s": sent["wall_s"],
            "req_per_s": len(sent["ttfts"]) / sent["wall_s"] if sent["wall_s"] else None,
            "prompt_tokens": asked, "routed_per_node": routed, "hit_rate_per_node": node_rates}


PEER_ROW = "sglang-router " + PEER_POLICY
GAP_S = 0.02
COST_BLOCKS = 256  # --cost-only: the one node's device blocks (its requests are one token long)


def overhead(fleet: Fleet, n: int, timeout: float, peer_name: str | None = PEERS[0], url: str = "") -> dict:
    """Each router's own cost per request: one node, one request at a time (a 1-token prompt
    asking one new token, not streamed), sent directly, through `kvrt route` and through the
    peer (when `peer_name`) in turn, so that all of them see the same moments of a noisy machine.
    GAP_S apart: a node answers a request that arrives just as its previous one finished some
    40 ms late, which would charge whichever target comes next in the turn. Besides the p50s'
    difference, the median of each turn's difference (paired: the node's own jitter from one
    moment to the next, larger than a router's cost, is taken out where it is shared). `url`: the
    backend (default the fleet's first node)."""
    url = url or fleet.urls[0]
    kvrt_base = fleet.route("cache-aware", [url])
    peer = PeerRouter([url]) if peer_name else None
    try:
        targets = {"direct": url, "kvrt route": kvrt_base}
        pids = {"kvrt route": fleet.router.pid}
        if peer is not None:
            _wait_http(peer.base, "the peer router", peer.proc)
            targets[PEER_ROW] = peer.base
            pids[PEER_ROW] = peer.proc.pid
        lat: dict[str, list[float]] = {k: [] for k in targets}
        cpu0: dict[str, float] = {}
        with httpx2.Client(timeout=timeout) as client:
            for i in range(n + 5):  # the first 5 of each warm connections and caches up
                if i == 5:
                    cpu0 = {k: cpu_s(pid) for k, pid in pids.items()}
                for name, base in targets.items():
                    body = {"model": MODEL, "prompt": as_text(np.asarray([i % 94])), "max_tokens": 1, "temperature": 0}
                    time.sleep(GAP_S)  # see the docstring
                    t0 = time.perf_counter()
                    r = client.post(base + "/v1/completions", json=body)
                    dt = (time.perf_counter() - t0) * 1e3
                    if r.status_code != 200:
                        raise RuntimeError(f"{name}: HTTP {r.status_code}: {r.text[:200]}")
                    if i >= 5:
                        lat[name].append(dt)
        cpu_ms = {k: (cpu_s(pid) - cpu0[k]) * 1e3 / n for k, pid in pids.items()} if n else {}
    finally:
        if peer is not None:
            peer.stop()
        fleet.stop_router()
    p50 = {k: float(np.percentile(v, 50)) for k, v in lat.items()}
    direct = np.asarray(lat["direct"])
    return {"requests": n, "p50_ms": p50,
            "overhead_p50_ms": {k: p50[k] - p50["direct"] for k in targets if k != "direct"},
            "paired_overhead_p50_ms": {k: float(np.median(np.asarray(v) - direct)) for k, v in lat.items()
                                       if k != "direct"},
            "cpu_ms_per_request": cpu_ms}


def cpu_s(pid: int) -> float:
    """The CPU seconds (user and system, all threads) process `pid` has used so far (Linux):
    a router's cost that the machine's other load inflates less than its latency."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peer_run(args: argparse.Namespace, specs: list[PromptSpec], ideal: float | None, say) -> dict:
    """`--peer`: kvrt's policies and the peer in front of the same nodes, roomy then small pools
    (prompts as text), then each router's cost per request."""
    roomy = pool_blocks(specs, args)
    small = args.small_blocks or max(1, roomy // 3)
    results, cost, k = [], None, 0
    for pool, blocks in (("roomy", roomy), ("small", small)):
        fleet = Fleet(args.nodes, blocks, args.block_size, say, pool[0])
        try:
            fleet.wait_ready()
            for policy in args.policies:
                results.append(measure(policy, fleet, fleet.route(policy), shifted(specs, k), args, say, ideal,
                                       text=True, pool=pool))
                fleet.stop_router()
                k += 1
            peer = PeerRouter(fleet.urls)
            try:
                _wait_http(peer.base, "the peer router", peer.proc)
                results.append(measure(PEER_ROW, fleet, peer.base, shifted(specs, k), args, say, ideal, text=True,
                                       pool=pool))
            finally:
                peer.stop()
            k += 1
            if pool == "roomy" and args.overhead_requests:
                cost = overhead(fleet, args.overhead_requests, args.timeout)
        finally:
            fleet.stop()
    ratios = {}
    for pool in ("roomy", "small"):
        rows = {r["policy"]: r for r in results if r.get("pool") == pool}
        ca, peer_row = rows.get("cache-aware"), rows.get(PEER_ROW)
        if ca and peer_row:
            ratios[pool] = {key: (ca[key] / peer_row[key] if ca[key] is not None and peer_row[key] else None)
                            for key in ("hit_token_rate", "ttft_p50_ms", "ttft_p99_ms", "req_per_s")}
    return {"results": results, "blocks_per_node": {"roomy": roomy, "small": small},
            "kvrt_over_peer": ratios, "router_cost": cost}


def render_peer(out: dict) -> str:
    c = out["config"]
    lines = [f"kvrt bench route --peer {c['peer']}: first {c['requests']} requests of {Path(c['trace']).name} as text, "
             f"{c['tokens_per_id']} tokens per trace id, block {c['block_size']}, at most {c['max_new_tokens_cap']} "
             f"new tokens, concurrency {c['concurrency']}; {c['nodes']} nodes x {c['blocks_per_node']['roomy']} "
             f"(roomy) or {c['blocks_per_node']['small']} (small) device blocks", "",
             f"{'pool':<7}{'router':<28}{'hit rate':>10}{'ideal':>10}{'TTFT p50':>11}{'TTFT p99':>11}{'req/s':>8}"
             f"{'failed':>8}  per node"]
    for r in out["results"]:
        name = r["policy"] if r["policy"] == PEER_ROW else "kvrt route " + r["policy"]
        lines.append(f"{r['pool']:<7}{name:<28}{pct(r['hit_token_rate']):>10}{pct(r['ideal_hit_token_rate']):>10}"
                     f"{fmt(r['ttft_p50_ms'], '.1f', ' ms'):>11}{fmt(r['ttft_p99_ms'], '.1f', ' ms'):>11}"
                     f"{fmt(r['req_per_s'], '.2f'):>8}{r['failed']:>8}  "
                     f"{'/'.join(map(str, r['routed_per_node'])) if r['routed_per_node'] else ''}")
    for pool, q in out["kvrt_over_peer"].items():
        lines.append(f"\n{pool} pools, kvrt cache-aware / {PEER_ROW}: hit rate {fmt(q['hit_token_rate'], '.2f', 'x')}"
                     f" (goal >= {'1.10' if pool == 'small' else '1.00'}x), TTFT p50 {fmt(q['ttft_p50_ms'], '.2f', 'x')},"
                     f" p99 {fmt(q['ttft_p99_ms'], '.2f', 'x')} (goal <= 1.00x), req/s {fmt(q['req_per_s'], '.2f', 'x')}")
    if out["router_cost"]:
        lines += ["", render_cost(out["router_cost"])]
    return "\n".join(lines)


def render_cost(cost: dict) -> str:
    """Each router's cost per request: its latency over direct, its CPU, and kvrt's over the peer's."""
    o, p50, cpu = cost["overhead_p50_ms"], cost["p50_ms"], cost.get("cpu_ms_per_request") or {}
    lines = [f"router cost, one backend, one request at a time ({cost['requests']} each, p50 latency over direct "
             f"{p50['direct']:.2f} ms): " + ", ".join(f"{k} +{v:.2f} ms" for k, v in o.items())]
    if paired := cost.get("paired_overhead_p50_ms"):
        lines.append("median of each turn's latency over that turn's direct one: "
                     + ", ".join(f"{k} +{v:.2f} ms" for k, v in paired.items()))
    if cpu:
        lines.append("router CPU per request (its process, all threads): "
                     + ", ".join(f"{k} {v:.2f} ms" for k, v in cpu.items()))
    if PEER_ROW in o:
        lat = o["kvrt route"] / o[PEER_ROW] if o[PEER_ROW] > 0 else None
        pq = paired["kvrt route"] / paired[PEER_ROW] if paired and paired[PEER_ROW] > 0 else None
        c = cpu["kvrt route"] / cpu[PEER_ROW] if cpu.get(PEER_ROW) else None
        lines.append(f"kvrt route / {PEER_ROW}: cost {fmt(lat, '.2f', 'x')} (goal <= 1.00x), paired "
                     f"{fmt(pq, '.2f', 'x')}, CPU {fmt(c, '.2f', 'x')}")
    return "\n".join(lines)


def render(out: dict) -> str:
    c = out["config"]
    lines = [f"kvrt bench route: first {c['requests']} requests of {Path(c['trace']).name}, {c['tokens_per_id']} "
             f"tokens per trace id, block {c['block_size']}, at most {c['max_new_tokens_cap']} new tokens, "
             f"concurrency {c['concurrency']}; {c['nodes']} nodes x {c['blocks_per_node']} device blocks", "",
             f"{'policy':<26}{'hit rate':>10}{'ideal':>10}{'TTFT p50':>11}{'TTFT p99':>11}{'req/s':>8}"
             f"{'requests':>10}{'failed':>8}  per node"]
    for r in out["results"]:
        lines.append(f"{r['policy']:<26}{pct(r['hit_token_rate']):>10}{pct(r['ideal_hit_token_rate']):>10}"
                     f"{fmt(r['ttft_p50_ms'], '.1f', ' ms'):>11}{fmt(r['ttft_p99_ms'], '.1f', ' ms'):>11}"
                     f"{fmt(r['req_per_s'], '.2f'):>8}{r['requests']:>10}{r['failed']:>8}  "
                     f"{'/'.join(map(str, r['routed_per_node'])) if r['routed_per_node'] else ''}")
    rates = {r["policy"]: r["hit_token_rate"] for r in out["results"]}
    ca, rr, one = rates.get("cache-aware"), rates.get("round-robin"), rates.get(ONE_NODE)
    if ca is not None and rr:
        lines.append(f"\ncache-aware / round-robin hit rate: {ca / rr:.2f}x (goal >= 1.5x)")
    if ca is not None and one:
        lines.append(f"cache-aware / one node: {ca / one:.2f} (goal >= 0.90)")
    return "\n".join(lines)


def cost_only(args: argparse.Namespace, say) -> int:
    """`--cost-only`: each router's cost per request in front of one node, or of a backend that
    answers at once, nothing else."""
    instant = args.cost_backend == "instant"
    fleet = Fleet(0 if instant else 1, COST_BLOCKS, args.block_size, say, "c")
    backend = None
    try:
        if instant:
            port = free_port()
            backend = subprocess.Popen([sys.executable, "-m", "kvrt.bench.instant_backend", str(port)], cwd=REPO,
                                       stdin=subprocess.DEVNULL)
            url = f"http://127.0.0.1:{port}"
            _wait_http(url, "the instant backend", backend)
        else:
            fleet.wait_ready()
            url = fleet.urls[0]
        cost = overhead(fleet, args.overhead_requests, args.timeout, args.peer, url)
    except KeyboardInterrupt:
        say("kvrt bench route: interrupted")
        return 130
    except RuntimeError as e:
        say(f"kvrt bench route: error: {e}")
        return 1
    finally:
        fleet.stop()
        if backend is not None:
            interrupt(backend, 10)
    out = {"config": {"peer": args.peer, "requests": args.overhead_requests, "backend": args.cost_backend},
           "router_cost": cost}
    print(json.dumps(out, indent=1) if args.json else render_cost(cost))
    return 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # not a line per request

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.peer and not installed(args.peer):
        say(f"kvrt bench route: {args.peer} is not installed (pip install {args.peer}): the peer is skipped")
        args.peer = None
    if args.cost_only:
        return cost_only(args, say)
    requests = synthetic(args.synthetic)[:args.limit] if args.synthetic else load_requests(args.parser, args)
    specs = trace_prompts(requests, args.tokens_per_id, vocab_size=VOCAB, max_new_tokens_cap=args.max_new_tokens_cap,
                          max_model_len=MAX_MODEL_LEN)
    scaled = [s.trace for s in specs]
    total = sum(t.input_length for t in scaled)
    ideal = ideal_hit_tokens(scaled, args.block_size, args.tokens_per_id) / total if total else None
    if args.peer:
        try:
            peer = peer_run(args, specs, ideal, say)
        except KeyboardInterrupt:
            say("kvrt bench route: interrupted")
            return 130
        except RuntimeError as e:
            say(f"kvrt bench route: error: {e}")
            return 1
        out = {"config": {"trace": str(args.trace), "requests": len(specs), "tokens_per_id": args.tokens_per_id,
                          "block_size": args.block_size, "max_new_tokens_cap": args.max_new_tokens_cap,
                          "concurrency": args.concurrency, "nodes": args.nodes, "peer": args.peer,
                          "blocks_per_node": peer.pop("blocks_per_node")}, **peer}
        print(json.dumps(out, indent=1) if args.json else render_peer(out))
        return 1 if any(r["failed"] for r in out["results"]) else 0
    blocks = pool_blocks(specs, args)
    results = []
    fleet = Fleet(args.nodes, blocks, args.block_size, say, "n")
    single = Fleet(1, blocks * args.nodes, args.block_size, say, "s")
    try:
        fleet.wait_ready()
        single.wait_ready()
        for k, policy in enumerate(args.policies):
            results.append(measure(policy, fleet, fleet.route(policy), shifted(specs, k), args, say, ideal))
            fleet.stop_router()
        results.append(measure(ONE_NODE, single, single.urls[0], specs, args, say, ideal))
    except KeyboardInterrupt:
        say("kvrt bench route: interrupted")
        return 130
    except RuntimeError as e:
        say(f"kvrt bench route: error: {e}")
        return 1
    finally:
        fleet.stop()
        single.stop()
    out = {"config": {"trace": str(args.trace), "requests": len(specs), "tokens_per_id": args.tokens_per_id,
                      "block_size": args.block_size, "max_new_tokens_cap": args.max_new_tokens_cap,
                      "concurrency": args.concurrency, "nodes": args.nodes, "blocks_per_node": blocks},
           "results": results}
    print(json.dumps(out, indent=1) if args.json else render(out))
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
