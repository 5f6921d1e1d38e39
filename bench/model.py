"""`kvrt bench model`: prefill and decode throughput of a Hugging Face checkpoint through the
worker's forward pass, next to the physical floor of a decode step.

In one run:
- without --model, a checkpoint of real ~0.5B shapes (Qwen2: hidden 896, 24 layers, 14 heads,
  2 KV heads, MLP 4864, vocab 151936, tied embeddings, random BF16 weights) is written in code
  into a temporary directory (`--shape small`: a few-layer toy of the same kind, for a quick run);
- it is loaded with the loader the worker uses (`HFModel`, memory-mapped safetensors) in the
  compute dtype a node would use (--compute-dtype, as `kvrt launch`'s: auto is float32 on a CPU
  and the checkpoint's precision, float16 for BF16, on a GPU; the KV pool follows) and run
  over a paged KV pool laid out by the node's KV layout spec (`ModelShape.kv_layout`), each
  sequence with its own block table, through `step_logits`, the worker's call;
- `memcpy`: one large copy (CPU: `np.copyto`; CUDA: a device-to-device copy), bytes read plus
  written per second: the memory bandwidth this run gets;
- prefill: one step of `batch` prompts of --prompt-len tokens, tokens/s;
- decode: --decode-steps steps of one token per sequence, tokens/s and ms/step, next to the floor:
  the time to read the model's weights (as held in memory) once at that bandwidth, since every
  decode step reads all of them; `vs floor` is measured / floor (1.0 is the limit);
- on CUDA, when `transformers` and `torch` import, a plain `generate` loop of the same
  checkpoint at the largest batch, for scale.

No timing is asserted anywhere; the figures are what this machine gave in this run.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import struct
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvrt.bench.copy import cuda_missing
from kvrt.workers.backend import BackendUnavailable, get_backend
from kvrt.workers.checkpoint import inspect
from kvrt.workers.hf_model import REQUESTED_DTYPES, HFModel, resolve_compute_dtype
from kvrt.workers.model import SeqInput

log = logging.getLogger("kvrt.bench.model")

# real Qwen2.5-0.5B shapes, and a toy of the same architecture
SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "small": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512),
}
BLOCK_SIZE = 16
MEMCPY_BYTES = 1 << 30  # large enough to leave every cache far behind


@dataclass
class Row:
    phase: str          # "memcpy", "prefill", "decode" or "transformers decode"
    batch: int          # 0 for memcpy
    tokens: int         # tokens computed in the timed part
    seconds: float
    tokens_s: float | None = None
    ms_step: float | None = None
    floor_ms: float | None = None     # decode: one read of the weights at the measured bandwidth
    vs_floor: float | None = None     # decode: ms_step / floor_ms
    gb_s: float | None = None         # memcpy: bytes read + written per second
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
    """A Qwen2 checkpoint of `shape` in `directory`: config.json and one BF16 model.safetensors,
    written tensor by tensor so peak memory stays one tensor. Returns the config."""
    s = SHAPES[shape]
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **s, "max_position_embeddings": 32768,
           "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu",
           "torch_dtype": "bfloat16"}
    d, h, kvh, m, v = s["hidden_size"], s["num_attention_heads"], s["num_key_value_heads"], \
        s["intermediate_size"], s["vocab_size"]
    hd = d // h
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                       p + "self_attn.q_proj.weight": (h * hd, d), p + "self_attn.q_proj.bias": (h * hd,),
                       p + "self_attn.k_proj.weight": (kvh * hd, d), p + "self_attn.k_proj.bias": (kvh * hd,),
                       p + "self_attn.v_proj.weight": (kvh * hd, d), p + "self_attn.v_proj.bias": (kvh * hd,),
                       p + "self_attn.o_proj.weight": (d, h * hd), p + "mlp.gate_proj.weight": (m, d),
                       p + "mlp.up_proj.weight": (m, d), p + "mlp.down_proj.weight": (d, m)})
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
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shp in shapes.items():
            n = math.prod(shp)
            if name.endswith("norm.weight"):
                data = np.full(n, 0x3F80, dtype=np.uint16)  # 1.0
            else:
                # ~1/sqrt(fan-in) keeps activations O(1) through the layers
                data = _bf16_random(rng, n, -int(round(math.log2(math.sqrt(shp[-1])))))
            f.write(data.tobytes())
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return cfg


# ---- measurements ----------------------------------------------------------------------------

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
        if a is None:
            return
        base = a
        while getattr(base, "base", None) is not None:
            base = base.base
        seen[id(base)] = base

    for a in (model.embed, model.final_norm, model.lm_head):
        add(a)
    for w in model.layers:
        for a in vars(w).values():
            add(a)
    return list(seen.values())


def run_model(model: HFModel, batches: list[int], prompt_len: int, steps: int, bw_gb_s: float,
              wbytes: int, seed: int = 0) -> list[Row]:
    """Prefill then decode at each batch, each sequence with its own blocks of one pool."""
    xp, s = model.xp, model.shape
    per_seq = -(-(prompt_len + steps) // BLOCK_SIZE)
    layout = s.kv_layout(BLOCK_SIZE, model.kv_dtype.name)
    pool = xp.zeros(layout.pool_shape(per_seq * max(batches)), dtype=layout.dtype)
    rng = np.random.default_rng(seed)
    floor_s = wbytes / (bw_gb_s * 1e9)
    # one untimed step first: the first call pays for page faults and lazy initialisation
    model.step_logits(pool, [SeqInput(np.zeros(min(prompt_len, BLOCK_SIZE), np.int32), 0, np.arange(per_seq))])
    rows = []
    for b in batches:
        tables = [np.arange(i * per_seq, (i + 1) * per_seq, dtype=np.int32) for i in range(b)]
        prompts = rng.integers(0, s.vocab_size, size=(b, prompt_len), dtype=np.int32)
        _sync(xp)
        t0 = time.perf_counter()
        tok = model.step_logits(pool, [SeqInput(prompts[i], 0, tables[i]) for i in range(b)]).argmax(-1)
        _sync(xp)
        t = time.perf_counter() - t0
        rows.append(Row("prefill", b, b * prompt_len, t, tokens_s=b * prompt_len / t))
        times = []
        for j in range(steps):
            seqs = [SeqInput(np.array([tok[i]], dtype=np.int32), prompt_len + j, tables[i]) for i in range(b)]
            _sync(xp)
            t0 = time.perf_counter()
            tok = model.step_logits(pool, seqs).argmax(-1)
            _sync(xp)
            times.append(time.perf_counter() - t0)
        step_s = float(np.median(times))
        rows.append(Row("decode", b, b * steps, float(sum(times)), tokens_s=b / step_s, ms_step=step_s * 1e3,
                        floor_ms=floor_s * 1e3, vs_floor=step_s / floor_s))
        log.info("batch %d done", b)
    return rows


def transformers_row(model_dir: str, batch: int, prompt_len: int, steps: int, floor_ms: float) -> Row:
    """A plain `transformers` generate loop over the same checkpoint (bf16 on the GPU), or a
    row saying why there is none."""
    try:
        import torch  # optional: only this comparison needs it
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        return Row("transformers decode", batch, 0, 0.0, note=f"skipped: {e}")
    import transformers

    # `torch_dtype` became `dtype` in transformers 4.56; the old name only warns, an unknown one
    # would be ignored and load float32, so the name is picked by version
    major, minor = (int(v) for v in transformers.__version__.split(".")[:2])
    kw = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.bfloat16}
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kw).to("cuda").eval()
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device="cuda")
    attn = torch.ones_like(ids)

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=attn, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(2)  # warm-up
    one, full = gen(1), gen(steps + 1)  # the difference is `steps` decode steps
    step_s = max(full - one, 1e-9) / steps
    return Row("transformers decode", batch, batch * steps, full - one, tokens_s=batch / step_s,
               ms_step=step_s * 1e3, floor_ms=floor_ms, vs_floor=step_s * 1e3 / floor_ms)


# ---- output ----------------------------------------------------------------------------------

def print_table(rows: list[Row], meta: dict) -> None:
    print(f"model {meta['model']} ({meta['params'] / 1e6:.1f} M params, weights held as "
          f"{meta['weight_bytes'] / 1e9:.2f} GB {meta['compute_dtype']}) on {meta['device']}; "
          f"prompt {meta['prompt_len']} tokens, {meta['decode_steps']} decode steps (median step), "
          f"block {meta['block_size']}; load {meta['load_s']:.1f} s")
    print(f"{'phase':<20} {'batch':>5} {'tokens/s':>10} {'ms/step':>9} {'floor ms':>9} {'vs floor':>9} "
          f"{'GB/s':>7}  note")

    def f(v: float | None, spec: str) -> str:
        return format(v, spec) if v is not None else format("-", ">" + spec.lstrip(">").split(".")[0])

    for r in rows:
        print(f"{r.phase:<20} {r.batch or '-':>5} {f(r.tokens_s, '>10.1f')} {f(r.ms_step, '>9.1f')} "
              f"{f(r.floor_ms, '>9.2f')} {f(r.vs_floor, '>9.1f')} {f(r.gb_s, '>7.1f')}  {r.note}")
    for r in rows:
        if r.phase == "transformers decode" and r.ms_step:
            ours = next((x for x in rows if x.phase == "decode" and x.batch == r.batch), None)
            if ours is not None and ours.ms_step:
                print(f"kvrt vs transformers at batch {r.batch}: {r.ms_step / ours.ms_step:.1f}x faster per step")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvrt bench model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face checkpoint directory (default: write a random "
                                   "~0.5B-shaped BF16 Qwen2 checkpoint into a temporary directory)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b",
                   help="shape of the checkpoint written without --model (default 0.5b; small: a toy)")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence (default 32)")
    p.add_argument("--decode-steps", type=int, default=8, help="timed decode steps per batch (default 8)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="numpy on CPU or CuPy (default cpu)")
    p.add_argument("--compute-dtype", choices=REQUESTED_DTYPES, default="auto",
                   help="as kvrt launch's (default auto: float32 on a CPU, the checkpoint's precision on a GPU)")
    p.add_argument("--memcpy-mib", type=int, default=MEMCPY_BYTES >> 20,
                   help=f"bytes of the bandwidth copy, MiB (default {MEMCPY_BYTES >> 20})")
    p.add_argument("--json", action="store_true", help='print {"meta": {...}, "rows": [...]} instead of a table')
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",") if b]
    except ValueError:
        p.error(f"--batches must be comma-separated integers, got {args.batches!r}")
    if not batches or min(batches) < 1 or args.prompt_len < 1 or args.decode_steps < 1 or args.memcpy_mib < 1:
        p.error("--batches, --prompt-len, --decode-steps and --memcpy-mib must be positive")
    try:
        xp = get_backend(args.device).xp
    except BackendUnavailable as e:
        p.error(str(e))
    if args.device == "cuda" and (why := cuda_missing()):  # CuPy imports, but no driver or no GPU
        p.error(f"--device cuda cannot run here: {why}")
    with tempfile.TemporaryDirectory(prefix="kvrt-bench-model-") as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = tmp
            t0 = time.perf_counter()
            write_checkpoint(model_dir, args.shape)
            log.info("wrote a %s checkpoint in %.1f s", args.shape, time.perf_counter() - t0)
        info = inspect(model_dir)
        max_len = args.prompt_len + args.decode_steps + 1
        if max_len > info.config.max_position_embeddings:
            p.error(f"--prompt-len + --decode-steps exceed the checkpoint's max_position_embeddings "
                    f"({info.config.max_position_embeddings})")
        compute = resolve_compute_dtype(args.compute_dtype, args.device, info)
        t0 = time.perf_counter()
        model = HFModel(info, max_len, xp, kv_dtype=compute, matmul_dtype=compute)
        load_s = time.perf_counter() - t0
        wbytes, params = weight_bytes(model), weight_params(model)
        bw = memcpy_gb_s(xp, args.memcpy_mib << 20)
        rows = [Row("memcpy", 0, 0, 0.0, gb_s=bw, note="d2d copy" if args.device == "cuda" else "np.copyto")]
        rows += run_model(model, batches, args.prompt_len, args.decode_steps, bw, wbytes)
        if args.device == "cuda":
            # transformers holds every weight in bf16: two bytes per parameter
            floor_ms = params * 2 / (bw * 1e9) * 1e3
            rows.append(transformers_row(model_dir, max(batches), args.prompt_len, args.decode_steps, floor_ms))
        c = info.config
        meta = dict(model=args.model or f"random {args.shape} Qwen2 (BF16 file)", arch=c.arch,
                    params=params, weight_bytes=wbytes, compute_dtype=compute, device=args.device,
                    prompt_len=args.prompt_len, decode_steps=args.decode_steps, block_size=BLOCK_SIZE,
                    load_s=load_s, memcpy_gb_s=bw)
    if args.json:
        print(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}))
    else:
        print_table(rows, meta)
    return 0
