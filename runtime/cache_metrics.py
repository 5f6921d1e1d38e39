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

TIERS = ("device", "host", "storage")


@dataclass(slots=True)
class CacheMetrics:
    """Cumulative counters; the cache increments them, readers take `snapshot()`."""

    requests: int = 0
    hit_requests: int = 0            # requests with at least one prompt token served from a tier
    query_tokens: int = 0            # prompt tokens looked up (the device tier's denominator)
    query_tokens_host: int = 0       # prompt tokens left after device hits
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

    def hit_rate(self, tier: str | None = None) -> float:
        """Hit tokens / queried tokens of one tier, or of all tiers together (tier=None)."""
        if tier is None:
            return _ratio(self.hit_tokens, self.query_tokens)
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; expected one of {TIERS}")
        query = {"device": self.query_tokens, "host": self.query_tokens_host,
                 "storage": self.query_tokens_storage}[tier]
        return _ratio(getattr(self, f"hit_tokens_{tier}"), query)

    def snapshot(self) -> dict[str, float]:
        """All counters plus the derived rates, as a flat dict of numbers."""
        out: dict[str, float] = asdict(self)
        out["hit_tokens"] = self.hit_tokens
        out["request_hit_rate"] = _ratio(self.hit_requests, self.requests)
        out["hit_token_rate"] = self.hit_rate()
        for tier in TIERS:
            out[f"hit_token_rate_{tier}"] = self.hit_rate(tier)
        return out


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0
