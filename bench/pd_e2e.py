"""End-to-end section of `kvrt bench pd`: the same requests through a mixed node and through a
P+D pair (per transport), one request at a time, so the figures are latencies, not queueing.

TTFT is send -> first token (P streams it as soon as its prefill ends, before the handoff);
the second token comes from D, so "to 2nd token" carries what of the handoff the prefill did not
hide: the blocks still to write when the prefill ended, kv-ready, D's first decode step and the
relay back through P; `1st_to_2nd` is that gap alone, per request (a mixed node's is one
decode step), which on a shared machine is steadier than the prefill-sized totals. P sends each chunk's full blocks while the prefill goes on, so for a P+D
pair two more columns say how much of the KV travelled while prefilling (`sent early`, of all
bytes P sent) and how much was left for after the prefill per request (`tail KiB`: the bytes
kv-ready waits for; kv-ready itself goes only once every byte landed, so none are in flight
then).
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

from kvrt.bench.nodes import LaunchedNode
from kvrt.runtime.client.client import Client
from kvrt.runtime.node.status import snapshot


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def prompt_lengths(text: str) -> list[int]:
    """`--e2e-prompt`: comma-separated prompt lengths in tokens."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token counts") from None
    if not out or min(out) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: every prompt needs at least 2 tokens")
    return out


def _prompts(args: argparse.Namespace, length: int) -> list[np.ndarray]:
    """Distinct prompts (no prefix hits: the handoff moves every block); as many tokens in all
    as --e2e-requests prompts of 1,024 (at least 3), so long prompts do not take forever."""
    rng = np.random.default_rng(length)
    n = max(3, round(args.e2e_requests * 1024 / length)) if length > 1024 else args.e2e_requests
    return [rng.integers(0, 512, length).astype(np.int32) for _ in range(n)]


def _run(port: int, prompts: list[np.ndarray], new_tokens: int) -> dict:
    ttft, second, gap, e2e = [], [], [], []
    with Client(port, timeout=600) as c:
        for p in prompts:
            t0 = time.perf_counter()
            times = []
            with c.stream(p, new_tokens) as gen:
                for _ in gen:
                    times.append(time.perf_counter() - t0)
            ttft.append(times[0] * 1e3)
            second.append(times[1] * 1e3)
            gap.append((times[1] - times[0]) * 1e3)
            e2e.append(times[-1] * 1e3)
    return {"ttft_p50_ms": statistics.median(ttft), "ttft_mean_ms": statistics.fmean(ttft),
            "to_2nd_token_p50_ms": statistics.median(second), "1st_to_2nd_p50_ms": statistics.median(gap),
            "e2e_p50_ms": statistics.median(e2e)}


def _warm_up(port: int, prompts: list[np.ndarray]) -> None:
    """One request of the same length first (a prompt of its own: no prefix hit later), so that
    first-call costs stay out of the figures: connections, a P/D session, and each process
    growing its heap to what a step of that length needs (a decode node's first decode step at
    4,096 tokens took 26 ms, the next ones 12.6)."""
    rng = np.random.default_rng(len(prompts[0]) + 1)
    with Client(port, timeout=600) as c:
        c.generate(rng.integers(0, 512, len(prompts[0])).astype(np.int32), 2)


def rows(args: argparse.Namespace) -> list[dict]:
    """For each prompt length: TTFT / time to the 2nd token / end to end of a mixed node and
    of P+D per transport, each next to the mixed node's."""
    out: list[dict] = []
    for length in args.e2e_prompt:
        out += _rows_of(args, length)
    return out


def _rows_of(args: argparse.Namespace, length: int) -> list[dict]:
    prompts = _prompts(args, length)
    bs = 16  # the launcher's default block size
    # the whole prompt in D, twice over
    blocks = max(512, 2 * -(-(length + args.e2e_new) // bs) + 16)
    base = ["--max-model-len", str(length + args.e2e_new + 16), "--num-gpu-blocks", str(blocks)]
    tag = f"b{os.getpid()}"
    out: list[dict] = []
    _say(f"end to end: {len(prompts)} requests of {length} tokens, {args.e2e_new} new tokens each")
    mixed = LaunchedNode.ready(tag + "m", base, _say)
    try:
        _warm_up(mixed.port, prompts)
        out.append({"case": f"mixed node, {length} tokens", **_run(mixed.port, prompts, args.e2e_new)})
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
        d = LaunchedNode.ready(tag + "d", ["--role", "decode", *pd], _say)
        try:
            p = LaunchedNode.ready(tag + "p", ["--role", "prefill", "--decode-peer", f"tcp://127.0.0.1:{d.port}", *pd],
                                   _say)
            try:
                _warm_up(p.port, prompts)
                before = _sent(p.name)
                row = {"case": f"P+D {transport}, {length} tokens", **_run(p.port, prompts, args.e2e_new)}
                sent, early = (a - b for a, b in zip(_sent(p.name), before))
                row["sent_early"] = early / sent if sent else 0.0
                row["tail_kib"] = (sent - early) / len(prompts) / 1024
                out.append(row)
            finally:
                p.stop()
        finally:
            d.stop()
    secret_file.close()
    ref = out[0]
    for r in out:
        if "ttft_p50_ms" in r:
            r["ttft_vs_mixed"] = r["ttft_p50_ms"] / ref["ttft_p50_ms"]
            r["2nd_vs_mixed"] = r["to_2nd_token_p50_ms"] / ref["to_2nd_token_p50_ms"]
    return out


def _sent(node: str) -> tuple[float, float]:
    """(KV bytes P sent, of them while prefilling) as P's engine counts them (the warm-up's
    included: the caller takes differences)."""
    e = snapshot(node)["engine"]
    return float(e["pd_sent_bytes"]), float(e.get("pd_early_bytes", 0.0))


def _mooncake_importable() -> bool:
    try:
        import mooncake.engine  # noqa: F401
        return True
    except Exception:  # not installed, or its libibverbs missing
        return False
