"""Tiny Hugging Face checkpoints made in the test (CI has no network), and an independent dense
float64 forward pass of them written the way Hugging Face's modeling code reads (rotate_half,
repeat_kv, whole-sequence recompute, no cache) to check kvrt's paged forward against.

A config.json is either hand-written (the transformers 4 form: top-level `rope_theta` and
`rope_scaling`) or written by transformers' own config class (`transformers_config`: whatever
form the installed transformers writes). The reference reads either through transformers' own
config class, so it sees the RoPE parameters transformers sees, and computes the frequencies
and the attention factor from them here in numpy (transformers' RoPE functions need torch).

    ck = make_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype="BF16", tied=True)
    ck = make_checkpoint(tmp_path, "Qwen3ForCausalLM",
                         config=transformers_config("Qwen3ForCausalLM", {"rope_type": "default", "rope_theta": 1e6}))
    logits = dense_logits(ck, [1, 2, 3])

Every architecture kvrt serves is here: the reference reads what sets each apart (sliding
layers and their window, soft caps, Gemma's norms and scales, experts, fused projections) from
transformers' own config object for the checkpoint's config.json, and computes it the way
transformers' modeling code does (its masks' `kv > q - window`, its routing, its 1 + w norms).
tests/workers/model/test_hf_transformers.py checks this reference against transformers' own
PyTorch forward where torch is installed.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field

import numpy as np

VOCAB = 256
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-5,
             rope_theta=10000.0)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


@dataclass
class Tiny:
    """A checkpoint on disk and what the reference needs: config and float64 weights exactly
    as stored (BF16/F16 rounding included)."""

    path: str
    config: dict
    weights: dict = field(default_factory=dict)
    dtype: str = "F32"  # the file's: what transformers rounds Gemma's embedding scale to


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, rounded to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path: str, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """Write a safetensors file: name -> (dtype name, array holding exactly that dtype's bytes)."""
    header, blobs, off = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


_CONFIG_CLASSES = {"LlamaForCausalLM": "LlamaConfig", "Qwen2ForCausalLM": "Qwen2Config",
                    "Qwen3ForCausalLM": "Qwen3Config", "MistralForCausalLM": "MistralConfig",
                    "Gemma2ForCausalLM": "Gemma2Config", "Gemma3ForCausalLM": "Gemma3TextConfig",
                    "Qwen2MoeForCausalLM": "Qwen2MoeConfig", "Qwen3MoeForCausalLM": "Qwen3MoeConfig",
                    "Phi3ForCausalLM": "Phi3Config"}
MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
               "MistralForCausalLM": "mistral", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
               "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe", "Phi3ForCausalLM": "phi3"}
GEMMAS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM")
# what each new architecture's tiny shape adds: a head_dim where the class's default is not
# hidden / heads, small experts, token ids inside the tiny vocabulary
ARCH_SHAPE = {
    "Qwen3ForCausalLM": dict(head_dim=16),
    "Gemma2ForCausalLM": dict(head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "Gemma3ForCausalLM": dict(head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "Qwen3MoeForCausalLM": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "Qwen2MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                shared_expert_intermediate_size=24),
    "Phi3ForCausalLM": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
}

SLIDING, FULL = "sliding_attention", "full_attention"
# Every architecture kvrt serves beyond Llama, Qwen2 and Qwen3's plain forms, as transformers 5's
# own config class writes it, with what makes each visibly itself at these tests' lengths
# (prompts of 45 to 130 tokens): windows of 12 tokens (blocks of 8 in the tests: a window ends
# mid-block), soft caps that bite, a RoPE of its own for Gemma 3's sliding layers, renormalised
# top-k routing; `kw` are transformers_config's arguments.
ARCH_CASES = {
    "mistral": ("MistralForCausalLM", dict(sliding_window=12)),
    "llama-dynamic": ("LlamaForCausalLM", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                "rope_theta": 1e4})),
    "qwen2-sliding": ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)),
    "qwen3-sliding": ("Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)),
    "gemma2": ("Gemma2ForCausalLM", dict(sliding_window=12, attn_logit_softcapping=2.0,
                                         final_logit_softcapping=5.0)),
    "gemma3": ("Gemma3ForCausalLM", dict(
        sliding_window=12, layer_types=[SLIDING, FULL], final_logit_softcapping=5.0,
        rope_parameters={FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         SLIDING: {"rope_type": "default", "rope_theta": 1e4}})),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(norm_topk_prob=True)),
    "qwen2-moe": ("Qwen2MoeForCausalLM", dict()),
    "phi3": ("Phi3ForCausalLM", dict(sliding_window=12, original_max_position_embeddings=256, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0, 1.5, 2.0, 4.0],
        "long_factor": [2.0, 3.0, 4.0, 8.0]})),
}


