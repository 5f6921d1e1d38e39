"""The storage tier beyond host memory: the interface and the `file:DIR` tier (`base.py`),
its factory (`factory.py`), the shared Mooncake store, and block I/O between a pool and
a store (`io.py`)."""
