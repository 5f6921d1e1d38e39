"""`mooncake://HOST:PORT`: the storage tier as a Mooncake Store pool shared by every node that
points at the same master.

Why Mooncake and not a home-made store: its master places objects in memory that clients
(and `kvrt store start`) lend it, evicts under pressure, and moves bytes with the Transfer
Engine (TCP here, RDMA where the NICs exist), so node B reads what node A wrote a moment ago.
Each cache-transfer rank opens one client (`P2PHANDSHAKE` metadata: no etcd, no HTTP metadata
server) and names its objects `kvrt-<block key hex>-r<rank>`; block keys are rooted in the
model identity (runtime/cache/keys.py), so nodes with other models never share an object.

Zero copy: `register` registers a host-memory pool with the client, and reads land in (writes
leave from) the pool's own blocks through `batch_get_into` / `batch_put_from` (a GPU pool's
blocks come through workers/storage/io.py's staging area, registered the same way). A buffer
outside every registered region goes through a registered staging area of this backend
instead, one copy more.

The store is a cache, so nothing it does fails a request: an error return, an exception, a full
pool, a dead or a frozen master is a miss (counted in `errors`). A call to a master that does
not answer blocks inside the client until its RPC timeout (`CLIENT_LIMITS`), so after a failure
that says the master cannot be reached the client is left alone: every call is an immediate miss
until `retry_s` passed *and* the master's port accepts a connection again; each time the master
fails again right after, the pause doubles (up to `MAX_RETRY_S`), since a frozen master's port
still accepts. A dead or frozen master costs the node its hits and one slow call per pause.
Store calls run on a helper thread while the caller keeps beating its heartbeat (the node's hang
detector must not take a slow store for a hung process). An existence check, which touches no
block, is also given up on after `ASK_LIMIT_S` should the client not time out itself. A read or
write is waited for to its end, because a read given
up on could land in blocks the engine has since given to someone else; one that outlives the
client's own timeouts by far (`CALL_LIMIT_S`) means a hung client: StoreHung, and the rank
exits rather than risk that.

The client's set-up holds the interpreter while it runs (no heartbeat, nothing else), for
seconds against a frozen master or one that dies during it (for ever without `CLIENT_LIMITS`);
so a rank sets its client up only after a throwaway process did the same handshake in time
(workers/storage/mooncake_probe.py).

Signed objects (a storage secret, workers/storage/mac.py): an object is the block's bytes
followed by their MAC. Writes stay zero copy (one put from two buffers: the block, and its MAC
in a registered array of this backend). Reads land in a registered area of this backend
(block + MAC per row), each object is checked there, and only checked blocks are copied into
the pool: a forged object never touches it. One that fails is a miss, counted in `forged`,
and removed from the store (else the existence check before each write would keep the real
block from ever being written again under its name).
"""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from kvrt.ipc.lifetime import die_with_parent
from kvrt.ipc.ports import WILDCARDS, free_port, listening_wider_than
from kvrt.ipc.storage_uri import StorageSpec

from kvrt.workers.storage.base import Storage, StorageError, StoreHung
from kvrt.workers.storage.mac import MAC_BYTES, BlockMac
from kvrt.workers.storage.mooncake_probe import probe_master

log = logging.getLogger(__name__)

INSTALL_HINT = ('install it with `pip install -e ".[pd]"` (the mooncake-transfer-engine wheel) and '
                "`apt-get install libibverbs1 librdmacm1 libnuma1` (needed even for TCP)")
