"""The `--storage` setting, parsed once for both halves of a node: the engine needs to know
whether the tier is node-local (it lists its keys at start-up) or shared (it must be asked),
and the cache-transfer ranks open the backend it names.

Forms:
- `file:DIR[?max_bytes=N]`: one file per block under DIR, node-local; `max_bytes` caps the
  bytes its objects take (oldest-used evicted first); N may end in K, M, G or T (powers of 1024).
- `mooncake://HOST:PORT[?segment_bytes=N]`: a Mooncake Store whose master listens on HOST:PORT;
  every node pointed at one master shares its pool. `segment_bytes` is memory each
  cache-transfer rank lends the pool (default 0: the pool is the memory of `kvrt store start`
  and other contributors, so a node that stops takes no blocks with it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl

FILE, MOONCAKE = "file", "mooncake"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_QUERY = {FILE: {"max_bytes"}, MOONCAKE: {"segment_bytes"}}
MAKE_SECRET_HINT = ("make one with `python -c 'import secrets; print(secrets.token_hex(32))' > store.secret && "
                    "chmod 600 store.secret` and give the same file to every node on the store "
                    "(--storage-secret-file)")


@dataclass(frozen=True)
class StorageSpec:
    scheme: str
    path: str = ""          # file: the directory
    max_bytes: int = 0      # file: cap on the bytes of its objects (0: none)
    host: str = ""          # mooncake: the master's address
    port: int = 0
    segment_bytes: int = 0  # mooncake: memory each rank contributes to the pool

    @property
    def shared(self) -> bool:
        """Other nodes write into this tier while we run: keys cannot be listed once at start."""
        return self.scheme == MOONCAKE

    @property
    def master(self) -> str:
        return f"{self.host}:{self.port}"


def parse_bytes(text: str) -> int:
    """`12345`, `64M`, `1.5G` -> bytes; ValueError names the text when it is not a size."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 1048576, 512M, 2G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_storage(uri: str) -> StorageSpec:
    """The spec `uri` names; ValueError says what is wrong with it."""
    base, _, query = uri.partition("?")
    scheme, sep, rest = base.partition(":")
    if not sep or scheme not in _QUERY:
        raise ValueError(f"storage {uri!r}: expected file:DIR or mooncake://HOST:PORT")
    opts: dict[str, int] = {}
    for name, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if name not in _QUERY[scheme]:
            raise ValueError(f"storage {uri!r}: unknown option {name!r} (known: {sorted(_QUERY[scheme])})")
        opts[name] = parse_bytes(value)
    if scheme == FILE:
        if not rest:
            raise ValueError(f"storage {uri!r}: file: needs a directory, e.g. file:/var/kvrt")
        return StorageSpec(FILE, path=rest, **opts)
    m = re.fullmatch(r"//([^:/?#\s]+):(\d{1,5})/?", rest)
    if not m or not 0 < int(m.group(2)) <= 65535:
        raise ValueError(f"storage {uri!r}: expected mooncake://HOST:PORT (the master's RPC port)")
    return StorageSpec(MOONCAKE, host=m.group(1), port=int(m.group(2)), **opts)
