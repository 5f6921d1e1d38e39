"""`kvrt bench model --backend torch`: the torch backend's steps (workers/model/torch_backend.py)
next to what a user would run instead and to the physical floor, as ratios.

Rows, for a checkpoint loaded as a worker loads it, over a paged KV pool of random K/V:
- `decode` at each --batches x --contexts: the median of --decode-steps steps (the first
  untimed), each the worker's whole step: the batch validated and planned on the host, the
  forward pass, the greedy draw of `sample`; `eager ms` with every kernel launched from Python,
  `graph ms` with the decode replayed as a CUDA graph captured for that batch over that pool (a
  GPU only), `replay ms` the graph's replay alone;
- `prefill` of one --prompt-len prompt (eager: prefill steps are never captured);
- the comparison: the same checkpoint's `transformers` model in the same dtype on the same
  device, decode as greedy `generate` per new token after a `context`-token prompt (`gen ms`) and
  as one forward per token over its cache (`hf ms`), prefill as one forward of the prompt;
- the floor: a step's bytes (every weight once, each sequence's K/V read once) at the device's
  copy bandwidth measured in the same run (read + written bytes per second), and for prefill
  the larger of that and its FLOPs at the measured matmul peak.
`vs gen` = gen ms / kvrt's best ms (above 1: kvrt faster), `vs hf` likewise, `vs floor` = kvrt's
best ms / floor ms (1.0 is the limit). No timing is asserted anywhere.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvrt.workers.model.checkpoint import CheckpointInfo
from kvrt.workers.model.hf_model import HFModel
from kvrt.workers.model.sampler import SamplingRows, sample
from kvrt.workers.model.transformer import SeqInput

log = logging.getLogger("kvrt.bench.model_torch")

BLOCK_SIZE = 16


@dataclass
class TorchRow:
    kind: str                 # "decode" or "prefill"
    batch: int
    context: int              # tokens of KV each sequence held before the step (prefill: 0)
    tokens: int               # tokens computed in one step
    eager_ms: float | None = None
    graph_ms: float | None = None
    replay_ms: float | None = None
    floor_ms: float | None = None
    hf_ms: float | None = None
    gen_ms: float | None = None
    best_ms: float | None = None   # graph ms where there is one, else eager ms
    tokens_s: float | None = None  # at best_ms
    vs_gen: float | None = None
    vs_hf: float | None = None
    vs_floor: float | None = None
    capture_s: float | None = None  # seconds the row's graph took to capture
    note: str = ""


class Bench:
    """The model, its device, the limits measured on it, and the comparison."""

    def __init__(self, info: CheckpointInfo, max_len: int, device: str, compute: str, cores: int) -> None:
        import torch

        from kvrt.workers.model.torch_backend import TorchModel, host_dtype

        self.torch = torch
        self.device = device
        self.xp = np
        if device == "cuda":
            import cupy

            self.xp = cupy
        kv = "float32" if compute == "float32" else "float16"
        t0 = time.perf_counter()
        hf = HFModel(info, max_len, np, kv_dtype=kv, matmul_dtype=host_dtype(compute))
        self.model = TorchModel(hf, "cuda" if device == "cuda" else "cpu", compute, xp=self.xp)
        self.load_s = time.perf_counter() - t0
        self.compute, self.cores = compute, cores
        s = self.model.shape
        self.kv_token_bytes = 2 * s.num_layers * s.num_kv_heads * s.head_dim * np.dtype(kv).itemsize
        self.gb_s = self._copy_gb_s()
        self.peak_flop_s = self._matmul_flop_s()

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def _copy_gb_s(self, nbytes: int = 1 << 30) -> float:
        torch = self.torch
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=self.model.device)
        dst = torch.empty_like(src)
        best = math.inf
        for _ in range(6):
            self.sync()
            t0 = time.perf_counter()
            dst.copy_(src)
            self.sync()
            best = min(best, time.perf_counter() - t0)
        return 2 * nbytes / best / 1e9

    def _matmul_flop_s(self, n: int = 4096) -> float:
        torch = self.torch
        n = n if self.device == "cuda" else 512
        a = torch.full((n, n), 0.5, dtype=self.model.dtype, device=self.model.device)
        best = math.inf
        for _ in range(4):
            self.sync()
            t0 = time.perf_counter()
            a @ a
            self.sync()
            best = min(best, time.perf_counter() - t0)
        return 2 * n ** 3 / best

    def pool(self, blocks: int) -> Any:
        layout = self.model.shape.kv_layout(BLOCK_SIZE, self.model.kv_dtype.name)
        pool = self.xp.empty(layout.pool_shape(blocks), dtype=layout.dtype)
        one = np.random.default_rng(0).standard_normal(layout.pool_shape(1)).astype(layout.dtype)
        pool[:] = self.xp.asarray(one)
        return pool

    def floor_ms(self, seqs: list[tuple[int, int]]) -> float:
        """What a step of (context, new tokens) sequences cannot take less than (module docstring)."""
        m = self.model
        tokens = sum(n for _, n in seqs)
        nbytes = m.weight_bytes() + sum(c + n for c, n in seqs) * self.kv_token_bytes
        s = m.shape
        per_token = 2 * sum(w.wqkv.numel() + w.wo.numel() + w.w_gate_up.numel() + w.w_down.numel() for w in m.layers)
        pairs = sum(n * c + n * (n + 1) // 2 for c, n in seqs)
        flops = per_token * tokens + 2 * m.lm_head.numel() * len(seqs) + 4 * s.num_heads * s.head_dim * s.num_layers * pairs
        return max(nbytes / (self.gb_s * 1e9), flops / self.peak_flop_s) * 1e3

    def _steps(self, pool: Any, seqs_at, steps: int, graphs: bool) -> float:
        """Median seconds of `steps` steps (one untimed first); seqs_at(j) is step j's batch."""
        times = []
        for j in range(steps + 1):
            seqs = seqs_at(j)
            self.sync()
            t0 = time.perf_counter()
            logits, _ = self.model.step_outputs(pool, seqs, on_device=True, graphs=graphs)
            sample(logits, SamplingRows.greedy(len(seqs)), self.xp)
            self.sync()
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    def decode(self, b: int, ctx: int, steps: int) -> TorchRow:
        row = TorchRow("decode", b, ctx, b)
        per_seq = -(-(ctx + steps + 2) // BLOCK_SIZE)
        pool = self.pool(b * per_seq)
        tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(b)]
        toks = np.random.default_rng(b).integers(0, self.model.shape.vocab_size, size=b).astype(np.int32)

        def seqs_at(j: int) -> list[SeqInput]:
            return [SeqInput(toks[i:i + 1], ctx + j, tables[i]) for i in range(b)]

        row.eager_ms = self._steps(pool, seqs_at, steps, graphs=False) * 1e3
        if self.device == "cuda":
            try:
                t0 = time.perf_counter()
                self.model.capture_graphs(pool, b, math.inf, buckets=[b])
                row.capture_s = time.perf_counter() - t0
                row.graph_ms = self._steps(pool, seqs_at, steps, graphs=True) * 1e3
                row.replay_ms = self._replay(b, steps) * 1e3
            except Exception as e:  # noqa: BLE001 (the row says why; the bench goes on)
                row.note = f"graphs failed: {type(e).__name__}: {e}"
            finally:
                self.model.graphs = None
        else:
            row.note = "no CUDA graphs on a CPU"
        row.floor_ms = self.floor_ms([(ctx, 1)] * b)
        return row

    def _replay(self, b: int, steps: int) -> float:
        graph = self.model.graphs.graphs[b]
        times = []
        for _ in range(steps + 1):
            self.sync()
            t0 = time.perf_counter()
            graph.replay()
            self.sync()
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    def prefill(self, b: int, n: int, repeats: int) -> TorchRow:
        row = TorchRow("prefill", b, 0, b * n, note="eager (prefill is never captured)")
        per_seq = -(-n // BLOCK_SIZE)
        pool = self.pool(b * per_seq)
        prompts = np.random.default_rng(n).integers(0, self.model.shape.vocab_size, size=(b, n), dtype=np.int32)
        seqs = [SeqInput(prompts[i], 0, np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32)) for i in range(b)]
        row.eager_ms = self._steps(pool, lambda j: seqs, repeats, graphs=False) * 1e3
        row.floor_ms = self.floor_ms([(0, n)] * b)
        return row


