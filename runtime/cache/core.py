"""The prefix cache's per-block inner loops (runtime/cache/_cache_core.c), loaded in one place.

Why: each loop has one implementation, in C; the modules that call them import them from here,
so a checkout whose extension was never built (or was built from older source) fails at once
with what to do, rather than somewhere inside the cache. The Python code each loop is tested
against lives in tests/runtime/cache/cache_reference.py.
"""
from __future__ import annotations

try:
    from kvrt.runtime.cache._cache_core import (adapt_discard, adapt_forget, adapt_front, adapt_missed, adapt_pop,
                                                adapt_push, adapt_recall,
                                                chain_keys, chain_tops, deref, drop_chains, drop_host_nodes, drop_host_run,
                                                drop_run, finish_swap_out, free_host_nodes, gaps_rank, ghost_ages, give_uses, mark_chains, mark_swap_out,
                                                policy_discard, policy_release, pop_live, record_chain, sketch_add,
                                                sketch_count, sketch_raise, stamp_runs, swap_chains,
                                                touch_device, walk)
except ImportError as e:
    if e.name != f"{__package__}._cache_core":  # it loaded and said what is wrong (xxhash) itself
        raise
    raise ImportError(f"runtime.cache._cache_core, the prefix cache's C loops, is not built or was built from "
                      f"older source ({e}): build it with `pip install -e .` in the checkout") from e

__all__ = ["adapt_discard", "adapt_forget", "adapt_front", "adapt_missed", "adapt_pop", "adapt_push", "adapt_recall", "chain_keys", "chain_tops", "deref", "drop_chains", "drop_host_nodes", "drop_host_run", "drop_run", "finish_swap_out",
           "free_host_nodes", "gaps_rank", "ghost_ages", "give_uses", "mark_chains", "mark_swap_out", "policy_discard", "policy_release", "pop_live", "record_chain",
           "sketch_add", "sketch_count", "sketch_raise", "stamp_runs", "swap_chains", "touch_device", "walk"]
