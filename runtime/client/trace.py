"""Request traces in the Mooncake format and their token ids.

One JSON object a line: `timestamp` (ms), `input_length`, `output_length`, and `hash_ids`, one id
per 512-token block of the prompt (the last may be partial). Equal ids at equal positions mean
equal prompts up to the end of that block.

Token expansion: token `p` of id `h` is `((h * 512 + p) * 0x9E3779B1) mod 2**32`, read as int32
(then mapped into 0..vocab_size-1 by `to_vocab` when a vocabulary is given, for a model that
needs valid ids; a plain `% vocab_size` would drop the id for a power-of-two vocabulary). Multiplying by an odd
constant is a bijection on 32-bit words, so distinct (id, position) pairs get distinct tokens for
every id below 2**23: any block size dividing 512 reproduces the trace's sharing exactly, down to
single tokens. It costs one vectorised pass per request (~8 us for a 12k-token prompt, 0.1 s for
the whole bundled trace), which is cheaper than caching 2 KiB per id (183k ids, 370 MB).
"""
from __future__ import annotations

import gzip
import json
import lzma
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

TRACE_BLOCK = 512
_MIX = np.uint32(0x9E3779B1)
_MAX_ID = 1 << 23
_POSITIONS = np.arange(TRACE_BLOCK, dtype=np.uint32)


class TraceError(ValueError):
    """A trace line is malformed; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The first `limit` requests (all if None) of a trace file, validated; a `.xz` or `.gz`
    file is read through its decompressor."""
    out: list[TraceRequest] = []
    with open_trace(path) as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            out.append(_parse(line, f"{path}:{lineno}"))
    return out


def _parse(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
        req = TraceRequest(int(obj["timestamp"]), int(obj["input_length"]),
                           int(obj["output_length"]), tuple(int(h) for h in obj["hash_ids"]))
    except (ValueError, KeyError, TypeError) as e:
        raise TraceError(f"{where}: not a trace request ({e})") from None
    n = len(req.hash_ids)
    if not n or not (n - 1) * TRACE_BLOCK < req.input_length <= n * TRACE_BLOCK:
        raise TraceError(f"{where}: input_length {req.input_length} does not fit {n} blocks of {TRACE_BLOCK}")
    if min(req.hash_ids) < 0 or max(req.hash_ids) >= _MAX_ID:
        raise TraceError(f"{where}: hash ids must be in [0, {_MAX_ID})")
    return req


def expand_tokens(req: TraceRequest, vocab_size: int | None = None) -> np.ndarray:
    """The request's prompt as int32 token ids (see the module docstring for the formula)."""
    ids = np.array(req.hash_ids, dtype=np.uint32) * np.uint32(TRACE_BLOCK)
    tokens = np.add.outer(ids, _POSITIONS).ravel()[:req.input_length]
    np.multiply(tokens, _MIX, out=tokens)
    if vocab_size is not None:
        return to_vocab(tokens, vocab_size)
    return tokens.view(np.int32)


def to_vocab(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """32-bit token words -> ids in 0..vocab_size-1: scrambled by a bijective 32-bit finalizer
    (MurmurHash3's fmix32), then scaled by their high bits (word * vocab >> 32).

    The trace words are (id * 512 + position) * odd, so neither their low bits (`% vocab`
    depends on the position alone for a power-of-two vocabulary up to 512) nor their high bits
    (two ids whose difference times 512 * odd is small mod 2**32 give nearly equal words at every
    position) separate ids once reduced to a small vocabulary: both give unrelated trace prefixes
    equal tokens. After the finalizer, distinct words are independent: two different 16-token
    blocks agree with probability vocab**-16."""
    x = np.asarray(tokens).view(np.uint32).copy()
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x85EBCA6B)
    x ^= x >> np.uint32(13)
    x *= np.uint32(0xC2B2AE35)
    x ^= x >> np.uint32(16)
    return ((x.astype(np.uint64) * np.uint64(vocab_size)) >> np.uint64(32)).astype(np.int32)



def num_blocks(req: TraceRequest, block_size: int) -> int:
    """Prompt blocks of the request, the partial last one included."""
    return -(-req.input_length // block_size)


def ideal_hit_tokens(requests: Iterable[TraceRequest], block_size: int, tokens_per_id: int = TRACE_BLOCK) -> int:
    """Prompt tokens an unlimited prefix cache serves, requests one after another, when each
    trace id stands for `tokens_per_id` tokens (512 in the trace itself; fewer for the requests
    runtime.client.replay.trace_prompts records, whose `input_length` is already scaled). Computed from
    hash_ids alone, independently of the cache.

    A full block is identified by the prefix it ends: the trie node of the id holding its last
    token and that token's offset in the id. A request hits its leading blocks seen before,
    except that a prompt matching entirely gives its last block back (its last token is
    recomputed), as in the prefix cache.
    """
    if not 1 <= tokens_per_id <= TRACE_BLOCK:
        raise ValueError(f"tokens per trace id must be 1..{TRACE_BLOCK}, got {tokens_per_id}")
    if block_size <= 0:
        raise ValueError(f"block size must be positive, got {block_size}")
    trie: dict[tuple[int, int], int] = {}
    seen = np.zeros(4096, dtype=bool)
    hits = 0
    for req in requests:
        full = req.input_length // block_size
        if full == 0:
            continue
        node, nodes = -1, []
        for h in req.hash_ids[:-(-req.input_length // tokens_per_id)]:
            node = trie.setdefault((node, h), len(trie))
            nodes.append(node)
        ends = np.arange(1, full + 1, dtype=np.int64) * block_size - 1
        keys = np.asarray(nodes, dtype=np.int64)[ends // tokens_per_id] * tokens_per_id + ends % tokens_per_id
        if len(trie) * tokens_per_id > len(seen):
            seen = np.concatenate([seen, np.zeros(len(trie) * tokens_per_id * 2 - len(seen), dtype=bool)])
        new = np.flatnonzero(~seen[keys])
        matched = int(new[0]) if len(new) else full
        if matched * block_size == req.input_length:
            matched -= 1
        hits += matched * block_size
        seen[keys] = True
    return hits


def open_trace(path: str | Path):
    """A trace file as text, decompressed by its suffix (.xz, .gz) as it is read."""
    suffix = Path(path).suffix
    if suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    if suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def default_trace_path() -> Path:
    """The conversation trace shipped inside kvrt (runtime/client/data/: its origin and licence
    are in the README there), xz-compressed: 200 KB for the trace's 3 MB of JSON lines."""
    return Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl.xz"