RPC_ERRORS = range(-999, -899)  # ErrorCode's RPC range (-900 failed, -901 timed out): the master did not answer
RETRY_S = 2.0          # how long a client that lost its master is left alone, at first
MAX_RETRY_S = 30.0     # ... and at most, after failing again each time it was asked
ASK_LIMIT_S = 5.0      # an existence check unanswered this long: the master is frozen
# The client's own bounds, as environment defaults it reads: a call to the master times out in
# 3 s (its default, 30 s, stalled a rank's transfers that long per call to a frozen master), and
# a set-up tries once (by default it retries for ever while the master that died during it is
# away, holding the interpreter all along).
CLIENT_LIMITS = {"MC_RPC_TIMEOUT_MS": "3000", "MC_STORE_CLIENT_SETUP_RETRIES": "1"}
# a probe process's start, set-up and check within this: a backstop, since under CLIENT_LIMITS the
# probe gives up on a frozen or lost master itself in seconds; generous, so that a start slowed by a
# loaded machine is not taken for a master that does not answer (writes meanwhile are not shared)
PROBE_LIMIT_S = 15.0
STAGING_BLOCKS = 64    # blocks of the staging area for buffers outside registered pools
CALL_LIMIT_S = 60.0    # a store call this long is a hung client (its RPCs time out in ~5 s)
SETUP_LIMIT_S = 15.0   # a client that takes longer to set up is given up (it touches no block)
_BEAT_S = 0.2          # how often a caller waiting for a store call beats


