"""`kvrt bench cache --peer vllm|sglang`: the same trace at the same capacities through vLLM's
and SGLang's own prefix caches, for hit rates and blocks per CPU-second beside kvrt's.

Why a child process in another interpreter: both peers import torch (and much of their
servers) to load their cache classes, which kvrt's own environment must not need; so the peers
live in a venv of their own (docs/benchmarks.md says how to build it) and
bench/peer_cache_child.py runs there, fed the trace as JSON lines on stdin (no pickle). The child
times its replay with time.process_time, so the figure is the peer's own CPU, not the import's
nor this process's.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kvrt.bench.peer_cache_child import PEERS, Header, header_line, request_line
from kvrt.runtime.client.trace import TraceRequest, num_blocks

CHILD = Path(__file__).resolve().parent / "peer_cache_child.py"
DEFAULT_PYTHON = Path(".venv-peers/bin/python")  # relative to where kvrt bench cache runs
TIMEOUT_S = 3600.0  # one peer, every capacity of one trace
MAX_ANSWER = 1 << 20  # bytes of the child's answer


class PeerError(RuntimeError):
    """A peer could not replay the trace (not installed, failed, or timed out)."""


def feed(peer: str, block_size: int, capacities: list[int], requests: list[TraceRequest]) -> bytes:
    """The child's stdin: a header line, then one line per request."""
    lines = [header_line(Header(peer, block_size, tuple(capacities)))]
    lines += [request_line(r.input_length, r.hash_ids) for r in requests]
    return ("\n".join(lines) + "\n").encode()


def run_peer(peer: str, python: Path, requests: list[TraceRequest], block_size: int,
             capacities: list[int | None], timeout: float = TIMEOUT_S) -> list[dict]:
    """One row per capacity (None: every block of the trace fits) from the peer's own cache."""
    if peer not in PEERS:
        raise PeerError(f"unknown peer {peer!r} (known: {', '.join(PEERS)})")
    if not Path(python).exists():
        raise PeerError(f"--peer-python {python}: no such interpreter (docs/benchmarks.md says how to build it)")
    total = sum(num_blocks(r, block_size) for r in requests)
    caps = [total if c is None else c for c in capacities]
    # -P: the child's folder (bench/, with a copy.py of its own) must not shadow the standard library
    try:
        done = subprocess.run([str(python), "-P", str(CHILD)], input=feed(peer, block_size, caps, requests),
                              capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise PeerError(f"{peer}: no answer from its replay within {timeout:.0f} s") from None
    err = done.stderr.decode(errors="replace")
    if done.returncode != 0:
        raise PeerError(f"{peer} (exit {done.returncode}): {err[-2000:]}")
    if len(done.stdout) > MAX_ANSWER:
        raise PeerError(f"{peer}: an answer of {len(done.stdout)} bytes")
    try:
        answer = json.loads(done.stdout)
        rows = answer["rows"]
    except (ValueError, KeyError, TypeError) as e:
        raise PeerError(f"{peer}: unreadable answer ({e}): {done.stdout[:200]!r}") from None
    for row, cap in zip(rows, capacities):
        row.update(peer=peer, version=answer.get("version", "?"), capacity_blocks=cap)
    return rows


def compare(peer_rows: list[dict], kvrt_rows: list[dict]) -> list[dict]:
    """Each peer row with kvrt's figures at its capacity: LRU's hit rate and, per kvrt policy,
    blocks per CPU-second and kvrt's over the peer's."""
    out = []
    for p in peer_rows:
        mine = [r for r in kvrt_rows if r["capacity_blocks"] == p["capacity_blocks"] and not r.get("kv")]
        lru = next((r["lru_hit_token_rate"] for r in mine), None)
        row = dict(p, lru_hit_token_rate=lru,
                   hit_points_vs_lru=None if lru is None else 100 * (p["hit_token_rate"] - lru),
                   kvrt_blocks_per_cpu_s={r["policy"]: r["blocks_per_cpu_s"] for r in mine})
        row["kvrt_over_peer"] = {k: (v / p["blocks_per_cpu_s"] if p.get("blocks_per_cpu_s") else None)
                                 for k, v in row["kvrt_blocks_per_cpu_s"].items()}
        out.append(row)
    return out


def table(rows: list[dict], python: Path) -> str:
    """The peers' rows under kvrt's table."""
    policies = list(dict.fromkeys(k for r in rows for k in r["kvrt_over_peer"]))
    head = (f"{'capacity':>10} {'peer':>14} {'hit rate':>9} {'vs LRU':>8} {'blocks/CPU-s':>13} "
            + " ".join(f"{'kvrt ' + p + '/peer':>16}" for p in policies))
    lines = [f"peers' own prefix caches (in {python}; CPU of their calls alone, token expansion not counted):",
             head, "-" * len(head)]
    for r in rows:
        cap = f"{r['capacity_blocks']:,}" if r["capacity_blocks"] is not None else "unlimited"
        name = f"{r['peer']} {r['version']}"
        diff = "-" if r["hit_points_vs_lru"] is None else f"{r['hit_points_vs_lru']:+.2f}"
        bps = r["blocks_per_cpu_s"]
        ratios = " ".join(f"{(f'{x:.1f}x' if x else '-'):>16}" for x in (r["kvrt_over_peer"].get(p) for p in policies))
        lines.append(f"{cap:>10} {name:>14} {r['hit_token_rate']:>9.2%} {diff:>8} "
                     f"{(f'{bps / 1e3:.0f}k' if bps else '-'):>13} {ratios}")
        if r["rejected_requests"]:
            lines.append(f"{'':>10} ({r['rejected_requests']} requests larger than the peer's cache were skipped)")
    return "\n".join(lines)