def case_config(case: str, tied: bool = False) -> tuple[str, dict]:
    """The architecture and config.json of ARCH_CASES[case]."""
    arch, kw = ARCH_CASES[case]
    kw = dict(kw)
    return arch, transformers_config(arch, kw.pop("rope_parameters", None), tied=tied, **kw)


def transformers_config(arch: str, rope_parameters: dict | None = None, tied: bool = False, **overrides) -> dict:
    """config.json of the tiny shape as transformers' own config class for `arch` writes it
    (transformers 5: `rope_theta` and the scaling inside one `rope_parameters`)."""
    import transformers

    kwargs = {k: v for k, v in SHAPE.items() if k != "rope_theta"}
    kwargs.update(ARCH_SHAPE.get(arch, {}))
    kwargs.update(architectures=[arch], tie_word_embeddings=tied, **overrides)
    if rope_parameters is not None:
        kwargs["rope_parameters"] = dict(rope_parameters)
    return json.loads(getattr(transformers, _CONFIG_CLASSES[arch])(**kwargs).to_json_string())


def make_checkpoint(directory, arch: str = "LlamaForCausalLM", dtype: str = "F32", tied: bool = False,
                    shards: int = 1, seed: int = 0, rope_scaling: dict | None = None, config: dict | None = None,
                    **overrides) -> Tiny:
    """A random checkpoint of `arch` in `directory` (created), with `config` as its config.json
    (then `tied`, `rope_scaling` and `overrides` are the config's business) or a hand-written
    one. Weights are scaled so the logits spread over several units: greedy answers do not
    hinge on float32 rounding."""
    os.makedirs(directory, exist_ok=True)
    if config is not None:
        cfg = config
    else:
        cfg = {"architectures": [arch], "model_type": MODEL_TYPES[arch], **SHAPE, "tie_word_embeddings": tied,
               "hidden_act": "silu", "torch_dtype": "bfloat16", **ARCH_SHAPE.get(arch, {}), **overrides}
        if rope_scaling is not None:
            cfg["rope_scaling"] = rope_scaling
    arch = cfg["architectures"][0]
    conf = hf_config(cfg)
    d, h, kvh = conf.hidden_size, conf.num_attention_heads, conf.num_key_value_heads
    hd = _head_dim(cfg)
    m, v = conf.intermediate_size, conf.vocab_size
    rng = np.random.default_rng(seed)

    def lin(out: int, inp: int, scale: float = 1.0) -> np.ndarray:
        return rng.standard_normal((out, inp)) * (scale / math.sqrt(inp))

    def norm(n: int) -> np.ndarray:  # Gemma stores w and applies 1 + w
        return (0.0 if arch in GEMMAS else 1.0) + 0.1 * rng.standard_normal(n)

    def mlp(prefix: str, width: int, fused: bool = False) -> dict:
        gate, up = lin(width, d), lin(width, d)
        parts = {prefix + "gate_up_proj.weight": np.concatenate([gate, up])} if fused else \
            {prefix + "gate_proj.weight": gate, prefix + "up_proj.weight": up}
        return {**parts, prefix + "down_proj.weight": lin(d, width)}

    w = {"model.embed_tokens.weight": rng.standard_normal((v, d)), "model.norm.weight": norm(d)}
    if not conf.tie_word_embeddings:
        w["lm_head.weight"] = lin(v, d, 4.0)
    for i in range(conf.num_hidden_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        w[p + "input_layernorm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(d)
        if arch in GEMMAS:
            w[p + "pre_feedforward_layernorm.weight"] = norm(d)
            w[p + "post_feedforward_layernorm.weight"] = norm(d)
        q, k, vv, o = lin(h * hd, d, 2.0), lin(kvh * hd, d), lin(kvh * hd, d), lin(d, h * hd)
        if arch == "Phi3ForCausalLM":
            w[a + "qkv_proj.weight"] = np.concatenate([q, k, vv])
        else:
            w.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": vv})
        w[a + "o_proj.weight"] = o
        if _routed(conf, arch, i):
            w[p + "mlp.gate.weight"] = lin(conf.num_experts, d, 2.0)
            for e in range(conf.num_experts):
                w.update(mlp(p + f"mlp.experts.{e}.", conf.moe_intermediate_size))
            if arch == "Qwen2MoeForCausalLM":
                w.update(mlp(p + "mlp.shared_expert.", conf.shared_expert_intermediate_size))
                w[p + "mlp.shared_expert_gate.weight"] = lin(1, d, 2.0)
        else:
            w.update(mlp(p + "mlp.", m, fused=arch == "Phi3ForCausalLM"))
        if arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and conf.qkv_bias):
            w.update({a + "q_proj.bias": 0.5 * rng.standard_normal(h * hd),
                      a + "k_proj.bias": 0.5 * rng.standard_normal(kvh * hd),
                      a + "v_proj.bias": 0.5 * rng.standard_normal(kvh * hd)})
        if arch in QK_NORM:
            w.update({a + "q_norm.weight": norm(hd), a + "k_norm.weight": norm(hd)})
    stored, exact = {}, {}
    for name, a in w.items():
        if dtype == "BF16":
            bits = to_bf16_bits(a)
            stored[name], exact[name] = ("BF16", bits), from_bf16_bits(bits).astype(np.float64)
        else:
            npd = {"F32": np.float32, "F16": np.float16}[dtype]
            stored[name], exact[name] = (dtype, a.astype(npd)), a.astype(npd).astype(np.float64)
    names = list(stored)
    if shards == 1:
        write_safetensors(os.path.join(directory, "model.safetensors"), stored)
    else:
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s::shards]
            write_safetensors(os.path.join(directory, fname), {n: stored[n] for n in part})
            weight_map.update({n: fname for n in part})
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return Tiny(str(directory), cfg, exact, dtype)


