"""The torch backend: a checkpoint's model run with torch's GEMMs, a few fused operations
between them (workers/model/torch_ops.py: Triton kernels on a GPU) and, on a GPU, decode steps
replayed as CUDA graphs (workers/model/graphs.py).

Why a second way to run the same model: on a GPU the array path (NumPy's code on CuPy,
workers/model/transformer.py) is a few thousand kernel launches a step, each costing more than
its work, and CuPy refuses cuBLAS inside a stream capture, so that path cannot become a graph.
torch makes cuBLAS capture-safe and Triton writes the fused and paged kernels.

It is the same model, not another one: `HFModel` reads and checks the checkpoint, slices it for
tensor parallelism and checks the pool (`_check_pool`); a step batch is checked by the same
rules as `_plan`'s, over the whole batch at once (workers/model/batch_plan.py); its weights
move here as they are (each projection once, in the compute dtype: float32, float16, or
real bfloat16, which the array path computes as float16); the layer below is the reference's
layer, op for op:
    h = RMSNorm(x) ; qkv = h W_qkv (+ bias) ; q, k = RoPE(qk-norm(q, k)) ; K, V -> pool
    x += attention(q, pool) W_o ; h = RMSNorm(x) ; x += (silu(h W_gate) * h W_up) W_down
with the residual add fused into the next norm. Arithmetic matches the reference's float16
path: GEMM operands in the compute dtype with float32 accumulation, each result rounded once;
the residual stream, norms, RoPE, softmax and the logits float32.

The KV pool stays the worker's (a CuPy allocation on a GPU, shared with cache-transfer through
CUDA IPC; shared memory on a CPU), viewed as a torch tensor without a copy (DLPack); logits go
back to the worker's array module the same way, so the sampler and prompt scoring run as they
do for the array path. With --tp > 1 each layer's two partial sums go through the node's
all-reduce, and steps stay eager (graphs.py says why).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from kvrt.workers.model.backends import torch_problem
from kvrt.workers.model.batch_plan import plan_batch
from kvrt.workers.model.graphs import CaptureReport, CudaGraphMaker, DecodeGraphs, GraphMaker, StaticInputs, \
    buckets_up_to
from kvrt.workers.model.hf_model import HFModel
from kvrt.workers.model.kernels.plan import block_m_for, num_splits_for, scratch_shapes, tiles
from kvrt.workers.model.prompt_logprobs import PromptQuery, PromptScores, score_prompt
from kvrt.workers.model.torch_ops import DecodeMeta, PrefillMeta, pick_ops
from kvrt.workers.model.transformer import SeqInput

log = logging.getLogger("kvrt.workers.model.torch_backend")

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WARM_UP_ROWS = 40  # the warm-up's longest chunk: more rows than a 16-row prefill tile holds


def host_dtype(compute_dtype: str) -> str:
    """What `HFModel` loads the weights as on the host for this compute dtype: float16 as the
    array path holds it (refused beyond its range), anything else float32 (a BF16 file's values
    are exact in float32 and again in bfloat16)."""
    return "float16" if compute_dtype == "float16" else "float32"


class TorchModel:
    """A checkpoint's model on torch: `step_outputs` as `Model.step_outputs`."""

    beat: Callable[[], None] | None = None  # the worker's progress mark, after each layer

    def __init__(self, model: HFModel, device: str, compute_dtype: str, ops: Any = None, xp: Any = np) -> None:
        if compute_dtype not in TORCH_DTYPES:
            raise ValueError(f"compute dtype must be one of {', '.join(TORCH_DTYPES)}, got {compute_dtype!r}")
        _check_supported(model)
        self.model, self.shape, self.kv_dtype = model, model.shape, model.kv_dtype
        self.device, self.xp = device, xp
        self.compute_dtype = compute_dtype
        self.dtype = TORCH_DTYPES[compute_dtype]
        self.ops = ops if ops is not None else pick_ops(device)
        self.eps = float(model.eps)
        s = self.shape
        self.scale = float(s.head_dim) ** -0.5
        self._move_weights()
        [(inv_freq, rope_scale)] = model.ropes  # one RoPE for every layer (`torch_problem`)
        ang = np.arange(s.max_model_len, dtype=np.float64)[:, None] * np.asarray(inv_freq)[None, :]
        self.cos = torch.from_numpy((np.cos(ang) * rope_scale).astype(np.float32)).to(device)
        self.sin = torch.from_numpy((np.sin(ang) * rope_scale).astype(np.float32)).to(device)
        self.graphs: DecodeGraphs | None = None
        self._pools: dict[int, Any] = {}
        log.info("torch backend on %s: %s, ops %s", device, compute_dtype, self.ops.name)

    @classmethod
    def load(cls, model_dir: str, fingerprint: str, max_model_len: int, device: str, kv_dtype: str,
             compute_dtype: str, rank: int = 0, tp: int = 1, allreduce: Callable[[Any], Any] | None = None,
             xp: Any = np) -> "TorchModel":
        """The checkpoint the launcher checked (`HFModel.load`), moved to torch on `device`."""
        hf = HFModel.load(model_dir, fingerprint, max_model_len, np, kv_dtype, rank, tp, allreduce,
                          host_dtype(compute_dtype))
        return cls(hf, device, compute_dtype, xp=xp)

    # ---- weights -------------------------------------------------------------------------

    def _move_weights(self) -> None:
        """Every weight to the device, in place of the host array (so the host copy is freed):
        projections as [out, in] (the layout torch's GEMM reads directly) in the compute dtype,
        norms and biases float32; a tied LM head is the embedding itself."""
        m, dev = self.model, self.device

        def tensor(a: np.ndarray) -> Any:  # a read-only memory map's view is copied (torch writes nothing, but asks)
            a = np.ascontiguousarray(a)
            return torch.from_numpy(a if a.flags.writeable else a.copy())

        def proj(a: np.ndarray) -> Any:  # [in, out] on the host
            return tensor(np.asarray(a).T).to(dev, self.dtype)

        def vec(a: Any) -> Any:
            return None if a is None else tensor(np.asarray(a, np.float32)).to(dev)

        tied = m.config.tie_word_embeddings
        self.lm_head = proj(m.lm_head)
        self.embed = self.lm_head if tied else tensor(np.asarray(m.embed)).to(dev, self.dtype)
        m.lm_head = m.embed = None
        self.final_norm = vec(m.final_norm)
        for w in m.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                setattr(w, name, proj(getattr(w, name)))
            for name in ("attn_norm", "mlp_norm", "bqkv", "q_norm", "k_norm"):
                setattr(w, name, vec(getattr(w, name, None)))
        self.layers = m.layers

    def weight_bytes(self) -> int:
        """Bytes of the weights as held (each tensor once)."""
        seen = {id(t): t for t in (self.embed, self.lm_head, self.final_norm)}
        for w in self.layers:
            seen.update({id(t): t for t in vars(w).values() if isinstance(t, torch.Tensor)})
        return sum(t.numel() * t.element_size() for t in seen.values())

    # ---- arrays ----------------------------------------------------------------------------

    def pool_view(self, pool: Any) -> Any:
        """The worker's pool (numpy or CuPy) as a torch tensor over the same memory."""
        key = _address(pool)
        view = self._pools.get(key)
        if view is None:
            view = torch.from_numpy(pool) if isinstance(pool, np.ndarray) else torch.from_dlpack(pool)
            self._pools[key] = view
        return view

    def to_xp(self, t: Any) -> Any:
        """A float32 or integer tensor as an array of the worker's module, without a copy."""
        return t.numpy() if self.xp is np else self.xp.from_dlpack(t.contiguous())

    def from_xp(self, a: Any) -> Any:
        return torch.from_numpy(np.ascontiguousarray(a)) if self.xp is np else torch.from_dlpack(a)

    def _dev(self, a: np.ndarray) -> Any:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

    # ---- the layers ----------------------------------------------------------------------

    def _reduce(self, partial: Any) -> Any:
        """The tp ranks' float32 sum of a partial output (one rank: itself)."""
        allreduce = self.model.allreduce
        if allreduce is None:
            return partial
        return self.from_xp(allreduce(self.to_xp(partial.float())))

    def layers_forward(self, pool: Any, tokens: Any, positions: Any, slots: Any,
                       attend: Callable[[int, Any, Any], None]) -> Any:
        """The normalised final hidden states [T, d] (compute dtype) of a batch's tokens, each
        token's K/V written into `pool` at its slot; `attend(layer, q, out)` is the batch's
        attention (decode or prefill)."""
        s, ops, dt = self.shape, self.ops, self.dtype
        t, d = tokens.shape[0], self.embed.shape[1]
        x = self.embed.index_select(0, tokens).float()
        h = torch.empty((t, d), dtype=dt, device=x.device)
        q = torch.empty((t, s.num_heads, s.head_dim), dtype=torch.float32, device=x.device)
        att = torch.empty((t, s.num_heads * s.head_dim), dtype=dt, device=x.device)
        act = torch.empty((t, s.mlp_dim), dtype=dt, device=x.device)
        layers = self.layers
        ops.rms_norm(x, layers[0].attn_norm, self.eps, h)
        for li, w in enumerate(layers):
            qkv = F.linear(h, w.wqkv)
            ops.rope_write_kv(qkv, w.bqkv, w.q_norm, w.k_norm, self.eps, self.cos, self.sin, positions, slots, pool,
                              li, self.scale, q, s.num_heads, s.num_kv_heads, s.head_dim)
            attend(li, q, att)
            ops.rms_norm(x, w.mlp_norm, self.eps, h, delta=self._reduce(F.linear(att, w.wo)))
            ops.silu_mul(F.linear(h, w.w_gate_up), act)
            norm = layers[li + 1].attn_norm if li + 1 < len(layers) else self.final_norm
            ops.rms_norm(x, norm, self.eps, h, delta=self._reduce(F.linear(act, w.w_down)))
            if self.beat is not None:
                self.beat()
        return h

    def head(self, h: Any) -> Any:
        """Float32 logits of normalised hidden states h [n, d]."""
        return F.linear(h, self.lm_head).float()

    def decode_meta(self, batch: int, tables: Any, context: Any) -> DecodeMeta:
        """Decode attention's inputs for `batch` rows: their tables [batch, width] and context
        lengths [batch] (int32 device tensors), the split count and the scratch it needs."""
        s = self.shape
        splits = num_splits_for(batch, s.num_kv_heads)
        o, ml = scratch_shapes(batch, s.num_heads, s.head_dim, splits)
        return DecodeMeta(tables, context, splits, torch.empty(o, dtype=torch.float32, device=self.device),
                          torch.empty(ml, dtype=torch.float32, device=self.device))

    def prefill_meta(self, tables: np.ndarray, lens: np.ndarray, starts: np.ndarray) -> PrefillMeta:
        """Prefill attention's inputs for sequences computing lens[i] tokens from starts[i]."""
        block_m = block_m_for(int(lens.max()))
        tile_seq, tile_row = tiles(lens, block_m)
        row0 = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int32)
        return PrefillMeta(self._dev(tables), self._dev(row0), self._dev(starts), self._dev(lens), self._dev(tile_seq),
                           self._dev(tile_row), block_m)

    def _decode_attend(self, pool: Any, meta: DecodeMeta) -> Callable[[int, Any, Any], None]:
        s = self.shape
        return lambda li, q, out: self.ops.decode_attention(q, pool, li, meta, out, s.num_heads, s.num_kv_heads,
                                                            s.head_dim)

    # ---- a step ----------------------------------------------------------------------------

    def step_logits(self, pool: Any, seqs: Sequence[SeqInput]) -> np.ndarray:
        return self.step_outputs(pool, seqs)[0]

    def step(self, pool: Any, seqs: Sequence[SeqInput]) -> np.ndarray:
        return self.step_logits(pool, seqs).argmax(axis=-1).astype(np.int32)

    def step_outputs(self, pool: Any, seqs: Sequence[SeqInput], prompt: PromptQuery | None = None,
                     on_device: bool = False, graphs: bool = True) -> tuple[Any, PromptScores | None]:
        """As `Model.step_outputs`: logits of each sequence's last token (float32; on the
        worker's array module with `on_device`, else host), and the prompt scores `prompt` asks
        for. A decode batch a captured graph covers replays it (unless `graphs` is False)."""
        m, s = self.model, self.shape
        if not seqs:
            return np.empty((0, s.vocab_size), np.float32), None
        b = plan_batch(seqs, int(pool.shape[0]), m._check_pool(pool), s.vocab_size, s.max_model_len)
        if prompt is not None:
            _check_prompt(prompt, len(b.tokens), s.vocab_size)
        pt = self.pool_view(pool)
        lens, starts = b.lens, b.starts
        h = None
        if (graphs and prompt is None and self.graphs is not None and int(lens.max()) == 1
                and self.graphs.covers(_address(pool), len(seqs), b.width)):
            logits = self.graphs.run(b.tokens, b.positions, b.slots, starts + 1, b.tables)
        else:
            tok, pos, sl = self._dev(b.tokens), self._dev(b.positions), self._dev(b.slots)
            if int(lens.max()) == 1:
                meta = self.decode_meta(len(seqs), self._dev(b.tables), self._dev(starts + 1))
                attend = self._decode_attend(pt, meta)
            else:
                pm = self.prefill_meta(b.tables, lens, starts)
                attend = lambda li, q, out: self.ops.prefill_attention(  # noqa: E731
                    q, pt, li, pm, out, s.num_heads, s.num_kv_heads, s.head_dim)
            h = self.layers_forward(pt, tok, pos, sl, attend)
            last = self._dev(np.cumsum(lens).astype(np.int64) - 1)
            logits = self.head(h.index_select(0, last))
        if self.dtype != torch.float32 and not bool(torch.isfinite(logits).all()):
            raise ValueError("non-finite logits: an activation overflowed the compute dtype; serve this "
                             "checkpoint with --compute-dtype float32")
        scores = None
        if prompt is not None:
            scores = score_prompt(lambda rows: self.to_xp(self.head(self.from_xp(rows).to(self.dtype))),
                                  self.to_xp(h.float()), prompt, s.vocab_size, self.xp)
        if on_device:
            return self.to_xp(logits), scores
        return logits.cpu().numpy(), scores

    # ---- start-up ---------------------------------------------------------------------------

    def warm_up(self, block_size: int) -> None:
        """Short steps over a scratch pool, their results dropped: every kernel variant serving
        uses (prefill tiles of 64 rows and of 16, decode rows alone and beside a chunk, prompt
        scoring) is compiled now, before the worker says ready, not in its first steps. Each
        rank at its own pace: without the all-reduce."""
        longest = max(1, min(WARM_UP_ROWS, self.shape.max_model_len - 1))
        blocks = -(-(longest + 1) // block_size) + 1
        layout = self.shape.kv_layout(block_size, self.kv_dtype.name)
        pool = self.xp.zeros(layout.pool_shape(blocks), dtype=layout.dtype)
        table = np.arange(blocks - 1, dtype=np.int32)
        spare = np.array([blocks - 1], np.int32)
        chunk = SeqInput(np.zeros(longest, np.int32), 0, table)
        decode = SeqInput(np.zeros(1, np.int32), longest, table)
        batches = [[chunk], [SeqInput(np.zeros(min(2, longest), np.int32), 0, table)], [decode],
                   [decode, SeqInput(np.zeros(1, np.int32), 0, spare)], [SeqInput(np.zeros(1, np.int32), 0, spare), chunk]]
        # no all-reduce: ranks load the checkpoint side by side and one may start well before
        # another; the first real step runs the sum's few operations
        allreduce, self.model.allreduce = self.model.allreduce, None
        try:
            for seqs in batches:
                rows = sum(len(q.tokens) for q in seqs)
                self.step_outputs(pool, seqs, PromptQuery(np.arange(rows, dtype=np.int64), np.zeros(rows, np.int64),
                                                          np.ones(rows, np.int64)))
                self.step_outputs(pool, seqs, on_device=True)
        except ValueError as e:  # e.g. a float16 overflow on zeros' neighbours: the kernels compiled anyway
            log.warning("warm-up step failed (kernels compiled anyway): %s", e)
        finally:
            self.model.allreduce = allreduce
            self._pools.pop(_address(pool), None)

    def capture_graphs(self, pool: Any, max_batch: int, budget_s: float, maker: GraphMaker | None = None,
                       beat: Callable[[], None] | None = None, buckets: list[int] | None = None) -> CaptureReport:
        """Capture decode graphs over `pool` for batches of up to `max_batch` sequences
        (graphs.py; only `buckets` of them if given), within `budget_s` seconds; `maker` is
        torch's CUDA graphs unless given."""
        if self.model.allreduce is not None:
            raise ValueError("decode graphs need --tp 1: the all-reduce cannot be captured")
        s = self.shape
        width = -(-s.max_model_len // int(pool.shape[3]))
        static = StaticInputs(torch, self.device, max_batch, width)
        pt = self.pool_view(pool)

        def body_for(bucket: int) -> Callable[[], Any]:
            tokens, positions, slots, context = static.fields(bucket)
            meta = self.decode_meta(bucket, static.tables[:bucket], context)

            def body() -> Any:
                return self.head(self.layers_forward(pt, tokens, positions, slots, self._decode_attend(pt, meta)))

            return body

        self.graphs = DecodeGraphs(maker if maker is not None else CudaGraphMaker(torch), static, body_for,
                                   _address(pool))
        t0 = time.monotonic()
        report = self.graphs.capture(buckets_up_to(max_batch) if buckets is None else buckets, budget_s, beat)
        log.info("captured %d decode graphs (batches %s) in %.2f s%s", len(report.captured),
                 ",".join(map(str, report.captured)), time.monotonic() - t0,
                 f"; batches of {report.skipped[0]}+ run eager (capture budget {budget_s:.0f} s spent)"
                 if report.skipped else "")
        return report


LAYER_FIELDS = frozenset({"attn_norm", "wqkv", "wo", "mlp_norm", "w_gate_up", "w_down", "bqkv", "q_norm", "k_norm",
                          "rope"})  # rope: one RoPE (`torch_problem`)


def _check_supported(model: HFModel) -> None:
    """ValueError unless the layer below (`TorchModel.layers_forward`) is the whole of this
    model's layer: an architecture it implements, no layer weight it would ignore, every layer
    attending to every key over one block table (no windows, so no layer groups: one pool page
    holds every layer), a KV dtype its kernels store and read as they are (no FP8 encoding)."""
    arch = model.config.arch
    if problem := torch_problem(model.config):
        raise ValueError(problem)
    if any(model.shape.windows) or model.shape.groups.hybrid:
        raise ValueError(f"the torch backend does not implement sliding windows or layer groups (pool pages of "
                         f"{model.shape.groups.describe()}) of {arch}")
    if model.kv_dtype.name not in ("float16", "float32"):
        raise ValueError(f"the torch backend keeps K/V in float16 or float32 pools, not {model.kv_dtype.name}"
                         + (" (--kv-cache-dtype fp8: serve it with --model-backend array)" if model.kv_dtype.fp8
                            else ""))
    for w in model.layers:
        extra = sorted(k for k, v in vars(w).items() if v is not None and k not in LAYER_FIELDS)
        if extra:
            raise ValueError(f"the torch backend does not implement the layer weights {extra} of {arch}")


def _address(a: Any) -> int:
    """Where an array's memory starts (a pool's identity across calls)."""
    return int(a.ctypes.data) if isinstance(a, np.ndarray) else int(a.data.ptr)


def _check_prompt(prompt: PromptQuery, n: int, vocab: int) -> None:
    if len(prompt.rows) and (int(prompt.rows.max()) >= n or int(prompt.rows.min()) < 0):
        raise ValueError(f"prompt logprob rows outside the step's {n} tokens")
    if len(prompt.targets) and (int(prompt.targets.min()) < 0 or int(prompt.targets.max()) >= vocab):
        raise ValueError(f"prompt logprob targets outside the vocabulary [0, {vocab})")
