"""A small decoder-only transformer over the paged KV cache: the worker's model.

kvrt ships no weights, so the model is a real transformer (RMSNorm, multi-head attention with
rotary embeddings and optional GQA, SiLU-gated MLP, LM head) with fixed-seed random weights.
Greedy decoding of such a model is a deterministic function of the prompt, so a test can
compare what the runtime produced through the paged pool (chunked prefill, shared prefixes,
swapped and restored blocks) with a dense forward that never touches a cache.

Exactness, not speed, is the design goal:
- everything is computed in float64;
- K and V are rounded to the pool dtype when stored, and the dense reference rounds its K/V
  through the same dtype, so both paths attend over bit-identical K/V values; what is left is
  summation order (~1e-15 relative), far below the gap between the two best logits;
- RoPE angles are computed elementwise from absolute positions, so a token's rotation does not
  depend on how its sequence was chunked.

The same code runs on numpy or cupy (`xp`); results come back as host numpy arrays.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ContextManager, Sequence

import numpy as np

from kvrt.ipc.config import NodeConfig
from kvrt.ipc.layout import KVLayout, LayerGroups, kv_dtype_name
from kvrt.workers.model.attention import (KV_BUDGET, SCORE_BUDGET, AttentionPlan, AttnShape, Span, paged_attention,
                                    plan_attention)
from kvrt.workers.model.kv_format import KVFormat
from kvrt.workers.model.phases import ATTENTION, COPIES, LM_HEAD, PROJECTIONS, PhaseClock
from kvrt.workers.model.prompt_logprobs import PromptQuery, PromptScores, score_prompt

log = logging.getLogger("kvrt.workers.model.transformer")

_EPS = 1e-6        # RMSNorm epsilon
_DENSE_CHUNK = 512  # query rows per attention call in the dense reference (bounds its memory)
_UNTIMED = contextlib.nullcontext()  # what `_phase` gives while no PhaseClock is attached


@dataclass(frozen=True)
class ModelShape:
    """Sizes of the model one rank runs. `num_kv_heads` is the number of KV heads in this
    rank's pool; `num_heads` query heads share them in groups (GQA) when larger."""

    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    vocab_size: int = 512
    mlp_dim: int = 256
    rope_theta: float = 10000.0
    max_model_len: int = 4096
    seed: int = 0
    # each layer's attention window in tokens, 0: full attention (empty: every layer full);
    # the KV pool's pages then hold a layer group each (ipc/layout.py LayerGroups)
    layer_windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in ("rope_theta", "seed", "layer_windows") and getattr(self, f.name) <= 0:
                raise ValueError(f"ModelShape.{f.name} must be positive, got {getattr(self, f.name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelShape: num_heads {self.num_heads} must be a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"ModelShape: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_theta <= 1:
            raise ValueError(f"ModelShape: rope_theta must be > 1, got {self.rope_theta}")
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"ModelShape: {len(self.layer_windows)} layer windows for {self.num_layers} layers")

    @property
    def windows(self) -> tuple[int, ...]:
        """Each layer's window (0: full attention), one per layer."""
        return self.layer_windows or (0,) * self.num_layers

    @functools.cached_property
    def groups(self) -> LayerGroups:
        """How the layers share the pool's pages (worked out once: every step reads it)."""
        return LayerGroups.of(self.windows)

    @property
    def hidden_dim(self) -> int:
        return self.num_heads * self.head_dim

    def kv_layout(self, block_size: int, dtype: str) -> KVLayout:
        """The KV blocks this model reads and writes, at `block_size` tokens of `dtype`."""
        return KVLayout(self.groups.page_layers, block_size, self.num_kv_heads, self.head_dim, kv_dtype_name(dtype))

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_config(cls, cfg: NodeConfig) -> "ModelShape":
        """The shape of one rank's model from the node config: each rank holds its share of
        the KV heads (the node's KV layout) and, without GQA, as many query heads."""
        layout = cfg.kv_layout
        return cls(num_layers=cfg.num_layers, num_heads=layout.kv_heads, num_kv_heads=layout.kv_heads,
                   head_dim=layout.head_dim, vocab_size=cfg.vocab_size, max_model_len=cfg.max_model_len,
                   seed=cfg.model_seed, layer_windows=tuple(cfg.layer_windows))


