"""P->D block transports: the interface (`base.py`), its factory (`factory.py`), and one
file per kind (same-machine shared memory, Mooncake)."""
