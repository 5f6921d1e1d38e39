"""`kvrt bench model`: where a step of a Hugging Face checkpoint's forward pass spends its time,
against the step's physical limit and against `transformers` running the same checkpoint.

In one run:
- without --model, a checkpoint of real ~0.5B shapes (Qwen2: hidden 896, 24 layers, 14 heads,
  2 KV heads, MLP 4864, vocab 151936, tied embeddings, random BF16 weights) is written in code
  into a temporary directory (`--shape small`: a few-layer toy of the same kind, for a quick run;
  `gemma3-1b`: Gemma 3 1B's shapes, five sliding layers of 512 tokens to each full one;
  `small-gemma3`, `small-moe`: toys of Gemma 3 and Qwen3-MoE); any architecture kvrt serves
  runs with --model;
- it is loaded with the loader the worker uses (`HFModel`, memory-mapped safetensors) in the
  compute dtype a node would use (--compute-dtype, as `kvrt launch`'s: auto is float32 on a CPU
  and the checkpoint's precision, float16 for BF16, on a GPU; the KV pool follows) and run over a
  paged KV pool laid out by the node's KV layout spec, each sequence with its own block table,
  through `step_outputs`, the worker's call, then the worker's `sample` on the same device,
  with the BLAS thread count the worker would use (workers/model/threads.py);
- the limits, measured first: `memcpy`, one large copy (bytes read plus written per second),
  and `peak`, a large square matmul in the compute dtype at each thread count used (FLOP/s);
- `decode` rows: at each --batches and --contexts, --decode-steps steps of one token per
  sequence whose KV already holds `context` tokens (written into the pool directly: the values
  do not change the work), median step; `prefill` rows: one step of a --prompt-len prompt per
  sequence at each --prefill-batches, best of --prefill-repeats; a `sampled` row: decode at
  --sample-batch with temperature 1, top_p 0.9, top_k 50, its steps interleaved with greedy ones,
  `vs greedy` being sampled / greedy;
- each row splits its step into phases (workers/model/phases.py: q/k/v/o and MLP projections,
  attention, LM head, host<->device copies, sampling, and the rest; on a GPU from a second copy
  of the step, since timing a phase there means a device sync at its ends) and stands next to its
  roofline: the larger of the bytes it must move (the weights once, the KV it reads) at the
  memcpy bandwidth and the FLOPs it must do (matmuls, causal attention) at the matmul peak of the
  same thread count (a sliding layer's KV and attention counted within its window, a layer of
  experts' weights as the top_k experts every token needs: the least any step reads); `vs roof`
  is measured / roofline (1.0 is the limit);
- when `torch` and `transformers` import, the same checkpoint's `transformers` model on the same
  device, in the same dtype, with the same thread count (torch.set_num_threads), each row right
  after kvrt's: decode as a manual loop of one forward per token over a `DynamicCache` holding
  `context` tokens (the model alone: `kvrt/hf`), and as greedy `generate` after a `context`-token
  prompt, per new token (the loop a transformers user runs, its bookkeeping included:
  `kvrt/gen`), prefill as one forward of the prompt; each ratio is transformers' step time /
  kvrt's (above 1: kvrt faster). Without them the rows say why and the rest runs;
- on a GPU, `graph ms`: the same decode step's kernels captured once as a CUDA graph and
  replayed, the floor of those kernels without Python's cost of launching each one;
- `--count-ops`, instead of timing: the array operations per layer of each row's step, counted
  on NumPy (bench/array_ops.py); on a GPU each is a kernel launch, and launches, not the
  kernels' work, are what a small step's time is made of there;
- --threads 1,2,auto measures each thread setting, the settings taking turns step by step so a
  change in the machine's load falls on all alike, and --busy N repeats every row with N busy
  processes competing for the cores.

Default grid: batches 1,8,32 at context 128, prefill at batch 1 and the sampled row (a few
minutes on 2 cores). The full grid: --contexts 128,2048,8192 --prefill-batches 1,8,32 (rows
whose pool exceeds --max-pool-gib are skipped with a note). No timing is asserted anywhere; the
figures are what this machine gave in this run.
"""
from __future__ import annotations

import argparse
import contextlib
import inspect as pyinspect
import json
import logging
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Callable

import numpy as np

from kvrt.bench.array_ops import count_step
from kvrt.bench.copy import cuda_missing
from kvrt.ipc.layout import FP8_E4M3
from kvrt.workers.backend import BackendUnavailable, get_backend
from kvrt.workers.model.checkpoint import inspect, parse_config
from kvrt.workers.model.hf_model import REQUESTED_DTYPES, HFModel, resolve_compute_dtype
from kvrt.workers.model.transformer import Model, SeqInput, attention_budgets
from kvrt.workers.model.phases import OTHER, SAMPLING, PhaseClock
from kvrt.workers.model.sampler import SamplingRows, sample
from kvrt.workers.model.threads import AUTO, BlasThreads, usable_cores

log = logging.getLogger("kvrt.bench.model")

QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_position_embeddings": 32768,
         "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu"}
GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "max_position_embeddings": 32768,
          "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "tie_word_embeddings": True,
          "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "sliding_window_pattern": 6}