def load_store_module() -> Any:
    """`mooncake.store`, or StorageError with what to install."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("GLOG_minloglevel", "2")  # its INFO/WARNING lines flood the node's logs
    for name, value in CLIENT_LIMITS.items():  # (an operator's own setting wins)
        os.environ.setdefault(name, value)
    try:
        import mooncake.store as store
    except ImportError as e:
        raise StorageError(f"--storage mooncake:// needs the Mooncake Store client, which does not import "
                           f"here ({e}); {INSTALL_HINT}") from None
    return store


def unavailable_reason() -> str | None:
    """Why a Mooncake store client cannot run here, or None if it can."""
    try:
        load_store_module()
    except StorageError as e:
        return str(e)
    return None


def open_client(master: str, host: str, segment_bytes: int) -> Any:
    """A set-up store client of the master at `master` that lends `segment_bytes` of its own
    memory to the pool; StorageError when the master does not take it. The client's transfer
    engine is asked to listen on `host` only (MC_TCP_BIND_ADDRESS); the 0.3 wheels listen on
    every interface regardless, which `wide_open_warning` reports."""
    if host not in WILDCARDS:
        os.environ["MC_TCP_BIND_ADDRESS"] = host  # honoured by builds that support it
    store = load_store_module().MooncakeDistributedStore()
    rc = store.setup({"local_hostname": host, "metadata_server": "P2PHANDSHAKE",
                      "global_segment_size": int(segment_bytes), "local_buffer_size": 0,
                      "protocol": "tcp", "master_server_addr": master})
    if rc != 0:
        raise StorageError(f"mooncake store: setup with master {master} from {host} returned {rc}")
    return store


def wide_open_warning(host: str, who: str) -> str:
    """What this process's store client listens on beyond `host` (empty: nothing), as a warning:
    whoever reaches those ports can read and write the memory the client lends the pool."""
    wide = listening_wider_than(host)
    if not wide:
        return ""
    return (f"{who}: this Mooncake build listens on {', '.join(wide)} although it was given {host} (it has no "
            f"working option to bind one interface); whoever reaches those ports can read and write the "
            f"store's memory in this process: firewall them to the nodes' addresses")


class MooncakeStorage(Storage):
    """One rank's client of a Mooncake Store pool (see the module docstring)."""

    def __init__(self, spec: StorageSpec, rank: int, host: str = "127.0.0.1", retry_s: float = RETRY_S,
                 mac: BlockMac | None = None):
        load_store_module()  # a missing wheel is a start-up error, not a stream of misses
        self.spec = spec
        self.mac = mac
        self.where = f"mooncake://{spec.master}"
        self.forged = 0
        self.rank = rank
        self.host = socket.gethostbyname(socket.gethostname()) if host in ("", "0.0.0.0", "::") else host
        self.retry_s = retry_s
        self._pause = retry_s  # how long the next failure leaves the client alone
        self.errors = 0
        self._client: Any = None
        self._down_until = 0.0
        self._down = False
        self._pools: list[np.ndarray] = []           # registered with the client
        self._regions: list[tuple[int, int]] = []    # their [start, end) addresses
        self._areas: dict[str, np.ndarray] = {}  # registered [rows, bytes] areas of this backend, by use
        self._connect()

    # ---- the client and its health
    def _connect(self) -> Any:
        """The client when the store looks usable: made on first use, and after a failure only
        once `retry_s` passed and the master's port answers again; else None (a miss)."""
        if self._down:
            if time.monotonic() < self._down_until:
                return None
            if not self._master_listens():
                self._down_until = time.monotonic() + self.retry_s
                return None
            self._down = False
            log.info("mooncake store %s answers again", self.spec.master)
        if self._client is not None:
            return self._client
        if not self._master_listens():  # (setting up with no master retries forever)
            self._failed("nothing listens there")
            return None
        try:
            why = self._wait("probe", lambda: probe_master(self.spec.master, self.host, PROBE_LIMIT_S),
                             PROBE_LIMIT_S + 5)
            if why:
                self._failed(why)
                return None
            client = self._wait("setup", lambda: open_client(self.spec.master, self.host, self.spec.segment_bytes),
                                SETUP_LIMIT_S)
            for arr in self._pools:
                self._register(client, arr)
        except (StorageError, StoreHung, RuntimeError) as e:  # no block involved: just down
            self._failed(f"{e}")
            return None
        log.info("mooncake store %s: rank %d connected from %s (lends %d bytes)", self.spec.master, self.rank,
                 self.host, self.spec.segment_bytes)
        wide = wide_open_warning(self.host, f"mooncake store client of rank {self.rank}")
        if wide:
            log.warning("%s", wide)
        self._client = client
        return client

    def _failed(self, what: str) -> None:
        """The master is unreachable: misses, without asking, until it listens again (asked
        after a pause that doubles while it keeps failing)."""
        if not self._down:
            log.warning("mooncake store %s unreachable (%s): storage misses until it answers again",
                        self.spec.master, what)
        self._down = True
        self._down_until = time.monotonic() + self._pause
        self._pause = min(2 * self._pause, max(self.retry_s, MAX_RETRY_S))

    def _master_listens(self) -> bool:
        try:
            socket.create_connection((self.spec.host, self.spec.port), timeout=0.2).close()
            return True
        except OSError:
            return False

    def _wait(self, what: str, fn: Callable[[], Any], limit: float = CALL_LIMIT_S, hung: bool = True) -> Any:
        """fn() on a helper thread, beating until it returns (see the module docstring); after
        `limit` seconds StoreHung, or TimeoutError for a call that may be given up on (`hung`
        false). The thread is a daemon: a hung call cannot hold the exit up."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["out"] = fn()
            except BaseException as e:  # handed to the caller below
                box["err"] = e
            finally:
                done.set()

        threading.Thread(target=run, name=f"mooncake-{what}-r{self.rank}", daemon=True).start()
        deadline = time.monotonic() + limit
        while not done.wait(_BEAT_S):
            self.beat()
            if time.monotonic() > deadline:
                if not hung:
                    raise TimeoutError(f"no answer within {limit:g}s")
                raise StoreHung(f"mooncake store {self.spec.master}: {what} did not return within {limit:g}s")
        if "err" in box:
            raise box["err"]
        return box["out"]

    def _call(self, what: str, fn: str, *args: Any) -> list[int] | None:
        """`client.fn(*args)` (a batch call), or None after counting the failure; a result
        that says the master did not answer, or an existence check it does not answer within
        `ASK_LIMIT_S`, marks the store down."""
        client = self._connect()
        if client is None:
            return None
        ask = fn == "batch_is_exist"  # (touches no block: may be given up on)
        try:
            out = [int(r) for r in self._wait(what, lambda: getattr(client, fn)(*args),
                                              ASK_LIMIT_S if ask else CALL_LIMIT_S, hung=not ask)]
        except StoreHung:
            raise
        except Exception as e:  # the store is a cache: whatever it raises is a miss
            self._failed(f"{what}: {type(e).__name__}: {e}")
            return None
        rpc = sorted({r for r in out if r in RPC_ERRORS})
        if rpc:
            self._failed(f"{what} returned {rpc} (the master did not answer)")
            return None
        self._pause = self.retry_s
        return out

    # ---- buffers
    @staticmethod
    def _register(client: Any, arr: np.ndarray) -> None:
        rc = client.register_buffer(int(arr.ctypes.data), int(arr.nbytes))
        if rc != 0:
            raise StorageError(f"mooncake store: registering {arr.nbytes} bytes returned {rc}")

    def register(self, array: np.ndarray) -> None:
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            return  # device memory: its blocks come through the staging area
        start = int(array.ctypes.data)
        self._pools.append(array)
        self._regions.append((start, start + int(array.nbytes)))
        if self._client is not None:
            self._register(self._client, array)

    def _direct(self, buf: np.ndarray) -> bool:
        start = int(buf.ctypes.data)
        end = start + buf.nbytes
        return buf.flags.c_contiguous and any(a <= start and end <= b for a, b in self._regions)

    def _area(self, use: str, n: int, nbytes: int) -> np.ndarray:
        """A registered [n, nbytes] area for `use` (grown on demand, registered like a pool):
        "stage" for buffers outside every pool, "macs" for the MACs of a signed put, "sealed"
        for the objects of a signed read."""
        a = self._areas.get(use)
        if a is None or a.shape[0] < n or a.shape[1] != nbytes:
            a = self._areas[use] = np.empty((max(n, STAGING_BLOCKS), nbytes), np.uint8)
            self.register(a)
        return a

    # ---- the Storage interface
    def name(self, key: bytes) -> str:
        return f"kvrt-{key.hex()}-r{self.rank}"

    def keys(self) -> Iterator[bytes]:
        return iter(())  # a shared pool is asked (exists_many), never listed

    def exists_many(self, keys: Sequence[bytes]) -> int:
        """How many leading keys have an object (one batched existence check)."""
        if not keys:
            return 0
        found = self._call("batch_is_exist", "batch_is_exist", [self.name(k) for k in keys])
        if found is None:
            self.errors += 1
            return 0
        n = 0
        for r in found:
            if r != 1:
                self.errors += r < 0
                break
            n += 1
        return n

    def contains(self, key: bytes) -> bool:
        return self.exists_many([key]) == 1

    def get(self, key: bytes, out: np.ndarray) -> bool:
        return self.get_many([key], [out]) == 1

    def put(self, key: bytes, data: np.ndarray) -> None:
        self.put_many([key], [data])

    def get_many(self, keys: Sequence[bytes], outs: Sequence[np.ndarray], deadline: float = 0.0) -> int:
        n = self.exists_many(keys)
        if not n or (deadline and time.monotonic() >= deadline):  # (the check may have been slow)
            return 0
        outs = [_flat(o) for o in outs[:n]]
        if self.mac is not None:
            return self._get_signed(keys[:n], outs, deadline)
        staged = not all(self._direct(o) for o in outs)
        bufs = list(self._area("stage", n, outs[0].nbytes)[:n]) if staged else outs
        got = self._call("batch_get_into", "batch_get_into", [self.name(k) for k in keys[:n]],
                         [int(b.ctypes.data) for b in bufs], [b.nbytes for b in bufs])
        if got is None:
            self.errors += 1
            return 0
        done = 0
        for r, b in zip(got, bufs):
            if r != b.nbytes:  # gone since the check (evicted), or a short object: the prefix ends
                self.errors += r < 0 and r != -704  # (-704: OBJECT_NOT_FOUND, an eviction race)
                break
            done += 1
        if staged:
            for o, b in zip(outs[:done], bufs):
                o[:] = b
        return done

    def _get_signed(self, keys: Sequence[bytes], outs: list[np.ndarray], deadline: float) -> int:
        """Read objects of block + MAC into the staging area, check them in order, and copy the
        leading valid ones into `outs` unless `deadline` passed meanwhile; a missing or wrong
        MAC ends the prefix (see the module docstring)."""
        n, nbytes = len(keys), outs[0].nbytes
        rows = self._area("sealed", n, nbytes + MAC_BYTES)[:n]
        names = [self.name(k) for k in keys]
        got = self._call("batch_get_into", "batch_get_into", names, [int(r.ctypes.data) for r in rows],
                         [r.nbytes for r in rows])
        if got is None:
            self.errors += 1
            return 0
        if deadline and time.monotonic() >= deadline:  # the blocks in `outs` may be someone else's now
            return 0
        done = 0
        for name, r, row, out in zip(names, got, rows, outs):
            if r == nbytes + MAC_BYTES and self.mac.valid(name.encode(), row[:nbytes], row[nbytes:]):
                out[:] = row[:nbytes]
                done += 1
                continue
            if r == nbytes + MAC_BYTES or r == nbytes:
                self._reject(name, "has a wrong MAC" if r != nbytes else "has no MAC")
                self._remove(name)
            else:  # gone since the check (evicted), or a foreign size: as an unsigned read's
                self.errors += r < 0 and r != -704
            break
        return done

    def _remove(self, name: str) -> None:
        """Take a forged object out of the store (best effort: its name is then free for the
        real block). Forced: the read just made holds a lease on it for seconds, and whoever
        else reads it before it goes checks its MAC too."""
        out = self._call("batch_remove", "batch_remove", [name], True)
        if out is None or out[0] != 0:
            log.info("mooncake store %s: removing forged object %s returned %s", self.spec.master, name, out)

    def put_many(self, keys: Sequence[bytes], datas: Sequence[np.ndarray]) -> int:
        """Store the blocks (an object that exists already is left as it is); returns the
        bytes stored. A failed put is counted, never raised: the block is just not shared."""
        if not keys:
            return 0
        found = self._call("batch_is_exist", "batch_is_exist", [self.name(k) for k in keys])
        if found is None:  # (also spares a put its seconds-long wait for a dead master)
            self.errors += 1
            return 0
        todo = [i for i, r in enumerate(found) if r != 1]
        if not todo:
            return 0
        keys = [keys[i] for i in todo]
        datas = [_flat(datas[i]) for i in todo]
        bufs = datas
        if not all(self._direct(d) for d in datas):
            bufs = list(self._area("stage", len(datas), datas[0].nbytes)[:len(datas)])
            for b, d in zip(bufs, datas):
                b[:] = d
        names = [self.name(k) for k in keys]
        if self.mac is not None:  # block + MAC, from the block where it is and a MAC row of ours
            macs = self._area("macs", len(bufs), MAC_BYTES)
            for m, name, b in zip(macs, names, bufs):
                m[:] = np.frombuffer(self.mac.of(name.encode(), b), np.uint8)
            put = self._call("batch_put_from_multi_buffers", "batch_put_from_multi_buffers", names,
                             [[int(b.ctypes.data), int(m.ctypes.data)] for b, m in zip(bufs, macs)],
                             [[b.nbytes, MAC_BYTES] for b in bufs])
        else:
            put = self._call("batch_put_from", "batch_put_from", names,
                             [int(b.ctypes.data) for b in bufs], [b.nbytes for b in bufs])
        if put is None:
            self.errors += 1
            return 0
        failed = sum(r != 0 for r in put)
        if failed:
            self.errors += 1
            log.warning("mooncake store %s: %d of %d puts failed (codes %s): those blocks are not shared",
                        self.spec.master, failed, len(put), sorted({r for r in put if r != 0}))
        return sum(b.nbytes for r, b in zip(put, bufs) if r == 0)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            client.close()
        except Exception as e:  # closing a client of a dead master: nothing left to do
            log.warning("mooncake store %s: close failed: %s", self.spec.master, e)


def _flat(a: np.ndarray) -> np.ndarray:
    """`a`'s bytes as a flat uint8 view (no copy)."""
    if not a.flags.c_contiguous:
        raise ValueError("storage reads and writes need a contiguous buffer")
    return a.reshape(-1).view(np.uint8)


