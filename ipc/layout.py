"""The KV layout of one rank: the one place a block's shape, size and dtype are worked out.

Pools, transports, the model and the launcher's sizing all derive a block from this spec, so
a change to the layout (another axis order, another split over ranks) is made once and a pool
that disagrees with it is named as such, instead of five hand-written shape formulas drifting
apart. Pools are block-major `[num_blocks, layers, K/V, block_size, kv_heads, head_dim]`: one
block is one contiguous byte range, so a run of consecutive blocks is one copy.

The KV dtype is a numpy float (float16, float32, ...) or FP8 e4m3 (`float8_e4m3fn`, vLLM's
`--kv-cache-dtype fp8`). numpy has no float8, so an FP8 pool holds its bytes as uint8: the
layout names the dtype the bytes mean, and the pool's array dtype is `storage_dtype`. uint8
stands for e4m3 and nothing else, so a pool's array says which KV dtype it holds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

KV_AXIS = 2  # K and V
FP8_E4M3 = "float8_e4m3fn"  # OCP FP8 e4m3: no infinities, NaN 0x7F / 0xFF, largest finite 448
_STORED_AS = {FP8_E4M3: np.dtype(np.uint8)}
_MEANS = {v.name: k for k, v in _STORED_AS.items()}


def kv_dtype_name(dtype: Any) -> str:
    """The canonical name of a KV dtype: `float8_e4m3fn`, or numpy's name of a float dtype.
    TypeError for what is neither."""
    if isinstance(dtype, str) and dtype in _STORED_AS:
        return dtype
    return np.dtype(dtype).name


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype a pool of KV dtype `name` holds its bytes in."""
    return _STORED_AS.get(name) or np.dtype(name)


@dataclass(frozen=True)
class LayerGroups:
    """How a model's layers share the KV pool: layers that attend alike (full attention, or a
    sliding window of W tokens) form groups of equal size, and a pool block ("page") holds one
    group's layers for one block of tokens. Every group has its own block table over the one
    pool, so a sliding group's blocks can be freed once they leave its window while the full
    groups' stay (runtime/cache/groups.py).

    Why one pool of equal pages and not a pool per group: the share of memory the groups need
    follows the workload (how many tokens are in flight, how many cached), so sized pools
    would leave one idle while the other evicts; with equal pages any free block serves any
    group, and swaps, storage objects and P->D sends move pages without knowing whose they are
    ("a block is a block"). Equal pages cost padding where the group sizes do not divide:
    the page is the smaller kind's layer count (no padding on it), and the larger kind is cut
    into as many groups of that size as it needs (its last one padded), e.g. Gemma-3 1B's 4
    full and 22 sliding layers are one full group and six sliding groups of 4 layers.

    `windows[g]`: group g's window in tokens (0: full attention); `layers[g]`: its layers in slot
    order. Group 0 is a full-attention group when there is one: its blocks are the prefix
    cache's tree, the other groups' blocks hang off it. A model with one kind of attention is
    one group of all its layers: today's layout, and the cache of a model without groups."""

    windows: tuple[int, ...]
    layers: tuple[tuple[int, ...], ...]
    page_layers: int

    @classmethod
    def of(cls, layer_windows: Sequence[int]) -> "LayerGroups":
        """The groups of a model whose layer i attends over the last `layer_windows[i]` tokens
        (0: all of them)."""
        windows = [int(w) for w in layer_windows]
        if not windows or min(windows) < 0:
            raise ValueError(f"layer windows must be one non-negative number per layer, got {windows}")
        kinds = sorted(set(windows))  # full attention (0) first, then narrower windows first
        by_kind = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
        page = min(len(v) for v in by_kind.values())
        out_w, out_l = [], []
        for w in kinds:
            layers = by_kind[w]
            for j in range(0, len(layers), page):
                out_w.append(w)
                out_l.append(tuple(layers[j:j + page]))
        return cls(tuple(out_w), tuple(out_l), page)

    @property
    def hybrid(self) -> bool:
        """More than one group: a token block is a page per group."""
        return len(self.windows) > 1

    @property
    def side_windows(self) -> tuple[int, ...]:
        """The windows of groups 1.. (the prefix cache's side groups)."""
        return self.windows[1:]

    def slot(self, layer: int) -> tuple[int, int]:
        """(group, slot in its page) of `layer`."""
        for g, layers in enumerate(self.layers):
            if layer in layers:
                return g, layers.index(layer)
        raise ValueError(f"layer {layer} is in no group")

    def describe(self) -> str:
        """A canonical text of the grouping (part of a node's identity: it decides what a page holds)."""
        return ";".join(f"{w}:{','.join(map(str, ls))}" for w, ls in zip(self.windows, self.layers))


@dataclass(frozen=True)
class KVLayout:
    """One rank's KV block: [num_layers, K/V, block_size, kv_heads, head_dim] of `dtype` (a KV
    dtype name, `kv_dtype_name`), where `kv_heads` is this rank's share of the model's KV heads."""

    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of_node(cls, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str,
                tp: int) -> "KVLayout":
        """The layout of each rank of a node whose `num_kv_heads` are split over `tp` ranks."""
        if tp <= 0 or num_kv_heads % tp:
            raise ValueError(f"tp {tp} must be positive and divide num_kv_heads {num_kv_heads}")
        return cls(int(num_layers), int(block_size), int(num_kv_heads) // tp, int(head_dim),
                   kv_dtype_name(dtype))

    @classmethod
    def of_pool_shape(cls, shape: Sequence[int], dtype: Any) -> "KVLayout":
        """The layout a pool of `shape` ([blocks, *block_shape]) and array dtype `dtype` holds
        (uint8: FP8 e4m3); ValueError when it is not a KV pool at all."""
        if len(shape) != 6 or shape[2] != KV_AXIS:
            raise ValueError(f"a KV pool is [blocks, layers, {KV_AXIS}, block_size, kv_heads, head_dim], "
                             f"got shape {tuple(shape)}")
        _, layers, _, bs, kvh, hd = (int(d) for d in shape)
        stored = np.dtype(dtype).name
        return cls(layers, bs, kvh, hd, _MEANS.get(stored, stored))

    @property
    def storage_dtype(self) -> np.dtype:
        """The dtype of a pool array holding these blocks (uint8 for FP8)."""
        return storage_dtype(self.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, KV_AXIS, self.block_size, self.kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * self.storage_dtype.itemsize

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (int(num_blocks), *self.block_shape)

    def pool_bytes(self, num_blocks: int) -> int:
        return int(num_blocks) * self.block_bytes

    def layer(self, pool: Any, layer: int) -> Any:
        """Layer `layer` of every block of `pool`, a view [blocks, K/V, block_size, kv_heads,
        head_dim] (no copy; works for numpy and CuPy arrays alike)."""
        return pool[:, layer]

    def differences(self, other: "KVLayout") -> list[tuple[str, Any, Any]]:
        """(field, this layout's value, `other`'s value) for every field that differs."""
        return [(name, getattr(self, name), getattr(other, name))
                for name in ("num_layers", "block_size", "kv_heads", "head_dim", "dtype")
                if getattr(self, name) != getattr(other, name)]

    def __str__(self) -> str:
        return f"[{'x'.join(str(d) for d in self.block_shape)}] {self.dtype}"
