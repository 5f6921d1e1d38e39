"""`kvrt bench model --kv-drift`: how far a checkpoint's answers drift when its KV blocks are
stored in fewer bits, next to what a user would pick instead.

For each architecture kvrt serves, a tiny random checkpoint whose config.json `transformers`' own
config class writes (random weights scaled as the tests' are, so the logits spread over several
units; BF16 file) runs through the worker's model (`HFModel`, float32 compute) over the paged
pool, with its K and V stored as:
- `bfloat16`, the baseline: what a BF16 node (vLLM's default `--kv-cache-dtype auto` for a BF16
  checkpoint) keeps; kvrt's pools have no bfloat16 dtype, so K and V are rounded to bfloat16
  and held in a float32 pool (the attention then reads exactly the bfloat16 values);
- `float16`, kvrt's 2-byte KV;
- `fp8`: `--kv-cache-dtype fp8`, e4m3 with a per-layer scale of 1 (workers/model/kv_format.py):
  byte for byte what vLLM's `--kv-cache-dtype fp8` stores without checkpoint scales (OCP e4m3,
  round to nearest even, saturating; the encoding is checked against ml_dtypes in the tests);
- `fp8 token scale`: e4m3 with a scale per token and head (its largest magnitude mapped to
  448), held dequantized in a float32 pool: finer than any per-block-per-head scale could be,
  so an upper bound on what such scales would buy over the per-layer one.
Per architecture and format, over `--drift-prompts` random prompts of 64 tokens:
- greedy agreement: each prompt's 256 (`--drift-tokens`) greedy tokens through the paged path
  (prefill in chunks, then one token a step), against the baseline's: the share of tokens before
  the first difference, averaged, and the prompts whose 256 tokens are all equal;
- mean KL: KL(baseline || format) of the next-token distributions at every position of the
  baseline's answer (the prompt and its 256 tokens, teacher-forced), in nats, averaged over
  positions and prompts; and the largest.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import tempfile
from typing import Any

import numpy as np

from kvrt.ipc.layout import FP8_E4M3
from kvrt.workers.model.checkpoint import inspect
from kvrt.workers.model.hf_model import HFModel
from kvrt.workers.model.kv_format import E4M3_MAX, KVFormat, e4m3_encode, e4m3_values
from kvrt.workers.model.transformer import SeqInput

ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-5)
BLOCK = 16
PROMPT = 64
FORMATS = ("bfloat16", "float16", "fp8", "fp8 token scale")


class _Rounded(KVFormat):
    """A format held in a float32 pool: K and V rounded as `rounding` says, read as they are."""

    def __init__(self, rounding) -> None:
        super().__init__("float32")
        self._rounding = rounding

    def store(self, x: Any, xp: Any = np) -> Any:
        return self._rounding(np.asarray(x, np.float32)).astype(np.float32)


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even), as float32."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


_E4M3 = e4m3_values()


def _fp8_token_scale(x: np.ndarray) -> np.ndarray:
    """e4m3 with each token's and head's own scale (x: [tokens, heads, dim])."""
    s = np.abs(x).max(axis=-1, keepdims=True) / E4M3_MAX
    s[s == 0] = 1.0
    return _E4M3[e4m3_encode(x / s)] * s


def kv_formats() -> dict[str, KVFormat]:
    return {"bfloat16": _Rounded(_bf16), "float16": KVFormat("float16"), "fp8": KVFormat(FP8_E4M3),
            "fp8 token scale": _Rounded(_fp8_token_scale)}


def write_checkpoint(directory: str, arch: str, seed: int) -> None:
    """A tiny random `arch` checkpoint: config.json from transformers' config class (a
    hand-written one of the same fields when transformers is not installed), BF16 weights."""
    cfg = dict(SHAPE, architectures=[arch], tie_word_embeddings=False, torch_dtype="bfloat16")
    if arch == "Qwen3ForCausalLM":
        cfg["head_dim"] = 32
    try:
        import transformers

        kind = {"LlamaForCausalLM": "LlamaConfig", "Qwen2ForCausalLM": "Qwen2Config",
                "Qwen3ForCausalLM": "Qwen3Config"}[arch]
        config = json.loads(getattr(transformers, kind)(**cfg).to_json_string())
    except ImportError:
        config = dict(cfg, model_type=arch[:-len("ForCausalLM")].lower(), rope_theta=10000.0, hidden_act="silu")
    d, h, kvh = SHAPE["hidden_size"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    hd = cfg.get("head_dim", d // h)
    m, v = SHAPE["intermediate_size"], SHAPE["vocab_size"]
    rng = np.random.default_rng(seed)

    def lin(out: int, inp: int, scale: float = 1.0) -> np.ndarray:
        return rng.standard_normal((out, inp)) * (scale / math.sqrt(inp))

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.1 * rng.standard_normal(n)

    w = {"model.embed_tokens.weight": rng.standard_normal((v, d)), "model.norm.weight": norm(d),
         "lm_head.weight": lin(v, d, 4.0)}
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
                  p + "self_attn.q_proj.weight": lin(h * hd, d, 2.0), p + "self_attn.k_proj.weight": lin(kvh * hd, d),
                  p + "self_attn.v_proj.weight": lin(kvh * hd, d), p + "self_attn.o_proj.weight": lin(d, h * hd),
                  p + "mlp.gate_proj.weight": lin(m, d), p + "mlp.up_proj.weight": lin(m, d),
                  p + "mlp.down_proj.weight": lin(d, m)})
        if arch == "Qwen2ForCausalLM":
            for n, rows in (("q", h * hd), ("k", kvh * hd), ("v", kvh * hd)):
                w[p + f"self_attn.{n}_proj.bias"] = 0.5 * rng.standard_normal(rows)
        if arch == "Qwen3ForCausalLM":
            w.update({p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd)})
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in w.items():
        bits = _bf16(a.astype(np.float32)).view(np.uint32) >> 16
        data = bits.astype(np.uint16).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


def _model(directory: str, fmt: KVFormat, max_len: int) -> HFModel:
    model = HFModel(inspect(directory), max_len)
    model.kv_dtype = fmt
    return model


def greedy(model: HFModel, prompt: np.ndarray, new: int) -> list[int]:
    """`new` greedy tokens through the paged pool: the prompt in chunks of 32, then a token a step."""
    fmt = model.kv_dtype
    blocks = -(-(len(prompt) + new) // BLOCK)
    pool = np.zeros(model.shape.kv_layout(BLOCK, fmt.name).pool_shape(blocks), dtype=fmt.dtype)
    table = np.arange(blocks, dtype=np.int32)
    out: list[int] = []
    pos = 0
    while pos < len(prompt):
        chunk = prompt[pos:pos + 32]
        tok = int(model.step(pool, [SeqInput(chunk, pos, table)])[0])
        pos += len(chunk)
    out.append(tok)
    while len(out) < new:
        tok = int(model.step(pool, [SeqInput(np.array([out[-1]], np.int32), pos, table)])[0])
        pos += 1
        out.append(tok)
    return out


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def drift(archs: list[str], prompts: int, new: int, seed: int = 0) -> list[dict]:
    """The rows of the drift table (module docstring): one per architecture and format."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvrt-kv-drift-") as tmp:
        for a, arch in enumerate(archs):
            directory = os.path.join(tmp, arch)
            os.makedirs(directory)
            write_checkpoint(directory, arch, seed + a)
            rng = np.random.default_rng(seed + 100 + a)
            inputs = [rng.integers(0, SHAPE["vocab_size"], PROMPT).astype(np.int32) for _ in range(prompts)]
            models = {name: _model(directory, fmt, PROMPT + new + 1) for name, fmt in kv_formats().items()}
            base = [greedy(models["bfloat16"], p, new) for p in inputs]
            seqs = [np.concatenate([p, np.array(b[:-1], np.int32)]) for p, b in zip(inputs, base)]
            ref = [_log_softmax(models["bfloat16"].dense_logits(s)) for s in seqs]
            for name, model in models.items():
                agree, same, kls = [], 0, []
                for p, b, s, lp in zip(inputs, base, seqs, ref):
                    got = b if name == "bfloat16" else greedy(model, p, new)
                    first = next((i for i, (x, y) in enumerate(zip(got, b)) if x != y), new)
                    agree.append(first / new)
                    same += first == new
                    lq = lp if name == "bfloat16" else _log_softmax(model.dense_logits(s))
                    kls.append((np.exp(lp) * (lp - lq)).sum(axis=-1)[PROMPT - 1:])
                kl = np.concatenate(kls)
                rows.append({"arch": arch, "kv": name, "bytes": 1 if name.startswith("fp8") else 2,
                             "agreement": float(np.mean(agree)), "identical": same, "prompts": prompts,
                             "tokens": new, "mean_kl": float(kl.mean()), "max_kl": float(kl.max())})
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'architecture':<18} {'KV':<16} {'bytes':>5} {'agreement':>10} {'identical':>10} {'mean KL':>10} {'max KL':>10}"
    lines = [f"greedy agreement over {rows[0]['tokens']} tokens and KL(bfloat16 KV || KV) of next-token "
             f"distributions, {rows[0]['prompts']} prompts per architecture", "", head, "-" * len(head)]
    for r in rows:
        nbytes = f"{r['bytes']}" + ("+s" if "scale" in r["kv"] else "")
        lines.append(f"{r['arch']:<18} {r['kv']:<16} {nbytes:>5} {r['agreement']:>10.1%} "
                     f"{r['identical']:>5}/{r['prompts']:<4} {r['mean_kl']:>10.2e} {r['max_kl']:>10.2e}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    rows = drift(list(ARCHS), args.drift_prompts, args.drift_tokens)
    print(json.dumps({"rows": rows}) if args.json else table(rows))
    return 0