# ---- `kvrt store start`: a master and the memory it hands out --------------------------------
MASTER_READY_S = 15.0
MASTER_STOP_S = 5.0  # a master exits within about a second of SIGTERM; one that does not is killed


def master_binary() -> str:
    """The `mooncake_master` of the installed wheel (next to its modules), else the one on PATH."""
    import shutil

    import mooncake

    inside = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    found = inside if os.access(inside, os.X_OK) else shutil.which("mooncake_master")
    if not found:
        raise StorageError(f"no mooncake_master binary in {os.path.dirname(inside)} or on PATH; {INSTALL_HINT}")
    return found


def master_command(host: str, port: int, metrics_port: int) -> list[str]:
    """The master on `host`:`port` (RPC), its HTTP metrics/admin server on `metrics_port` of the
    same interface (it cannot be turned off; a fixed default port would collide), no HTTP
    metadata server (clients use P2P handshakes)."""
    return [master_binary(), f"--rpc_address={host}", f"--rpc_port={port}", f"--metrics_host={host}",
            f"--metrics_port={metrics_port}", "--enable_http_metadata_server=false",
            "--enable_metric_reporting=false", "--logtostderr"]


def _wait_listening(host: str, port: int, proc: subprocess.Popen, timeout: float) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise StorageError(f"mooncake_master exited with {proc.returncode} before it listened on {host}:{port}")
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise StorageError(f"mooncake_master did not listen on {host}:{port} within {timeout:g}s") from None
            time.sleep(0.05)  # polling another process's port at start-up, not a hot path


