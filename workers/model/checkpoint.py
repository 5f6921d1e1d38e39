"""Hugging Face checkpoint directories: config.json and memory-mapped safetensors weights.

Why its own reader: real checkpoints ship BF16, which numpy has no dtype for, and the
`safetensors` package's numpy loader refuses it (and copies every tensor). The format is an
8-byte little-endian header length, a JSON header (name -> dtype, shape, byte offsets) and the
raw bytes; so a file is mapped once with `np.memmap`, an F32 tensor is a zero-copy view of it,
and a BF16 tensor becomes float32 by shifting its 16 bits into the top half of a uint32 (a
bfloat16 is exactly the top 16 bits of a float32).

Everything a launch needs to refuse a checkpoint (unsupported architecture or RoPE type,
a missing shard, a corrupt header, a missing or misshapen tensor) is found by `inspect`, which
reads config.json and the headers only, so the launcher refuses before any process starts.
The fingerprint is the model identity block keys are rooted in: config.json, every header, and
a sample of every tensor's bytes. The sample matters: a fine-tune has its base model's config
and headers, and sharing KV blocks between the two (a storage tier, a P->D pair) would serve
one model's KV to the other; a few pages per tensor differ between any two trainings, and
reading them costs milliseconds where hashing every byte would cost a second pass over the
weights.
"""
from __future__ import annotations

import json
import logging
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from xxhash import xxh3_128_hexdigest

from kvrt.workers.model.archs import ARCHITECTURES, FAMILIES
from kvrt.workers.model.archs.features import ArchError, Features, boolean, positive_float, positive_int
from kvrt.workers.model.archs.tensors import LayerTensors, layer_tensors
from kvrt.workers.model.rope import Rope, RopeError

log = logging.getLogger("kvrt.workers.model.checkpoint")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
_MAX_HEADER = 100 << 20  # the safetensors format's own limit on a header's size
_MAX_JSON = 16 << 20     # config.json and the shard index are small; refuse anything huge
_SAMPLES, _SAMPLE_BYTES = 8, 4096  # per tensor, at evenly spaced offsets, for the fingerprint


class CheckpointError(ValueError):
    """The checkpoint directory cannot be served; the message names the file and the problem."""