# ---- the independent dense reference (float64, Hugging Face's formulation) ----

def hf_config(cfg: dict):
    """transformers' own config object for config.json `cfg` (its defaults and conversions)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[cfg["model_type"]].from_dict(json.loads(json.dumps(cfg)))  # it edits dicts in place


def _head_dim(cfg: dict) -> int:
    conf = hf_config(cfg)
    return getattr(conf, "head_dim", None) or conf.hidden_size // conf.num_attention_heads


def _routed(conf, arch: str, i: int) -> bool:
    """Whether layer i's MLP is routed experts (transformers' decoder layer's rule)."""
    return arch in MOES and i not in conf.mlp_only_layers and conf.num_experts > 0 \
        and (i + 1) % conf.decoder_sparse_step == 0


def rope_parameters(cfg: dict, layer_type: str | None = None) -> dict:
    """The RoPE parameters transformers' rotary embedding reads for config.json `cfg` (of one
    layer type, where they are per layer type): the config class's reading of whichever form
    it is in, standardized as the model does before computing its frequencies (which is where a
    top-level original_max_position_embeddings wins)."""
    config = hf_config(cfg)
    config.standardize_rope_params()
    rp = config.rope_parameters
    return dict(rp[layer_type] if layer_type is not None else rp)


def _llama3(inv: np.ndarray, rp: dict) -> np.ndarray:
    factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(f)
        elif wavelen > old / lo:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def _yarn(rp: dict, dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """YaRN, one frequency at a time: interpolated (slowed by `factor`) below the correction
    range's low end, extrapolated (unchanged) above its high end, a linear blend between; and
    cos/sin scaled by the attention factor."""
    base, old = rp["rope_theta"], rp["original_max_position_embeddings"]
    factor = rp["factor"] if rp["factor"] is not None else max_position_embeddings / old

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rp.get("attention_factor")
    if attention is None:
        m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rp.get("beta_fast") or 32), correction_dim(rp.get("beta_slow") or 1)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        extrapolated = 1.0 / base ** (2 * i / dim)
        keep = 1 - min(max((i - low) / (high - low), 0.0), 1.0)  # 1: extrapolate, 0: interpolate
        out.append(extrapolated / factor * (1 - keep) + extrapolated * keep)
    return np.array(out), float(attention)


