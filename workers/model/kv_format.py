"""The number format of the KV blocks, as the model writes and reads them: a numpy float dtype,
or FP8 e4m3 (`--kv-cache-dtype fp8`, vLLM's name), which halves a BF16/F16 block.

FP8 e4m3 (OCP's `float8_e4m3fn`: 1 sign, 4 exponent and 3 mantissa bits, exponent bias 7, no
infinities, NaN 0x7F/0xFF, largest finite 448) is encoded and decoded here by arithmetic on
`xp` arrays, the same code on numpy and CuPy, neither of which has a float8 dtype: a pool holds
the bytes as uint8 (ipc/layout.py). Encoding rounds to nearest, ties to even, straight from
the input's precision (scaling by a power of two is exact, so one `rint` is the only rounding)
and saturates at +-448, as vLLM's FP8 KV quantization clamps before it converts; decoding is
one gather from the 256 values a byte can hold, in the compute dtype. tests/workers/model/
test_kv_format.py checks both, all 256 bytes and random values, against ml_dtypes' float8_e4m3fn.

Scales: one static scale per layer for K and one for V, of 1 for every layer: vLLM's per-tensor
k_scale / v_scale and their default when a checkpoint carries none. Why static per-layer scales
and not per-block-per-head ones:
- A float format's relative precision is the same over its whole normal range ([2**-6, 448] for
  e4m3: 3 mantissa bits, at most 2**-4 relative error): a scale only decides which magnitudes
  fall below it (into subnormals) or beyond it (saturated), and the K and V of the models served
  sit inside it. A per-block scale would buy precision only for heads whose values are all below
  2**-6 or beyond 448.
- A block is then a plain byte range that means the same wherever it was computed: swaps,
  the storage tier, a shared store and a P->D handoff move it unchanged, and its block key
  (rooted in the KV dtype, runtime/cache/keys.py) names its bytes. Per-block scales would have
  to travel beside every block on every tier, and would be fixed by the first token written
  into the block (chunked prefill and decode fill a block over several steps): a later token
  larger than the first ones would clip or force the block's earlier tokens to be requantized.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from kvrt.ipc.layout import FP8_E4M3, kv_dtype_name, storage_dtype

E4M3_MAX = 448.0
E4M3_NAN = 0x7F
_E4M3_MIN_EXP = -6  # the smallest normal exponent; below it, subnormals in steps of 2**-9


def e4m3_values() -> np.ndarray:
    """The float64 value of each of the 256 e4m3 bytes (NaN for 0x7F and 0xFF)."""
    b = np.arange(256)
    exp, man = (b >> 3) & 15, (b & 7).astype(np.float64)
    mag = np.where(exp == 0, man * 2.0 ** (_E4M3_MIN_EXP - 3), (1 + man / 8) * 2.0 ** (exp - 7.0))
    mag[(b & 0x7F) == E4M3_NAN] = np.nan
    return np.where(b & 0x80, -mag, mag)


def e4m3_encode(x: Any, xp: Any = np) -> Any:
    """x (float32 or float64, on `xp`) as e4m3 bytes (uint8): rounded to nearest even,
    saturated at +-448, NaN as 0x7F.

    A magnitude a with floor(log2 a) = e (held at -6 below the normal range) is q = rint(a *
    2**(3 - e)) steps of 2**(e - 3), and its byte is (e + 6) * 8 + q: for a normal value q is
    8..15 (the implicit one and the mantissa) over the biased exponent e + 7; a subnormal one
    has e = -6 and q = 0..7; and a q that rounds up to 16 carries into the next exponent by the
    same formula."""
    a = xp.minimum(xp.abs(x), E4M3_MAX)
    _, e = xp.frexp(a)  # a = m * 2**e, m in [0.5, 1): floor(log2 a) = e - 1 (frexp(0) gives e = 0)
    e = xp.where(a > 0, xp.maximum(e - 1, _E4M3_MIN_EXP), _E4M3_MIN_EXP)
    q = xp.rint(xp.ldexp(a, 3 - e))
    code = xp.where(xp.isnan(a), E4M3_NAN, (e - _E4M3_MIN_EXP) * 8 + q).astype(xp.uint8)
    return code | (xp.signbit(x).astype(xp.uint8) << 7)


class KVFormat:
    """How K and V are stored in and read from a pool of KV dtype `name`. `dtype` is the pool
    array's dtype (so `xp.zeros(shape, dtype=fmt)` makes a pool of this format) and `itemsize`
    its bytes per element."""

    def __init__(self, name: str) -> None:
        self.name = kv_dtype_name(name)
        self.dtype = storage_dtype(self.name)
        self.itemsize = self.dtype.itemsize
        self.fp8 = self.name == FP8_E4M3
        self._tables: dict[tuple[str, str], Any] = {}

    def store(self, x: Any, xp: Any = np) -> Any:
        """x (the compute dtype) as the pool holds it."""
        return e4m3_encode(x, xp) if self.fp8 else x.astype(self.dtype)

    def loader(self, xp: Any, cd: Any) -> Callable[[Any], Any]:
        """A function from pool elements (gathered on `xp`) to their values in `cd`."""
        if not self.fp8:
            return lambda a: a.astype(cd, copy=False)
        key = (xp.__name__, np.dtype(cd).name)
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = xp.asarray(e4m3_values().astype(cd))
        return table.take

    def round(self, x: Any, xp: Any, cd: Any) -> Any:
        """What storing x and reading it back in `cd` gives (the dense reference's K and V)."""
        return self.loader(xp, cd)(self.store(x, xp))

    def __repr__(self) -> str:
        return f"KVFormat({self.name})"
