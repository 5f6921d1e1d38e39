"""Counters of the prefix cache.

Why these and not a hit rate: every rate is kept as numerator and denominator (hit tokens and
queried tokens per tier), cumulative from start-up and never reset by a window, so any reader
(a status line, Prometheus, the replay benchmark) can form rates over any interval from two
snapshots. The reference system reset its counters every 10,000 requests and reported only the
latest window (41.2% reported vs 37.4% true on the conversation trace), and could not tell "no
reuse" from "shared prefix shorter than one block"; `partial_block_tokens` and
`backoff_tokens` tell those apart.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping

TIERS = ("device", "host", "storage")


@dataclass(frozen=True)
class Rate:
    """One hit rate: a numerator counter over a denominator counter, both cumulative since
    start-up. The one definition `kvrt status`, Prometheus, the cache benchmark and the replay
    client all use, so no two of them can disagree on what "hit rate" means."""

    key: str                 # its name in snapshots (`kvrt status --json`, CacheMetrics.snapshot)
    numerator: str           # counter names (ENGINE_STATS / CacheMetrics fields)
    denominator: str
    numerator_metric: str    # the same counters as Prometheus series
    denominator_metric: str
    what: str


_QUERY, _QUERY_METRIC = "query_tokens", "kvrt_prefix_query_tokens_total"  # prompt tokens looked up
# A tier's rate is its share of ALL prompt tokens looked up (not of what the tiers before it
# missed), so the tier rates add up to the total rate.
RATES: tuple[Rate, ...] = (
    Rate("hit_token_rate", "hit_tokens", _QUERY, "kvrt_prefix_hit_tokens_total (all tiers)", _QUERY_METRIC,
         "prompt tokens served from any cache tier"),
    *(Rate(f"hit_token_rate_{t}", f"hit_tokens_{t}", _QUERY, f'kvrt_prefix_hit_tokens_total{{tier="{t}"}}',
           _QUERY_METRIC, f"prompt tokens served from the {t} tier") for t in TIERS),
    Rate("request_hit_rate", "hit_requests", "requests", "kvrt_prefix_hit_requests_total", "kvrt_requests_total",
         "requests with at least one prompt token served from a cache tier"),
)
RATE = {r.key: r for r in RATES}


def ratio(num: float, den: float) -> float | None:
    """num / den, or None (JSON null, never NaN) when nothing was counted yet."""
    return num / den if den > 0 else None


def _counter(counters: Mapping[str, float], name: str) -> float:
    if name == "hit_tokens" and name not in counters:
        return sum(counters[f"hit_tokens_{t}"] for t in TIERS)
    return counters[name]


def rate(counters: Mapping[str, float], key: str) -> float | None:
    """The rate `key` of RATES from a mapping of counter names to values."""
    r = RATE[key]
    return ratio(_counter(counters, r.numerator), _counter(counters, r.denominator))


def rates(counters: Mapping[str, float]) -> dict[str, float | None]:
    """Every rate of RATES from a mapping of counter names to values."""
    return {r.key: rate(counters, r.key) for r in RATES}


def token_rate_key(tier: str | None = None) -> str:
    """The RATES key of the token hit rate of `tier` (None: all tiers)."""
    if tier is None:
        return "hit_token_rate"
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")
    return f"hit_token_rate_{tier}"


@dataclass(slots=True)
class CacheMetrics:
    """Cumulative counters; the cache increments them, readers take `snapshot()`."""

    requests: int = 0
    hit_requests: int = 0            # requests with at least one prompt token served from a tier
    query_tokens: int = 0            # prompt tokens looked up (every hit rate's denominator)
    query_tokens_host: int = 0       # prompt tokens left after device hits (looked up in host)
    query_tokens_storage: int = 0    # prompt tokens left after device and host hits
    hit_tokens_device: int = 0
    hit_tokens_host: int = 0
    hit_tokens_storage: int = 0
    # shared-prefix tokens no block could carry: the whole match reached a partial last block
    # while the tree holds a longer prefix past that point (an upper bound: the cached
    # continuation may differ inside the block; only token-granular matching could tell)
    partial_block_tokens: int = 0
    # tokens matched but given back because the whole prompt matched (last token recomputed)
    backoff_tokens: int = 0
    evicted_device_blocks: int = 0   # device blocks evicted (swapped out or dropped)
    evicted_host_blocks: int = 0     # host blocks dropped
    swap_out_blocks: int = 0
    swap_out_cancelled: int = 0      # SWAP2CPU nodes matched again before the swap finished
    swap_in_blocks: int = 0
    storage_read_blocks: int = 0
    storage_write_blocks: int = 0
    tasks_done: int = 0
    tasks_failed: int = 0

    @property
    def hit_tokens(self) -> int:
        return self.hit_tokens_device + self.hit_tokens_host + self.hit_tokens_storage

    def hit_rate(self, tier: str | None = None) -> float | None:
        """The token hit rate of one tier, or of all tiers together (tier=None), as RATES
        defines it; None before any lookup."""
        return rate(asdict(self), token_rate_key(tier))

    def snapshot(self) -> dict[str, float | None]:
        """All counters plus the rates of RATES, as a flat dict (a rate is None before its
        denominator counted anything)."""
        out: dict[str, float | None] = asdict(self)
        out["hit_tokens"] = self.hit_tokens
        out.update(rates(out))
        return out
