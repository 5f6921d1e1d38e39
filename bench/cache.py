"""kvrt bench cache: replay a request trace through the prefix cache (no model, no processes).

Each request runs to completion before the next starts: its prompt is expanded to tokens
(runtime/client/trace.py), hashed into block keys, matched, allocated, recorded as computed, and
released; swap tasks are applied as done at once, as if the cache-transfer ranks were
infinitely fast. The timed loop counts hashing and the cache's calls, not the token expansion (a
server gets token ids from its tokenizer; the peers' replays leave it out too). Reported per device
capacity:
- hit_token_rate: prompt tokens served from any tier / all prompt tokens (a whole-prompt match
  gives its last block back, which counts as a miss), with the per-tier rates;
- ideal_hit_token_rate: the same for an unlimited cache, computed from hash_ids alone
  (runtime.client.trace.ideal_hit_tokens) — with no --capacity-blocks the replay must equal it;
- offline_bound_hit_token_rate: per capacity, Belady's policy with future knowledge over the same
  trace, prefix constraint kept (bench/belady.py), next to lru_hit_token_rate, LRU's figure (each
  `--eviction` policy is replayed, and LRU too for that column);
- blocks_per_s: prompt blocks processed (matched + computed, a partial last block included);
- peak_rss_mb: the process's peak resident set (getrusage; tracemalloc would slow the replay
  several-fold).
`--evict-scaling` fills caches of 10k, 100k and 1M blocks and times evicting a fixed number of
blocks, to show the cost per evicted block does not grow with the cache.

`--kv NAME...` replays the trace once per KV layout in the same device memory: `--capacity-blocks`
then counts blocks of the layout's model with every layer full attention in BF16, and each layout
gets the pages that memory holds (`KV_LAYOUTS`): `bf16` is that block, `fp8` half of it (twice the
blocks); `gemma3-full` is a Gemma-3-1B-shaped model (26 layers, 1 KV head of 256, 512-token
window on 5 layers of 6) treated as if every layer were full attention, `gemma3` the same model
with its layer groups (ipc/layout.py: pages of 4 layers, one full group and six sliding ones;
runtime/cache/groups.py), each also in FP8 (`-fp8`). A model of several groups prefills in
chunks of `--chunk` tokens, as a node does, so that its sliding pages are given back while a long
prompt runs; every layout reports the blocks of tokens its device holds (mean over the replay:
`blocks held`, group 0's nodes for a grouped model) and what a prefill node would send a
decode node per request (`handoff`: every block's full-attention pages, the sliding groups'
last window).

`--peer vllm sglang` replays the same trace at the same capacities through vLLM's and SGLang's
own prefix caches, in the interpreter `--peer-python` names (bench/peer_cache.py): their hit
rates next to kvrt's LRU and their blocks per CPU-second next to each kvrt policy's.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvrt.bench import peer_cache
from kvrt.bench.belady import offline_hit_rate, uses
from kvrt.ipc.layout import LayerGroups
from kvrt.bench.synthetic import PREFIX, TRACES, synthetic
from kvrt.runtime.cache.keys import BlockHasher
from kvrt.runtime.cache.policies.base import make_policy, policy_names
from kvrt.runtime.cache.nodes import GPU, STATE, SWAP2CPU
from kvrt.runtime.cache.prefix_cache import PrefixCache
from kvrt.runtime.client.trace import (TRACE_BLOCK, TraceError, TraceRequest, default_trace_path, expand_tokens,
                           ideal_hit_tokens, load_trace, num_blocks)

EVICT_SIZES = (10_000, 100_000, 1_000_000)
GEMMA3_WINDOWS = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))  # Gemma 3 1B: 4 of 26 layers full
GEMMA3_PAGE_BYTES = 2 * 1 * 256  # per layer and token: K and V of one KV head of 256 (times the dtype's bytes)


@dataclass(frozen=True)
class KVLayoutRow:
    """A KV layout `--kv` replays: its model's layer windows (None: one group, no model), and
    the bytes of an element."""

    windows: tuple[int, ...] | None
    itemsize: int

    def groups(self) -> LayerGroups | None:
        return None if self.windows is None else LayerGroups.of(self.windows)

    def pages(self, full_bf16_blocks: int) -> int:
        """How many of this layout's pages the memory of `full_bf16_blocks` blocks of its model
        (every layer full attention, BF16) holds."""
        g = self.groups()
        layers = 1 if g is None else len(self.windows)
        page = 1 if g is None else g.page_layers
        return full_bf16_blocks * layers * 2 // (page * self.itemsize)

    def page_bytes(self, block_size: int) -> int:
        g = self.groups()
        layers = 1 if g is None else g.page_layers
        return layers * block_size * GEMMA3_PAGE_BYTES * self.itemsize


KV_LAYOUTS = {
    "bf16": KVLayoutRow(None, 2), "fp8": KVLayoutRow(None, 1),
    "gemma3-full": KVLayoutRow((0,) * 26, 2), "gemma3-full-fp8": KVLayoutRow((0,) * 26, 1),
    "gemma3": KVLayoutRow(GEMMA3_WINDOWS, 2), "gemma3-fp8": KVLayoutRow(GEMMA3_WINDOWS, 1),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvrt bench cache", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=None,
                   help=f"trace file (JSON lines with hash_ids), or {PREFIX}NAME for a generated one "
                        f"({', '.join(TRACES)}: bench/synthetic.py); default: {default_trace_path()}")
    p.add_argument("--block-size", type=int, default=64, help="tokens per block; must divide 512 (default 64)")
    p.add_argument("--capacity-blocks", type=int, nargs="+", default=None, metavar="N",
                   help="device capacities to replay, one run each (default: unlimited)")
    p.add_argument("--host-blocks", type=int, default=0, metavar="M", help="host tier blocks (default 0)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="replay only the first N requests")
    p.add_argument("--eviction", nargs="+", choices=policy_names(), default=[policy_names()[0]],
                   metavar="NAME", help=f"eviction policies to replay, one row each ({', '.join(policy_names())}; "
                                        f"default {policy_names()[0]}); LRU is replayed too for its column")
    p.add_argument("--no-bound", action="store_true",
                   help="skip the offline bound (Belady with future knowledge; a few seconds per capacity)")
    p.add_argument("--json", action="store_true", help='print {"results": [...]} instead of a table')
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="draw hit rate vs capacity (needs matplotlib: pip install 'kvrt[plot]'); without "
                        "--capacity-blocks, at 1/64, 1/16, 1/4 and all of the trace's distinct blocks")
    p.add_argument("--suite", action="store_true",
                   help="replay every synthetic family (its reported seed) and the bundled trace (or the file "
                        "--trace names) at 1/64, 1/16, 1/4 and all of each trace's distinct blocks: one table per "
                        "trace (--capacity-blocks is ignored)")
    p.add_argument("--kv", nargs="+", choices=sorted(KV_LAYOUTS), default=None, metavar="LAYOUT",
                   help=f"KV layouts to replay in the same memory, one row each ({', '.join(KV_LAYOUTS)}): "
                        f"--capacity-blocks counts BF16 full-attention blocks of the layout's model (default: "
                        f"the plain rows)")
    p.add_argument("--chunk", type=int, default=512, metavar="T",
                   help="prefill chunk of a model of several layer groups, in tokens (default 512)")
    p.add_argument("--peer", nargs="+", choices=peer_cache.PEERS, default=[], metavar="NAME",
                   help="also replay through these peers' own prefix caches (vllm, sglang) at the same capacities, "
                        "in --peer-python's interpreter: hit rate and blocks per CPU-second beside kvrt's")
    p.add_argument("--peer-python", type=Path, default=peer_cache.DEFAULT_PYTHON, metavar="PATH",
                   help=f"the interpreter with vllm / sglang and torch installed (default {peer_cache.DEFAULT_PYTHON}; "
                        f"docs/benchmarks.md says how to build it)")
    p.add_argument("--evict-scaling", action="store_true",
                   help="also time eviction per block at 10k, 100k and 1M cached blocks")
    p.add_argument("--evict-sizes", type=int, nargs="+", default=list(EVICT_SIZES), metavar="N",
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.block_size <= 0 or TRACE_BLOCK % args.block_size:
        p.error(f"--block-size {args.block_size} must divide {TRACE_BLOCK}")
    if args.capacity_blocks and min(args.capacity_blocks) <= 0:
        p.error("--capacity-blocks must be positive")
    if args.host_blocks < 0:
        p.error("--host-blocks must be >= 0")
    if args.peer and (args.host_blocks or args.kv):
        p.error("--peer compares device caches of plain blocks: not with --host-blocks or --kv")
    if args.peer and not args.peer_python.exists():
        p.error(f"--peer-python {args.peer_python}: no such interpreter (docs/benchmarks.md says how to build the "
                f"peers' venv)")
    if args.trace is None:
        args.trace = default_trace_path()
        if not args.trace.exists() and not args.suite:
            p.error(f"no --trace given and the bundled trace is not at {args.trace}")
    elif str(args.trace).startswith(PREFIX):
        family, _, seed = str(args.trace)[len(PREFIX):].partition(":")
        if family not in TRACES or (seed and not seed.isdigit()):
            p.error(f"--trace {args.trace}: known synthetic traces are {', '.join(TRACES)} (optionally NAME:SEED)")
    elif not args.trace.exists():
        p.error(f"--trace {args.trace}: no such file")
    return args


def settle(cache: PrefixCache) -> None:
    """Apply every task the cache issues as done (infinitely fast cache-transfer ranks)."""
    while tasks := cache.take_tasks():
        for t in tasks:
            cache.apply_task_result(t.task_id, True)


def replay(requests: list[TraceRequest], block_size: int, capacity: int | None,
           host_blocks: int, policy: str = "lru", kv: str | None = None, chunk: int = 512) -> dict:
    """One pass over the trace with the eviction policy named `policy`; returns the row for this
    capacity (without the ideal and the bound). With a `kv` layout (KV_LAYOUTS) the capacities
    are its pages in the memory of `capacity` (and `host_blocks`) BF16 full-attention blocks."""
    total = sum(num_blocks(r, block_size) for r in requests)
    factory = make_policy(policy)
    layout = KV_LAYOUTS[kv] if kv else None
    groups = layout.groups() if layout else None
    side = groups.side_windows if groups is not None else ()
    pages = (lambda n: layout.pages(n)) if layout else (lambda n: n)
    device = pages(capacity) if capacity else total * (1 + len(side))
    cache = PrefixCache(block_size, device, pages(host_blocks), policy=factory, groups=side)
    rejected = 0
    held = []  # blocks of tokens the device holds, sampled
    handoff = 0
    sample_every = max(1, len(requests) // 200) if kv else 0  # (a sample reads every node: kv rows only)
    start, cpu = time.perf_counter(), time.process_time()
    making = making_cpu = 0.0  # the trace's token expansion: not the cache's work (nor the peers')
    for i, req in enumerate(requests):
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = expand_tokens(req)
        making += time.perf_counter() - t0
        making_cpu += time.process_time() - c0
        n = req.input_length
        m = cache.match(i, BlockHasher(block_size).update(tokens), n)
        if not m.ready:
            settle(cache)  # swap-ins, and the swap-outs they wait for
        if not _compute(cache, i, n, m.cached_tokens if side else 0, chunk if side else n):
            rejected += 1  # larger than the device: skipped
            cache.release(i)
            continue
        if side:
            handoff += -(-n // block_size) + sum(-(-n // block_size) - cache._lo(g, n) for g in range(len(side)))
        else:
            handoff += -(-n // block_size)
        cache.release(i)
        settle(cache)
        if sample_every and i % sample_every == 0:
            held.append(_blocks_held(cache))
    seconds = time.perf_counter() - start - making
    cpu = time.process_time() - cpu - making_cpu
    m = cache.metrics
    page_bytes = layout.page_bytes(block_size) if layout and layout.windows else 0
    return {
        "policy": policy,
        "requests": len(requests),
        "blocks": total,
        "capacity_blocks": capacity,
        "host_blocks": host_blocks,
        "hit_token_rate": m.hit_rate(),
        "hit_token_rate_device": m.hit_rate("device"),
        "hit_token_rate_host": m.hit_rate("host"),
        "request_hit_rate": m.hit_requests / m.requests if m.requests else 0.0,
        "blocks_per_s": total / seconds,
        "blocks_per_cpu_s": total / cpu if cpu > 0 else float("inf"),
        "seconds": seconds,
        "evicted_device_blocks": m.evicted_device_blocks,
        "evicted_host_blocks": m.evicted_host_blocks,
        "swap_out_blocks": m.swap_out_blocks,
        "swap_in_blocks": m.swap_in_blocks,
        "partial_block_tokens": m.partial_block_tokens,
        "rejected_requests": rejected,
        "peak_rss_mb": peak_rss_mb(),
        "kv": kv or "",
        "device_pages": device,
        "blocks_held": float(np.mean(held)) if held else 0.0,
        "handoff_pages_per_request": handoff / max(1, len(requests) - rejected),
        "handoff_mb_per_request": handoff * page_bytes / max(1, len(requests) - rejected) / 1e6,
    }


def _compute(cache: PrefixCache, rid: int, n: int, start: int, chunk: int) -> bool:
    """Allocate and record request `rid`'s prompt of `n` tokens from `start` on, a `chunk` of
    tokens a step; False when the device cannot hold it even after the transfers settle."""
    pos = start
    while pos < n:
        end = min(n, pos + chunk)
        if cache.allocate(rid, end) is None:
            settle(cache)
            if not cache.is_ready(rid) or cache.allocate(rid, end) is None:
                return False
        cache.update(rid, end)
        pos = end
    return True


def _blocks_held(cache: PrefixCache) -> int:
    """Blocks of tokens the device holds: the cached nodes of the first layer group."""
    f = cache._f
    live = (f[STATE] == GPU) | (f[STATE] == SWAP2CPU)
    if cache._side_w:
        live &= cache._group == 0
    return int(np.count_nonzero(live)) - 1  # (the root)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def evict_cost(size: int, block_size: int, host: bool, batch: int = 10_000, rounds: int = 3) -> float:
    """Microseconds per evicted block when the device holds `size` cached blocks: fill it with
    chains of 256 blocks, then time allocations that each evict `batch` blocks (the best of
    `rounds`; each round caches its blocks again, so the next one evicts as many). With `host`,
    victims are swapped to free host blocks instead of dropped."""
    batch = min(batch, size // 2)
    cache = PrefixCache(block_size, size, batch * rounds if host else 0)
    rng = np.random.default_rng(size)

    def request(rid, n: int) -> float:
        raw = rng.bytes(16 * n)
        keys = [raw[j:j + 16] for j in range(0, 16 * n, 16)]
        cache.match(rid, keys, n * block_size + 1)
        t0 = time.perf_counter()
        got = cache.allocate(rid, n * block_size)
        dt = time.perf_counter() - t0
        if got is None:  # swapped out: the blocks come back when the swap reports done
            settle(cache)
            got = cache.allocate(rid, n * block_size)
        assert got is not None and len(got) == n
        cache.update(rid, n * block_size)
        cache.release(rid)
        return dt

    chain = 256
    for i in range(size // chain):
        request(("fill", i), chain)
    if size % chain:
        request(("fill", "rest"), size % chain)
    return min(request(("evict", r), batch) for r in range(rounds)) / batch * 1e6

def run_evict_scaling(sizes: list[int], block_size: int) -> list[dict]:
    return [{"cached_blocks": size,
             "drop_us_per_block": evict_cost(size, block_size, host=False),
             "swap_us_per_block": evict_cost(size, block_size, host=True),
             "peak_rss_mb": peak_rss_mb()} for size in sizes]


def table(results: list[dict], scaling: list[dict], trace: Path, block_size: int) -> str:
    r0 = results[0]
    lines = [f"trace {trace}: {r0['requests']:,} requests, {r0['blocks']:,} prompt blocks of "
             f"{block_size} tokens; ideal (unlimited) token hit rate {r0['ideal_hit_token_rate']:.2%}", ""]
    kv = any(r.get("kv") for r in results)
    head = (f"{'capacity':>10} {'host':>8} {'policy':>8} {'hit rate':>9} {'device':>8} {'host':>8} "
            f"{'LRU':>8} {'bound':>8} {'ideal':>8} {'blocks/s':>10} {'evicted':>10} {'swapped':>9} "
            f"{'peak RSS':>9}")
    if kv:
        lines = lines[:-1] + ["capacity: BF16 blocks of the layout's model with every layer full attention (the same "
                              "memory in every row); pages: what that memory holds in the row's layout", ""]
        head = (f"{'capacity':>10} {'kv':>15} {'pages':>9} {'policy':>8} {'hit rate':>9} {'LRU':>8} "
                f"{'blocks held':>12} {'handoff':>11} {'blocks/s':>10} {'evicted':>10}")
    lines += [head, "-" * len(head)]
    for r in results:
        if kv:
            cap = "unlimited" if r["capacity_blocks"] is None else f"{r['capacity_blocks']:,}"
            mb = f"{r['handoff_mb_per_request']:.1f} MB" if r["handoff_mb_per_request"] else \
                f"{r['handoff_pages_per_request']:.1f} p"
            lines.append(f"{cap:>10} {r['kv']:>15} {r['device_pages']:>9,} {r['policy']:>8} {r['hit_token_rate']:>9.2%} "
                         f"{r['lru_hit_token_rate']:>8.2%} {r['blocks_held']:>12,.0f} {mb:>11} "
                         f"{r['blocks_per_s'] / 1e6:>9.2f}M {r['evicted_device_blocks']:>10,}")
            continue
        cap = "unlimited" if r["capacity_blocks"] is None else f"{r['capacity_blocks']:,}"
        host = f"{r['hit_token_rate_host']:.2%}" if r["host_blocks"] else "-"
        bound = r.get("offline_bound_hit_token_rate")
        bound_s = "-" if bound is None else f"{bound:.2%}"
        lines.append(f"{cap:>10} {r['host_blocks']:>8,} {r['policy']:>8} {r['hit_token_rate']:>9.2%} "
                     f"{r['hit_token_rate_device']:>8.2%} {host:>8} {r['lru_hit_token_rate']:>8.2%} "
                     f"{bound_s:>8} {r['ideal_hit_token_rate']:>8.2%} "
                     f"{r['blocks_per_s'] / 1e6:>9.2f}M {r['evicted_device_blocks']:>10,} "
                     f"{r['swap_out_blocks']:>9,} {r['peak_rss_mb']:>6.0f} MB")
        if r["rejected_requests"]:
            lines.append(f"{'':>10} ({r['rejected_requests']} requests larger than the device were skipped)")
    if scaling:
        lines += ["", f"eviction cost per block ({block_size}-token blocks; best of 3 rounds)",
                  f"{'cached blocks':>14} {'drop us/block':>14} {'swap us/block':>14}"]
        lines += [f"{s['cached_blocks']:>14,} {s['drop_us_per_block']:>14.2f} {s['swap_us_per_block']:>14.2f}"
                  for s in scaling]
    return "\n".join(lines)


PLOT_FRACTIONS = (1 / 64, 1 / 16, 1 / 4, 1)  # of the trace's distinct blocks, for --plot without capacities


def plot_capacities(requests: list[TraceRequest], block_size: int) -> list[int]:
    """Device capacities for a hit-rate curve when none are given: fractions of the blocks an
    unlimited cache would hold (every prompt block minus the ideal hits), from a small cache
    up to one that never evicts; without them the chart would have no curve at all."""
    total = sum(num_blocks(r, block_size) for r in requests)
    distinct = max(1, total - ideal_hit_tokens(requests, block_size) // block_size)
    return sorted({max(1, round(distinct * f)) for f in PLOT_FRACTIONS})


def plot(results: list[dict], path: Path, trace: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted((r for r in results if r["capacity_blocks"] is not None), key=lambda r: r["capacity_blocks"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if rows:
        ax.plot([r["capacity_blocks"] for r in rows], [100 * r["hit_token_rate"] for r in rows], "o-",
                label="LRU, replayed")
        ax.set_xscale("log")
    ax.axhline(100 * results[0]["ideal_hit_token_rate"], color="gray", ls="--", label="unlimited (ideal)")
    ax.set_xlabel("device capacity (blocks)")
    ax.set_ylabel("prompt token hit rate (%)")
    ax.set_title(f"prefix cache hit rate: {trace.name}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_trace(requests: list[TraceRequest], capacities: list[int | None], args: argparse.Namespace) -> list[dict]:
    """Every `--eviction` policy (and LRU) at each capacity, with the ideal and the bound."""
    ideal = ideal_hit_tokens(requests, args.block_size) / sum(r.input_length for r in requests)
    policies = list(dict.fromkeys(args.eviction))
    bound_uses = None if args.no_bound or capacities == [None] else uses(requests, args.block_size)
    results = []
    for capacity in capacities:
        for kv in getattr(args, "kv", None) or [None]:
            rows = {name: replay(requests, args.block_size, capacity, args.host_blocks, name, kv,
                                 getattr(args, "chunk", 512))
                    for name in dict.fromkeys(policies + ["lru"])}
            bound = ideal if capacity is None else None
            if bound_uses is not None and capacity is not None and kv is None:
                bound = offline_hit_rate(bound_uses, args.block_size, capacity)
            for name in policies:
                row = rows[name]
                row["ideal_hit_token_rate"] = ideal
                row["lru_hit_token_rate"] = rows["lru"]["hit_token_rate"]
                row["offline_bound_hit_token_rate"] = bound
                results.append(row)
    return results


def suite(args: argparse.Namespace) -> int:
    """`--suite`: every synthetic family and the bundled trace, each at its plot capacities."""
    traces: list[tuple[str, list[TraceRequest]]] = [(f"{PREFIX}{name}", synthetic(name)) for name in TRACES]
    real = args.trace
    if not str(real).startswith(PREFIX) and real.exists():
        traces.append((str(real), load_trace(real, args.limit)))
    out, peers_out = [], []
    for name, requests in traces:
        requests = requests[:args.limit]
        capacities = plot_capacities(requests, args.block_size)
        results = run_trace(requests, capacities, args)
        peers = peer_rows(requests, capacities, results, args)
        for r in results + peers:
            r["trace"] = name
        out += results
        peers_out += peers
        if not args.json:
            print(table(results, [], Path(name), args.block_size) + "\n", flush=True)
            if peers:
                print(peer_cache.table(peers, args.peer_python) + "\n", flush=True)
    if args.json:
        print(json.dumps({"results": out, **({"peers": peers_out} if args.peer else {})}, indent=1))
    return 0


def peer_rows(requests: list[TraceRequest], capacities: list[int | None], results: list[dict],
              args: argparse.Namespace) -> list[dict]:
    """`--peer`: each peer's rows at these capacities, with kvrt's `results` beside them."""
    rows = []
    for name in args.peer:
        rows += peer_cache.run_peer(name, args.peer_python, requests, args.block_size, capacities)
    return peer_cache.compare(rows, results)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.suite:
        try:
            return suite(args)
        except peer_cache.PeerError as e:
            print(f"kvrt bench cache: --peer: {e}", file=sys.stderr)
            return 1
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("kvrt bench cache: --plot needs matplotlib: pip install 'kvrt[plot]'", file=sys.stderr)
            return 2
    try:
        if str(args.trace).startswith(PREFIX):
            requests = synthetic(str(args.trace)[len(PREFIX):])[:args.limit]
        else:
            requests = load_trace(args.trace, args.limit)
    except (OSError, TraceError) as e:
        print(f"kvrt bench cache: {e}", file=sys.stderr)
        return 2
    if not requests:
        print(f"kvrt bench cache: {args.trace} has no requests", file=sys.stderr)
        return 2
    capacities = args.capacity_blocks or [None]
    if args.plot is not None and not args.capacity_blocks:
        capacities = plot_capacities(requests, args.block_size)
        print(f"kvrt bench cache: no --capacity-blocks: plotting device capacities {', '.join(map(str, capacities))}",
              file=sys.stderr)
    results = run_trace(requests, capacities, args)
    try:
        peers = peer_rows(requests, capacities, results, args)
    except peer_cache.PeerError as e:
        print(f"kvrt bench cache: --peer: {e}", file=sys.stderr)
        return 1
    scaling = run_evict_scaling(args.evict_sizes, args.block_size) if args.evict_scaling else []
    if args.plot is not None:
        plot(results, args.plot, args.trace)
    if args.json:
        out: dict = {"results": results}
        if scaling:
            out["evict_scaling"] = scaling
        if args.peer:
            out["peers"] = peers
        print(json.dumps(out, indent=1))
    else:
        print(table(results, scaling, args.trace, args.block_size))
        if peers:
            print("\n" + peer_cache.table(peers, args.peer_python))
        if args.plot is not None:
            print(f"\nplot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
