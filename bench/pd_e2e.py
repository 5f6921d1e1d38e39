"""End-to-end section of `kvrt bench pd`: the same requests through a mixed node and through a
P+D pair (per transport), one request at a time, so the figures are latencies, not queueing.

TTFT is send -> first token (P streams it as soon as its prefill ends, before the handoff);
the second token comes from D, so "to 2nd token" carries the whole handoff: the blocks written
into D, kv-ready, D's first decode step and the relay back through P.
"""
from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import tempfile
import time

import numpy as np

from bench.nodes import LaunchedNode, free_port
from runtime.client import Client


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _prompts(args: argparse.Namespace) -> list[np.ndarray]:
    rng = np.random.default_rng(0)  # distinct prompts: no prefix hits, the handoff moves every block
    return [rng.integers(0, 512, args.e2e_prompt).astype(np.int32) for _ in range(args.e2e_requests)]


def _run(port: int, prompts: list[np.ndarray], new_tokens: int) -> dict:
    ttft, second, e2e = [], [], []
    with Client(port, timeout=60) as c:
        c.generate(prompts[0][:32], 2)  # warm-up: first-call costs stay out of the figures
        for p in prompts:
            t0 = time.perf_counter()
            times = []
            with c.stream(p, new_tokens) as gen:
                for _ in gen:
                    times.append(time.perf_counter() - t0)
            ttft.append(times[0] * 1e3)
            second.append(times[1] * 1e3)
            e2e.append(times[-1] * 1e3)
    return {"ttft_p50_ms": statistics.median(ttft), "ttft_mean_ms": statistics.fmean(ttft),
            "to_2nd_token_p50_ms": statistics.median(second), "e2e_p50_ms": statistics.median(e2e)}


def _node(name: str, launch_args: list[str]) -> LaunchedNode:
    node = LaunchedNode(name, free_port(), launch_args, _say)
    try:
        node.wait_ready()
    except RuntimeError:
        node.stop()
        raise
    return node


def rows(args: argparse.Namespace) -> list[dict]:
    """TTFT / time to the 2nd token / end to end of a mixed node and of P+D per transport."""
    prompts = _prompts(args)
    base = ["--max-model-len", str(args.e2e_prompt + args.e2e_new + 16)]
    tag = f"b{os.getpid()}"
    out: list[dict] = []
    _say(f"end to end: {len(prompts)} requests of {args.e2e_prompt} tokens, {args.e2e_new} new tokens each")
    mixed = _node(tag + "m", base)
    try:
        out.append({"case": "mixed node", **_run(mixed.port, prompts, args.e2e_new)})
    finally:
        mixed.stop()
    secret_file = tempfile.NamedTemporaryFile("w", prefix="kvrt-bench-pd-", suffix=".secret")  # mode 0600
    secret_file.write(secrets.token_hex(32))
    secret_file.flush()
    for transport in ("shm", "mooncake"):
        if transport == "mooncake" and not _mooncake_importable():
            out.append({"case": "P+D mooncake", "note": "mooncake-transfer-engine not importable"})
            continue
        pd = ["--pd-transport", transport, "--pd-secret-file", secret_file.name, *base]
        d = _node(tag + "d", ["--role", "decode", *pd])
        try:
            p = _node(tag + "p", ["--role", "prefill", "--decode-peer", f"tcp://127.0.0.1:{d.port}", *pd])
            try:
                out.append({"case": f"P+D {transport}", **_run(p.port, prompts, args.e2e_new)})
            finally:
                p.stop()
        finally:
            d.stop()
    secret_file.close()
    ref = out[0]["ttft_p50_ms"]
    for r in out:
        if "ttft_p50_ms" in r:
            r["ttft_vs_mixed"] = r["ttft_p50_ms"] / ref
    return out


def _mooncake_importable() -> bool:
    try:
        import mooncake.engine  # noqa: F401
        return True
    except Exception:  # not installed, or its libibverbs missing
        return False
