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
                    "Qwen3ForCausalLM": "Qwen3Config"}


def transformers_config(arch: str, rope_parameters: dict | None = None, tied: bool = False, **overrides) -> dict:
    """config.json of the tiny shape as transformers' own config class for `arch` writes it
    (transformers 5: `rope_theta` and the scaling inside one `rope_parameters`)."""
    import transformers

    kwargs = {k: v for k, v in SHAPE.items() if k != "rope_theta"}
    kwargs.update(architectures=[arch], tie_word_embeddings=tied, **overrides)
    if arch == "Qwen3ForCausalLM":
        kwargs.setdefault("head_dim", 16)
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
        cfg = {"architectures": [arch], "model_type": arch[:-len("ForCausalLM")].lower(), **SHAPE,
               "tie_word_embeddings": tied, "hidden_act": "silu", "torch_dtype": "bfloat16", **overrides}
        if arch == "Qwen3ForCausalLM":
            cfg.setdefault("head_dim", 16)  # Qwen3 decouples head_dim from hidden_size / heads
        if rope_scaling is not None:
            cfg["rope_scaling"] = rope_scaling
    tied = cfg.get("tie_word_embeddings", False)
    d, h, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = _head_dim(cfg)
    m, v = cfg["intermediate_size"], cfg["vocab_size"]
    rng = np.random.default_rng(seed)

    def lin(out: int, inp: int, scale: float = 1.0) -> np.ndarray:
        return rng.standard_normal((out, inp)) * (scale / math.sqrt(inp))

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.1 * rng.standard_normal(n)

    w = {"model.embed_tokens.weight": rng.standard_normal((v, d)), "model.norm.weight": norm(d)}
    if not tied:
        w["lm_head.weight"] = lin(v, d, 4.0)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
                  p + "self_attn.q_proj.weight": lin(h * hd, d, 2.0), p + "self_attn.k_proj.weight": lin(kvh * hd, d),
                  p + "self_attn.v_proj.weight": lin(kvh * hd, d), p + "self_attn.o_proj.weight": lin(d, h * hd),
                  p + "mlp.gate_proj.weight": lin(m, d), p + "mlp.up_proj.weight": lin(m, d),
                  p + "mlp.down_proj.weight": lin(d, m)})
        if arch == "Qwen2ForCausalLM":
            w.update({p + "self_attn.q_proj.bias": 0.5 * rng.standard_normal(h * hd),
                      p + "self_attn.k_proj.bias": 0.5 * rng.standard_normal(kvh * hd),
                      p + "self_attn.v_proj.bias": 0.5 * rng.standard_normal(kvh * hd)})
        if arch == "Qwen3ForCausalLM":
            w.update({p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)})
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
    return Tiny(str(directory), cfg, exact)


# ---- the independent dense reference (float64, Hugging Face's formulation) ----

def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def rope_parameters(cfg: dict) -> dict:
    """The RoPE parameters transformers' rotary embedding reads for config.json `cfg`: the
    config class's reading of whichever form it is in, standardized as the model does before
    computing its frequencies (which is where a top-level original_max_position_embeddings
    wins)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[cfg["model_type"]].from_dict(json.loads(json.dumps(cfg)))  # it edits dicts in place
    config.standardize_rope_params()
    return dict(config.rope_parameters)


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


def reference_rope(cfg: dict) -> tuple[np.ndarray, float]:
    """RoPE inverse frequencies [head_dim / 2] and the factor cos and sin are scaled by, for
    config.json `cfg`, as transformers computes them (types default, linear, llama3, yarn)."""
    rp, hd = rope_parameters(cfg), _head_dim(cfg)
    inv = 1.0 / (rp["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    kind = rp["rope_type"]
    if kind == "default":
        return inv, 1.0
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


def dense_logits(ck: Tiny, tokens) -> np.ndarray:
    """Logits [len(tokens), vocab] of the whole sequence, recomputed from scratch."""
    cfg, W = ck.config, ck.weights
    h, kvh = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = _head_dim(cfg)
    eps = cfg["rms_norm_eps"]
    arch = cfg["architectures"][0]
    tokens = np.asarray(tokens)
    n = len(tokens)
    inv_freq, attention_factor = reference_rope(cfg)
    freqs = np.outer(np.arange(n, dtype=np.float64), inv_freq)
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[None] * attention_factor, np.sin(emb)[None] * attention_factor  # [1, n, hd]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    x = W["model.embed_tokens.weight"][tokens]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        hs = _rms(x, W[p + "input_layernorm.weight"], eps)
        q, k, v = (hs @ W[p + f"self_attn.{t}_proj.weight"].T for t in "qkv")
        if arch == "Qwen2ForCausalLM":
            q, k, v = (a + W[p + f"self_attn.{t}_proj.bias"] for a, t in zip((q, k, v), "qkv"))
        q = q.reshape(n, h, hd).transpose(1, 0, 2)    # [heads, n, hd]
        k = k.reshape(n, kvh, hd).transpose(1, 0, 2)
        v = v.reshape(n, kvh, hd).transpose(1, 0, 2)
        if arch == "Qwen3ForCausalLM":
            q = _rms(q, W[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, W[p + "self_attn.k_norm.weight"], eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k, v = np.repeat(k, h // kvh, axis=0), np.repeat(v, h // kvh, axis=0)  # repeat_kv
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(hd) + mask
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(n, h * hd)
        x = x + attn @ W[p + "self_attn.o_proj.weight"].T
        hs = _rms(x, W[p + "post_attention_layernorm.weight"], eps)
        gate = hs @ W[p + "mlp.gate_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (hs @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
    head = W["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else W["lm_head.weight"]
    return _rms(x, W["model.norm.weight"], eps) @ head.T


def greedy(ck: Tiny, prompt, new: int) -> list[int]:
    """Greedy tokens of the dense reference."""
    seq, out = [int(t) for t in prompt], []
    for _ in range(new):
        tok = int(dense_logits(ck, seq)[-1].argmax())
        out.append(tok)
        seq.append(tok)
    return out
