"""Files and directories only this user may touch: a shared secret read from a file, and a
directory that holds KV blocks.

Why both halves of a node need it: the launcher checks these at start, for a clear error
before any process runs, and the processes that use them (the P/D peer link, the storage
tier's MACs, the file tier) read or check them again themselves. A secret file another user
can read is no secret; a directory another user can write into is a place to plant blocks.
"""
from __future__ import annotations

import os
import stat

MIN_SECRET_BYTES = 16


def read_secret_file(path: str, flag: str, hint: str) -> bytes:
    """The secret in `path` (surrounding whitespace stripped); ValueError naming `flag` when it
    cannot be read, is readable or writable by group or others, or is shorter than
    MIN_SECRET_BYTES (a short secret can be guessed offline from one MAC). `hint` says how to
    make one."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            secret = f.read().strip()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{flag} {path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                         f"chmod 600 it")
    check_secret_length(secret, f"{flag} {path}", hint)
    return secret


def check_secret_length(secret: bytes, where: str, hint: str) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the secret in {where} is {len(secret)} bytes; use at least {MIN_SECRET_BYTES} "
                         f"random bytes: {hint}")


def check_private_dir(path: str, what: str) -> None:
    """ValueError when the existing directory `path` belongs to another user or lets group or
    others in (read, write or search): its blocks could be read, or planted, by them."""
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise ValueError(f"{what} {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                         f"its owner could read and plant KV blocks there; use a directory of your own")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ValueError(f"{what} {path} has mode {mode:o}: other users may read or write its KV blocks; "
                         f"chmod 700 it")