def reference_rope(cfg: dict, layer_type: str | None = None) -> tuple[np.ndarray, float]:
    """RoPE inverse frequencies [head_dim / 2] and the factor cos and sin are scaled by, for
    config.json `cfg` (one layer type's, where they are per layer type), as transformers
    computes them (types default, linear, llama3, yarn; dynamic and longrope for a sequence
    within max_position_embeddings and the original context, where they are computed)."""
    rp, hd = rope_parameters(cfg, layer_type), _head_dim(cfg)
    inv = 1.0 / (rp["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    kind = rp["rope_type"]
    max_pos = hf_config(cfg).max_position_embeddings
    if kind == "default":
        return inv, 1.0
    if kind == "dynamic":  # the sequence length is taken to be at least max_position_embeddings
        base = rp["rope_theta"] * ((rp["factor"] * max_pos / max_pos) - (rp["factor"] - 1)) ** (hd / (hd - 2))
        return 1.0 / (base ** (np.arange(0, hd, 2, dtype=np.float64) / hd)), 1.0
    if kind == "longrope":
        old = rp["original_max_position_embeddings"]
        factor = rp.get("factor") or max_pos / old
        attention = rp.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old))
        return inv / np.array(rp["short_factor"], dtype=np.float64), float(attention)
    if kind == "linear":
        return inv / rp["factor"], 1.0
    if kind == "llama3":
        return _llama3(inv, rp), 1.0
    if kind == "yarn":
        return _yarn(rp, hd, cfg["max_position_embeddings"])
    raise NotImplementedError(f"the reference has no RoPE type {kind!r}")


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * (x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps))


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rounded(value: float, dtype: str) -> float:
    """`value` as a tensor of the file's dtype holds it (transformers scales Gemma's embeddings
    by sqrt(hidden) cast to the weights' dtype)."""
    if dtype == "BF16":
        return float(from_bf16_bits(to_bf16_bits(np.array([value], np.float32)))[0])
    return float(np.array(value, {"F32": np.float32, "F16": np.float16}[dtype]))


def _windows(conf, arch: str) -> list[int | None]:
    """Each layer's sliding window as transformers' modeling code applies it: per `layer_types`
    where the config has them, else the one `sliding_window` for every layer."""
    types, window = getattr(conf, "layer_types", None), getattr(conf, "sliding_window", None)
    if types is None:
        return [window] * conf.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


def _act(arch: str, x: np.ndarray) -> np.ndarray:
    if arch in GEMMAS:  # gelu_pytorch_tanh
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return x / (1 + np.exp(-x))


