"""What the engine and a compile process (runtime/grammar/worker.py) say to each other over the
compile process's stdin and stdout: msgpack messages (ipc/codec.py), each framed by its length.

Why not pickle: the compiled index comes back as outlines-core's own binary form (what
`Index.from_binary` reads), a byte string inside a msgpack map; nothing that arrives can run
code in the engine.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import BinaryIO

from kvrt.ipc.codec import Codec

CODEC = Codec()
_LEN = struct.Struct("<I")


@CODEC.message("grammar_setup")
@dataclass
class Setup:
    """The vocabulary a compile process compiles against: a checkpoint's tokenizer.json, or
    (tests, benchmarks) `pieces`, [token id, bytes] pairs; and the memory a compile may add."""

    model_dir: str = ""
    pieces: list = field(default_factory=list)
    memory_bytes: int = 4 << 30


@CODEC.message("grammar_ready")
@dataclass
class Ready:
    vocab_size: int  # token ids the vocabulary spans (a mask needs room for all of them)


@CODEC.message("grammar_job")
@dataclass
class Job:
    job: int
    kind: str
    spec: str
    eos: int
    seconds: float      # the compile's time limit (the engine kills it past that)
    memory_bytes: int   # its memory limit (for the estimate; the process's own limit holds it)
    index_bytes: int    # the largest index the engine takes


@CODEC.message("grammar_done")
@dataclass
class Done:
    job: int
    index: bytes  # outlines-core's binary form of the Index
    states: int   # the estimate's states, for the log


@CODEC.message("grammar_failed")
@dataclass
class Failed:
    job: int
    message: str
    refused: bool  # the spec's fault (a 400), not the node's


def write(out: BinaryIO, msg: object) -> None:
    data = CODEC.encode(msg)
    out.write(_LEN.pack(len(data)) + data)
    out.flush()


def read(inp: BinaryIO, max_bytes: int) -> object | None:
    """The next message, or None at the end of the stream (ProtocolError when malformed)."""
    head = inp.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    if n > max_bytes:
        from kvrt.ipc.errors import ProtocolError

        raise ProtocolError(f"a {n}-byte grammar message, above {max_bytes}")
    data = inp.read(n)
    if len(data) < n:
        return None
    return CODEC.decode(data)
