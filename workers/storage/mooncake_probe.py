"""Does a Mooncake master answer a store client's set-up? Asked from a throwaway process.

Why a process: the client's `setup` holds the Python interpreter for as long as it runs: about
30 s against a frozen master and for ever against one that died half-way through it, with the
client's defaults, and still seconds within kvrt's bounds on them (workers/storage/mooncake.py
`CLIENT_LIMITS`). In a rank's own process that stops the heartbeat (the node may take the rank
for hung) and every transfer with it.
So before a rank sets its own client up, a process of its own does the same handshake, lending
no memory, and has one existence check answered; it is killed when it does not answer in time,
and the rank sets up only after it answered. What is left is a master lost in the moment
between the two, which those bounds keep to seconds.

`python -m kvrt.workers.storage.mooncake_probe MASTER HOST`: prints `ok` and exits 0 once
the master answered, or prints why not and exits 1.
"""
from __future__ import annotations

import os
import subprocess
import sys

PROBE = "kvrt-probe"  # an object name no rank ever writes (ranks write kvrt-<hex>-r<rank>)


def probe_master(master: str, host: str, limit: float) -> str | None:
    """None when a throwaway client set up with `master` from `host` and had an existence
    check answered within `limit` seconds; else why not. Blocks the calling thread (without
    the interpreter lock) for at most `limit` seconds."""
    cmd = [sys.executable, "-m", "kvrt.workers.storage.mooncake_probe", master, host]
    try:
        out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:  # (run() kills it)
        return f"a probe client's set-up with master {master} did not finish within {limit:g}s"
    if out.returncode == 0:
        return None
    said = (out.stdout.strip().splitlines() or [""])[-1] or f"exit {out.returncode}"
    return f"a probe client of master {master}: {said}"


def main(argv: list[str]) -> int:
    from kvrt.ipc.lifetime import die_with_parent

    die_with_parent()  # (set after exec: the waiting thread outlives this process by design)
    master, host = argv
    from kvrt.workers.storage.base import StorageError
    from kvrt.workers.storage.mooncake import RPC_ERRORS, open_client

    try:
        client = open_client(master, host, 0)
        found = [int(r) for r in client.batch_is_exist([PROBE])]
        said = f"its existence check returned {found}" if any(r in RPC_ERRORS for r in found) else "ok"
    except (StorageError, RuntimeError) as e:
        said = str(e)
    print(said, flush=True)
    return 0 if said == "ok" else 1


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))  # no goodbye to the master: it lent nothing, and a goodbye takes a second