def _mlp(W: dict, prefix: str, arch: str, hs: np.ndarray) -> np.ndarray:
    if prefix + "gate_up_proj.weight" in W:  # Phi-3: gate, up = chunk(2)
        gate, up = np.split(hs @ W[prefix + "gate_up_proj.weight"].T, 2, axis=-1)
    else:
        gate, up = hs @ W[prefix + "gate_proj.weight"].T, hs @ W[prefix + "up_proj.weight"].T
    return (_act(arch, gate) * up) @ W[prefix + "down_proj.weight"].T


def _experts(W: dict, p: str, conf, arch: str, hs: np.ndarray) -> np.ndarray:
    """The sparse MoE block: softmax over the experts, the top k, optionally renormalised, each
    token through its experts; Qwen2-MoE's sigmoid-gated shared expert added."""
    logits = hs @ W[p + "mlp.gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :conf.num_experts_per_tok]
    weights = np.take_along_axis(probs, top, -1)
    if conf.norm_topk_prob:
        weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(hs)
    for t in range(hs.shape[0]):
        for e, wt in zip(top[t], weights[t]):
            out[t] += wt * _mlp(W, p + f"mlp.experts.{e}.", arch, hs[t:t + 1])[0]
    if arch == "Qwen2MoeForCausalLM":
        gate = 1 / (1 + np.exp(-(hs @ W[p + "mlp.shared_expert_gate.weight"].T)))
        out += gate * _mlp(W, p + "mlp.shared_expert.", arch, hs)
    return out


def kv_rounding(kv: str):
    """What the KV pool does to K and V before attention reads them back: nothing for
    float32 (the reference's float64 is as close as the tests look), e4m3 rounding for "fp8"
    (`--kv-cache-dtype fp8`), done by ml_dtypes' float8_e4m3fn (an implementation independent of
    kvrt's workers/model/kv_format.py)."""
    if kv == "float32":
        return lambda a: a
    if kv != "fp8":
        raise ValueError(f"kv must be float32 or fp8, got {kv!r}")
    import ml_dtypes

    return lambda a: a.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def dense_logits(ck: Tiny, tokens, kv: str = "float32") -> np.ndarray:
    """Logits [len(tokens), vocab] of the whole sequence, recomputed from scratch; with `kv`
    "fp8" K (after RoPE) and V are rounded as an FP8 pool stores them (`kv_rounding`)."""
    stored = kv_rounding(kv)
    cfg, W = ck.config, ck.weights
    conf = hf_config(cfg)
    arch = cfg["architectures"][0]
    gemma = arch in GEMMAS
    h, kvh = conf.num_attention_heads, conf.num_key_value_heads
    hd = _head_dim(cfg)
    eps = conf.rms_norm_eps
    tokens = np.asarray(tokens)
    n = len(tokens)

    def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return _rms(x, 1 + w if gemma else w, eps)

    def rotations(layer_type: str | None) -> tuple[np.ndarray, np.ndarray]:
        inv_freq, attention_factor = reference_rope(cfg, layer_type)
        freqs = np.outer(np.arange(n, dtype=np.float64), inv_freq)
        emb = np.concatenate([freqs, freqs], axis=-1)
        return np.cos(emb)[None] * attention_factor, np.sin(emb)[None] * attention_factor  # [1, n, hd]

    # Gemma 3: one RoPE per layer type
    types = conf.layer_types if arch == "Gemma3ForCausalLM" else [None] * conf.num_hidden_layers
    ropes = {t: rotations(t) for t in set(types)}
    scaling = conf.query_pre_attn_scalar ** -0.5 if gemma else hd ** -0.5
    softcap = conf.attn_logit_softcapping if arch == "Gemma2ForCausalLM" else None
    pos = np.arange(n)
    x = W["model.embed_tokens.weight"][tokens]
    if gemma:
        x = x * _rounded(conf.hidden_size ** 0.5, ck.dtype)
    for i, window in enumerate(_windows(conf, arch)):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        hs = rms(x, W[p + "input_layernorm.weight"])
        if a + "qkv_proj.weight" in W:
            q, k, v = np.split(hs @ W[a + "qkv_proj.weight"].T, [h * hd, (h + kvh) * hd], axis=-1)
        else:
            q, k, v = (hs @ W[a + f"{t}_proj.weight"].T for t in "qkv")
        if a + "q_proj.bias" in W:
            q, k, v = (t + W[a + f"{name}_proj.bias"] for t, name in zip((q, k, v), "qkv"))
        q = q.reshape(n, h, hd).transpose(1, 0, 2)    # [heads, n, hd]
        k = k.reshape(n, kvh, hd).transpose(1, 0, 2)
        v = v.reshape(n, kvh, hd).transpose(1, 0, 2)
        if a + "q_norm.weight" in W:
            q, k = rms(q, W[a + "q_norm.weight"]), rms(k, W[a + "k_norm.weight"])
        cos, sin = ropes[types[i]]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k, v = stored(k), stored(v)
        k, v = np.repeat(k, h // kvh, axis=0), np.repeat(v, h // kvh, axis=0)  # repeat_kv
        scores = q @ k.transpose(0, 2, 1) * scaling
        if softcap:
            scores = np.tanh(scores / softcap) * softcap
        visible = pos[None, :] <= pos[:, None]
        if window:
            visible &= pos[None, :] > pos[:, None] - window
        scores = np.where(visible, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(n, h * hd) @ W[a + "o_proj.weight"].T
        if gemma:
            x = x + rms(attn, W[p + "post_attention_layernorm.weight"])
            hs = rms(x, W[p + "pre_feedforward_layernorm.weight"])
        else:
            x = x + attn
            hs = rms(x, W[p + "post_attention_layernorm.weight"])
        out = _experts(W, p, conf, arch, hs) if _routed(conf, arch, i) else _mlp(W, p + "mlp.", arch, hs)
        x = x + (rms(out, W[p + "post_feedforward_layernorm.weight"]) if gemma else out)
    head = W["model.embed_tokens.weight"] if conf.tie_word_embeddings else W["lm_head.weight"]
    logits = rms(x, W["model.norm.weight"]) @ head.T
    cap = getattr(conf, "final_logit_softcapping", None)
    return np.tanh(logits / cap) * cap if cap else logits


def greedy(ck: Tiny, prompt, new: int, kv: str = "float32") -> list[int]:
    """Greedy tokens of the dense reference (`kv`: as `dense_logits`)."""
    seq, out = [int(t) for t in prompt], []
    for _ in range(new):
        tok = int(dense_logits(ck, seq, kv)[-1].argmax())
        out.append(tok)
        seq.append(tok)
    return out


def paged_pool(model, blocks: int, block_size: int, kv_dtype: str = "float32", xp=np):
    """A zeroed KV pool for `model` (a `Model` or `HFModel`) with `blocks` blocks of tokens for
    each of its layer groups (ipc/layout.py LayerGroups: a checkpoint with sliding and full
    layers has a page per group and block); see `grouped`."""
    layout = model.shape.kv_layout(block_size, kv_dtype)
    return xp.zeros(layout.pool_shape(blocks * len(model.shape.groups.windows)), dtype=layout.storage_dtype)


def grouped(model, seqs: list, blocks: int) -> list:
    """`seqs` (SeqInputs with one block table each) for `model` over a `paged_pool` of `blocks`:
    layer group g's table is the block table shifted by g * blocks, so each group has pages of
    its own and a test written for one table runs unchanged over layer groups."""
    from kvrt.workers.model.transformer import SeqInput

    n = len(model.shape.groups.windows)
    out = []
    for s in seqs:
        t = np.asarray(s.block_table)
        out.append(SeqInput(s.tokens, s.start, t, tuple((t + g * blocks).astype(t.dtype) for g in range(1, n))))
    return out