@dataclass
class StepInputs:
    """A prepared step batch on the device (`Model.prepare`): each token's id, position, pool
    block and slot, the batch rows whose logits are read, and the attention plan; for a model
    of several layer groups, each other group's blocks and plan (`groups`)."""

    tokens: Any
    positions: Any
    blocks: Any
    slots: Any
    last: Any
    attn: AttentionPlan
    groups: list[tuple[Any, AttentionPlan]] = field(default_factory=list)


@dataclass
class SeqInput:
    """One sequence of a step batch.

    tokens: int32 ids computed this step (a prefill chunk, or one token for decode).
    start: position of tokens[0]; the KV of positions < start is already in the pool.
    block_table: int32 device block ids in token order, covering >= start + len(tokens) positions.
    group_tables: for a model of several layer groups, each other group's table, as long (-1
    for blocks a sliding group no longer reads).
    """

    tokens: np.ndarray
    start: int
    block_table: np.ndarray
    group_tables: Sequence[np.ndarray] = ()


@dataclass
class LayerWeights:
    """One layer's weights, projections as [in, out] blocks. The q, k and v projections are one
    block side by side (`wqkv`), as are the MLP's gate and up projections (`w_gate_up`): one
    matmul each instead of three and two, since on a GPU a step's time is mostly the count of
    its kernel launches."""

    attn_norm: Any
    wqkv: Any       # [d, (heads + 2 * kv_heads) * head_dim]: q, then k, then v
    wo: Any
    mlp_norm: Any
    w_gate_up: Any  # [d, 2 * mlp]: gate, then up
    w_down: Any


def _init_weights(shape: ModelShape) -> tuple[np.ndarray, list[dict], np.ndarray, np.ndarray]:
    """Random float64 weights, scaled so activations stay O(1) through the layers and the
    logits spread over a few units (large top-2 gaps, so argmax never hinges on rounding)."""
    rng = np.random.default_rng(shape.seed)
    d, hd, m = shape.hidden_dim, shape.head_dim, shape.mlp_dim
    kv = shape.num_kv_heads * hd

    def normal(rows: int, cols: int, scale: float) -> np.ndarray:
        return rng.standard_normal((rows, cols)) * (scale / np.sqrt(rows))

    embed = rng.standard_normal((shape.vocab_size, d))
    layers = []
    for _ in range(shape.num_layers):
        layers.append(dict(
            attn_norm=1.0 + 0.1 * rng.standard_normal(d),
            wq=normal(d, d, 2.0),   # sharper attention than unit-scale scores
            wk=normal(d, kv, 1.0),
            wv=normal(d, kv, 1.0),
            wo=normal(d, d, 1.0),
            mlp_norm=1.0 + 0.1 * rng.standard_normal(d),
            w_gate=normal(d, m, 1.0),
            w_up=normal(d, m, 1.0),
            w_down=normal(m, d, 1.0),
        ))
    final_norm = 1.0 + 0.1 * rng.standard_normal(d)
    lm_head = normal(d, shape.vocab_size, 4.0)
    return embed, layers, final_norm, lm_head


