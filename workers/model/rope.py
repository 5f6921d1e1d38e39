"""RoPE as Hugging Face transformers reads it from a checkpoint's config.json.

Why its own module: config.json holds RoPE in two forms, and reading only one serves the
other wrong without an error (a Qwen3 checkpoint at theta 10,000 instead of 1,000,000 still
answers, just badly). transformers 4 wrote a top-level `rope_theta` and a `rope_scaling`
dict; transformers 5 writes one `rope_parameters` dict holding both. transformers 5 reads
either, and this module reads them the same way:
- a non-empty `rope_scaling` is taken in place of `rope_parameters`;
- `rope_theta` inside that dict wins over a top-level one, which wins over 10,000;
- the type is `rope_type`, else the legacy `type`, else default;
- for llama3 and yarn, a top-level `original_max_position_embeddings` wins over the dict's,
  which defaults to `max_position_embeddings`.
Types default, linear, llama3 and yarn are computed as transformers' RoPE functions compute
them (in float64). Two types change their frequencies with the length of the sequence, and
are served where transformers' own answers do not depend on how a sequence was cut into
forward calls:
- dynamic (NTK) keeps the plain frequencies up to max_position_embeddings and rescales them
  beyond it; kvrt never serves positions beyond it (`--max-model-len` is capped there), so it
  is the plain RoPE, exactly;
- longrope uses its short factors while the sequence fits its original context and switches
  every later token to the long factors once it does not, while the keys already cached stay
  rotated by the short ones: beyond that context a token's KV would depend on where a
  generation crossed it. So longrope is served up to its original context
  (`Rope.position_limit`), with its short factors and its attention factor.
Anything else (a per-layer-type dict, a partial rotation, another type) is refused with the
key and value named, since serving it as plain RoPE would give wrong answers without an error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
DEFAULT_THETA = 10000.0
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # transformers' defaults, also for a 0 or null value


class RopeError(ValueError):
    """config.json's RoPE cannot be served; the message names the key and its value."""


@dataclass(frozen=True)
class Rope:
    """One RoPE for every layer. `attention_factor` scales cos and sin (so q.k by its square),
    as transformers does for yarn; 1 for the other types."""

    rope_type: str
    theta: float
    factor: float = 1.0                          # linear, llama3, yarn
    original_max_position_embeddings: int = 0    # llama3, yarn
    low_freq_factor: float = 0.0                 # llama3
    high_freq_factor: float = 0.0
    beta_fast: float = YARN_BETA_FAST            # yarn
    beta_slow: float = YARN_BETA_SLOW
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()         # longrope: each frequency divided by its factor
    position_limit: int = 0                      # longrope: positions from here on are not served (0: none)

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [head_dim / 2] (float64)."""
        inv = 1.0 / self.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            return self._llama3(inv)
        if self.rope_type == "yarn":
            return self._yarn(inv, head_dim)
        if self.rope_type == "longrope":
            return inv / np.asarray(self.short_factor, dtype=np.float64)
        return inv  # default, and dynamic within max_position_embeddings

    def _llama3(self, inv: np.ndarray) -> np.ndarray:
        """Low frequencies slowed by `factor`, high ones kept, a smooth ramp between."""
        old = self.original_max_position_embeddings
        low_wavelen, high_wavelen = old / self.low_freq_factor, old / self.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
        smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)

    def _yarn(self, inv: np.ndarray, dim: int) -> np.ndarray:
        """Frequencies that turn fewer than `beta_slow` times over the original context are
        slowed by `factor`, those turning more than `beta_fast` times are kept, with a linear
        ramp over the dimensions between."""
        old = self.original_max_position_embeddings

        def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times over `old`
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
        keep = 1.0 - ramp
        return inv / self.factor * (1.0 - keep) + inv * keep


def _key(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _number(d: dict, key: str, where: str, positive: bool = True) -> float:
    """d[key] as a finite (positive) number; `where` names d in the error ("" for config.json's
    top level)."""
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        raise RopeError(f"{_key(where, key)} must be a {'positive ' if positive else ''}number, got {v!r}")
    return float(v)


def _int(d: dict, key: str, where: str) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise RopeError(f"{_key(where, key)} must be a positive integer, got {v!r}")
    return v


def _chosen(cfg: dict) -> tuple[str, dict]:
    """The dict transformers takes the RoPE parameters from, and its key. A copy: defaults are
    filled in by the caller."""
    scaling = cfg.get("rope_scaling")
    where, raw = ("rope_scaling", scaling) if scaling else ("rope_parameters", cfg.get("rope_parameters"))
    if raw is None:
        return where, {}
    if not isinstance(raw, dict):
        raise RopeError(f"{where} must be an object or null, got {raw!r}")
    layer_types = cfg.get("layer_types")
    declared = set(t for t in layer_types if isinstance(t, str)) if isinstance(layer_types, list) else set()
    for key, value in raw.items():
        # no flat parameter is an object: one that is, or is named for a layer type, is a layer
        # type's own RoPE (transformers would ignore one whose layer type the config does not list)
        if isinstance(value, dict) or key in declared:
            raise RopeError(f"{where}.{key}: RoPE parameters per layer type are not supported (one RoPE "
                            f"for every layer is); serving them as one would give wrong answers")
    return where, dict(raw)


def parse_rope(cfg: dict, name: str = "") -> Rope:
    """The RoPE config.json `cfg` describes, read as transformers reads it (module docstring).
    RopeError for a type or parameter this runtime cannot serve exactly; `name` names the dict
    the parameters came from in the message, when it is not config.json's own."""
    where, rp = _chosen(cfg)
    where = name or where
    theta = (_number(rp, "rope_theta", where) if "rope_theta" in rp
             else _number(cfg, "rope_theta", "") if "rope_theta" in cfg else DEFAULT_THETA)
    if theta <= 1:
        raise RopeError(f"rope_theta must exceed 1, got {theta!r}")
    kind_key = "type" if "type" in rp and "rope_type" not in rp else "rope_type"
    kind = rp.get(kind_key, "default")
    if kind not in ROPE_TYPES:
        raise RopeError(f"{where}.{kind_key} {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)}); "
                        f"serving it as another type would give wrong answers")
    for src, d in ((where, rp), ("", cfg)):
        partial = d.get("partial_rotary_factor")
        if partial is not None and partial != 1:
            raise RopeError(f"{_key(src, 'partial_rotary_factor')} {partial!r} is not supported (this runtime "
                            f"rotates the whole head)")
    if kind == "default":
        return Rope("default", theta)
    if kind == "linear":
        return Rope("linear", theta, factor=_number(rp, "factor", where))
    if kind == "dynamic":
        return Rope("dynamic", theta, factor=_number(rp, "factor", where))
    if "original_max_position_embeddings" in cfg:
        old = _int(cfg, "original_max_position_embeddings", "")
    elif "original_max_position_embeddings" in rp:
        old = _int(rp, "original_max_position_embeddings", where)
    else:
        old = _int(cfg, "max_position_embeddings", "")
    if kind == "llama3":
        rope = Rope("llama3", theta, factor=_number(rp, "factor", where), original_max_position_embeddings=old,
                    low_freq_factor=_number(rp, "low_freq_factor", where),
                    high_freq_factor=_number(rp, "high_freq_factor", where))
        if rope.high_freq_factor <= rope.low_freq_factor:
            raise RopeError(f"{where}.high_freq_factor {rope.high_freq_factor} must exceed "
                            f"{where}.low_freq_factor {rope.low_freq_factor}")
        return rope
    if kind == "longrope":
        return _longrope(rp, where, theta, old, cfg)
    return _yarn(rp, where, theta, old, cfg)


