"""Hugging Face Llama, Qwen2 and Qwen3 checkpoints over the paged KV pool.

The network is the reference model's (workers/model/transformer.py) with real weights and each
architecture's differences: Qwen2's q/k/v biases, Qwen3's per-head RMSNorm of q and k before
RoPE, the checkpoint's RMSNorm epsilon, RoPE as Hugging Face computes it (workers/model/rope.py:
linear, llama3 and yarn scaling, yarn's attention factor on cos and sin), and tied or separate
LM heads. It inherits the reference model's paged step (block tables, chunked prefill,
batched decode, validation), so the worker runs either through the same interface and the
prefix cache, swaps and P->D transfers see one KV layout.

Computation runs on numpy or CuPy (`xp`), one code path, in one of two compute dtypes:
- float32 (the default, and CPU's): weights converted to float32 once at load (BF16/F16 files
  included);
- float16 (a GPU's choice for F16 and BF16 checkpoints: half the bytes each decode step reads,
  and tensor cores): the projection weights and the embedding are held in float16 and every
  projection multiplies float16 operands (float32 accumulation inside the GEMM, on numpy and in
  cuBLAS alike; each result rounded once to float16, the LM head's too, as Hugging Face's
  float16 models do), while everything whose rounding would grow with the model stays float32:
  the residual stream, RMSNorm statistics, biases, RoPE, attention scores, softmax and the
  attention-weighted sum, the all-reduce, and the logits once computed. CuPy has no bfloat16, so
  BF16 weights are held as float16: a bfloat16's 8 significand bits fit float16's 11, so the
  conversion is exact for every value in float16's normal range; a tensor with a value beyond
  float16's range is refused (serve it in float32), and one whose values sit mostly below that
  range, where float16 loses bits, is named in a warning.
RoPE angles are computed in float64 from absolute positions and then rounded, so a token's
rotation does not depend on how its sequence was chunked.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from kvrt.workers.model.kv_format import KVFormat
from kvrt.workers.model.checkpoint import CheckpointError, CheckpointInfo, Weights, inspect
from kvrt.workers.model.transformer import LayerWeights, Model, ModelShape, attention_budgets

log = logging.getLogger("kvrt.workers.model.hf_model")

PROGRESS_AFTER_S = 2.0  # a load longer than this logs a progress line per layer
COMPUTE_DTYPES = ("float32", "float16")       # what the projections multiply in
REQUESTED_DTYPES = ("auto", *COMPUTE_DTYPES, "bfloat16")  # what a launch may ask for
F16_MAX = float(np.finfo(np.float16).max)     # 65504
F16_TINY = float(np.finfo(np.float16).tiny)   # 2**-14: below it float16 keeps fewer bits
# a float16 copy of a tensor further than this from it (relative, in norm) has most of its
# values below float16's normal range; normal-range rounding alone is at most 2**-11
HALF_WARN_REL_ERROR = 1e-3
_FILE_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def checkpoint_dtype(info: CheckpointInfo) -> str:
    """The dtype most of the checkpoint's bytes are stored in: float32, float16 or bfloat16."""
    nbytes: dict[str, int] = {}
    for t in info.tensors.values():
        nbytes[t.dtype] = nbytes.get(t.dtype, 0) + int(np.prod(t.shape)) * (4 if t.dtype == "F32" else 2)
    return _FILE_DTYPES[max(nbytes, key=nbytes.__getitem__)]


def resolve_compute_dtype(requested: str, device: str, info: CheckpointInfo) -> str:
    """The compute dtype (one of COMPUTE_DTYPES) a node serving `info` on `device` uses for
    `requested`: auto is float32 on a CPU (numpy has no fast float16 matmul, and CPU figures
    stay what they were) and the checkpoint's own precision on a GPU; bfloat16 is computed as
    float16 (module docstring). ValueError for anything else."""
    if requested not in REQUESTED_DTYPES:
        raise ValueError(f"--compute-dtype must be one of {', '.join(REQUESTED_DTYPES)}, got {requested!r}")
    if requested == "auto":
        if device != "cuda":
            return "float32"
        requested = checkpoint_dtype(info)
    return "float16" if requested == "bfloat16" else requested


def to_half(name: str, a: np.ndarray) -> np.ndarray:
    """A float32 host tensor as float16: exact for a BF16 or F16 file's values in float16's
    normal range. CheckpointError for a tensor holding a value float16 cannot (beyond +-65504,
    inf or nan); a warning for one whose float16 copy is off by more than HALF_WARN_REL_ERROR
    (most of its magnitude below 2**-14)."""
    peak = float(np.abs(a).max()) if a.size else 0.0
    if not peak <= F16_MAX:  # also catches nan
        raise CheckpointError(f"tensor {name} holds {peak:g}, beyond float16's range (+-{F16_MAX:g}): "
                              f"serve this checkpoint with --compute-dtype float32")
    half = a.astype(np.float16)
    norm = float(np.linalg.norm(a))
    if norm > 0:
        err = float(np.linalg.norm(half.astype(np.float32) - a)) / norm
        if err > HALF_WARN_REL_ERROR:
            log.warning("tensor %s: its float16 copy is off by %.2g (relative): most of its values are below "
                        "float16's normal range (%g); --compute-dtype float32 keeps them", name, err, F16_TINY)
    return half