# real Qwen2.5-0.5B and Gemma 3 1B shapes, and toys of them and of Qwen3-MoE
SHAPES = {
    "0.5b": dict(QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "small": dict(QWEN2, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512),
    "gemma3-1b": dict(GEMMA3, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512),
    "small-gemma3": dict(GEMMA3, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512, sliding_window=16),
    "small-moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu",
                  "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
}
BLOCK_SIZE = 16
MEMCPY_BYTES = 1 << 30  # large enough to leave every cache far behind
PEAK_N = 2048           # the peak matmul's side: large enough for the BLAS's best blocking
SAMPLED = dict(temperature=1.0, top_p=0.9, top_k=50)
SWITCH_PAUSE_S = 0.2    # between kvrt and torch, and between thread settings: idle threads stop spinning first


@dataclass
class Row:
    kind: str             # "memcpy", "peak", "decode", "prefill" or "sampled"
    threads: str = "-"    # the setting: "1", "2", ..., "auto"
    load: str = "quiet"   # "quiet" or "busy N": N competing busy processes
    batch: int = 0
    context: int = 0      # tokens each sequence's KV held before the step
    tokens: int = 0       # tokens computed in one step
    blas_threads: int = 0  # what the setting resolved to (auto: for the row's last step)
    ms: float | None = None           # kvrt, per step
    tokens_s: float | None = None
    phases_ms: dict[str, float] = field(default_factory=dict)  # the median step's, "other" included
    phased_ms: float | None = None    # what the phases add up to: on a GPU a step of its own, timed
    #                                   with a device sync around each phase, so above `ms`
    graph_ms: float | None = None     # decode on a GPU: the same step's kernels replayed as one CUDA graph
    mem_ms: float | None = None       # bytes it must move at the memcpy bandwidth
    flop_ms: float | None = None      # FLOPs it must do at the matmul peak of its thread count
    roof_ms: float | None = None      # max(mem_ms, flop_ms)
    vs_roof: float | None = None      # ms / roof_ms
    hf_ms: float | None = None        # transformers, per step
    vs_hf: float | None = None        # hf_ms / ms: kvrt's speed in units of transformers'
    gen_ms: float | None = None       # decode: transformers' `generate`, per step
    vs_gen: float | None = None       # gen_ms / ms
    greedy_ms: float | None = None    # sampled: the interleaved greedy steps
    vs_greedy: float | None = None    # sampled: ms / greedy_ms
    gb_s: float | None = None         # memcpy: bytes read + written per second
    gflop_s: float | None = None      # peak
    note: str = ""


# ---- a checkpoint made in code ---------------------------------------------------------------

def _bf16_random(rng: np.random.Generator, n: int, scale_exp: int) -> np.ndarray:
    """n random bfloat16 bit patterns of magnitude ~2**scale_exp with random signs (built from
    random bits, not floats: half a billion of them in a few seconds)."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits &= np.uint16(0x807F)  # keep sign and mantissa
    bits |= np.uint16((127 + scale_exp) << 7)
    return bits


def write_checkpoint(directory: str, shape: str, seed: int = 0) -> dict:
    """A checkpoint of `shape` in `directory`: config.json and one BF16 model.safetensors holding
    every tensor kvrt's reading of that config expects, written tensor by tensor so peak memory
    stays one tensor. Returns the config."""
    cfg = {**SHAPES[shape], "torch_dtype": "bfloat16"}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    shapes = parse_config(directory).expected_tensors()
    # transformers refuses (some versions: fails on) a safetensors file without the format
    # save_pretrained writes; kvrt's own reader skips this entry
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shp in shapes.items():
        n = 2 * math.prod(shp)
        header[name] = {"dtype": "BF16", "shape": list(shp), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shp in shapes.items():
            n = math.prod(shp)
            if name.endswith("norm.weight"):  # 1.0, or 0.0 where applied as 1 + w (Gemma)
                data = np.full(n, 0 if cfg["model_type"].startswith("gemma") else 0x3F80, dtype=np.uint16)
            else:
                # ~1/sqrt(fan-in) keeps activations O(1) through the layers
                data = _bf16_random(rng, n, -int(round(math.log2(math.sqrt(shp[-1])))))
            f.write(data.tobytes())
    return cfg



# ---- limits ----------------------------------------------------------------------------------

def _sync(xp: Any) -> None:
    if xp is not np:
        xp.cuda.Stream.null.synchronize()


def memcpy_gb_s(xp: Any, nbytes: int, repeat: int = 5) -> float:
    """Bandwidth of one large copy, bytes read plus written per second, best of `repeat`."""
    src = xp.ones(nbytes // 4, dtype=xp.float32)
    dst = xp.empty_like(src)
    best = math.inf
    for _ in range(repeat + 1):  # the first also faults the destination pages in
        _sync(xp)
        t0 = time.perf_counter()
        xp.copyto(dst, src)
        _sync(xp)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def matmul_gflop_s(xp: Any, dtype: str, n: int, repeat: int = 3) -> float:
    """FLOP/s of an n x n by n x n matmul in `dtype` (the thread count in force), best of `repeat`."""
    a = xp.full((n, n), 0.5, dtype=dtype)
    b = xp.full((n, n), 0.25, dtype=dtype)
    best = math.inf
    for _ in range(repeat + 1):  # the first also pays for the BLAS's lazy start
        _sync(xp)
        t0 = time.perf_counter()
        a @ b
        _sync(xp)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def weight_bytes(model: HFModel) -> int:
    """Bytes of the weights as the model holds them (each array once: a tied LM head is the
    embedding's view)."""
    return sum(int(a.nbytes) for a in _weight_arrays(model))


def weight_params(model: HFModel) -> int:
    """Parameters of this rank's model (each array once), whatever dtype holds them."""
    return sum(int(a.size) for a in _weight_arrays(model))


def _weight_arrays(model: HFModel) -> list[Any]:
    seen: dict[int, Any] = {}

    def add(a: Any) -> None:
        if is_dataclass(a):  # a layer's experts
            for v in vars(a).values():
                add(v)
            return
        if not hasattr(a, "nbytes"):  # None, a layer's window or RoPE index
            return
        base = a
        while getattr(base, "base", None) is not None:
            base = base.base
        seen[id(base)] = base

    for a in (model.embed, model.final_norm, model.lm_head):
        add(a)
    for w in model.layers:
        add(w)
    return list(seen.values())


@dataclass
class Limits:
    """What this machine can do, measured in this run, and what a step must do (`cost`)."""

    gb_s: float                  # memcpy, read + written
    gflop_s: dict[int, float]    # matmul peak by thread count
    step_bytes: int              # a step's weight traffic: every weight once (an untied embedding: its rows;
    #                              experts: the top_k of each layer every token needs)
    layer_matmul_params: int     # q/k/v/o and MLP (or the top_k experts', the router's) weights of all layers
    head_params: int             # the LM head
    attn_width: int              # query heads x head_dim of all layers summed
    kv_token_bytes: int          # one token's K and V over all layers, in the pool
    windows: tuple[int, ...] = ()  # each layer's sliding window (0: none); () as one full layer

    def cost(self, seqs: list[tuple[int, int]]) -> tuple[float, float]:
        """(bytes, FLOPs) a step of sequences (context, new tokens) cannot do without: the
        weights read once and each sequence's KV read once (a sliding layer's: its queries'
        windows) and its new KV written; the projections of every token, the LM head of each
        sequence's last, and causal attention (QK^T and PV: 4 FLOPs per query, key and
        query-head dimension)."""
        tokens = sum(n for _, n in seqs)
        windows = self.windows or (0,)
        keys = pairs = 0.0  # over the layers, in units of one layer's share
        for w in windows:
            for ctx, n in seqs:
                keys += ctx + n - (max(0, ctx - w + 1) if w else 0)
                seen = np.arange(ctx + 1, ctx + n + 1)  # keys each query sees
                pairs += float((np.minimum(seen, w) if w else seen).sum())
        kv = keys * self.kv_token_bytes / len(windows)
        flops = (2 * self.layer_matmul_params * tokens + 2 * self.head_params * len(seqs)
                 + 4 * self.attn_width * pairs / len(windows))
        return float(self.step_bytes + kv), float(flops)

    def roofline(self, row: Row, seqs: list[tuple[int, int]]) -> None:
        nbytes, flops = self.cost(seqs)
        row.mem_ms = nbytes / (self.gb_s * 1e9) * 1e3
        row.flop_ms = flops / (self.gflop_s[row.blas_threads] * 1e9) * 1e3
        row.roof_ms = max(row.mem_ms, row.flop_ms)
        if row.ms:
            row.vs_roof = row.ms / row.roof_ms


def model_limits(model: HFModel, gb_s: float, gflop_s: dict[int, float]) -> Limits:
    s = model.shape
    per_token = unread = 0  # matmul weights each token multiplies; expert bytes a step need not read
    for w in model.layers:
        per_token += sum(int(a.size) for a in (w.wqkv, w.wo, w.w_gate_up, w.w_down, w.shared_gate_up,
                                               w.shared_down, w.shared_gate) if a is not None)
        if w.experts is not None:
            count, k = w.experts.gate_up.shape[0], model.experts.top_k
            one = (int(w.experts.gate_up.size) + int(w.experts.down.size)) // count
            per_token += k * one + int(w.experts.router.size)
            unread += (count - k) * one * w.experts.gate_up.itemsize
    tied = model.config.tie_word_embeddings
    return Limits(gb_s, gflop_s, weight_bytes(model) - (0 if tied else int(model.embed.nbytes)) - unread,
                  per_token, int(model.lm_head.size), s.num_heads * s.head_dim * s.num_layers,
                  2 * s.num_layers * s.num_kv_heads * s.head_dim * model.kv_dtype.itemsize,
                  model.shape.windows)


# ---- kvrt ------------------------------------------------------------------------------------

class Runner:
    """kvrt's steps as the worker runs them at one thread setting: the BLAS thread count for
    the step's rows, the forward pass, then `sample`; each step's phases recorded. On a GPU a
    phase is timed by synchronising the device at its ends, which would slow the step itself,
    so there the phases come from a second, untimed copy of the step."""

    def __init__(self, model: HFModel, threads: BlasThreads) -> None:
        self.model, self.threads = model, threads
        self.clock = PhaseClock(model.xp)

    def step(self, pool: Any, seqs: list[SeqInput], rows: SamplingRows) -> tuple[np.ndarray, float, dict[str, float]]:
        """Tokens, seconds and phases (ms, with the rest as "other") of one step."""
        on_gpu = self.model.xp is not np
        if on_gpu:
            tokens, t = self._run(pool, seqs, rows, None)
        self.clock.take()
        tokens, t_phased = self._run(pool, seqs, rows, self.clock)
        phases = {k: v * 1e3 for k, v in self.clock.take().items()}
        phases[OTHER] = max(0.0, t_phased * 1e3 - sum(phases.values()))
        return tokens, t if on_gpu else t_phased, phases

    def _run(self, pool: Any, seqs: list[SeqInput], rows: SamplingRows, clock: PhaseClock | None
             ) -> tuple[np.ndarray, float]:
        xp = self.model.xp
        self.model.phases = clock
        _sync(xp)
        t0 = time.perf_counter()
        with self.threads.for_rows(sum(len(s.tokens) for s in seqs)):
            logits, _ = self.model.step_outputs(pool, seqs, on_device=True)
            with self.clock.span(SAMPLING) if clock else contextlib.nullcontext():
                tokens, _ = sample(logits, rows, xp)
        _sync(xp)
        self.model.phases = None
        return tokens, time.perf_counter() - t0


def kv_pool(model: HFModel, blocks: int, seed: int = 0) -> Any:
    """A pool of `blocks` blocks, every one holding random K/V (attention's work does not
    depend on the values, and written pages cost no fault inside a timed step)."""
    xp = model.xp
    layout = model.shape.kv_layout(BLOCK_SIZE, model.kv_dtype.name)
    pool = xp.empty(layout.pool_shape(blocks), dtype=layout.storage_dtype)
    one = model.kv_dtype.store(np.random.default_rng(seed).standard_normal(layout.pool_shape(1)))
    pool[:] = xp.asarray(one)
    return pool


def seq_tables(model: HFModel, b: int, per_seq: int) -> tuple[int, list[tuple[np.ndarray, tuple]]]:
    """The pool blocks `b` sequences of `per_seq` blocks take, and each one's block tables: a
    table per layer group (ipc/layout.py LayerGroups), none shared."""
    g = len(model.shape.groups.windows)
    out = []
    for i in range(b):
        ts = [np.arange((i * g + k) * per_seq, (i * g + k + 1) * per_seq, dtype=np.int32) for k in range(g)]
        out.append((ts[0], tuple(ts[1:])))
    return b * per_seq * g, out


def pool_bytes(model: HFModel, blocks: int) -> int:
    return blocks * model.shape.kv_layout(BLOCK_SIZE, model.kv_dtype.name).block_bytes


Step = tuple[float, dict[str, float], int]  # seconds, phases (ms), BLAS threads


def _median_step(results: list[Step]) -> Step:
    """The median step (the lower middle one of an even count), so its phases add up to the
    time shown."""
    return sorted(results, key=lambda r: r[0])[(len(results) - 1) // 2]


def _sampled_rows(b: int, position: int) -> SamplingRows:
    return SamplingRows(np.full(b, SAMPLED["temperature"]), np.full(b, SAMPLED["top_p"]),
                        np.full(b, SAMPLED["top_k"], np.int64), np.arange(b, dtype=np.uint64),
                        np.full(b, position, np.int64), np.zeros(b, bool))


def _pause_between(runners: list[Runner]) -> None:
    """Between two settings' steps: a BLAS's idle threads spin for a while after a step that
    used them, and would slow the next setting's step, not their own."""
    if len(runners) > 1:
        time.sleep(SWITCH_PAUSE_S)


def kvrt_decode(runners: list[Runner], b: int, ctx: int, steps: int, sampled: bool = False
                ) -> list[tuple[Step, float | None]]:
    """For each runner (thread setting): its median decode step at batch b over ctx tokens of
    KV; with `sampled`, the sampled steps' and the median of greedy steps interleaved with them
    (s). The settings take turns step by step, so a change in the machine's load falls on all
    of them alike (each setting's steps write the same slots: the values do not matter)."""
    model = runners[0].model
    per_seq = -(-(ctx + steps + 1) // BLOCK_SIZE)
    blocks, tables = seq_tables(model, b, per_seq)
    pool = kv_pool(model, blocks)
    first = np.random.default_rng(b).integers(0, model.shape.vocab_size, size=b).astype(np.int32)
    toks = [first] * len(runners)
    out: list[list[Step]] = [[] for _ in runners]
    greedy: list[list[float]] = [[] for _ in runners]
    for j in range(steps + 1):  # the first step untimed
        pos = ctx + j
        for r, runner in enumerate(runners):
            _pause_between(runners)
            seqs = [SeqInput(toks[r][i:i + 1], pos, *tables[i]) for i in range(b)]
            if sampled:
                _, t, _ = runner.step(pool, seqs, SamplingRows.greedy(b))
                if j:
                    greedy[r].append(t)
            toks[r], t, ph = runner.step(pool, seqs, _sampled_rows(b, pos + 1) if sampled else SamplingRows.greedy(b))
            if j:
                out[r].append((t, ph, runner.threads.last))
    return [(_median_step(o), float(np.median(g)) if sampled else None) for o, g in zip(out, greedy)]


def graph_decode(model: HFModel, b: int, ctx: int, steps: int) -> float | str:
    """On a GPU: the median seconds of a decode step at batch b over ctx tokens of KV whose
    kernels (the layers and the LM head) are captured once as a CUDA graph and replayed, so
    no kernel pays its launch from Python: the floor this step's kernels reach, next to the
    eager step's time. A string says why it could not be measured."""
    cp = model.xp
    per_seq = -(-(ctx + 1) // BLOCK_SIZE)
    blocks, tables = seq_tables(model, b, per_seq)
    pool = kv_pool(model, blocks)
    seqs = [SeqInput(np.zeros(1, np.int32), ctx, *tables[i]) for i in range(b)]
    stream = cp.cuda.Stream(non_blocking=True)
    memory = cp.cuda.MemoryPool()  # the graph's own: its buffers are never handed to anything else
    try:
        with cp.cuda.using_allocator(memory.malloc), stream:
            inputs = model.prepare(pool, seqs)
            run = lambda: Model._head(model, model.forward(pool, inputs)[inputs.last])  # noqa: E731
            run()
            stream.synchronize()
            stream.begin_capture()
            logits = run()
            graph = stream.end_capture()
            times = []
            for _ in range(steps + 1):
                stream.synchronize()
                t0 = time.perf_counter()
                graph.launch(stream)
                stream.synchronize()
                times.append(time.perf_counter() - t0)
            del logits
    except Exception as e:  # noqa: BLE001 (the row says why, the bench goes on)
        return f"graph capture failed: {type(e).__name__}: {e}"
    return float(np.median(times[1:]))


def kvrt_prefill(runners: list[Runner], b: int, prompt_len: int, repeats: int) -> list[Step]:
    """For each runner: its best of `repeats` prefill steps of b prompts of prompt_len tokens,
    the runners taking turns."""
    model = runners[0].model
    per_seq = -(-prompt_len // BLOCK_SIZE)
    blocks, tables = seq_tables(model, b, per_seq)
    pool = kv_pool(model, blocks)
    prompts = np.random.default_rng(prompt_len).integers(0, model.shape.vocab_size, size=(b, prompt_len),
                                                         dtype=np.int32)
    seqs = [SeqInput(prompts[i], 0, *tables[i]) for i in range(b)]
    out: list[list[Step]] = [[] for _ in runners]
    for _ in range(repeats):
        for r, runner in enumerate(runners):
            _pause_between(runners)
            _, t, ph = runner.step(pool, seqs, SamplingRows.greedy(b))
            out[r].append((t, ph, runner.threads.last))
    return [min(o, key=lambda x: x[0]) for o in out]


def count_rows(info: Any, max_len: int, compute: str, grid: Grid, budgets: tuple[int, int]) -> list[dict]:
    """Array operations per layer of one step of each decode row (batch x context) and each
    prefill row, counted on NumPy in the compute dtype `compute` with attention's key-tile
    `budgets` (a GPU's with --device cuda, which needs no GPU for this; bench/array_ops.py)."""
    out = []
    shapes = [("decode", b, ctx, 1) for ctx in grid.contexts for b in grid.batches]
    shapes += [("prefill", b, 0, grid.prompt_len) for b in grid.prefill_batches]
    for kind, b, ctx, n in shapes:
        model = HFModel(info, max_len, np, kv_dtype=compute, matmul_dtype=compute)
        model.attn_budgets = budgets
        per_seq = -(-(ctx + n) // BLOCK_SIZE)
        blocks, tables = seq_tables(model, b, per_seq)
        seqs = [SeqInput(np.zeros(n, np.int32), ctx, *tables[i]) for i in range(b)]
        counts = count_step(model, kv_pool(model, blocks), seqs)
        layers = model.config.num_layers
        out.append(dict(kind=kind, batch=b, context=ctx, ops_per_layer=sum(counts.values()) / layers,
                        ops_per_step=sum(counts.values()),
                        top={k: v / layers for k, v in counts.most_common(8)}))
    return out


def format_ops(rows: list[dict], compute: str) -> str:
    lines = [f"array operations of one step's layers, counted on NumPy ({compute}); each is a kernel launch on CuPy",
             f"{'kind':<8} {'batch':>5} {'ctx':>5} {'per layer':>9} {'per step':>8}  most frequent, per layer"]
    for r in rows:
        top = ", ".join(f"{k} {v:g}" for k, v in r["top"].items())
        lines.append(f"{r['kind']:<8} {r['batch']:>5} {r['context']:>5} {r['ops_per_layer']:>9.1f} "
                     f"{r['ops_per_step']:>8}  {top}")
    return "\n".join(lines)


# ---- transformers ----------------------------------------------------------------------------

class Transformers:
    """The same checkpoint's `transformers` model on the same device and dtype, or why not."""

    def __init__(self, model_dir: str, device: str, compute_dtype: str) -> None:
        self.why, self.model = "", None
        try:
            import torch  # optional: only this comparison needs it, and the project does not depend on it
            import transformers
            from transformers import AutoModelForCausalLM, DynamicCache
        except ImportError as e:
            self.why = f"transformers skipped: {e}"
            return
        self.torch, self.DynamicCache = torch, DynamicCache
        self.device = "cuda" if device == "cuda" else "cpu"
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(compute_dtype, torch.float16)
        # `torch_dtype` became `dtype` in transformers 4.56; the old name only warns, an unknown
        # one would be ignored and load float32, so the name is picked by version
        major, minor = (int(v) for v in transformers.__version__.split(".")[:2])
        kw = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": self.dtype}
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, **kw).to(self.device).eval()
        # the cache argument's name: past_key_values until transformers renamed it cache
        params = pyinspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.version = f"transformers {transformers.__version__}, torch {torch.__version__}"

    def _sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def _forward(self, ids: Any, positions: Any, cache: Any) -> Any:
        return self.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                          **{self.cache_kw: cache})

    def decode(self, b: int, ctx: int, steps: int, threads: int) -> float:
        """Median seconds of one forward per token at batch b over a cache of ctx tokens."""
        torch, cfg = self.torch, self.model.config
        torch.set_num_threads(threads)
        kvh = cfg.num_key_value_heads
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        cache = self.DynamicCache(config=cfg)
        # drawn where the cache lives: a GPU row's cache (batch 128 x 2,048 tokens) is gigabytes
        gen = torch.Generator(device=self.device).manual_seed(0)
        for li in range(cfg.num_hidden_layers):
            k = torch.randn(b, kvh, ctx, hd, generator=gen, device=self.device, dtype=self.dtype)
            v = torch.randn(b, kvh, ctx, hd, generator=gen, device=self.device, dtype=self.dtype)
            cache.update(k, v, li)
        tok = torch.randint(0, cfg.vocab_size, (b, 1), generator=gen, device=self.device)
        times = []
        with torch.inference_mode():
            for j in range(steps + 1):  # the first step untimed
                pos = torch.full((b, 1), ctx + j, device=self.device)
                self._sync()
                t0 = time.perf_counter()
                out = self._forward(tok, pos, cache)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                self._sync()
                times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    def generate(self, b: int, ctx: int, steps: int, threads: int) -> float:
        """Seconds per decode step of greedy `generate` at batch b after a ctx-token prompt, the
        loop a user of transformers runs: (best run of 1 + steps new tokens - best run of 1) /
        steps, so the prompt's prefill and the call's set-up are not charged to the steps."""
        torch, cfg = self.torch, self.model.config
        torch.set_num_threads(threads)
        gen = torch.Generator().manual_seed(ctx)
        ids = torch.randint(0, cfg.vocab_size, (b, max(ctx, 1)), generator=gen).to(self.device)
        mask = torch.ones_like(ids)

        def run(new: int) -> float:
            self._sync()
            t0 = time.perf_counter()
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                do_sample=False, pad_token_id=0)
            self._sync()
            return time.perf_counter() - t0

        with torch.inference_mode():
            run(2)  # warm-up
            one = min(run(1) for _ in range(2))
            many = min(run(1 + steps) for _ in range(2))
        return max(many - one, 0.0) / steps

    def prefill(self, b: int, prompt_len: int, repeats: int, threads: int) -> float:
        """Best of `repeats` forwards (s) of b prompts of prompt_len tokens into fresh caches."""
        torch, cfg = self.torch, self.model.config
        torch.set_num_threads(threads)
        gen = torch.Generator().manual_seed(prompt_len)
        ids = torch.randint(0, cfg.vocab_size, (b, prompt_len), generator=gen).to(self.device)
        pos = torch.arange(prompt_len, device=self.device).expand(b, -1)
        best = math.inf
        with torch.inference_mode():
            self._forward(ids[:, :BLOCK_SIZE], pos[:, :BLOCK_SIZE], self.DynamicCache(config=cfg))  # warm-up
            for _ in range(repeats):
                self._sync()
                t0 = time.perf_counter()
                out = self._forward(ids, pos, self.DynamicCache(config=cfg))
                out.logits[:, -1].argmax(-1)
                self._sync()
                best = min(best, time.perf_counter() - t0)
        return best


# ---- the grid --------------------------------------------------------------------------------

@dataclass
class Grid:
    batches: list[int]
    contexts: list[int]
    decode_steps: int
    prompt_len: int
    prefill_batches: list[int]
    prefill_repeats: int
    sample_batch: int
    max_pool_bytes: int


def run_grid(model: HFModel, hf: Transformers, limits: Limits, grid: Grid, settings: list[int], load: str,
             cores: int) -> list[Row]:
    """Every row of the grid at each thread setting (the settings' steps interleaved), each
    setting's kvrt row followed by transformers at the same thread count."""
    runners = [Runner(model, BlasThreads(s, cores)) for s in settings]
    labels = ["auto" if s == AUTO else str(s) for s in settings]
    rows: list[Row] = []
    # one untimed step first: the first call pays for lazy initialisation
    for runner in runners:
        blocks, [tables] = seq_tables(model, 1, 1)
        runner.step(kv_pool(model, blocks), [SeqInput(np.zeros(2, np.int32), 0, *tables)], SamplingRows.greedy(1))

    def finish(row: Row, step: Step, seqs: list[tuple[int, int]], hf_time: Callable[[int], float] | None,
               gen_time: Callable[[int], float] | None = None) -> None:
        t, row.phases_ms, row.blas_threads = step
        row.ms, row.tokens_s = t * 1e3, row.tokens / t
        row.phased_ms = sum(row.phases_ms.values())
        limits.roofline(row, seqs)
        if hf_time is None:
            pass
        elif hf.model is None:
            row.note = row.note or hf.why
        else:
            time.sleep(SWITCH_PAUSE_S)
            row.hf_ms = hf_time(row.blas_threads) * 1e3
            row.vs_hf = row.hf_ms / row.ms
            if gen_time is not None:
                row.gen_ms = gen_time(row.blas_threads) * 1e3
                row.vs_gen = row.gen_ms / row.ms
            time.sleep(SWITCH_PAUSE_S)
        rows.append(row)
        log.info("%s batch %d context %d threads %s (%s): %.1f ms", row.kind, row.batch, row.context, row.threads,
                 load, row.ms)

    for ctx in grid.contexts:
        for b in grid.batches:
            need = pool_bytes(model, seq_tables(model, b, -(-(ctx + grid.decode_steps + 1) // BLOCK_SIZE))[0])
            if need > grid.max_pool_bytes:
                rows += [Row("decode", label, load, b, ctx, b, note=f"skipped: its pool takes {need / 2**30:.1f} GiB "
                             f"> --max-pool-gib") for label in labels]
                continue
            graph = graph_decode(model, b, ctx, grid.decode_steps) if model.xp is not np else None
            for label, (step, _) in zip(labels, kvrt_decode(runners, b, ctx, grid.decode_steps)):
                row = Row("decode", label, load, b, ctx, b)
                if isinstance(graph, float):
                    row.graph_ms = graph * 1e3
                elif graph:
                    row.note = graph
                finish(row, step, [(ctx, 1)] * b, lambda n: hf.decode(b, ctx, grid.decode_steps, n),
                       lambda n: hf.generate(b, ctx, grid.decode_steps, n))
    for b in grid.prefill_batches:
        for label, step in zip(labels, kvrt_prefill(runners, b, grid.prompt_len, grid.prefill_repeats)):
            finish(Row("prefill", label, load, b, 0, b * grid.prompt_len), step, [(0, grid.prompt_len)] * b,
                   lambda n: hf.prefill(b, grid.prompt_len, grid.prefill_repeats, n))
    if grid.sample_batch:
        b, ctx = grid.sample_batch, grid.contexts[0]
        for label, (step, greedy) in zip(labels, kvrt_decode(runners, b, ctx, grid.decode_steps, sampled=True)):
            row = Row("sampled", label, load, b, ctx, b, greedy_ms=greedy * 1e3)
            finish(row, step, [(ctx, 1)] * b, None)
            row.vs_greedy = row.ms / row.greedy_ms
    return rows


class Busy:
    """N processes spinning on the CPU for the length of a `with` block: the competing load of
    a shared machine."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Busy":
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


# ---- output ----------------------------------------------------------------------------------

PHASE_COLUMNS = ("projections", "attention", "lm_head", "copies", "sampling", "other")


def _f(v: float | None, spec: str) -> str:
    width = spec.lstrip(">").split(".")[0]
    return format(v, spec) if v is not None else format("-", ">" + width)


def print_table(rows: list[Row], meta: dict) -> None:
    print(f"model {meta['model']} ({meta['params'] / 1e6:.1f} M params, weights held as "
          f"{meta['weight_bytes'] / 1e9:.2f} GB {meta['compute_dtype']}) on {meta['device']} "
          f"({meta['cores']} cores); block {meta['block_size']}; load {meta['load_s']:.1f} s; "
          f"comparison: {meta['transformers']}")
    if meta.get("kv_dtype") == FP8_E4M3 or meta.get("layer_windows"):
        print(f"KV: {meta['kv_dtype']}" + (f"; layer windows {meta['layer_windows']} (a table per layer group)"
                                           if meta.get("layer_windows") else ""))
    for r in rows:
        if r.kind == "memcpy":
            print(f"memcpy: {r.gb_s:.1f} GB/s read + written ({r.note})")
        elif r.kind == "peak":
            print(f"matmul peak at {r.blas_threads} thread(s): {r.gflop_s:.1f} GFLOP/s ({r.note})")
    print("ms per step; phases of the median step (decode, sampled) or the best (prefill); "
          "vs roof = ms / roofline; kvrt/hf = transformers' ms / kvrt's (above 1: kvrt faster); "
          "kvrt/gen = the same for transformers' generate; graph ms = kvrt's step replayed as a CUDA graph")
    print(f"{'kind':<8} {'thr':>4} {'load':>6} {'batch':>5} {'ctx':>5} {'ms':>8} {'tok/s':>8} "
          + " ".join(f"{c[:7]:>7}" for c in PHASE_COLUMNS)
          + f" {'roof ms':>8} {'vs roof':>7} {'hf ms':>8} {'kvrt/hf':>7} {'gen ms':>8} {'kvrt/gen':>8}"
          + f" {'graph ms':>8}  note")
    for r in rows:
        if r.kind in ("memcpy", "peak"):
            continue
        thr = f"{r.threads}" + (f"={r.blas_threads}" if r.threads == "auto" else "")
        note = r.note or (f"sampled/greedy {r.vs_greedy:.2f} (greedy {r.greedy_ms:.1f} ms)"
                          if r.vs_greedy is not None else "")
        print(f"{r.kind:<8} {thr:>4} {r.load:>6} {r.batch:>5} {r.context:>5} {_f(r.ms, '>8.1f')} "
              f"{_f(r.tokens_s, '>8.1f')} " + " ".join(_f(r.phases_ms.get(c), '>7.1f') for c in PHASE_COLUMNS)
              + f" {_f(r.roof_ms, '>8.1f')} {_f(r.vs_roof, '>7.2f')} {_f(r.hf_ms, '>8.1f')} "
              f"{_f(r.vs_hf, '>7.2f')} {_f(r.gen_ms, '>8.1f')} {_f(r.vs_gen, '>8.2f')} {_f(r.graph_ms, '>8.2f')}  {note}")
    for line in thread_summary(rows):
        print(line)


def thread_summary(rows: list[Row]) -> list[str]:
    """For each row measured at both 1 and 2 threads: 2 threads' time / 1 thread's, and the
    per-step choice's / the better of the two (the choice holds up where both are <= 1.0x)."""
    by = {(r.kind, r.load, r.batch, r.context, r.threads): r.ms for r in rows if r.ms}
    out = []
    for (kind, load, b, ctx, thr), ms in by.items():
        one, two = by.get((kind, load, b, ctx, "1")), by.get((kind, load, b, ctx, "2"))
        if thr != "1" or two is None:
            continue
        auto = by.get((kind, load, b, ctx, "auto"))
        line = f"threads {kind} batch {b} ctx {ctx} ({load}): 2 threads / 1 = {two / one:.2f}"
        if auto is not None:
            line += f"; auto / best of 1 and 2 = {auto / min(one, two):.2f}"
        out.append(line)
    return out


def _ints(p: argparse.ArgumentParser, name: str, value: str, allow_empty: bool = False) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v]
    except ValueError:
        p.error(f"{name} must be comma-separated integers, got {value!r}")
    if (not out and not allow_empty) or any(v < 1 for v in out):
        p.error(f"{name} must be positive")
    return out


def _settings(p: argparse.ArgumentParser, value: str) -> list[int]:
    out = []
    for v in value.split(","):
        if v == "auto":
            out.append(AUTO)
        elif v.isdigit() and int(v) > 0:
            out.append(int(v))
        else:
            p.error(f"--threads takes comma-separated positive counts or auto, got {value!r}")
    return out


def _torch_rows(args: argparse.Namespace, info: Any, model_dir: str, max_len: int, compute: str, grid: Grid) -> int:
    """--backend torch: bench/model_torch.py's rows, as a table or JSON."""
    try:
        from kvrt.bench import model_torch
    except ImportError as e:
        print(f"kvrt bench model: --backend torch needs torch: {e}", file=sys.stderr)
        return 2
    meta, rows = model_torch.run(info, model_dir, max_len, args.device, compute, usable_cores(), grid.batches,
                                 grid.contexts, args.decode_steps, args.prompt_len, grid.prefill_batches,
                                 args.prefill_repeats, not args.no_transformers)
    meta["model"] = args.model or f"random {args.shape} Qwen2 (BF16 file)"
    if args.json:
        print(json.dumps(model_torch.as_json(meta, rows)))
    else:
        model_torch.print_table(meta, rows)
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvrt bench model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face checkpoint directory (default: write a random "
                                   "~0.5B-shaped BF16 Qwen2 checkpoint into a temporary directory)")
    p.add_argument("--shape", choices=list(SHAPES), default="0.5b",
                   help="shape of the checkpoint written without --model (default 0.5b, Qwen2.5-0.5B's; small: a "
                        "toy of it; gemma3-1b: Gemma 3 1B's; small-gemma3, small-moe: toys of Gemma 3, Qwen3-MoE)")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes, comma-separated (default 1,8,32)")
    p.add_argument("--contexts", default="128",
                   help="tokens of KV each sequence holds before a decode step, comma-separated (default 128; "
                   "the full grid: 128,2048,8192)")
    p.add_argument("--decode-steps", type=int, default=5, help="timed decode steps per row, median shown (default 5)")
    p.add_argument("--prompt-len", type=int, default=512, help="prefill prompt tokens per sequence (default 512)")
    p.add_argument("--prefill-batches", default="1",
                   help="prefill batch sizes, comma-separated; empty for none (default 1; the full grid: 1,8,32)")
    p.add_argument("--prefill-repeats", type=int, default=2, help="prefill steps per row, best shown (default 2)")
    p.add_argument("--sample-batch", type=int, default=8,
                   help="batch of the sampled-decode row (temperature 1, top_p 0.9, top_k 50) vs greedy, at the "
                   "first context; 0 for none (default 8)")
    p.add_argument("--threads", default="auto",
                   help="BLAS thread settings to measure, comma-separated: counts and/or auto, the worker's "
                   "per-step choice (kvrt launch --threads) (default auto; e.g. 1,2,auto)")
    p.add_argument("--busy", type=int, default=0,
                   help="also measure every row with N busy processes competing for the CPU (default 0: quiet only)")
    p.add_argument("--max-pool-gib", type=float, default=4.0,
                   help="skip decode rows whose KV pool would exceed this many GiB (default 4)")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers comparison")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="numpy on CPU or CuPy (default cpu)")
    p.add_argument("--compute-dtype", choices=REQUESTED_DTYPES, default="auto",
                   help="as kvrt launch's (default auto: float32 on a CPU, the checkpoint's precision on a GPU)")
    p.add_argument("--memcpy-mib", type=int, default=MEMCPY_BYTES >> 20,
                   help=f"bytes of the bandwidth copy, MiB (default {MEMCPY_BYTES >> 20})")
    p.add_argument("--peak-n", type=int, default=PEAK_N, help=f"side of the peak matmul (default {PEAK_N})")
    p.add_argument("--count-ops", action="store_true",
                   help="instead of timing: count the array operations (kernel launches on a GPU) per layer of "
                        "each decode and prefill row, on NumPy (bench/array_ops.py; --device cuda: with a GPU's "
                        "attention tiles, no GPU needed)")
    p.add_argument("--backend", choices=("array", "torch"), default="array",
                   help="the worker's model path to measure (as kvrt launch --model-backend): array (NumPy/CuPy, with "
                   "phases and thread settings) or torch (eager and CUDA-graph steps next to transformers' generate "
                   "and the HBM floor: bench/model_torch.py) (default array)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="what the KV pool holds, as kvrt launch's (default auto: the compute dtype; fp8: e4m3); a "
                        "checkpoint with sliding windows beside full layers (--shape small-gemma3, gemma3-1b) runs "
                        "over layer groups, a table per group, as a node serves it")
    p.add_argument("--kv-drift", action="store_true",
                   help="instead of timing: how far answers drift with bfloat16, float16, FP8 KV (bench/kv_drift.py): "
                        "greedy agreement and next-token KL on tiny checkpoints written through transformers' configs")
    p.add_argument("--drift-prompts", type=int, default=8, help="--kv-drift: prompts per architecture (default 8)")
    p.add_argument("--drift-tokens", type=int, default=256, help="--kv-drift: greedy tokens per prompt (default 256)")
    p.add_argument("--json", action="store_true", help='print {"meta": {...}, "rows": [...]} instead of a table')
    args = p.parse_args(argv)
    if args.kv_drift:
        from kvrt.bench.kv_drift import main as drift

        if args.drift_prompts < 1 or args.drift_tokens < 1:
            p.error("--drift-prompts and --drift-tokens must be positive")
        return drift(args)
    grid = Grid(_ints(p, "--batches", args.batches), _ints(p, "--contexts", args.contexts), args.decode_steps,
                args.prompt_len, _ints(p, "--prefill-batches", args.prefill_batches, allow_empty=True),
                args.prefill_repeats, args.sample_batch, int(args.max_pool_gib * 2**30))
    settings = _settings(p, args.threads)
    if min(args.decode_steps, args.prompt_len, args.prefill_repeats, args.memcpy_mib, args.peak_n) < 1 \
            or args.sample_batch < 0 or args.busy < 0:
        p.error("--decode-steps, --prompt-len, --prefill-repeats, --memcpy-mib and --peak-n must be positive, "
                "--sample-batch and --busy not negative")
    try:
        xp = np if args.count_ops else get_backend(args.device).xp
    except BackendUnavailable as e:
        p.error(str(e))
    if args.device == "cuda" and not args.count_ops and (why := cuda_missing()):  # CuPy imports, but no GPU
        p.error(f"--device cuda cannot run here: {why}")
    cores = usable_cores()
    with tempfile.TemporaryDirectory(prefix="kvrt-bench-model-") as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = tmp
            t0 = time.perf_counter()
            write_checkpoint(model_dir, args.shape)
            log.info("wrote a %s checkpoint in %.1f s", args.shape, time.perf_counter() - t0)
        info = inspect(model_dir)
        max_len = max(max(grid.contexts) + args.decode_steps + 2, args.prompt_len)
        if max_len > info.config.max_position_embeddings:
            p.error(f"--contexts + --decode-steps or --prompt-len exceed the checkpoint's max_position_embeddings "
                    f"({info.config.max_position_embeddings})")
        if args.backend == "torch" and args.kv_cache_dtype != "auto":
            p.error("--backend torch keeps K/V in float16 or float32 blocks: leave --kv-cache-dtype out")
        compute = resolve_compute_dtype(args.compute_dtype, args.device, info, args.backend)
        if args.backend == "torch" and not args.count_ops:
            return _torch_rows(args, info, model_dir, max_len, compute, grid)
        if args.count_ops and args.kv_cache_dtype != "auto":
            p.error("--count-ops counts the compute dtype's KV blocks' operations: leave --kv-cache-dtype out")
        if args.count_ops:
            ops = count_rows(info, max_len, compute, grid, attention_budgets(np if args.device == "cpu" else None))
            print(json.dumps({"compute_dtype": compute, "rows": ops}) if args.json else format_ops(ops, compute))
            return 0
        t0 = time.perf_counter()
        model = HFModel(info, max_len, xp, kv_dtype=FP8_E4M3 if args.kv_cache_dtype == "fp8" else compute,
                        matmul_dtype=compute)
        load_s = time.perf_counter() - t0
        gb_s = memcpy_gb_s(xp, args.memcpy_mib << 20)
        rows = [Row("memcpy", gb_s=gb_s, note="d2d copy" if args.device == "cuda" else "np.copyto")]
        counts = sorted({c for s in settings for c in (range(1, cores + 1) if s == AUTO else {s})})
        peaks = {}
        for n in counts if args.device == "cpu" else counts[:1]:  # a GPU's matmul takes no BLAS threads
            with BlasThreads(n, cores).for_rows(1):
                peaks[n] = matmul_gflop_s(xp, compute, args.peak_n)
            rows.append(Row("peak", str(n), blas_threads=n, gflop_s=peaks[n],
                            note=f"{args.peak_n}x{args.peak_n} {compute} matmul"))
        peaks = {n: peaks.get(n, peaks[counts[0]]) for n in counts}
        limits = model_limits(model, gb_s, peaks)
        hf = Transformers(model_dir, args.device, compute) if not args.no_transformers else None
        if hf is None:
            hf = Transformers.__new__(Transformers)
            hf.model, hf.why = None, "transformers skipped: --no-transformers"
        for load in ["quiet"] + ([f"busy {args.busy}"] if args.busy else []):
            with Busy(args.busy if load != "quiet" else 0):
                rows += run_grid(model, hf, limits, grid, settings, load, cores)
        c = info.config
        meta = dict(model=args.model or f"random {args.shape} {c.arch} (BF16 file)", arch=c.arch,
                    params=weight_params(model), weight_bytes=weight_bytes(model), compute_dtype=compute,
                    kv_dtype=model.kv_dtype.name, layer_windows=list(model.shape.layer_windows),
                    device=args.device, cores=cores, block_size=BLOCK_SIZE, load_s=load_s, memcpy_gb_s=gb_s,
                    peak_gflop_s={str(k): v for k, v in peaks.items()}, decode_steps=args.decode_steps,
                    prompt_len=args.prompt_len, transformers=getattr(hf, "version", None) or hf.why,
                    hf_decode="one forward per token over a DynamicCache; gen: greedy generate, per new token")
    if args.json:
        print(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}))
    else:
        print_table(rows, meta)
    return 0
