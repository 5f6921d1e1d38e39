"""The KV layout of one rank: the one place a block's shape, size and dtype are worked out.

Pools, transports, the model and the launcher's sizing all derive a block from this spec, so
a change to the layout (another axis order, another split over ranks) is made once and a pool
that disagrees with it is named as such, instead of five hand-written shape formulas drifting
apart. Pools are block-major `[num_blocks, layers, K/V, block_size, kv_heads, head_dim]`: one
block is one contiguous byte range, so a run of consecutive blocks is one copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

KV_AXIS = 2  # K and V


@dataclass(frozen=True)
class KVLayout:
    """One rank's KV block: [num_layers, K/V, block_size, kv_heads, head_dim] of `dtype`, where
    `kv_heads` is this rank's share of the model's KV heads."""

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
                   np.dtype(dtype).name)

    @classmethod
    def of_pool_shape(cls, shape: Sequence[int], dtype: Any) -> "KVLayout":
        """The layout a pool of `shape` ([blocks, *block_shape]) and `dtype` holds; ValueError
        when it is not a KV pool at all."""
        if len(shape) != 6 or shape[2] != KV_AXIS:
            raise ValueError(f"a KV pool is [blocks, layers, {KV_AXIS}, block_size, kv_heads, head_dim], "
                             f"got shape {tuple(shape)}")
        _, layers, _, bs, kvh, hd = (int(d) for d in shape)
        return cls(layers, bs, kvh, hd, np.dtype(dtype).name)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, KV_AXIS, self.block_size, self.kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * np.dtype(self.dtype).itemsize

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
