"""A node's private sockets: ZeroMQ ipc:// endpoints in a directory only this user may enter.

Why: libzmq 4.3 aborts the whole process when a peer that speaks raw ZeroMQ fills a connection's
queue, sends a PING command and resets the connection (the buffered PING is answered on the failed
connection: `!_io_error`, stream_engine_base.cpp), and no socket option prevents it short of
queues without a bound. So every socket that outsiders reach belongs to the gateway process
(runtime/gateway/), which may die of it and is restarted, and the engine and the launcher's HTTP
thread listen and connect only here: a directory of mode 0700, so no other user's process can
connect (a peer of ours never sends PINGs: heartbeats are off everywhere in kvrt).

The directory is named after the node (node names are unique among live nodes: the registry's
lock), so every process of the node finds it from the name alone; the launcher makes it before
any child starts and removes it with the node's shared memory, and reclaiming a dead node
(`kvrt clean`) removes it too.
"""
from __future__ import annotations

import os
import shutil
import stat
import tempfile

from kvrt.ipc.errors import IpcError

SUN_PATH_MAX = 107  # bytes of a Unix socket's path (sockaddr_un.sun_path, less its NUL)
API = "api"        # the engine's client API for the node's own processes (the HTTP bridge)
LINK = "link"      # the engine's end of its link with the gateway
EVENTS = "events"  # the engine's KV events publisher (the gateway forwards it)
REPLAY = "replay"  # the engine's KV events replay socket (the gateway relays to it)


def socket_dir(node: str) -> str:
    """The node's private socket directory (it may not exist)."""
    return os.path.join(tempfile.gettempdir(), f"kvrt.{os.geteuid()}.{node}")


def address(node: str, name: str) -> str:
    """The ipc:// address of the node's private socket `name` (API, LINK, EVENTS or REPLAY);
    ValueError when the path is too long for a Unix socket (a long TMPDIR)."""
    path = os.path.join(socket_dir(node), name)
    if len(path.encode()) > SUN_PATH_MAX:
        raise ValueError(f"the node's private socket path {path} is longer than a Unix socket allows "
                         f"({SUN_PATH_MAX} bytes): set TMPDIR to a shorter directory")
    return f"ipc://{path}"


def make_socket_dir(node: str) -> str:
    """Create the node's socket directory, mode 0700, replacing a dead node's of the same name
    (the caller owns the node's registry, so no live node uses it). IpcError when the path is
    taken by something that is not a directory of this user (never a place someone else made),
    or too long for a Unix socket."""
    path = socket_dir(node)
    try:
        address(node, REPLAY)  # (the longest name)
    except ValueError as e:
        raise IpcError(str(e)) from None
    remove_socket_dir(node)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        raise IpcError(f"{path} exists and is not a directory of this user (uid {os.geteuid()}): node {node} "
                         f"cannot put its private sockets there; remove it or use another node name") from None
    os.chmod(path, 0o700)  # (mkdir's mode is masked by the umask: never wider than 0700 anyway)
    return path


def remove_socket_dir(node: str) -> bool:
    """Remove the node's socket directory and its sockets; False when there is none of this
    user's (a path another user made is left alone)."""
    path = socket_dir(node)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True