class Model:
    """The transformer: `step` runs a batch over the paged pool, `dense_logits` and
    `generate_dense` are the cache-free reference the runtime is checked against."""

    compute_dtype: Any = np.float64  # what K/V read from the pool are computed in (subclasses: float32)
    # called after each layer of a paged step and each key tile of its attention: the worker's
    # progress marks (workers/progress.py), so a long step of a big model (seconds per prefill
    # chunk on a CPU) is not taken for a hung process
    beat: Callable[[], None] | None = None
    # a benchmark's phase recorder (workers/model/phases.py); None while serving, so a step pays nothing
    phases: PhaseClock | None = None
    # attention's key-tile budgets, scores and keys (workers/model/attention.py; `attention_budgets`);
    # the warm-up shrinks them for one step
    attn_budgets: tuple[int, int] = (SCORE_BUDGET, KV_BUDGET)
    attn_softcap: float = 0.0  # attention scores soft-capped (AttnShape.softcap); 0: not

    def __init__(self, shape: ModelShape, xp: Any = np, kv_dtype: str = "float32") -> None:
        self.shape = shape
        self.xp = xp
        self.attn_budgets = attention_budgets(xp)
        self.kv_dtype = KVFormat(kv_dtype)
        embed, layers, final_norm, lm_head = _init_weights(shape)
        self.embed = xp.asarray(embed)
        self.layers = [LayerWeights(
            attn_norm=xp.asarray(lw["attn_norm"]), wqkv=xp.asarray(np.concatenate([lw["wq"], lw["wk"], lw["wv"]], 1)),
            wo=xp.asarray(lw["wo"]), mlp_norm=xp.asarray(lw["mlp_norm"]),
            w_gate_up=xp.asarray(np.concatenate([lw["w_gate"], lw["w_up"]], 1)), w_down=xp.asarray(lw["w_down"]))
            for lw in layers]
        self.final_norm = xp.asarray(final_norm)
        self.lm_head = xp.asarray(lm_head)
        half = shape.head_dim // 2
        self.inv_freq = xp.asarray(shape.rope_theta ** (-np.arange(half, dtype=np.float64) / half))
        log.debug("model %s on %s, kv dtype %s", shape, xp.__name__, self.kv_dtype)

    @functools.cached_property
    def _slots(self) -> list[tuple[int, int]]:
        """(layer group, slot in its page) of each layer (ipc/layout.py LayerGroups)."""
        groups = self.shape.groups
        return [groups.slot(layer) for layer in range(self.shape.num_layers)]

    # ---- building blocks (shared by the paged and the dense path) ----

    def _phase(self, name: str) -> ContextManager[None]:
        """A span of phase `name` on the attached PhaseClock; nothing without one."""
        return _UNTIMED if self.phases is None else self.phases.span(name)

    def _proj(self, a: Any, w: Any, phase: str = PROJECTIONS) -> Any:
        """`_mm`, counted as one of the step's projections (or as `phase`) when timed."""
        if self.phases is None:
            return self._mm(a, w)
        with self.phases.span(phase):
            return self._mm(a, w)

    def _host(self, a: Any) -> np.ndarray:
        return a if isinstance(a, np.ndarray) else a.get()

    def _rms(self, x: Any, w: Any) -> Any:
        return x / self.xp.sqrt(self.xp.mean(x * x, axis=-1, keepdims=True) + _EPS) * w

    def _rope_tables(self, positions: Any) -> Any:
        """The rotary embedding's tables at absolute positions [T], once a step for every
        layer's q and k (what `_qkv` takes as `rope`)."""
        return self._rotation(positions, self.inv_freq)

    def _rotation(self, positions: Any, inv_freq: Any) -> tuple[Any, Any]:
        """One RoPE's tables [T, 1, hd]: cos repeated over both halves, and sin negated over
        the first half (so a rotation is two products and a sum, `_rope`)."""
        xp = self.xp
        ang = positions.astype(xp.float64)[:, None] * inv_freq[None, :]
        cos, sin = xp.cos(ang)[:, None, :], xp.sin(ang)[:, None, :]
        return xp.concatenate([cos, cos], axis=-1), xp.concatenate([-sin, sin], axis=-1)

    def _rope(self, x: Any, rope: tuple[Any, Any]) -> Any:
        """Rotate-half rotary embedding of x [T, heads, hd] by the step's `_rope_tables`:
        [x1 cos - x2 sin, x2 cos + x1 sin] for the halves x1, x2 of each head."""
        cos, sin = rope
        half = self.shape.head_dim // 2
        return x * cos + self.xp.concatenate([x[..., half:], x[..., :half]], axis=-1) * sin

    def _split_qkv(self, y: Any) -> tuple[Any, Any, Any]:
        """The q [T, H, hd], k and v [T, KVH, hd] column blocks of the fused projection y."""
        s, t = self.shape, y.shape[0]
        qd, kvd = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        return (y[:, :qd].reshape(t, s.num_heads, s.head_dim), y[:, qd:qd + kvd].reshape(t, s.num_kv_heads, s.head_dim),
                y[:, qd + kvd:].reshape(t, s.num_kv_heads, s.head_dim))

    def _qkv(self, h: Any, w: LayerWeights, rope: tuple[Any, Any]) -> tuple[Any, Any, Any]:
        """Projections of the normed hidden states h [T, d]: q [T, H, hd] (rotated and scaled),
        k (rotated) and v [T, KVH, hd], in the compute dtype (the pool rounds k and v to the
        KV dtype as it stores them; the dense path rounds them the same way)."""
        q, k, v = self._split_qkv(self._proj(h, w.wqkv))
        return self._rope(q, rope) * (float(self.shape.head_dim) ** -0.5), self._rope(k, rope), v

    def _round_kv(self, a: Any) -> Any:
        return self.kv_dtype.round(a, self.xp, self.compute_dtype)

    def _attend(self, q: Any, k: Any, v: Any, start: int, window: int = 0) -> Any:
        """Causal attention of queries q [n, H, hd] at positions start.. over keys/values
        k, v [L, KVH, hd] at positions 0..L-1 (with a `window`, only the last `window`
        positions up to each query's own); returns [n, H*hd]."""
        xp, s = self.xp, self.shape
        n, L, kvh, g, hd = q.shape[0], k.shape[0], s.num_kv_heads, s.group, s.head_dim
        qg = q.reshape(n, kvh, g, hd).transpose(1, 2, 0, 3).reshape(kvh, g * n, hd)
        scores = (qg @ k.transpose(1, 2, 0)).reshape(kvh, g, n, L)
        if self.attn_softcap:
            scores = xp.tanh(scores / self.attn_softcap) * self.attn_softcap
        qpos = (start + xp.arange(n))[:, None]
        visible = xp.arange(L)[None, :] <= qpos
        if window:
            visible &= xp.arange(L)[None, :] > qpos - window
        scores = xp.where(visible, scores, -xp.inf)
        scores = xp.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        out = probs.reshape(kvh, g * n, L) @ v.transpose(1, 0, 2)
        return out.reshape(kvh, g, n, hd).transpose(2, 0, 1, 3).reshape(n, s.hidden_dim)

    def _mm(self, a: Any, w: Any) -> Any:
        """Activations a times a weight matrix w (the one place a subclass changes the
        arithmetic of the projections, e.g. float16 operands with float32 results)."""
        return a @ w

    def _embed(self, tokens: Any) -> Any:
        """The residual stream's first value: the embedding rows of `tokens` (xp int array)."""
        return self.embed[tokens]

    def _mlp(self, x: Any, w: LayerWeights) -> Any:
        gate_up = self._proj(self._rms(x, w.mlp_norm), w.w_gate_up)
        m = gate_up.shape[1] // 2
        gate = gate_up[:, :m]
        return self._proj(gate / (1.0 + self.xp.exp(-gate)) * gate_up[:, m:], w.w_down)

    def _reduce(self, partial: Any) -> Any:
        """The sum over tensor-parallel ranks of a layer's partial output (one rank: itself)."""
        return partial

    def _after_attention(self, y: Any, w: LayerWeights) -> Any:
        """What the residual stream adds of the attention's summed output y (an architecture
        may normalise it first)."""
        return y

    def _after_mlp(self, y: Any, w: LayerWeights) -> Any:
        """What the residual stream adds of the MLP's summed output y."""
        return y

    def _head(self, x: Any) -> Any:
        """The logits of hidden states x [n, d], where x lies (on `xp`)."""
        return self._proj(self._rms(x, self.final_norm), self.lm_head, LM_HEAD)

    def _logits(self, x: Any) -> np.ndarray:
        logits = self._head(x)
        with self._phase(COPIES):
            return self._host(logits)

    # ---- validation ----

    def _check_pool(self, pool: Any) -> int:
        """Raise ValueError unless pool is this model's block-major KV pool; returns block_size."""
        try:
            got = KVLayout.of_pool_shape(pool.shape, pool.dtype)
        except ValueError as e:
            raise ValueError(f"KV pool must be this model's: {e}") from None
        if got.block_size <= 0:
            raise ValueError(f"KV pool block_size must be positive, got {got.block_size}")
        if diff := self.shape.kv_layout(got.block_size, self.kv_dtype.name).differences(got):
            what, want, have = diff[0]
            raise ValueError(f"KV pool {what} is {have}, the model needs {want} (pool shape {tuple(pool.shape)})")
        return got.block_size

    def _check_tokens(self, tokens: np.ndarray, start: int, who: str) -> np.ndarray:
        s = self.shape
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or len(tokens) == 0:
            raise ValueError(f"{who}: tokens must be a non-empty 1-D array, got shape {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{who}: token ids must be integers, got dtype {tokens.dtype}")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= s.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{who}: token id {bad} out of range [0, {s.vocab_size})")
        if start < 0:
            raise ValueError(f"{who}: start must be >= 0, got {start}")
        if start + len(tokens) > s.max_model_len:
            raise ValueError(f"{who}: positions up to {start + len(tokens) - 1} exceed "
                             f"max_model_len {s.max_model_len}")
        return tokens

    def _plan(self, seqs: Sequence[SeqInput], num_blocks: int, bs: int) -> tuple[list[Span], np.ndarray, np.ndarray, np.ndarray]:
        """Validate the batch; returns the per-seq spans, all tokens, their positions and the
        pool blocks they are written to."""
        plans, toks, poss, blks, slots, row = [], [], [], [], [], 0
        for i, seq in enumerate(seqs):
            who = f"seq {i}"
            start = int(seq.start)
            tokens = self._check_tokens(seq.tokens, start, who)
            end = start + len(tokens)
            nblk = -(-end // bs)
            table = np.asarray(seq.block_table)
            if table.ndim != 1 or not np.issubdtype(table.dtype, np.integer):
                raise ValueError(f"{who}: block_table must be a 1-D integer array, got "
                                 f"{table.dtype} shape {table.shape}")
            if len(table) < nblk:
                raise ValueError(f"{who}: block_table has {len(table)} blocks, positions 0..{end - 1} "
                                 f"need {nblk} blocks of {bs}")
            table = table[:nblk]
            if int(table.min()) < 0 or int(table.max()) >= num_blocks:
                raise ValueError(f"{who}: block_table holds block ids outside [0, {num_blocks}): "
                                 f"{table.min()}..{table.max()}")
            if len(np.unique(table)) != nblk:
                raise ValueError(f"{who}: block_table repeats a block id: {table.tolist()}")
            positions = np.arange(start, end, dtype=np.int64)
            blks.append(table[positions // bs].astype(np.int64))
            slots.append(blks[-1] * bs + positions % bs)
            plans.append(Span(row, len(tokens), start, table.astype(np.int64)))
            toks.append(tokens.astype(np.int64))
            poss.append(positions)
            row += len(tokens)
        written = np.concatenate(slots)
        if len(np.unique(written)) != len(written):
            raise ValueError("two seqs of the batch would write the same pool slot "
                             "(block tables overlap beyond a shared prefix)")
        return plans, np.concatenate(toks), np.concatenate(poss), np.concatenate(blks)

    def _plan_group(self, seqs: Sequence[SeqInput], g: int, num_blocks: int, bs: int) -> tuple[list[Span], np.ndarray]:
        """Layer group g's (g >= 1) spans and the pool blocks its layers write, validated as
        `_plan` validates group 0's: every block from the first one the group's window reads
        must be the sequence's own, in range; those before may be -1 (freed)."""
        window = self.shape.groups.windows[g]
        plans, blks, row = [], [], 0
        for i, seq in enumerate(seqs):
            start, n = int(seq.start), len(seq.tokens)
            nblk = -(-(start + n) // bs)
            if len(seq.group_tables) != len(self.shape.groups.windows) - 1:
                raise ValueError(f"seq {i}: {len(seq.group_tables)} group tables, the model's layers form "
                                 f"{len(self.shape.groups.windows)} groups")
            table = np.asarray(seq.group_tables[g - 1])
            if table.ndim != 1 or not np.issubdtype(table.dtype, np.integer) or len(table) < nblk:
                raise ValueError(f"seq {i}: group {g}'s block table must be a 1-D integer array of at least "
                                 f"{nblk} blocks")
            table = table[:nblk].astype(np.int64)
            first = max(0, (start - window + 1) // bs) if window else 0
            live = table[first:]
            if int(live.min()) < 0 or int(live.max()) >= num_blocks or len(np.unique(live)) != len(live):
                raise ValueError(f"seq {i}: group {g}'s block table holds block ids outside [0, {num_blocks}) "
                                 f"or twice where its layers read: {live.tolist()}")
            positions = np.arange(start, start + n, dtype=np.int64)
            blks.append(table[positions // bs])
            plans.append(Span(row, n, start, table))
            row += n
        written = np.concatenate(blks) * bs + np.concatenate([np.arange(int(q.start), int(q.start) + len(q.tokens)) % bs
                                                              for q in seqs])
        if len(np.unique(written)) != len(written):
            raise ValueError(f"two seqs of the batch would write the same pool slot of group {g}")
        return plans, np.concatenate(blks)

    # ---- the paged path ----

    def step_logits(self, pool: Any, seqs: Sequence[SeqInput]) -> np.ndarray:
        """`step`, returning the logits of each seq's last position [len(seqs), vocab] (float64)."""
        return self.step_outputs(pool, seqs)[0]

    def step_outputs(self, pool: Any, seqs: Sequence[SeqInput], prompt: PromptQuery | None = None,
                     on_device: bool = False) -> tuple[Any, PromptScores | None]:
        """`step_logits`, and from the same forward pass the prompt scores `prompt` asks for
        (its rows index the batch's tokens, flattened in sequence order; workers/model/prompt_logprobs.py).
        With `on_device` the logits stay where the model computes them (float32 on `xp`): the
        worker samples there, and only the chosen tokens cross to the host."""
        s = self.shape
        if not seqs:
            return np.empty((0, s.vocab_size)), None
        inputs = self.prepare(pool, seqs)
        x = self.forward(pool, inputs)
        scores = None
        if prompt is not None:
            n = int(inputs.tokens.shape[0])
            if len(prompt.rows) and (int(prompt.rows.max()) >= n or int(prompt.rows.min()) < 0):
                raise ValueError(f"prompt logprob rows outside the step's {n} tokens")
            if len(prompt.targets) and (int(prompt.targets.min()) < 0 or int(prompt.targets.max()) >= s.vocab_size):
                raise ValueError(f"prompt logprob targets outside the vocabulary [0, {s.vocab_size})")
            scores = score_prompt(self._head, x, prompt, s.vocab_size, self.xp, self.beat)
        return (self._head(x[inputs.last]) if on_device else self._logits(x[inputs.last])), scores

    def prepare(self, pool: Any, seqs: Sequence[SeqInput]) -> StepInputs:
        """The host half of a step: the batch validated and planned, its inputs on the device.
        Split from `forward` so that everything after it is device work alone (no host round
        trip), which is what a CUDA graph can capture."""
        xp, s = self.xp, self.shape
        bs = self._check_pool(pool)
        plans, tokens, positions, blocks = self._plan(seqs, int(pool.shape[0]), bs)
        with self._phase(COPIES):
            pos, toks, blk = xp.asarray(positions), xp.asarray(tokens), xp.asarray(blocks)
            last = xp.asarray(np.array([p.row0 + p.n - 1 for p in plans]))
        score_budget, kv_budget = self.attn_budgets
        shape, windows = AttnShape(s.num_heads, s.num_kv_heads, s.head_dim, bs, self.attn_softcap), s.groups.windows
        attn = plan_attention(plans, shape, xp, score_budget=score_budget, kv_budget=kv_budget, window=windows[0])
        groups = []
        for g in range(1, len(windows)):
            spans, gblocks = self._plan_group(seqs, g, int(pool.shape[0]), bs)
            with self._phase(COPIES):
                gblk = xp.asarray(gblocks)
            groups.append((gblk, plan_attention(spans, shape, xp, score_budget=score_budget, kv_budget=kv_budget,
                                                window=windows[g])))
        return StepInputs(toks, pos, blk, pos % bs, last, attn, groups)

    def forward(self, pool: Any, inputs: StepInputs) -> Any:
        """The layers over a prepared batch: each token's K/V written to the pool, the hidden
        states [tokens, d] returned (on the device)."""
        xp = self.xp
        x = self._embed(inputs.tokens)
        rope = self._rope_tables(inputs.positions)
        kv, load = self.kv_dtype, self.kv_dtype.loader(xp, self.compute_dtype)
        groups = [(inputs.blocks, inputs.attn)] + inputs.groups
        for li, w in enumerate(self.layers):
            q, k, v = self._qkv(self._rms(x, w.attn_norm), w, rope)
            g, slot = self._slots[li]
            blocks, attn = groups[g]
            with self._phase(ATTENTION):
                pool[blocks, slot, 0, inputs.slots] = kv.store(k, xp)
                pool[blocks, slot, 1, inputs.slots] = kv.store(v, xp)
                att = paged_attention(xp, pool, slot, q, attn, self.compute_dtype, self.beat, load)
            x = x + self._after_attention(self._reduce(self._proj(att, w.wo)), w)
            x = x + self._after_mlp(self._reduce(self._mlp(x, w)), w)
            if self.beat is not None:
                self.beat()
        return x

    def warm_up(self, block_size: int) -> None:
        """On a GPU, short steps over a scratch pool, their results dropped. CuPy compiles each
        kernel at its first call, for each dtype and count of dimensions (not of length one)
        it meets: seconds for a forward pass where its kernel cache is empty, which a worker's
        first real steps must not spend past their deadline. So `warm_up_steps` takes each
        shape serving takes (module function). Nothing to compile on numpy."""
        if self.xp is np:
            return
        layout, groups = self.shape.kv_layout(block_size, self.kv_dtype.name), len(self.shape.groups.windows)
        pool = self.xp.zeros(layout.pool_shape(WARM_UP_BLOCKS * groups), dtype=layout.storage_dtype)
        budgets = self.attn_budgets
        try:
            for seqs, tiny_tiles in warm_up_steps(block_size, self.shape.max_model_len, groups):
                self.attn_budgets = (1, 1) if tiny_tiles else budgets
                rows = sum(len(s.tokens) for s in seqs)
                self.step_outputs(pool, seqs, PromptQuery(np.arange(rows, dtype=np.int64),
                                                          np.zeros(rows, np.int64), np.ones(rows, np.int64)))
        except ValueError as e:  # e.g. float16 overflow: a request may still fit, and fails alone
            log.warning("warm-up step failed (kernels compiled anyway): %s", e)
        finally:
            self.attn_budgets = budgets

    def step(self, pool: Any, seqs: Sequence[SeqInput]) -> np.ndarray:
        """Run one batch: store each seq's new K/V into `pool` at its positions (block =
        block_table[pos // block_size], slot = pos % block_size), attend causally over the pool
        through the block table, and return the greedy next token per seq (host int32)."""
        return self.step_logits(pool, seqs).argmax(axis=-1).astype(np.int32)

    # ---- the dense reference ----

    def dense_logits(self, tokens: np.ndarray, last_only: bool = False) -> np.ndarray:
        """Reference forward with no cache: logits [len(tokens), vocab] (host float64), or with
        `last_only` the last position's alone [1, vocab]: the last layer's other rows feed no
        later position, so only its last query is attended (a long prompt's reference then
        costs one quadratic attention fewer). K/V are rounded through kv_dtype exactly as the
        pool would store them."""
        xp = self.xp
        tokens = self._check_tokens(tokens, 0, "dense_logits")
        n = len(tokens)
        rope = self._rope_tables(xp.arange(n))
        x = self._embed(xp.asarray(tokens.astype(np.int64)))
        for layer, (w, window) in enumerate(zip(self.layers, self.shape.windows)):
            q, k, v = self._qkv(self._rms(x, w.attn_norm), w, rope)
            k, v = self._round_kv(k), self._round_kv(v)
            first = n - 1 if last_only and layer == len(self.layers) - 1 else 0
            x = x[first:]
            outs = [self._attend(q[i:i + _DENSE_CHUNK], k[:i + _DENSE_CHUNK], v[:i + _DENSE_CHUNK], i, window)
                    for i in range(first, n, _DENSE_CHUNK)]
            x = x + self._after_attention(self._reduce(self._mm(xp.concatenate(outs), w.wo)), w)
            x = x + self._after_mlp(self._reduce(self._mlp(x, w)), w)
        return self._logits(x)

    def generate_dense(self, prompt: np.ndarray, max_new_tokens: int, eos_token_id: int = -1) -> list[int]:
        """Greedy generation with dense_logits only: the oracle the runtime is compared with.
        Stops after max_new_tokens, after emitting eos_token_id (included), or when prompt plus
        output reach max_model_len."""
        seq = [int(t) for t in np.asarray(prompt)]
        out: list[int] = []
        while len(out) < max_new_tokens and len(seq) < self.shape.max_model_len:
            tok = int(self.dense_logits(np.array(seq, dtype=np.int32), last_only=True)[-1].argmax())
            out.append(tok)
            seq.append(tok)
            if tok == eos_token_id:
                break
        return out


WARM_UP_BLOCKS = 4  # the scratch pool of `Model.warm_up`


def warm_up_steps(block_size: int, max_model_len: int, groups: int = 1) -> list[tuple[list[SeqInput], bool]]:
    """The batches a GPU worker's warm-up runs (over a pool of WARM_UP_BLOCKS blocks for each of
    the model's `groups` layer groups, every group's tables its own share of it), each as (seqs,
    whether to cut its keys into tiles of one block): one and two sequences; one and several
    query rows; one block and several (padded to the longest); one key tile and several (the
    online softmax's merge). Every length that can be one is once one and once more, since a
    length of one drops a dimension from the kernel CuPy compiles."""
    def seq(tokens: np.ndarray, start: int, table: np.ndarray) -> SeqInput:
        return SeqInput(tokens, start, table, tuple(table + g * WARM_UP_BLOCKS for g in range(1, groups)))

    n = max(1, min(block_size + 1, max_model_len - 1))  # a prompt over two blocks, where they fit
    table = np.arange(WARM_UP_BLOCKS - 1, dtype=np.int32)
    one = np.zeros(1, np.int32)
    short = seq(one, 0, np.array([WARM_UP_BLOCKS - 1], np.int32))
    prompt = seq(np.zeros(n, np.int32), 0, table)
    batches = [[prompt], [short], [prompt, short]]
    if n + 1 <= max_model_len:
        tail = seq(one, n, table)  # a decode row over the prompt's blocks
        batches += [[tail], [short, tail]]
    return [(b, tiny) for b in batches for tiny in (False, True)]


GPU_TILE_SCALE = 16  # a GPU's key tiles hold this many times the elements of a CPU's


def attention_budgets(xp: Any) -> tuple[int, int]:
    """The key tiles' budgets (score elements, K elements) for arrays on `xp`. On a CPU a tile
    is sized to stay in cache; on a GPU each tile is a round of a dozen kernel launches, which
    cost more than the memory a bigger tile takes (16 times a CPU's: 64 MiB of float32 scores
    at most, so a decode batch of 32 over 512 tokens is one tile)."""
    if xp is np:
        return SCORE_BUDGET, KV_BUDGET
    return SCORE_BUDGET * GPU_TILE_SCALE, KV_BUDGET * GPU_TILE_SCALE