def store_main(argv: list[str]) -> int:
    """`kvrt store start`: a Mooncake master plus a client that lends it `--memory`, in the
    foreground until SIGINT/SIGTERM (then both stop and the pool's objects are gone).

    The stop ends the master, then this process without its client's goodbye (`_exit_at_once`):
    the goodbye only tells the master the lent memory is leaving, which matters to a master
    that goes on, and this one does not; to a master that is slow or already gone the goodbye
    retried for 11 s and more, so a stopped store could outlive any wait for it."""
    import argparse
    import signal
    import threading

    p = argparse.ArgumentParser(prog="kvrt store", description="a Mooncake Store for --storage mooncake://")
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    s = sub.add_parser("start", help="start a master and lend it memory, in the foreground (Ctrl-C stops)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address the master's RPC and admin server listen on (default 127.0.0.1); the lent "
                   "memory's transfer ports are on every interface with Mooncake 0.3 wheels (printed at start)")
    s.add_argument("--port", type=int, default=50051, help="master RPC port: nodes use mooncake://HOST:PORT (default 50051)")
    s.add_argument("--memory", default="1G", help="memory this process lends the pool, e.g. 512M, 4G (default 1G)")
    s.add_argument("--metrics-port", type=int, default=0, help="the master's HTTP metrics port (default: a free one)")
    args = p.parse_args(argv)
    from kvrt.ipc.storage_uri import parse_bytes

    try:
        memory = parse_bytes(args.memory)
        cmd = master_command(args.host, args.port, args.metrics_port or free_port(args.host))
    except (ValueError, StorageError) as e:
        print(f"kvrt store: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    master = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)  # ends with us, even SIGKILLed
    client, code = None, 1
    try:
        _wait_listening(args.host, args.port, master, MASTER_READY_S)
        client = open_client(f"{args.host}:{args.port}", args.host, memory)
        wide = wide_open_warning(args.host, f"kvrt store (pid {os.getpid()})")
        if wide:
            print(f"kvrt store: warning: {wide}", file=sys.stderr, flush=True)
        print(f"kvrt store: mooncake master on {args.host}:{args.port} (pid {master.pid}), {memory} bytes lent; "
              f"nodes: --storage mooncake://{args.host}:{args.port}; Ctrl-C stops", flush=True)
        while not stop.wait(0.5):
            if master.poll() is not None:
                print(f"kvrt store: mooncake_master exited with {master.returncode}", file=sys.stderr)
                break
        else:
            code = 0
    except StorageError as e:
        print(f"kvrt store: {e}", file=sys.stderr)
    finally:
        if master.poll() is None:
            master.terminate()
            try:
                master.wait(MASTER_STOP_S)
            except subprocess.TimeoutExpired:
                print(f"kvrt store: mooncake_master (pid {master.pid}) did not exit within {MASTER_STOP_S:g} s "
                      "of SIGTERM: killed", file=sys.stderr)
                master.kill()
                try:
                    master.wait(MASTER_STOP_S)
                except subprocess.TimeoutExpired:  # (in the kernel's hands: this process ends anyway)
                    print(f"kvrt store: mooncake_master (pid {master.pid}) still there {MASTER_STOP_S:g} s after "
                          "SIGKILL", file=sys.stderr)
    if client is not None:
        _exit_at_once(code)
    return code


def _exit_at_once(code: int) -> None:
    """End this process now, with `code`, without running the store client's teardown (its
    goodbye to a master that is gone: see store_main). Nothing of it outlives the process: its
    lent memory is this process's own, its listeners close with it, it made nothing in /dev/shm."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
