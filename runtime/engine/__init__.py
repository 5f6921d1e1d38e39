"""The engine process: its loop (`engine.py`), the scheduler and its sequences, the intake of
requests, the client API server, the cache-transfer tasks and ownership hand-overs it
orders, and the Prometheus metrics it serves. One process per node; it alone changes block
state."""
