"""Eviction policies, one per file behind the interface in `base.py`: each decides only
the order in which the cache's evictable nodes are handed out."""
