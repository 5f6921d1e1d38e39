"""The child of `kvrt bench cache --peer`: replays a trace through vLLM's or SGLang's own prefix
cache, in the interpreter that has them installed (a separate venv with torch: kvrt's does not
need it, and theirs do not import without it).

Why a script of its own, run by path: the peer's interpreter need not have kvrt installed, so
this file imports only the standard library and numpy at the top, loads kvrt's token expansion
(runtime/client/trace.py, stdlib + numpy too) from its path beside this file, and imports the
peer inside the replay. The parent (bench/peer_cache.py) writes the trace on stdin as JSON lines
(no pickle): a header `{"peer", "block_size", "capacity_blocks": [N, ...]}`, then one
`{"input_length", "hash_ids"}` per request; the child replays the trace once per capacity (one
import of the peer for all) and prints one JSON object on stdout: per capacity the hit tokens,
the blocks, and the CPU seconds (time.process_time) of the replay alone.

Both peers are driven as their schedulers drive them for one request at a time: look up the
longest cached prefix (at most the prompt less one token, as both do to compute the last
token's logits), allocate the rest (evicting as the peer does when short), record the prompt's
full blocks as cached, and free the request. Token expansion is not counted in the CPU time (a
peer gets token ids from its tokenizer); each peer's own hashing and key building are.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

PEERS = ("vllm", "sglang")
MAX_LINE = 1 << 24  # bytes of one request line (a 2-million-token prompt's ids and then some)


@dataclass(frozen=True)
class Header:
    """What the replay needs besides the requests."""

    peer: str
    block_size: int
    capacity_blocks: tuple[int, ...]


@dataclass(frozen=True)
class FeedRequest:
    input_length: int
    hash_ids: tuple[int, ...]


class FeedError(ValueError):
    """The trace on stdin is not what the parent writes."""


def header_line(h: Header) -> str:
    return json.dumps({"peer": h.peer, "block_size": h.block_size, "capacity_blocks": list(h.capacity_blocks)})


def request_line(input_length: int, hash_ids: Iterable[int]) -> str:
    return json.dumps({"input_length": input_length, "hash_ids": list(hash_ids)}, separators=(",", ":"))


def read_feed(lines: Iterable[str]) -> tuple[Header, list[FeedRequest]]:
    """The header and the requests of a feed, validated (types, signs, the peer's name)."""
    it = iter(lines)
    try:
        head = json.loads(_bounded(next(it)))
    except StopIteration:
        raise FeedError("empty feed: no header line") from None
    if not isinstance(head, dict) or head.get("peer") not in PEERS:
        raise FeedError(f"header must name a peer of {PEERS}: {head!r:.200}")
    bs, cap = head.get("block_size"), head.get("capacity_blocks")
    if not (_int(bs) and bs > 0 and isinstance(cap, list) and cap and all(_int(c) and c > 0 for c in cap)):
        raise FeedError(f"header needs a positive block_size and a list of positive capacity_blocks: {head!r:.200}")
    out = []
    for n, line in enumerate(it, 2):
        if not line.strip():
            continue
        o = json.loads(_bounded(line))
        if not isinstance(o, dict):
            raise FeedError(f"line {n}: not an object")
        length, ids = o.get("input_length"), o.get("hash_ids")
        if not (_int(length) and length > 0 and isinstance(ids, list) and ids
                and all(_int(i) and i >= 0 for i in ids)):
            raise FeedError(f"line {n}: needs a positive input_length and a list of hash_ids >= 0")
        out.append(FeedRequest(length, tuple(ids)))
    return Header(head["peer"], bs, tuple(cap)), out


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _bounded(line: str) -> str:
    if len(line) > MAX_LINE:
        raise FeedError(f"a line of {len(line)} characters (at most {MAX_LINE})")
    return line


def _expander() -> Callable[[FeedRequest], "object"]:
    """kvrt's token expansion (runtime/client/trace.py), loaded by path: the same tokens kvrt's
    own replay hashes, without kvrt installed in this interpreter."""
    path = Path(__file__).resolve().parent.parent / "runtime" / "client" / "trace.py"
    spec = importlib.util.spec_from_file_location("_kvrt_trace", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (dataclasses look their module up while the class is built)
    spec.loader.exec_module(mod)
    return mod.expand_tokens


class VllmReplay:
    """vLLM v1's KVCacheManager (its BlockPool, free-block queue and request block hasher), one
    full-attention group, `capacity` usable blocks (plus the null block vLLM keeps)."""

    def __init__(self, block_size: int, capacity: int):
        import torch
        from vllm import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request

        hash_fn = get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
        init_none_hash(hash_fn)
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float16)
        config = KVCacheConfig(num_blocks=capacity + 1, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        self.max_len = 1 << 30
        self.manager = KVCacheManager(config, max_model_len=self.max_len, scheduler_block_size=block_size,
                                      hash_block_size=block_size, enable_caching=True)
        self.hasher = get_request_block_hasher(block_size, hash_fn)
        self.params = SamplingParams(max_tokens=1)
        self.Request = Request

    def request(self, rid: int, tokens: list[int]) -> tuple[int, bool]:
        """(tokens served from the cache, whether the request fit)."""
        req = self.Request(str(rid), tokens, self.params, None, block_hasher=self.hasher)
        m = self.manager
        blocks, hit, _ = m.get_computed_blocks(req)
        if m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is None:
            return hit, False
        req.num_computed_tokens = req.num_tokens
        m.free(req)
        return hit, True


class SglangReplay:
    """SGLang's RadixCache (LRU, its default) over a paged token-to-KV allocator of `capacity`
    pages of `block_size` tokens, with no KV tensors (the cache only moves their indices)."""

    def __init__(self, block_size: int, capacity: int):
        import torch
        from array import array
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self.torch, self.array = torch, array
        self.bs = block_size
        # need_sort (SGLang's mode under P/D): frees are staged and merged when an allocation runs
        # short. Its default instead concatenates the whole free list on every free, a copy a GPU
        # makes asynchronously but that a CPU replay would charge to SGLang.
        self.alloc = PagedTokenToKVPoolAllocator(capacity * block_size, block_size, torch.float16, "cpu",
                                                 kvcache=None, need_sort=True)
        self.cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                                token_to_kv_pool_allocator=self.alloc, page_size=block_size))
        self.Key, self.Match, self.Insert = RadixKey, MatchPrefixParams, InsertParams

    def request(self, rid: int, tokens: list[int]) -> tuple[int, bool]:
        n, bs, cache, alloc = len(tokens), self.bs, self.cache, self.alloc
        ids = self.array("q", tokens)
        m = cache.match_prefix(self.Match(key=self.Key(ids[:n - 1])))  # at most all but the last token
        hit, node = m.device_prefix_len, m.last_device_node
        prefix = cache.path_device_indices(node)
        cache.inc_lock_ref(node)
        need = -(-(n - hit) // bs) * bs
        if need > alloc.available_size() + cache.evictable_size():
            cache.dec_lock_ref(node)  # SGLang's admission turns it away without evicting anything
            return hit, False
        alloc.evict_to_free_tokens(cache, need)
        new = alloc.alloc(need)
        if new is None:
            raise RuntimeError(f"request {rid}: SGLang's allocator is short of {need} tokens after evicting")
        kv = self.torch.cat((prefix, new))
        full = n // bs * bs
        done = cache.insert(self.Insert(key=self.Key(ids[:full]), value=kv[:full]))
        # as SGLang's cache_finished_req: free what the tree already had and the partial page
        alloc.free_segment(kv[hit:done.prefix_len], start_pos=hit)
        if full < len(kv):
            alloc.free_segment(kv[full:], start_pos=full)
        cache.dec_lock_ref(node)
        return hit, True


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def replay(header: Header, requests: list[FeedRequest]) -> dict:
    """The trace through the peer at each capacity, from an empty cache each time."""
    expand = _expander()
    rows = [replay_one(header.peer, header.block_size, c, requests, expand) for c in header.capacity_blocks]
    return {"peer": header.peer, "version": _version(header.peer), "rows": rows}


def replay_one(name: str, block_size: int, capacity: int, requests: list[FeedRequest],
               expand: Callable[[FeedRequest], "object"]) -> dict:
    """Every request through the peer in order; the CPU time counts the peer's calls only."""
    peer = (VllmReplay if name == "vllm" else SglangReplay)(block_size, capacity)
    hit = tokens = blocks = rejected = 0
    cpu = 0.0
    wall = time.perf_counter()
    for i, r in enumerate(requests):
        ids = expand(r).tolist()
        t0 = time.process_time()
        got, fit = peer.request(i, ids)
        cpu += time.process_time() - t0
        tokens += r.input_length
        blocks += -(-r.input_length // block_size)
        hit += got
        rejected += not fit
    return {"capacity_blocks": capacity, "requests": len(requests), "blocks": blocks,
            "prompt_tokens": tokens, "hit_tokens": hit, "hit_token_rate": hit / tokens if tokens else 0.0,
            "rejected_requests": rejected, "cpu_s": cpu, "blocks_per_cpu_s": blocks / cpu if cpu > 0 else None,
            "wall_s": time.perf_counter() - wall}


def main() -> int:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the peers print on import goes to stderr; stdout carries the answer alone
    try:
        header, requests = read_feed(sys.stdin)
    except (FeedError, ValueError) as e:
        print(f"peer_cache_child: {e}", file=sys.stderr)
        return 2
    out.write(json.dumps(replay(header, requests)) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