@dataclass(frozen=True)
class ModelConfig:
    """What config.json says about the network, validated."""

    arch: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: Rope            # the full-attention layers' (every layer's but Gemma 3's sliding ones)
    tie_word_embeddings: bool
    features: Features    # what sets the architecture apart from Llama (workers/model/archs/)

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim / 2] (float64), as Hugging Face computes them."""
        return self.rope.inv_freq(self.head_dim)

    def ropes(self) -> list[Rope]:
        """The RoPE of each layer."""
        sliding = self.features.sliding_rope
        return [sliding if sliding is not None and w else self.rope for w in self.features.windows]

    def layer_windows(self, max_model_len: int) -> tuple[int, ...]:
        """Each layer's attention window on a node serving up to `max_model_len` positions (0:
        full attention), () when every layer attends to everything. The one reading of the
        windows (`Features.windows`, as transformers reads config.json) that the node's layer
        groups (the pool's pages, the prefix cache's side groups) and the attention both take;
        a window no shorter than max_model_len never leaves a key out, so it is no window."""
        out = tuple(w if w < max_model_len else 0 for w in self.features.windows)
        return out if any(out) else ()

    def max_model_len(self) -> tuple[int, str]:
        """The most positions a node may serve, and what sets it: max_position_embeddings, or a
        RoPE served only within a shorter context (longrope's original one; rope.py)."""
        limits = [(r.position_limit, f"its {r.rope_type} RoPE's original_max_position_embeddings (beyond it "
                                     f"transformers' answers depend on where a sequence crossed it)")
                  for r in self.ropes() if 0 < r.position_limit < self.max_position_embeddings]
        return min(limits, default=(self.max_position_embeddings, "max_position_embeddings"))

    def layer(self, i: int) -> LayerTensors:
        """Where layer i's weights are (workers/model/archs/tensors.py)."""
        return layer_tensors(self, i)

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the forward pass reads, with its shape (Hugging Face names)."""
        d = self.hidden_size
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, d), "model.norm.weight": (d,)}
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = (self.vocab_size, d)
        for i in range(self.num_layers):
            out.update(self.layer(i).shapes(d, self.num_heads, self.num_kv_heads, self.head_dim))
        return out


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_JSON + 1)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {what} {path}: {e}") from None
    if len(raw) > _MAX_JSON:
        raise CheckpointError(f"{what} {path} is larger than {_MAX_JSON} bytes")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{what} {path} is not valid JSON: {e}") from None


def parse_config(model_dir: str) -> ModelConfig:
    """The validated network description of `model_dir`/config.json."""
    path = os.path.join(model_dir, "config.json")
    cfg = _read_json(path, "config")
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    archs = cfg.get("architectures")
    if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in ARCHITECTURES):
        raise CheckpointError(f"{path}: architectures {archs!r} is not supported (supported: "
                              f"{', '.join(ARCHITECTURES)})")
    try:
        return _parse(archs[0], {**FAMILIES[archs[0]].defaults, **cfg})
    except (ArchError, RopeError) as e:
        raise CheckpointError(f"{path}: {e}") from None


def _parse(arch: str, cfg: dict) -> ModelConfig:
    hidden = positive_int(cfg, "hidden_size")
    heads = positive_int(cfg, "num_attention_heads")
    kv_heads = positive_int(cfg, "num_key_value_heads", heads)
    head_dim = cfg.get("head_dim")
    head_dim = hidden // heads if head_dim is None else positive_int(cfg, "head_dim")
    if head_dim <= 0 or head_dim % 2:
        raise ArchError(f"head_dim {head_dim} must be even and positive")
    if heads % kv_heads:
        raise ArchError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    tie = boolean(cfg, "tie_word_embeddings")
    max_pos = positive_int(cfg, "max_position_embeddings", 4096)
    layers = positive_int(cfg, "num_hidden_layers")
    rope, features = FAMILIES[arch].read({**cfg, "max_position_embeddings": max_pos}, layers)
    ex = features.experts
    dense = ex is None or not all(ex.routed)
    return ModelConfig(
        arch=arch, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        intermediate_size=positive_int(cfg, "intermediate_size") if dense else cfg.get("intermediate_size") or 0,
        head_dim=head_dim, vocab_size=positive_int(cfg, "vocab_size"), max_position_embeddings=max_pos,
        rms_norm_eps=positive_float(cfg, "rms_norm_eps", 1e-6), rope=rope, tie_word_embeddings=tie,
        features=features)


@dataclass(frozen=True)
class TensorInfo:
    file: str           # absolute path of the shard holding it
    dtype: str          # safetensors dtype name: F32, F16, BF16
    shape: tuple[int, ...]
    offset: int         # absolute byte offset in the file


def read_header(path: str) -> tuple[bytes, dict[str, TensorInfo]]:
    """The raw header bytes and the tensors of one safetensors file, every field checked
    against the file's size, so a corrupt or truncated file is refused here, never read
    out of bounds later."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt safetensors header: header length {n} does not fit "
                                      f"the file ({size} bytes)")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"weights file {path} is missing") from None
    except OSError as e:
        raise CheckpointError(f"cannot read weights file {path}: {e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    data0, data_len = 8 + n, size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        bad = f"{path}: corrupt safetensors header entry {name!r}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{bad}: not an object")
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _DTYPES:
            raise CheckpointError(f"{bad}: dtype {dtype!r} is not supported (supported: {', '.join(_DTYPES)})")
        if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                for d in shape)):
            raise CheckpointError(f"{bad}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and not isinstance(o, bool)
                                                                  for o in offs)):
            raise CheckpointError(f"{bad}: data_offsets {offs!r} is not [begin, end]")
        begin, end = offs
        want = math.prod(shape) * _DTYPES[dtype].itemsize  # Python ints: a huge shape cannot wrap around
        if not 0 <= begin <= end <= data_len or end - begin != want:
            raise CheckpointError(f"{bad}: data_offsets {offs} do not hold {shape} {dtype} ({want} bytes) "
                                  f"within the file's {data_len} data bytes")
        tensors[name] = TensorInfo(path, dtype, tuple(shape), data0 + begin)
    return raw, tensors


