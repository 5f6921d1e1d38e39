"""Tiny Hugging Face checkpoints made in the test (CI has no network), and an independent dense
float64 forward pass of them written the way Hugging Face's modeling code reads (rotate_half,
repeat_kv, whole-sequence recompute, no cache) to check kvrt's paged forward against.

    ck = make_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype="BF16", tied=True)
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


def make_checkpoint(directory, arch: str = "LlamaForCausalLM", dtype: str = "F32", tied: bool = False,
                    shards: int = 1, seed: int = 0, rope_scaling: dict | None = None, **overrides) -> Tiny:
    """A random checkpoint of `arch` in `directory` (created). Weights are scaled so the logits
    spread over several units: greedy answers do not hinge on float32 rounding."""
    os.makedirs(directory, exist_ok=True)
    cfg = {"architectures": [arch], "model_type": arch[:-len("ForCausalLM")].lower(), **SHAPE,
           "tie_word_embeddings": tied, "hidden_act": "silu", "torch_dtype": "bfloat16", **overrides}
    if arch == "Qwen3ForCausalLM":
        cfg.setdefault("head_dim", 16)  # Qwen3 decouples head_dim from hidden_size / heads
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    d, h, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", d // h)
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

def _inv_freq(cfg: dict, hd: int) -> np.ndarray:
    base = cfg["rope_theta"]
    inv = 1.0 / (base ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    rs = cfg.get("rope_scaling")
    if not rs:
        return inv
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
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


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * (x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps))


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def dense_logits(ck: Tiny, tokens) -> np.ndarray:
    """Logits [len(tokens), vocab] of the whole sequence, recomputed from scratch."""
    cfg, W = ck.config, ck.weights
    d, h, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", d // h)
    eps = cfg["rms_norm_eps"]
    arch = cfg["architectures"][0]
    tokens = np.asarray(tokens)
    n = len(tokens)
    freqs = np.outer(np.arange(n, dtype=np.float64), _inv_freq(cfg, hd))
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb)[None], np.sin(emb)[None]  # [1, n, hd]
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
