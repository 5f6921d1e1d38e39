"""Which storage tier a node's `storage` setting names: the one place that knows every kind, so
the interface (`base.py`) that each kind implements imports none of them."""
from __future__ import annotations

from typing import Callable

from kvrt.ipc.storage_uri import FILE, parse_storage
from kvrt.workers.storage.base import FileStorage, Storage
from kvrt.workers.storage.mac import BlockMac


def open_storage(uri: str, rank: int, tp: int = 1, host: str = "127.0.0.1",
                 beat: Callable[[], None] | None = None, mac: BlockMac | None = None) -> Storage | None:
    """Rank `rank`'s view of the storage tier a node's `storage` setting names (ipc/storage_uri.py),
    or None when it is empty. `tp` splits a file tier's cap among the ranks; `host` is the
    address a shared store's peers reach this process at; `beat` is called while a shared
    store's call takes long (the caller's heartbeat); `mac` signs the objects written and checks
    those read (workers/storage/mac.py; None: no storage secret)."""
    if not uri:
        return None
    spec = parse_storage(uri)
    if spec.scheme == FILE:
        storage: Storage = FileStorage(spec.path, rank, spec.max_bytes // tp if spec.max_bytes else 0, mac)
    else:
        from kvrt.workers.storage.mooncake import MooncakeStorage  # the wheel is an optional dependency

        storage = MooncakeStorage(spec, rank, host, mac=mac)
    if beat is not None:
        storage.beat = beat
    return storage