def finish(row: TorchRow) -> None:
    row.best_ms = row.graph_ms if row.graph_ms is not None else row.eager_ms
    row.tokens_s = row.tokens / row.best_ms * 1e3
    if row.gen_ms is not None:
        row.vs_gen = row.gen_ms / row.best_ms
    if row.hf_ms is not None:
        row.vs_hf = row.hf_ms / row.best_ms
    if row.floor_ms:
        row.vs_floor = row.best_ms / row.floor_ms


def run(info: CheckpointInfo, model_dir: str, max_len: int, device: str, compute: str, cores: int,
        batches: list[int], contexts: list[int], steps: int, prompt_len: int, prefill_batches: list[int],
        repeats: int, transformers: bool) -> tuple[dict, list[TorchRow]]:
    """Every row (module docstring); the transformers comparison right after each row's kvrt steps."""
    from kvrt.bench.model import Transformers

    bench = Bench(info, max_len, device, compute, cores)
    hf = Transformers(model_dir, device, compute) if transformers else None
    rows: list[TorchRow] = []
    for ctx in contexts:
        for b in batches:
            row = bench.decode(b, ctx, steps)
            if hf is not None and hf.model is not None:
                row.hf_ms = hf.decode(b, ctx, steps, cores) * 1e3
                row.gen_ms = hf.generate(b, ctx, steps, cores) * 1e3
            elif hf is not None:
                row.note = (row.note + "; " if row.note else "") + hf.why
            finish(row)
            rows.append(row)
            log.info("decode batch %d context %d: eager %.2f ms, graph %s ms", b, ctx, row.eager_ms,
                     f"{row.graph_ms:.2f}" if row.graph_ms is not None else "-")
    for b in prefill_batches:
        row = bench.prefill(b, prompt_len, repeats)
        if hf is not None and hf.model is not None:
            row.hf_ms = hf.prefill(b, prompt_len, repeats, cores) * 1e3
        finish(row)
        rows.append(row)
    m = bench.model
    meta = dict(backend="torch", device=device, compute_dtype=compute, ops=m.ops.name, weight_bytes=m.weight_bytes(),
                load_s=bench.load_s, copy_gb_s=bench.gb_s, matmul_tflop_s=bench.peak_flop_s / 1e12,
                block_size=BLOCK_SIZE, decode_steps=steps, prompt_len=prompt_len,
                transformers=(getattr(hf, "version", None) or hf.why) if hf is not None else "skipped")
    return meta, rows


