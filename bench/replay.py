"""kvrt bench replay: a trace against a node this command launches, prefix cache on vs off.

Starts its own node (`python -m kvrt.launcher launch --port P ...`), waits until it answers `info()`,
replays N trace requests (--select: by default whole multi-turn conversations, so that even a
small --limit has prefixes to reuse) with the prefix cache on, then the same requests with it off
(`use_cache=False`: nothing matched, nothing recorded), and stops the node with SIGINT. Reported
side by side: TTFT (mean, p50, p99), prompt tokens computed, hit rates per tier, wall time, and
the off/on ratios; next to them the trace's ideal hit rate for exactly the prompts sent (an
unlimited cache, one request at a time, at the node's block size).

Each trace id stands for --tokens-per-id tokens instead of 512 (runtime/client/replay.py), which keeps
the trace's sharing at a fraction of the compute. Requests are sent as fast as --concurrency
allows (the trace's clock is ignored unless --speed is given), so TTFT includes queueing.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import numpy as np

from kvrt.ipc.ports import free_port
from kvrt.bench.nodes import LaunchedNode
from kvrt.runtime.client.client import Client, ClientError
from kvrt.runtime.client.replay import (ProgressBar, add_trace_args, check_trace_args, fit_requests, fmt, pct, replay,
                            scaled_length, select_requests, trace_prompts)
from kvrt.runtime.client.trace import ideal_hit_tokens

AUTO_BLOCKS_MAX = 16384


def parse_args(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="kvrt bench replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_args(p, limit=500, tokens_per_id=8, concurrency=4, cap=8, speed=0.0, select="conversations")
    p.add_argument("--block-size", type=int, default=16, help="the node's tokens per KV block (default 16)")
    p.add_argument("--num-gpu-blocks", type=int, default=0,
                   help=f"the node's device blocks (default 0: enough for every prompt of the run, so nothing is "
                        f"evicted, at most {AUTO_BLOCKS_MAX})")
    p.add_argument("--num-cpu-blocks", type=int, default=0, help="the node's host blocks (default 0)")
    p.add_argument("--port", type=int, default=0, help="the node's client API port (default: a free one)")
    p.add_argument("--launch-args", default="", metavar="ARGS",
                   help="more options for `kvrt launch`, one string (e.g. \"--max-num-seqs 8\")")
    p.add_argument("--ready-timeout", type=float, default=120.0, metavar="S",
                   help="seconds to wait for the node to answer (default 120)")
    p.add_argument("--only", choices=["on", "off"], default=None, help="run one side only")
    p.add_argument("--log", type=Path, default=None, metavar="FILE",
                   help="the node's output (default: a temporary file, shown if the node fails)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    check_trace_args(p, args)
    if args.port and not 0 < args.port <= 65535:
        p.error(f"--port must be 1..65535, got {args.port}")
    return p, args


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def render(out: dict) -> str:
    cfg, on, off = out["config"], out["on"], out["off"]
    skipped = f" ({cfg['skipped_too_long']} longer than max_model_len skipped)" if cfg["skipped_too_long"] else ""
    lines = [f"kvrt bench replay: {cfg['taken']} of {Path(cfg['trace']).name}{skipped}, "
             f"{cfg['tokens_per_id']} tokens per trace id, block {cfg['block_size']}, at most "
             f"{cfg['max_new_tokens_cap']} new tokens, concurrency {cfg['concurrency']}, "
             f"speed {'max' if not cfg['speed'] else cfg['speed']}", ""]
    cols = [("cache on", on), ("cache off", off)]

    def row(name: str, get, spec: str = ".1f", r: float | None = None, unit: str = "") -> str:
        cells = [fmt(get(s), spec) if s is not None else "-" for _, s in cols]
        rat = fmt(r, ".2f", "x") if r is not None else ""
        return f"{name:<24}{cells[0]:>12}{cells[1]:>12}{rat:>10}  {unit}"

    lines.append(f"{'':<24}{'cache on':>12}{'cache off':>12}{'off/on':>10}")
    rt = out["ratio_off_on"]
    lines.append(row("TTFT mean", lambda s: s["ttft_ms"]["mean"], r=rt["ttft_mean"], unit="ms"))
    lines.append(row("TTFT p50", lambda s: s["ttft_ms"]["p50"], r=rt["ttft_p50"], unit="ms"))
    lines.append(row("TTFT p99", lambda s: s["ttft_ms"]["p99"], unit="ms"))
    lines.append(row("TPOT p50", lambda s: s["tpot_ms"]["p50"], ".2f", unit="ms"))
    lines.append(row("prompt tokens computed", lambda s: s["computed_prompt_tokens"], ",.0f",
                     r=rt["computed_prompt_tokens"]))
    lines.append(row("prompt tokens", lambda s: s["prompt_tokens"], ",.0f"))
    for tier in ("total", "device", "host", "storage"):
        name = "hit rate" if tier == "total" else f"  {tier}"
        cells = [pct(s["hit_rate"][tier]) if s is not None else "-" for _, s in cols]
        lines.append(f"{name:<24}{cells[0]:>12}{cells[1]:>12}")
    lines.append(f"{'ideal hit rate':<24}{pct(out['ideal_hit_rate']):>12}")
    lines.append(row("wall time", lambda s: s["wall_s"], ".1f", r=rt["wall_s"], unit="s"))
    lines.append(row("requests/s", lambda s: s["throughput"]["req_per_s"], ".2f"))
    lines.append(row("errors", lambda s: s["errors"], "d"))
    return "\n".join(lines)


def auto_blocks(requests, tokens_per_id: int, block_size: int, concurrency: int) -> int:
    """Device blocks that hold every prompt block of the run at once (an upper bound on what an
    unlimited cache would keep), plus room for the requests in flight; capped."""
    lens = [scaled_length(r.input_length, tokens_per_id) for r in requests]
    need = sum(-(-n // block_size) for n in lens) + concurrency * (-(-max(lens) // block_size) + 1)
    return min(need, AUTO_BLOCKS_MAX)


def main(argv: list[str]) -> int:
    p, args = parse_args(argv)
    requests, taken = select_requests(p, args)
    if args.num_gpu_blocks <= 0:
        args.num_gpu_blocks = auto_blocks(requests, args.tokens_per_id, args.block_size, args.concurrency)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    node = LaunchedNode(f"bench{os.getpid()}", args.port or free_port(),
                        ["--block-size", str(args.block_size), "--num-gpu-blocks", str(args.num_gpu_blocks),
                         "--num-cpu-blocks", str(args.num_cpu_blocks), *shlex.split(args.launch_args)],
                        say, args.ready_timeout, args.log)
    say(f"launching node {node.name} on port {node.port}: {' '.join(node.cmd[1:])}")
    results: dict[str, dict | None] = {"on": None, "off": None}
    try:
        node.wait_ready()
        with Client(node.port, timeout=args.timeout) as c:
            info = c.info()
            fits, too_long = fit_requests(requests, args.tokens_per_id, info.max_model_len, args.max_new_tokens_cap)
            if not fits:
                raise RuntimeError(f"no request fits the node's max_model_len {info.max_model_len}")
            specs = trace_prompts(fits, args.tokens_per_id, vocab_size=info.vocab_size,
                                  max_new_tokens_cap=args.max_new_tokens_cap)
            # one throwaway request first, so neither side pays for a cold start
            warm = np.arange(min(64, info.max_model_len - 2), dtype=np.int32) % info.vocab_size
            c.generate(warm, 1, use_cache=False)
            for name, use_cache in (("on", True), ("off", False)):
                if args.only and args.only != name:
                    continue
                say(f"cache {name}: {len(specs)} requests")
                res = replay(c, specs, speed=args.speed, concurrency=args.concurrency, use_cache=use_cache,
                             progress=ProgressBar(f"cache {name}"))
                results[name] = res.summary()
    except KeyboardInterrupt:
        say("kvrt bench replay: interrupted")
        node.stop()
        return 130
    except (ClientError, RuntimeError) as e:
        say(f"kvrt bench replay: error: {e}")
        node.stop()
        return 1
    rc = node.stop()
    if rc not in (0, None):
        say(f"kvrt bench replay: note: the node exited with code {rc} at stop; log: {node.log_path}")
    scaled = [s.trace for s in specs]
    total = sum(t.input_length for t in scaled)
    ideal = ideal_hit_tokens(scaled, info.block_size, args.tokens_per_id) / total if total else None
    on, off = results["on"], results["off"]

    def get(s, *path):
        for k in path:
            s = None if s is None else s[k]
        return s

    out = {
        "config": {"trace": str(args.trace), "requests": len(specs), "select": args.select, "taken": taken,
                   "skipped_too_long": len(too_long), "tokens_per_id": args.tokens_per_id,
                   "block_size": info.block_size, "max_new_tokens_cap": args.max_new_tokens_cap,
                   "concurrency": args.concurrency, "speed": args.speed, "vocab_size": info.vocab_size,
                   "max_model_len": info.max_model_len, "num_gpu_blocks": args.num_gpu_blocks,
                   "num_cpu_blocks": args.num_cpu_blocks, "node_cmd": node.cmd[1:]},
        "ideal_hit_rate": ideal,
        "on": on,
        "off": off,
        "ratio_off_on": {
            "ttft_mean": ratio(get(off, "ttft_ms", "mean"), get(on, "ttft_ms", "mean")),
            "ttft_p50": ratio(get(off, "ttft_ms", "p50"), get(on, "ttft_ms", "p50")),
            "computed_prompt_tokens": ratio(get(off, "computed_prompt_tokens"), get(on, "computed_prompt_tokens")),
            "wall_s": ratio(get(off, "wall_s"), get(on, "wall_s")),
        },
    }
    print(json.dumps(out, indent=1) if args.json else render(out))
    errors = sum(s["errors"] for s in (on, off) if s is not None)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
