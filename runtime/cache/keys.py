"""Block keys: chained xxh3-128 digests of a token sequence's full blocks.

Why this shape:
- Block i's key hashes block i-1's key and block i's tokens, so equal keys mean equal prefixes
  and a key alone finds a node, with no walk from the root. `chain_keys` is the
  one function that derives keys; the engine, a decode node receiving KV from a prefill node,
  and the storage tier must all agree on it, so it depends on nothing but the tokens: a fixed
  root key, little-endian int32 token bytes, no per-process seed such as Python's `hash()`.
- Keys are 16-byte `bytes`. As dict keys they were as fast as 128-bit ints in our measurements
  (a bytes object caches its hash; a big int is rehashed at every lookup), they travel in
  msgpack as `bin` as they are, and `xxh3_128_digest(parent + tokens)` (one concatenation,
  one call) was the cheapest chaining we measured: ~125 ns per 64-token block, against
  ~220 ns for a seeded `xxh3_128_intdigest` plus 128-bit int arithmetic.
- The loop runs in C (runtime/cache/_cache_core.c, built by setup.py): the same bytes without a
  slice, a concatenation and a call per block, a quarter of a Python loop's time
  (tests/runtime/cache/cache_reference.py holds that loop, the reference it is tested against).
- `BlockHasher` keeps the last key and the number of blocks hashed: a request that grows
  (chunked prefill, output tokens) hashes each block exactly once.
- A request's `cache_salt` (vLLM's field) moves its chain to a root of its own (`salted_root`),
  so its first block's key, and hence every later one, differs from any other salt's: tenants
  with different salts never share a block, on any tier (storage objects are named by these keys
  too), and a hit (`cached_tokens`, the time to first token) only ever comes from the same salt.
  The salted root is a BLAKE2b keyed hash, not xxh3: a tenant's salt must not be recoverable
  from the keys its blocks are published under.
- A model whose layers form several groups (ipc/layout.py LayerGroups: full attention and
  sliding windows) has a page per group for a block of tokens. Group 0's page is named by the
  block's key; group g's by `group_key(key, g)`, a digest of both, so every page of every tier
  (storage objects, a P->D handoff) has a name of its own, derived by anyone who has the key.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import numpy as np
from xxhash import xxh3_128_digest

from kvrt.runtime.cache.core import chain_keys as _chain_keys_c

TOKEN_DTYPE = np.dtype("<i4")
ROOT_KEY: bytes = xxh3_128_digest(b"kvrt.prefix-cache.root.v1")
KEY_BYTES = 16
_IDENTITY_DOMAIN = b"kvrt.prefix-cache.model-root.v1\0"
_GROUP_DOMAIN = b"kvrt.prefix-cache.group-page.v1\0"


@dataclass(frozen=True)
class ModelIdentity:
    """Everything that decides what the KV of a token sequence is, and how it is laid out in a
    block of one rank: two nodes may share blocks (storage, P->D) only if all of it is equal.

    `weights` fingerprints the weights: for the built-in reference model its seed and shape
    (its weights are a function of them); for a checkpoint a digest of its config.json, its
    safetensors headers (every tensor's name, dtype, shape and place) and a sample of every
    tensor's bytes (workers/model/checkpoint.py)."""

    arch: str
    weights: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    tp: int
    layer_groups: str = ""  # LayerGroups.describe() of a model with several groups; "": one group

    def key_root(self) -> bytes:
        """The root of this model's block-key chain: a digest of every field, canonically
        encoded (sorted JSON), in a domain of its own so it never equals `ROOT_KEY` (a model
        of one layer group digests what it did before groups existed)."""
        fields = asdict(self)
        if not self.layer_groups:
            del fields["layer_groups"]
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return xxh3_128_digest(_IDENTITY_DOMAIN + blob)


def salted_root(root: bytes, cache_salt: str) -> bytes:
    """The root of the key chain of requests with this `cache_salt` ("" is no salt: `root`)."""
    if not cache_salt:
        return root
    return hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=KEY_BYTES, key=root,
                           person=b"kvrt.cache-salt").digest()


def group_key(key: bytes, group: int) -> bytes:
    """The name of layer group `group`'s page of the block named `key` (group 0: `key` itself)."""
    if not group:
        return key
    return xxh3_128_digest(_GROUP_DOMAIN + key + group.to_bytes(2, "little"))


def chain_keys(token_bytes: bytes, block_size: int, parent: bytes = ROOT_KEY) -> list[bytes]:
    """Keys of the full blocks in `token_bytes` (little-endian int32 tokens), chained from
    `parent` (a 16-byte key); a trailing partial block gets no key."""
    return _chain_keys_c(token_bytes, block_size, parent)


def as_token_array(tokens) -> np.ndarray:
    """Tokens as a contiguous little-endian int32 array (no copy when they already are)."""
    arr = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    return arr


class BlockHasher:
    """Keys of one request's full blocks, computed incrementally as the request grows.

    `keys` is the list of keys so far; `update(tokens)` takes the whole sequence so far (prompt
    plus any output tokens) and hashes only the full blocks not hashed yet.
    """

    __slots__ = ("block_size", "keys", "root")

    def __init__(self, block_size: int, root: bytes = ROOT_KEY):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if len(root) != KEY_BYTES:
            raise ValueError(f"root key must be {KEY_BYTES} bytes, got {len(root)}")
        self.block_size = block_size
        self.root = root
        self.keys: list[bytes] = []

    def update(self, tokens) -> list[bytes]:
        """Hash the full blocks of `tokens` beyond those already hashed; returns the new keys."""
        arr = as_token_array(tokens)
        done = len(self.keys)
        full = len(arr) // self.block_size
        if full <= done:
            return []
        parent = self.keys[-1] if done else self.root
        # (the array's bytes as they are: chain_keys reads any contiguous buffer, no copy)
        new = _chain_keys_c(arr[done * self.block_size:full * self.block_size], self.block_size, parent)
        self.keys.extend(new)
        return new