def _f(v: float | None, spec: str) -> str:
    width = spec.lstrip(">").split(".")[0]
    return format(v, spec) if v is not None else format("-", ">" + width)


def print_table(meta: dict, rows: list[TorchRow]) -> None:
    print(f"torch backend on {meta['device']} ({meta['ops']} ops), {meta['compute_dtype']}; weights "
          f"{meta['weight_bytes'] / 1e9:.2f} GB; copy {meta['copy_gb_s']:.0f} GB/s read + written; matmul "
          f"{meta['matmul_tflop_s']:.1f} TFLOP/s; comparison: {meta['transformers']}")
    print("ms per step; best = graph where captured, else eager; vs gen / vs hf = transformers' ms / best "
          "(above 1: kvrt faster); vs floor = best / floor (1.0 is the limit)")
    print(f"{'kind':<8} {'batch':>5} {'ctx':>5} {'eager':>8} {'graph':>8} {'replay':>8} {'floor':>7} {'gen':>8} "
          f"{'hf':>8} {'vs gen':>7} {'vs hf':>6} {'vs floor':>8} {'tok/s':>9}  note")
    for r in rows:
        print(f"{r.kind:<8} {r.batch:>5} {r.context:>5} {_f(r.eager_ms, '>8.2f')} {_f(r.graph_ms, '>8.2f')} "
              f"{_f(r.replay_ms, '>8.2f')} {_f(r.floor_ms, '>7.3f')} {_f(r.gen_ms, '>8.2f')} {_f(r.hf_ms, '>8.2f')} "
              f"{_f(r.vs_gen, '>7.2f')} {_f(r.vs_hf, '>6.2f')} {_f(r.vs_floor, '>8.2f')} {_f(r.tokens_s, '>9.0f')}  "
              f"{r.note}")


def as_json(meta: dict, rows: list[TorchRow]) -> dict:
    return {"meta": meta, "rows": [asdict(r) for r in rows]}
