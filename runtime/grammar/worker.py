"""A compile process: guided specs in, compiled indexes out, one at a time, for the engine's
pool (runtime/grammar/pool.py), which kills it at a compile's time limit and starts another.

Why a process: a grammar's automaton can take minutes and gigabytes to build (its size is not
its text's), and a thread cannot be stopped or held to a memory limit. Here the address space
is capped once the vocabulary is loaded (RLIMIT_AS: what it holds then, plus the compile
memory limit), so a compile that would grow past the limit fails in this process, never in the
engine; and whatever it does, the engine's loop goes on.
"""
from __future__ import annotations

import logging
import os
import resource
import sys

from kvrt.runtime.grammar import messages as M
from kvrt.runtime.grammar.compile import build_index, vocabulary
from kvrt.runtime.grammar.limits import Limits
from kvrt.runtime.grammar.spec import GrammarError

log = logging.getLogger("kvrt.grammar")
MAX_JOB_BYTES = 1 << 20  # a job carries a spec of at most 64 KiB


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _token_bytes(setup: M.Setup) -> dict[int, bytes]:
    if setup.model_dir:
        from kvrt.runtime.engine.token_bytes import read_token_bytes

        return read_token_bytes(setup.model_dir)[0]
    return {int(t): bytes(b) for t, b in setup.pieces}


def serve(inp, out) -> int:
    setup = M.read(inp, 64 << 20)
    if not isinstance(setup, M.Setup):
        return 2
    token_bytes = _token_bytes(setup)
    vocab_size = max(token_bytes, default=0) + 1
    vocabs: dict[int, object] = {}
    cap = _address_space() + setup.memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    M.write(out, M.Ready(vocab_size))
    while True:
        job = M.read(inp, MAX_JOB_BYTES)
        if job is None:
            return 0
        if not isinstance(job, M.Job):
            continue
        size = max(vocab_size, job.eos + 1)
        try:
            if job.eos not in vocabs:
                vocabs[job.eos] = vocabulary(token_bytes, job.eos)
            index, rx = build_index({"kind": job.kind, "spec": job.spec}, vocabs[job.eos], size,
                                    Limits(job.seconds, job.memory_bytes, job.index_bytes))
            data = index.__reduce__()[1][0]  # outlines-core's own binary form (Index.from_binary reads it)
            del index
            if len(data) > job.index_bytes:
                raise GrammarError(f"its compiled index is {len(data) >> 20} MiB, above the limit of "
                                   f"{job.index_bytes >> 20} MiB")
            M.write(out, M.Done(job.job, data, rx.states))
        except GrammarError as e:
            M.write(out, M.Failed(job.job, str(e), e.refused))
        except MemoryError:
            M.write(out, M.Failed(job.job, f"the compile went past its memory limit of {setup.memory_bytes >> 20} "
                                           f"MiB (kvrt launch --grammar-memory-mib)", True))
        except Exception as e:  # noqa: BLE001 - whatever a spec makes fail is that spec's answer, not this process's end
            log.exception("compiling guided %s failed", job.kind)
            M.write(out, M.Failed(job.job, f"guided {job.kind}: cannot compile it ({type(e).__name__}: "
                                           f"{str(e)[:120]})", True))


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s kvrt-grammar %(levelname)s %(message)s")
    return serve(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    sys.exit(main())
