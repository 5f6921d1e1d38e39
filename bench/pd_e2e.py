"""End-to-end section of `kvrt bench pd`: the same requests through a mixed node and through a
P+D pair (per transport), one request at a time, so the figures are latencies, not queueing.
Every node is up for the whole section and the cases take turns request by request (each
prompt goes to every case before the next prompt, the order rotating), so a case's figures and
the mixed node's come from the same minutes: on a shared machine whose load drifts, running
the cases one after another made the ratios swing by more than what they compare.
`2nd_paired` is the median over prompts of each one's time to the 2nd token next to the mixed
node's for the same prompt, sent moments apart: the steadiest ratio.

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

from dataclasses import dataclass, field

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


@dataclass
class _Case:
    """One way to serve the requests: the node a client asks, and P's node for its counters."""

    name: str
    port: int
    prefill_node: str = ""
    times: list[list[float]] = field(default_factory=list)  # per request: each token's arrival (s)


def _request(c: Client, prompt: np.ndarray, new_tokens: int) -> list[float]:
    t0 = time.perf_counter()
    times = []
    with c.stream(prompt, new_tokens) as gen:
        for _ in gen:
            times.append(time.perf_counter() - t0)
    return times


def _run(cases: list[_Case], prompts: list[np.ndarray], new_tokens: int) -> None:
    """Each prompt through every case in turn (the order rotating, so no case always follows
    the same one), one request at a time."""
    clients = [Client(case.port, timeout=600) for case in cases]
    try:
        for i, prompt in enumerate(prompts):
            for k in range(len(cases)):
                j = (i + k) % len(cases)
                cases[j].times.append(_request(clients[j], prompt, new_tokens))
    finally:
        for c in clients:
            c.close()


def _figures(case: _Case) -> dict:
    ttft = [t[0] * 1e3 for t in case.times]
    second = [t[1] * 1e3 for t in case.times]
    gap = [(t[1] - t[0]) * 1e3 for t in case.times]
    e2e = [t[-1] * 1e3 for t in case.times]
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
    notes: list[dict] = []
    _say(f"end to end: {len(prompts)} requests of {length} tokens, {args.e2e_new} new tokens each, "
         f"the cases taking turns")
    secret_file = tempfile.NamedTemporaryFile("w", prefix="kvrt-bench-pd-", suffix=".secret")  # mode 0600
    secret_file.write(secrets.token_hex(32))
    secret_file.flush()
    nodes: list[LaunchedNode] = []
    try:
        nodes.append(LaunchedNode.ready(tag + "m", base, _say))
        cases = [_Case(f"mixed node, {length} tokens", nodes[-1].port)]
        for transport in ("shm", "mooncake"):
            if transport == "mooncake" and not _mooncake_importable():
                notes.append({"case": "P+D mooncake", "note": "mooncake-transfer-engine not importable"})
                continue
            pd = ["--pd-transport", transport, "--pd-secret-file", secret_file.name, *base]
            d = LaunchedNode.ready(tag + "d" + transport[0], ["--role", "decode", *pd], _say)
            nodes.append(d)
            nodes.append(LaunchedNode.ready(tag + "p" + transport[0],
                                            ["--role", "prefill", "--decode-peer", f"tcp://127.0.0.1:{d.port}", *pd],
                                            _say))
            cases.append(_Case(f"P+D {transport}, {length} tokens", nodes[-1].port, nodes[-1].name))
        for case in cases:
            _warm_up(case.port, prompts)
        before = {case.name: _sent(case.prefill_node) for case in cases if case.prefill_node}
        _run(cases, prompts, args.e2e_new)
        out = []
        for case in cases:
            row = {"case": case.name, **_figures(case)}
            if case.prefill_node:
                sent, early = (a - b for a, b in zip(_sent(case.prefill_node), before[case.name]))
                row["sent_early"] = early / sent if sent else 0.0
                row["tail_kib"] = (sent - early) / len(prompts) / 1024
            out.append(row)
    finally:
        for node in reversed(nodes):
            node.stop()
        secret_file.close()
    ref, mixed = out[0], cases[0]
    for r, case in zip(out, cases):
        r["ttft_vs_mixed"] = r["ttft_p50_ms"] / ref["ttft_p50_ms"]
        r["2nd_vs_mixed"] = r["to_2nd_token_p50_ms"] / ref["to_2nd_token_p50_ms"]
        r["2nd_paired"] = statistics.median(t[1] / m[1] for t, m in zip(case.times, mixed.times))
    return out + notes


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