def weight_files(model_dir: str) -> list[str]:
    """The safetensors files of `model_dir`: the one model.safetensors, or the shards the
    index names (each must exist)."""
    single, index = os.path.join(model_dir, SINGLE_FILE), os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index):
        idx = _read_json(index, "weights index")
        wmap = idx.get("weight_map") if isinstance(idx, dict) else None
        if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to file names")
        files = sorted(set(wmap.values()))
        for f in files:
            if os.path.basename(f) != f:
                raise CheckpointError(f"{index}: shard name {f!r} must be a plain file name in the directory")
        return [os.path.join(model_dir, f) for f in files]
    if os.path.exists(single):
        return [single]
    raise CheckpointError(f"{model_dir}: no weights: neither {SINGLE_FILE} nor {INDEX_FILE} is there")


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint checked end to end without reading a weight: its config, where each
    tensor lies, and its fingerprint."""

    model_dir: str
    config: ModelConfig
    tensors: dict[str, TensorInfo]
    fingerprint: str

    def check_tp(self, tp: int) -> None:
        """CheckpointError unless `tp` ranks can each hold an equal share of the heads, the KV
        heads and the MLP width (each expert's too: experts split like the MLP)."""
        c, ex = self.config, self.config.features.experts
        widths = [("num_attention_heads", c.num_heads), ("num_key_value_heads", c.num_kv_heads)]
        if ex is None or not all(ex.routed):
            widths.append(("intermediate_size", c.intermediate_size))
        if ex is not None:
            widths.append(("moe_intermediate_size", ex.intermediate_size))
            if ex.shared_intermediate_size:
                widths.append(("shared_expert_intermediate_size", ex.shared_intermediate_size))
        for what, n in widths:
            if tp <= 0 or n % tp:
                raise CheckpointError(f"--tp {tp} must divide the checkpoint's {what} {n}")

    def node_shape(self) -> dict[str, int]:
        """The node settings config.json decides (launch flags of these names must agree;
        max_model_len may only be lowered)."""
        c = self.config
        return {"num_layers": c.num_layers, "num_kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
                "vocab_size": c.vocab_size, "max_model_len": c.max_model_len()[0]}


def inspect(model_dir: str) -> CheckpointInfo:
    """Check `model_dir` as a launch needs it checked (CheckpointError otherwise): a supported
    config, every weight file present with a sound header, every tensor the forward pass reads
    there once with its expected shape."""
    model_dir = os.path.abspath(model_dir)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"--model {model_dir}: not a directory")
    config = parse_config(model_dir)
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        digest_parts = [f.read()]
    tensors: dict[str, TensorInfo] = {}
    for path in weight_files(model_dir):
        raw, found = read_header(path)
        digest_parts.append(raw)
        for name, info in found.items():
            if name in tensors:
                raise CheckpointError(f"tensor {name} is in both {tensors[name].file} and {path}")
            tensors[name] = info
    for name, shape in config.expected_tensors().items():
        if name not in tensors:
            raise CheckpointError(f"{model_dir}: tensor {name} is missing from the weights")
        if tensors[name].shape != shape:
            raise CheckpointError(f"{model_dir}: tensor {name} has shape {list(tensors[name].shape)}, "
                                  f"config.json implies {list(shape)}")
    digest_parts += _samples(tensors)
    fingerprint = xxh3_128_hexdigest(b"\0".join(len(p).to_bytes(8, "little") + p for p in digest_parts))
    return CheckpointInfo(model_dir, config, tensors, fingerprint)


def _samples(tensors: dict[str, TensorInfo]) -> list[bytes]:
    """A few pages of each tensor's bytes (all of a small one), in name order."""
    out, fds = [], {}
    try:
        for name in sorted(tensors):
            t = tensors[name]
            if t.file not in fds:
                fds[t.file] = os.open(t.file, os.O_RDONLY)
            size = math.prod(t.shape) * _DTYPES[t.dtype].itemsize
            starts = sorted({t.offset + (size - _SAMPLE_BYTES) * i // (_SAMPLES - 1) for i in range(_SAMPLES)}
                            if size > _SAMPLES * _SAMPLE_BYTES else {t.offset})
            n = min(size, _SAMPLE_BYTES) if size > _SAMPLES * _SAMPLE_BYTES else size
            out.extend(os.pread(fds[t.file], n, s) for s in starts)
    except OSError as e:
        raise CheckpointError(f"cannot read weights for the fingerprint: {e}") from None
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


class Weights:
    """The tensors of a checkpoint as host float32 arrays, read through one read-only memory
    map per file (F32 tensors are views of the map: nothing is copied until used)."""

    def __init__(self, info: CheckpointInfo) -> None:
        self.info = info
        self._maps: dict[str, np.memmap] = {}

    def get(self, name: str) -> np.ndarray:
        t = self.info.tensors[name]
        mm = self._maps.get(t.file)
        if mm is None:
            mm = self._maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
        count = math.prod(t.shape)
        raw = np.frombuffer(mm, dtype=_DTYPES[t.dtype], count=count, offset=t.offset).reshape(t.shape)
        if t.dtype == "BF16":
            bits = raw.astype(np.uint32)
            bits <<= 16  # in place: one float32-sized allocation per tensor
            return bits.view(np.float32)
        return raw.astype(np.float32, copy=False)

    def close(self) -> None:
        """Drop the maps (arrays still referencing them keep their pages alive)."""
        self._maps.clear()
