"""kvrt: the node launcher and command-line entry point.

Each subcommand lives in the module that owns the behaviour; this file only dispatches, so
`kvrt --help` lists everything a user can do on a node.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# benchmark name -> (module, one-line help); each module has main(argv) -> int
BENCHES = {
    "ipc": ("bench.ipc", "ring vs multiprocessing.Queue, BaseManager over TCP and pyzmq ipc://"),
    "cache": ("bench.cache", "replay a request trace through the prefix cache (hit rates, blocks/s)"),
}
STRESS = {
    "ring": ("bench.stress_ring", "multiprocess ring stress: N producers, checksums, order, SIGKILL"),
}


def _dispatch(table: dict, kind: str, argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in table:
        lines = [f"usage: kvrt {kind} NAME [options]   (kvrt {kind} NAME --help for options)", "", "names:"]
        lines += [f"  {name:<8} {help_}" for name, (_, help_) in table.items()]
        print("\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nkvrt {kind}: unknown name {argv[0]!r}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    module, _ = table[argv[0]]
    return importlib.import_module(module).main(argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="kvrt",
        description="kvrt: a shared-memory KV-cache runtime for LLM serving nodes.",
        epilog="Run `kvrt COMMAND --help` for a command's options.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES), add_help=False)
    sub.add_parser("stress", help="stress tests: " + ", ".join(STRESS), add_help=False)
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "bench":
        return _dispatch(BENCHES, "bench", rest)
    if args.command == "stress":
        return _dispatch(STRESS, "stress", rest)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
