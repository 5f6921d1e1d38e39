"""`kvrt route --port R --backends URL,URL,... [--policy cache-aware|round-robin|least-load]`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys

from kvrt.ipc.log_limit import limit_logs
from kvrt.runtime.cache.event_secret import EventSecret
from kvrt.runtime.router.app import BACKEND_TIMEOUT_S, SLOW_S, Router, create_handler
from kvrt.runtime.router.backends import HEALTH_INTERVAL_S, Backends
from kvrt.runtime.router.policy import POLICIES, Picker
from kvrt.runtime.router.server import serve

log = logging.getLogger("kvrt.route")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrt route", description=(
        "An OpenAI-compatible HTTP router in front of kvrt nodes (each launched with --http-port, and with "
        "--kv-events-port for cache-aware routing)."))
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, metavar="R", help="HTTP port to listen on")
    p.add_argument("--backends", required=True, metavar="URL,URL,...",
                   help="the nodes' HTTP base URLs, e.g. http://127.0.0.1:8000,http://127.0.0.1:8001")
    p.add_argument("--policy", default="cache-aware", choices=POLICIES,
                   help="cache-aware: the node holding the longest prefix of the prompt, among nodes whose "
                        "load is within --load-margin of the least loaded; round-robin; least-load: fewest "
                        "requests in flight (default cache-aware)")
    p.add_argument("--load-margin", type=int, default=4, metavar="N",
                   help="cache-aware: a node with more than N requests in flight above the least loaded one "
                        "loses its affinity (default 4)")
    p.add_argument("--health-interval", type=float, default=HEALTH_INTERVAL_S, metavar="S",
                   help=f"seconds between two /health checks of every backend (default {HEALTH_INTERVAL_S:g})")
    p.add_argument("--backend-timeout", type=float, default=BACKEND_TIMEOUT_S, metavar="S",
                   help=f"seconds a backend may take to send an answer's headers (a non-streamed answer's come "
                        f"once it is whole) or between two chunks of it; past it the client gets a 504 (the request "
                        f"is not sent again: the backend has it) and the backend is avoided for {SLOW_S:g} s "
                        f"(default {BACKEND_TIMEOUT_S:g})")
    p.add_argument("--tokenizer", default="", metavar="DIR",
                   help="the served model's tokenizer files, to find text prompts' blocks (default: the model "
                        "directory the backends report; the byte tokenizer for the reference model)")
    p.add_argument("--events-secret-file", default="", metavar="PATH",
                   help="the nodes' KV events secret (their --events-secret-file): to subscribe to events that "
                        "need it and to map prompts to the keys they publish (nodes without one are read as they are)")
    return p


async def _serve(router: Router, sock: socket.socket) -> None:
    """Serve until SIGINT or SIGTERM; then close the upstream connections."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await serve(create_handler(router), sock, stop)
    finally:
        await router.aclose()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not 0 < args.port <= 65535:
        print(f"kvrt route: error: --port must be 1..65535, got {args.port}", file=sys.stderr)
        return 2
    try:
        picker = Picker(args.policy, args.load_margin)
        if not args.backend_timeout > 0:
            raise ValueError(f"--backend-timeout must be > 0, got {args.backend_timeout}")
        secret = EventSecret.load(args.events_secret_file) if args.events_secret_file else None
        backends = Backends([u for u in args.backends.split(",") if u.strip()],
                            events=args.policy == "cache-aware", health_interval=args.health_interval, secret=secret)
    except ValueError as e:
        print(f"kvrt route: error: {e}", file=sys.stderr)
        return 2
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        print(f"kvrt route: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # the health checks: not a line per check
    backends.start()
    router = Router(backends, picker, args.tokenizer, args.backend_timeout)
    log.info("routing on %s:%d to %d backends (%s)", args.host, args.port, len(backends.items), args.policy)
    try:
        asyncio.run(_serve(router, sock))
    finally:
        backends.stop()
        sock.close()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    limit_logs()  # a flood of bad input is not a flood of log lines
    sys.exit(main())
