"""Hugging Face checkpoints over the paged KV pool: Llama, Mistral, Qwen2, Qwen3, their
mixtures of experts, Gemma 2 and 3, Phi-3 (workers/model/archs/).

The network is the reference model's (workers/model/transformer.py) with real weights and each
architecture's differences as switches (`Features`): q/k/v biases, per-head RMSNorm of q and k
before RoPE, Gemma's 1 + w norms, its norms after attention and the MLP, its embedding scale,
query scale and soft caps, the gelu_tanh gate, fused projections (read as their parts), routed
experts (workers/model/moe.py), sliding-window layers (workers/model/attention.py; with
full-attention layers beside them, layer groups of the pool's pages: ipc/layout.py), the
checkpoint's RMSNorm epsilon, RoPE as Hugging Face computes it (workers/model/rope.py: linear,
llama3, yarn, dynamic and longrope, a RoPE of its own for Gemma 3's sliding layers, yarn's and
longrope's attention factor on cos and sin), and tied or separate LM heads. It inherits the
reference model's paged step (block tables, chunked prefill, batched decode, validation), so
the worker runs either through the same interface and the prefix cache, swaps and P->D
transfers see one KV layout.

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
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvrt.workers.model.archs.tensors import LayerTensors, Mlp, Rows
from kvrt.workers.model.kv_format import KVFormat
from kvrt.workers.model.checkpoint import CheckpointError, CheckpointInfo, Weights, inspect
from kvrt.workers.model.moe import ExpertWeights, experts
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


def resolve_compute_dtype(requested: str, device: str, info: CheckpointInfo, backend: str = "array") -> str:
    """The compute dtype (one of COMPUTE_DTYPES) a node serving `info` on `device` uses for
    `requested`: auto is float32 on a CPU (numpy has no fast float16 matmul, and CPU figures
    stay what they were) and the checkpoint's own precision on a GPU; bfloat16 is computed as
    float16 (module docstring), except by the torch backend (workers/model/torch_backend.py),
    which computes it as bfloat16. ValueError for anything else."""
    if requested not in REQUESTED_DTYPES:
        raise ValueError(f"--compute-dtype must be one of {', '.join(REQUESTED_DTYPES)}, got {requested!r}")
    if requested == "auto":
        if device != "cuda":
            return "float32"
        requested = checkpoint_dtype(info)
    return "float16" if requested == "bfloat16" and backend != "torch" else requested


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
    bqkv: Any = None    # q/k/v projection biases, side by side as `wqkv`'s columns (Qwen2)
    q_norm: Any = None  # per-head RMSNorm weights [head_dim] (Qwen3, Gemma 3)
    k_norm: Any = None
    post_attn_norm: Any = None  # norms of the attention's and the MLP's outputs (Gemma 2, 3)
    post_mlp_norm: Any = None
    rope: int = 0       # which of the model's RoPEs rotates this layer's q and k
    experts: ExpertWeights | None = None  # routed experts in place of w_gate_up / w_down
    shared_gate_up: Any = None  # Qwen2-MoE's shared expert, and its gate [hidden, 1]
    shared_down: Any = None
    shared_gate: Any = None


def shape_of(info: CheckpointInfo, max_model_len: int, tp: int = 1) -> ModelShape:
    """The reference model's description of one rank's share of this checkpoint (what the
    pool and the paged step's validation need): 1/tp of the heads, KV heads and MLP width
    (an expert's, where every layer routes), and its layers' windows, which also decide how
    they share the pool's pages (ipc/layout.py LayerGroups)."""
    c = info.config
    info.check_tp(tp)
    ex = c.features.experts
    width = ex.intermediate_size if ex is not None and all(ex.routed) else c.intermediate_size
    return ModelShape(num_layers=c.num_layers, num_heads=c.num_heads // tp, num_kv_heads=c.num_kv_heads // tp,
                      head_dim=c.head_dim, vocab_size=c.vocab_size, mlp_dim=width // tp,
                      rope_theta=c.rope.theta, max_model_len=max_model_len,
                      layer_windows=c.layer_windows(max_model_len))


def in_file_dtype(value: float, file_dtype: str) -> float:
    """`value` rounded as a tensor of the safetensors dtype `file_dtype` holds it (bfloat16:
    the nearest float32 with 16 low bits zero, ties to even)."""
    if file_dtype == "BF16":
        bits = int(np.array(value, np.float32).view(np.uint32))
        return float(np.array(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16, np.uint32).view(np.float32))
    return float(np.float16(value) if file_dtype == "F16" else np.float32(value))


class _Loader:
    """One rank's share of a checkpoint's tensors, on the device in the compute dtype: rows of
    a projection (q/k/v heads, MLP width) by rank, whole vectors and embeddings."""

    def __init__(self, info: CheckpointInfo, rank: int, xp: Any, matmul_dtype: np.dtype) -> None:
        self.weights, self.xp, self.matmul_dtype, self.rank = Weights(info), xp, matmul_dtype, rank
        self.plus_one = info.config.features.norm_plus_one
        self._last: tuple[str, np.ndarray] | None = None  # a fused tensor is read once for its parts

    def _get(self, name: str) -> np.ndarray:
        if self._last is None or self._last[0] != name:
            self._last = (name, self.weights.get(name))
        return self._last[1]

    def _matrix(self, name: str, a: np.ndarray, transpose: bool) -> np.ndarray:
        if self.matmul_dtype == np.float16:
            a = to_half(name, a)
        # a projection is held [in, out] in one contiguous block: activations times a
        # transposed view ran half as fast again for a few rows on a CPU's BLAS
        return np.ascontiguousarray(a.T) if transpose else a

    def share(self, rows: Rows, per_rank: int) -> np.ndarray:
        """This rank's `per_rank` rows of a projection, as an [in, out] host block."""
        lo = rows.offset + self.rank * per_rank
        return self._matrix(rows.name, self._get(rows.name)[lo:lo + per_rank], True)

    def side_by_side(self, parts: list[tuple[Rows, int]]) -> Any:
        """Projections' shares concatenated along their output axis, on the device."""
        return self.xp.asarray(np.concatenate([self.share(r, n) for r, n in parts], axis=-1))

    def _columns(self, name: str, per_rank: int) -> np.ndarray:
        a = self._get(name)[:, self.rank * per_rank:(self.rank + 1) * per_rank]
        return self._matrix(name, a, True)

    def columns(self, name: str, per_rank: int) -> Any:
        """This rank's `per_rank` input columns of an output projection ([in, out] block)."""
        return self.xp.asarray(self._columns(name, per_rank))

    def whole(self, name: str, transpose: bool = False) -> Any:
        """A tensor every rank holds whole (an embedding, a router), on the device."""
        return self.xp.asarray(self._matrix(name, self._get(name), transpose))

    def vector(self, name: str, rows: slice = slice(None)) -> Any:
        """A bias (this rank's `rows`) in float32."""
        return self.xp.asarray(self._get(name)[rows])

    def norm(self, name: str | None) -> Any:
        """RMSNorm weights in float32, as applied (1 + w for Gemma's, in float32 as there)."""
        if name is None:
            return None
        w = self._get(name)
        return self.xp.asarray(w + np.float32(1) if self.plus_one else w)

    def _mlp(self, m: Mlp, tp: int) -> tuple[np.ndarray, np.ndarray]:
        n = m.width // tp
        return np.concatenate([self.share(m.gate, n), self.share(m.up, n)], axis=-1), self._columns(m.down, n)

    def mlp(self, m: Mlp, tp: int) -> tuple[Any, Any]:
        """A gated MLP's [in, 2 * width/tp] gate-and-up block and its [width/tp, out] down block."""
        return tuple(self.xp.asarray(a) for a in self._mlp(m, tp))

    def experts(self, t: LayerTensors, tp: int) -> ExpertWeights:
        """A layer's router and its experts' blocks, stacked on the host and moved once."""
        pairs = [self._mlp(m, tp) for m in t.experts]
        return ExpertWeights(self.whole(t.router, transpose=True), self.xp.asarray(np.stack([p[0] for p in pairs])),
                             self.xp.asarray(np.stack([p[1] for p in pairs])))

    def close(self) -> None:
        self._last = None
        self.weights.close()


class HFModel(Model):
    """A checkpoint's transformer: `step` / `step_logits` over the paged pool, as `Model`.

    With tp > 1, rank `rank` holds its slice of the attention heads (q/k/v rows, o columns)
    and of the MLP (gate/up rows, down columns; each expert's alike), and `allreduce` sums the
    partial outputs of the attention output and MLP down projections across the ranks
    (identical sums on each); embeddings, norms, routers and the LM head are whole on every
    rank."""

    compute_dtype = np.float32  # attention (scores, softmax, weighted sum) and the residual stream

    def __init__(self, info: CheckpointInfo, max_model_len: int, xp: Any = np, kv_dtype: str = "float32",
                 rank: int = 0, tp: int = 1, allreduce: Callable[[Any], Any] | None = None,
                 matmul_dtype: str = "float32") -> None:
        if tp > 1 and allreduce is None:
            raise ValueError("a model split over tp > 1 ranks needs an all-reduce")
        if matmul_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {matmul_dtype!r}")
        self.matmul_dtype = np.dtype(matmul_dtype)
        self.info = info
        self.config = c = info.config
        f = c.features
        self.shape = s = shape_of(info, max_model_len, tp)
        self.allreduce = allreduce if tp > 1 else None
        self.xp = xp
        self.attn_budgets = attention_budgets(xp)
        self.attn_softcap = f.attn_softcap
        self.final_softcap = f.final_softcap
        self.activation = f.activation
        self.experts = f.experts
        self.query_scale = np.float32((f.query_pre_attn_scalar or c.head_dim) ** -0.5)
        self.kv_dtype = KVFormat(kv_dtype)
        self.eps = np.float32(c.rms_norm_eps)
        ropes = c.ropes()
        distinct = list(dict.fromkeys(ropes))
        # each RoPE's inverse frequencies and the factor its cos and sin are scaled by (q.k by its square)
        self.ropes = [(xp.asarray(r.inv_freq(c.head_dim)), r.attention_factor) for r in distinct]
        embed_dtype = info.tensors["model.embed_tokens.weight"].dtype
        self.embed_scale = np.float32(in_file_dtype(c.hidden_size ** 0.5, embed_dtype)) if f.embed_scale else None
        t0 = time.monotonic()
        load = _Loader(info, rank, xp, self.matmul_dtype)
        hq, hkv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        q_rows, kv_rows = slice(rank * hq, (rank + 1) * hq), slice(rank * hkv, (rank + 1) * hkv)

        if c.tie_word_embeddings:  # one array: the LM head's [in, out] block, the embedding a view of it
            self.lm_head = load.whole("model.embed_tokens.weight", transpose=True)
            self.embed = self.lm_head.T
        else:
            self.embed = load.whole("model.embed_tokens.weight")
            self.lm_head = load.whole("lm_head.weight", transpose=True)
        self.final_norm = load.norm("model.norm.weight")
        self.layers = []
        for i in range(c.num_layers):
            t = c.layer(i)
            dense = load.mlp(t.mlp, tp) if t.mlp is not None else (None, None)
            shared = load.mlp(t.shared, tp) if t.shared is not None else (None, None)
            self.layers.append(HFLayerWeights(
                attn_norm=load.norm(t.attn_norm), mlp_norm=load.norm(t.mlp_norm),
                wqkv=load.side_by_side([(t.q, hq), (t.k, hkv), (t.v, hkv)]),
                wo=load.columns(t.o, hq), w_gate_up=dense[0], w_down=dense[1],
                bqkv=(xp.concatenate([load.vector(b, r) for b, r in zip(t.biases, (q_rows, kv_rows, kv_rows))])
                      if t.biases else None),
                q_norm=load.norm(t.q_norm), k_norm=load.norm(t.k_norm),
                post_attn_norm=load.norm(t.post_attn_norm), post_mlp_norm=load.norm(t.post_mlp_norm),
                rope=distinct.index(ropes[i]),
                experts=load.experts(t, tp) if t.experts else None,
                shared_gate_up=shared[0], shared_down=shared[1],
                shared_gate=load.whole(t.shared_gate, transpose=True) if t.shared_gate else None))
            if time.monotonic() - t0 > PROGRESS_AFTER_S:
                log.info("loading %s: layer %d/%d (%.1f s)", info.model_dir, i + 1, c.num_layers, time.monotonic() - t0)
        load.close()
        log.info("loaded %s (%s, %d layers) in %.2f s on %s, computing in %s", info.model_dir, c.arch,
                 c.num_layers, time.monotonic() - t0, xp.__name__, self.matmul_dtype.name)

    @classmethod
    def load(cls, model_dir: str, fingerprint: str, max_model_len: int, xp: Any = np, kv_dtype: str = "float32",
             rank: int = 0, tp: int = 1, allreduce: Callable[[Any], Any] | None = None,
             matmul_dtype: str = "float32") -> "HFModel":
        """The checkpoint the launcher checked: CheckpointError if it changed on disk since
        (its blocks' keys are rooted in `fingerprint`)."""
        info = inspect(model_dir)
        if info.fingerprint != fingerprint:
            raise CheckpointError(f"{model_dir} changed since the node was launched "
                                  f"(fingerprint {info.fingerprint}, launched with {fingerprint})")
        return cls(info, max_model_len, xp, kv_dtype, rank, tp, allreduce, matmul_dtype)

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
        x = self.embed[tokens].astype(np.float32, copy=False)
        return x if self.embed_scale is None else x * self.embed_scale

    def _head(self, x: Any) -> Any:
        """Float32 logits (soft-capped where the architecture caps them); with float16
        projections an activation beyond float16's range becomes inf and then nan, which must
        fail the step rather than answer token 0."""
        logits = super()._head(x)
        if self.matmul_dtype == np.float16 and not bool(self.xp.isfinite(logits).all()):
            raise ValueError("non-finite logits: a float16 activation overflowed (beyond +-65504); "
                             "serve this checkpoint with --compute-dtype float32")
        if self.final_softcap:
            logits = self.xp.tanh(logits / np.float32(self.final_softcap)) * np.float32(self.final_softcap)
        return logits

    def _reduce(self, partial: Any) -> Any:
        """The tp ranks' sum of a float32 partial. The all-reduce works on this model's array
        module (shared memory for numpy, CUDA IPC buffers for CuPy), so a partial never makes
        a round trip through the host."""
        return partial if self.allreduce is None else self.allreduce(partial)

    def _rms(self, x: Any, w: Any) -> Any:
        return x / self.xp.sqrt(self.xp.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def _rope_tables(self, positions: Any) -> list[tuple[Any, Any]]:
        """Each of the model's RoPEs' tables (a layer takes its own, `HFLayerWeights.rope`)."""
        xp = self.xp
        out = []
        for inv_freq, scale in self.ropes:
            cos, sin = self._rotation(positions, inv_freq)
            out.append(((cos * scale).astype(xp.float32), (sin * scale).astype(xp.float32)))
        return out

    def _qkv(self, h: Any, w: HFLayerWeights, rope: list[tuple[Any, Any]]) -> tuple[Any, Any, Any]:
        y = self._proj(h, w.wqkv)
        if w.bqkv is not None:
            y = y + w.bqkv
        q, k, v = self._split_qkv(y)
        if w.q_norm is not None:
            q, k = self._rms(q, w.q_norm), self._rms(k, w.k_norm)
        return self._rope(q, rope[w.rope]) * self.query_scale, self._rope(k, rope[w.rope]), v

    def _gated(self, gate_up: Any) -> Any:
        """The MLP's gate applied: act(gate) * up of a [n, 2 * width] gate-and-up product."""
        xp, m = self.xp, gate_up.shape[1] // 2
        gate, up = gate_up[:, :m], gate_up[:, m:]
        if self.activation == "gelu_tanh":
            c = np.float32(math.sqrt(2 / math.pi))
            return np.float32(0.5) * gate * (1 + xp.tanh(c * (gate + np.float32(0.044715) * gate * gate * gate))) * up
        return gate / (1.0 + xp.exp(-gate)) * up

    def _mlp(self, x: Any, w: HFLayerWeights) -> Any:
        """This rank's partial of the MLP's output: the dense MLP, or the routed experts (and
        the shared expert beside them, its share scaled by its gate, computed whole)."""
        h = self._rms(x, w.mlp_norm)
        if w.experts is None:
            return self._proj(self._gated(self._proj(h, w.w_gate_up)), w.w_down)
        ex = self.experts
        out = experts(self.xp, h, w.experts, ex.top_k, ex.norm_topk_prob, self._proj, self._gated)
        if w.shared_gate_up is not None:
            gate = 1.0 / (1.0 + self.xp.exp(-self._proj(h, w.shared_gate)))
            out = out + self._proj(self._gated(self._proj(h, w.shared_gate_up)), w.shared_down) * gate
        return out

    def _after_attention(self, y: Any, w: HFLayerWeights) -> Any:
        return y if w.post_attn_norm is None else self._rms(y, w.post_attn_norm)

    def _after_mlp(self, y: Any, w: HFLayerWeights) -> Any:
        return y if w.post_mlp_norm is None else self._rms(y, w.post_mlp_norm)