def _factors(rp: dict, key: str, where: str, n: int) -> tuple[float, ...]:
    v = rp.get(key)
    if not (isinstance(v, list) and len(v) == n and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0 for x in v)):
        raise RopeError(f"{_key(where, key)} must be a list of {n} positive numbers (one per frequency), got {v!r}")
    return tuple(float(x) for x in v)


def _longrope(rp: dict, where: str, theta: float, old: int, cfg: dict) -> Rope:
    """longrope within its original context (module docstring): the short factors, and cos and
    sin scaled by the attention factor, which unless given is sqrt(1 + ln(factor) / ln(original
    context)) for a factor above 1, the factor defaulting to max_position_embeddings over the
    original context (as transformers computes both)."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    short = _factors(rp, "short_factor", where, head_dim // 2)
    _factors(rp, "long_factor", where, head_dim // 2)
    factor = (_number(rp, "factor", where) if rp.get("factor") is not None
              else _int(cfg, "max_position_embeddings", "") / old)
    if rp.get("attention_factor") is not None:
        attention = _number(rp, "attention_factor", where)
    else:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old))
    return Rope("longrope", theta, factor=factor, original_max_position_embeddings=old,
                attention_factor=attention, short_factor=short, position_limit=old)


def _yarn(rp: dict, where: str, theta: float, old: int, cfg: dict) -> Rope:
    """yarn's parameters. A null `factor` is max_position_embeddings over the original
    context; a missing one is refused, as transformers refuses it. The attention factor, unless
    given, is 0.1 ln(factor) + 1, or with both `mscale` and `mscale_all_dim` set the ratio of
    0.1 m ln(factor) + 1 at each; a null or 0 beta takes its default, a null truncate is false."""
    if "factor" not in rp:
        raise RopeError(f"{where}.factor is missing (yarn needs it)")
    factor = _int(cfg, "max_position_embeddings", "") / old if rp["factor"] is None else _number(rp, "factor", where)
    for key in ("mscale", "mscale_all_dim"):
        if rp.get(key) is not None:
            _number(rp, key, where, positive=False)
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
    beta_fast = _number(rp, "beta_fast", where) if rp.get("beta_fast") else YARN_BETA_FAST
    beta_slow = _number(rp, "beta_slow", where) if rp.get("beta_slow") else YARN_BETA_SLOW

    def scale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if rp.get("attention_factor") is not None:
        attention = _number(rp, "attention_factor", where)
    elif mscale and mscale_all_dim:
        attention = scale(mscale) / scale(mscale_all_dim) if scale(mscale_all_dim) else math.inf
    else:
        attention = scale(1.0)
    if not (math.isfinite(attention) and attention > 0):
        raise RopeError(f"{where}: mscale {mscale!r} and mscale_all_dim {mscale_all_dim!r} give the attention "
                        f"factor {attention!r}, which must be a positive number")
    truncate = rp.get("truncate", True)
    if truncate is not None and not isinstance(truncate, bool):
        raise RopeError(f"{where}.truncate must be a boolean, got {truncate!r}")
    return Rope("yarn", theta, factor=factor, original_max_position_embeddings=old,
                beta_fast=beta_fast, beta_slow=beta_slow, truncate=bool(truncate),
                attention_factor=float(attention))
