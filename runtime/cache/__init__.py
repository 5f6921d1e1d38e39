"""The prefix cache: which blocks hold which tokens, on which tier. `prefix_cache.py` is the
facade the scheduler talks to; the node matrix, matching, eviction, transfer tasks, block
keys, pools, the invariant checker, its counters, KV events and the C loops are its parts."""