@dataclass
class HFLayerWeights(LayerWeights):
    bqkv: Any = None    # Qwen2: q/k/v projection biases, side by side as `wqkv`'s columns
    q_norm: Any = None  # Qwen3: per-head RMSNorm weights [head_dim]
    k_norm: Any = None


def shape_of(info: CheckpointInfo, max_model_len: int, tp: int = 1) -> ModelShape:
    """The reference model's description of one rank's share of this checkpoint (what the
    pool and the paged step's validation need): 1/tp of the heads, KV heads and MLP width."""
    c = info.config
    info.check_tp(tp)
    return ModelShape(num_layers=c.num_layers, num_heads=c.num_heads // tp, num_kv_heads=c.num_kv_heads // tp,
                      head_dim=c.head_dim, vocab_size=c.vocab_size, mlp_dim=c.intermediate_size // tp,
                      rope_theta=c.rope.theta, max_model_len=max_model_len)


class HFModel(Model):
    """A checkpoint's transformer: `step` / `step_logits` over the paged pool, as `Model`.

    With tp > 1, rank `rank` holds its slice of the attention heads (q/k/v rows, o columns)
    and of the MLP (gate/up rows, down columns), and `allreduce` sums the partial outputs of
    the attention output and MLP down projections across the ranks (identical sums on each);
    embeddings, norms and the LM head are whole on every rank."""

    compute_dtype = np.float32  # attention (scores, softmax, weighted sum) and the residual stream

    def __init__(self, info: CheckpointInfo, max_model_len: int, xp: Any = np, kv_dtype: str = "float32",
                 rank: int = 0, tp: int = 1, allreduce: Callable[[Any], Any] | None = None,
                 matmul_dtype: str = "float32", layer_windows: Sequence[int] = ()) -> None:
        if tp > 1 and allreduce is None:
            raise ValueError("a model split over tp > 1 ranks needs an all-reduce")
        if matmul_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {matmul_dtype!r}")
        self.matmul_dtype = np.dtype(matmul_dtype)
        self.info = info
        self.config = c = info.config
        # layer windows: how the layers share the pool's pages, and each one's attention window
        self.shape = s = replace(shape_of(info, max_model_len, tp), layer_windows=tuple(layer_windows))
        self.allreduce = allreduce if tp > 1 else None
        self.xp = xp
        self.attn_budgets = attention_budgets(xp)
        self.kv_dtype = KVFormat(kv_dtype)
        self.eps = np.float32(c.rms_norm_eps)
        self.inv_freq = xp.asarray(c.inv_freq())
        self.rope_scale = c.rope.attention_factor  # cos and sin times it: q.k times its square
        t0 = time.monotonic()
        weights = Weights(info)

        q_rows = slice(rank * s.num_heads * s.head_dim, (rank + 1) * s.num_heads * s.head_dim)
        kv_rows = slice(rank * s.num_kv_heads * s.head_dim, (rank + 1) * s.num_kv_heads * s.head_dim)
        mlp_rows = slice(rank * s.mlp_dim, (rank + 1) * s.mlp_dim)
        whole = slice(None)

        def host(name: str, transpose: bool = False, rows: slice = whole, cols: slice = whole) -> np.ndarray:
            """This rank's slice of a tensor ([in, out] for a projection): a matrix in the
            compute dtype, a vector (norm weights, biases) in float32."""
            a = weights.get(name)
            a = a[rows] if a.ndim == 1 else a[rows, cols]
            if a.ndim == 2 and self.matmul_dtype == np.float16:
                a = to_half(name, a)
            # a projection is held [in, out] in one contiguous block: activations times a
            # transposed view ran half as fast again for a few rows on a CPU's BLAS
            return np.ascontiguousarray(a.T) if transpose else a

        def get(name: str, transpose: bool = False, rows: slice = whole, cols: slice = whole) -> Any:
            return xp.asarray(host(name, transpose, rows, cols))

        def side_by_side(names: list[str], rows: list[slice], transpose: bool = True) -> Any:
            """Tensors' blocks concatenated along their output (last) axis, on the device."""
            return xp.asarray(np.concatenate([host(n, transpose, r) for n, r in zip(names, rows)], axis=-1))

        if c.tie_word_embeddings:  # one array: the LM head's [in, out] block, the embedding a view of it
            self.lm_head = get("model.embed_tokens.weight", transpose=True)
            self.embed = self.lm_head.T
        else:
            self.embed = get("model.embed_tokens.weight")
            self.lm_head = get("lm_head.weight", transpose=True)
        self.final_norm = get("model.norm.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            bias = c.attention_bias
            qkv = [p + f"self_attn.{n}_proj." for n in "qkv"]
            self.layers.append(HFLayerWeights(
                attn_norm=get(p + "input_layernorm.weight"), mlp_norm=get(p + "post_attention_layernorm.weight"),
                wqkv=side_by_side([n + "weight" for n in qkv], [q_rows, kv_rows, kv_rows]),
                wo=get(p + "self_attn.o_proj.weight", True, cols=q_rows),
                w_gate_up=side_by_side([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [mlp_rows, mlp_rows]),
                w_down=get(p + "mlp.down_proj.weight", True, cols=mlp_rows),
                bqkv=side_by_side([n + "bias" for n in qkv], [q_rows, kv_rows, kv_rows], False) if bias else None,
                q_norm=get(p + "self_attn.q_norm.weight") if c.qk_norm else None,
                k_norm=get(p + "self_attn.k_norm.weight") if c.qk_norm else None))
            if time.monotonic() - t0 > PROGRESS_AFTER_S:
                log.info("loading %s: layer %d/%d (%.1f s)", info.model_dir, i + 1, c.num_layers, time.monotonic() - t0)
        weights.close()
        log.info("loaded %s (%s, %d layers) in %.2f s on %s, computing in %s", info.model_dir, c.arch,
                 c.num_layers, time.monotonic() - t0, xp.__name__, self.matmul_dtype.name)

    @classmethod
    def load(cls, model_dir: str, fingerprint: str, max_model_len: int, xp: Any = np, kv_dtype: str = "float32",
             rank: int = 0, tp: int = 1, allreduce: Callable[[Any], Any] | None = None,
             matmul_dtype: str = "float32", layer_windows: Sequence[int] = ()) -> "HFModel":
        """The checkpoint the launcher checked: CheckpointError if it changed on disk since
        (its blocks' keys are rooted in `fingerprint`)."""
        info = inspect(model_dir)
        if info.fingerprint != fingerprint:
            raise CheckpointError(f"{model_dir} changed since the node was launched "
                                  f"(fingerprint {info.fingerprint}, launched with {fingerprint})")
        return cls(info, max_model_len, xp, kv_dtype, rank, tp, allreduce, matmul_dtype, layer_windows)

    def warm_up(self, block_size: int) -> None:
        """`Model.warm_up` with no all-reduce: each rank warms up at its own pace (ranks load
        the checkpoint side by side, one may finish well before another), and the first real
        step compiles the sum's few kernels."""
        allreduce, self.allreduce = self.allreduce, None
        try:
            super().warm_up(block_size)
        finally:
            self.allreduce = allreduce

    def _mm(self, a: Any, w: Any) -> Any:
        """a (float32) times w in the compute dtype, back as float32: float16 operands whose
        products the GEMM accumulates in float32 (numpy's float16 matmul and cuBLAS both do)."""
        return (a.astype(self.matmul_dtype, copy=False) @ w).astype(np.float32, copy=False)

    def _embed(self, tokens: Any) -> Any:
        return self.embed[tokens].astype(np.float32, copy=False)

    def _head(self, x: Any) -> Any:
        """Float32 logits; with float16 projections an activation beyond float16's range
        becomes inf and then nan, which must fail the step rather than answer token 0."""
        logits = super()._head(x)
        if self.matmul_dtype == np.float16 and not bool(self.xp.isfinite(logits).all()):
            raise ValueError("non-finite logits: a float16 activation overflowed (beyond +-65504); "
                             "serve this checkpoint with --compute-dtype float32")
        return logits

    def _reduce(self, partial: Any) -> Any:
        """The tp ranks' sum of a float32 partial. The all-reduce works on this model's array
        module (shared memory for numpy, CUDA IPC buffers for CuPy), so a partial never makes
        a round trip through the host."""
        return partial if self.allreduce is None else self.allreduce(partial)

    def _rms(self, x: Any, w: Any) -> Any:
        return x / self.xp.sqrt(self.xp.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope_tables(self, positions: Any) -> tuple[Any, Any]:
        cos, sin = super()._rope_tables(positions)
        xp = self.xp
        return (cos * self.rope_scale).astype(xp.float32), (sin * self.rope_scale).astype(xp.float32)

    def _qkv(self, h: Any, w: HFLayerWeights, rope: tuple[Any, Any]) -> tuple[Any, Any, Any]:
        y = self._proj(h, w.wqkv)
        if w.bqkv is not None:
            y = y + w.bqkv
        q, k, v = self._split_qkv(y)
        if w.q_norm is not None:
            q, k = self._rms(q, w.q_norm), self._rms(k, w.k_norm)
        return self._rope(q, rope) * np.float32(float(self.shape.head_dim) ** -0.5), self._rope(k, rope), v
