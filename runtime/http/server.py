"""`kvrt launch --http-port H`: the OpenAI-compatible API served by uvicorn in a thread of the
launcher process.

Why a thread in the launcher: the launcher only supervises its children (the engine loop runs
in the engine process), so an HTTP server beside it delays no engine step, and it lives and
dies with the node without a process of its own to supervise. It talks to the engine through
the node's ordinary client API (runtime/client/client.py over ZeroMQ), exactly as any other client.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import random
import socket
import threading
from dataclasses import dataclass

import uvicorn

from kvrt.runtime.cache.event_secret import EventSecret
from kvrt.runtime.client.client import address_of
from kvrt.runtime.http.access_log import AccessLog
from kvrt.runtime.http.app import IdsOnly, Server, create_app
from kvrt.runtime.http.auth import ApiKeyAuth
from kvrt.runtime.http.bridge import ENGINE_TIMEOUT_S, Bridge, Submission
from kvrt.runtime.http.chat_template_flag import read_chat_template
from kvrt.runtime.http.connections import IDLE_S, uvicorn_config
from kvrt.runtime.http.stalled import STALL_S
from kvrt.runtime.node.config import NodeConfig

log = logging.getLogger(__name__)

REFERENCE_MODEL_NAME = "kvrt-reference"
STOP_WAIT_S = 10.0


def served_model_names(names: list[str] | None, model: str) -> list[str]:
    """The model ids of the HTTP API, as vLLM names them: the names given (the first is the one
    /v1/models reports), else `--model` exactly as given (a path stays a path, so that a tool
    that loads the tokenizer by model id, as guidellm and aiperf do, finds it on this machine
    rather than asking a model hub for the directory's bare name), else the built-in reference
    model's."""
    return list(dict.fromkeys(names)) if names else [model] if model else [REFERENCE_MODEL_NAME]


def cache_info(cfg: NodeConfig) -> dict:
    """What a cache-aware router needs to know of this node (GET /kvrt/cache): how it keys blocks
    (the block size and the root of the key chain, runtime/cache/keys.py), the model directory its
    tokenizer is read from (empty: the reference model, one token per byte), its model's length (the
    router's body limit follows from it) and where its KV events are published (null when the node
    publishes none; a 0.0.0.0 host means "this node's address"), with the CURVE public key its event
    sockets serve with (null without --events-secret-file): public by design, it lets a router tell
    whether it holds the same secret."""
    events = f"tcp://{cfg.host}:{cfg.kv_events_port}" if cfg.kv_events_port else None
    replay = f"tcp://{cfg.host}:{cfg.kv_events_port + 1}" if cfg.kv_events_port else None
    curve = EventSecret.load(cfg.events_secret_file).server_public.decode() if cfg.events_secret_file else None
    return {"node": cfg.node, "block_size": cfg.block_size, "key_root": cfg.key_root.hex(),
            "max_model_len": cfg.max_model_len,
            "model_dir": os.path.abspath(cfg.model_dir) if cfg.model_dir else "",
            "kv_events": events, "kv_events_replay": replay, "kv_events_curve_key": curve}


@dataclass
class HttpOptions:
    """The HTTP server's settings that vLLM's flags of the same names give (`kvrt launch --api-key`,
    `--chat-template`, `--seed`, `--access-log`, `--log-requests`, `--uvicorn-log-level`), how long
    an answer's write may wait for a client that reads nothing (`--http-stall-timeout`), and how long
    a connection may say nothing before it is closed (`--http-idle-timeout`)."""

    api_key: str | None = None
    chat_template: str | None = None  # the template's text (read from --chat-template)
    seed: int | None = None
    access_log: bool = False
    log_requests: bool = False
    uvicorn_log_level: str = "warning"
    stall_timeout: float = STALL_S
    idle_timeout: float = IDLE_S

    @classmethod
    def of(cls, args: argparse.Namespace) -> "HttpOptions":
        """From `kvrt launch`'s flags; ValueError when the chat template cannot be read or the
        API key is empty or the stall or idle timeout is not a finite number of seconds > 0."""
        if args.api_key is not None and not args.api_key:
            raise ValueError("--api-key must not be empty")
        stall = STALL_S if args.http_stall_timeout is None else args.http_stall_timeout
        if not (math.isfinite(stall) and stall > 0):
            raise ValueError(f"--http-stall-timeout must be a finite number of seconds > 0, got {stall}")
        idle = IDLE_S if args.http_idle_timeout is None else args.http_idle_timeout
        if not (math.isfinite(idle) and idle > 0):
            raise ValueError(f"--http-idle-timeout must be a finite number of seconds > 0, got {idle}")
        template = read_chat_template(args.chat_template) if args.chat_template is not None else None
        return cls(args.api_key, template, args.seed, args.access_log, args.log_requests, args.uvicorn_log_level,
                   stall, idle)


class _SeededBridge(Bridge):
    """--seed: a request without a seed gets the next one of a generator seeded once, so that the
    same requests in the same order draw the same tokens again (vLLM's meaning of its flag)."""

    def __init__(self, address: str, engine_timeout: float, seed: int) -> None:
        super().__init__(address, engine_timeout)
        self._seeds = random.Random(seed)

    def submit(self, sub: Submission) -> None:
        if sub.sampling.seed is None:
            sub = dataclasses.replace(sub, sampling=dataclasses.replace(sub.sampling,
                                                                        seed=self._seeds.getrandbits(63)))
        super().submit(sub)


class _TemplatedServer(Server):
    """--chat-template: the served model's tokenizer with that template instead of its own."""

    def __init__(self, *args, chat_template: str, **kw) -> None:
        super().__init__(*args, **kw)
        self._flag_template = chat_template

    def decoder(self):
        tok = super().decoder()
        if not isinstance(tok, IdsOnly) and tok.chat_template is not self._flag_template:
            tok.chat_template = self._flag_template
        return tok


class HttpServer:
    """uvicorn on (host, port) in a daemon thread, over a bridge to the node's client API, with
    its connections and bodies bounded (runtime/http/connections.py, body_limit.py). The
    socket is bound here, before the node starts, so a port in use is an error of `kvrt launch`
    (OSError) rather than a thread that dies quietly."""

    def __init__(self, host: str, port: int, client_host: str, client_port: int | str, model_names: list[str],
                 node: str = "", metrics_port: int = 0, cache: dict | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, engine_timeout: float = ENGINE_TIMEOUT_S,
                 options: HttpOptions | None = None) -> None:
        options = options or HttpOptions()
        connect = "127.0.0.1" if client_host in ("", "0.0.0.0", "::") else client_host
        address = address_of(client_port, connect)
        self.bridge = Bridge(address, engine_timeout) if options.seed is None else \
            _SeededBridge(address, engine_timeout, options.seed)
        kw = dict(node=node, tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)
        self.api = server = Server(self.bridge, model_names, metrics_port, cache, **kw) if options.chat_template is None else \
            _TemplatedServer(self.bridge, model_names, metrics_port, cache, chat_template=options.chat_template, **kw)
        server.stall_s = options.stall_timeout
        app = create_app(server)
        if options.access_log or options.log_requests:
            app = AccessLog(app, access=options.access_log, requests=options.log_requests)
        if options.api_key:
            app = ApiKeyAuth(app, options.api_key)  # outermost: nothing runs for a request without the key
        config = uvicorn_config(app, host, port, idle_s=options.idle_timeout)
        logging.getLogger("uvicorn").setLevel(options.uvicorn_log_level.upper().replace("TRACE", "DEBUG"))
        logging.getLogger("uvicorn.error").setLevel(options.uvicorn_log_level.upper().replace("TRACE", "DEBUG"))
        self._server = uvicorn.Server(config)
        self.host, self.port = host, port
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise OSError(f"--http-port: cannot listen on {host}:{port}: {e.strerror or e}") from None
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, name="kvrt-http",
                                        daemon=True)

    def url(self) -> str:
        """The server's base URL as a client on this machine writes it (all interfaces: loopback)."""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else "[::1]" if self.host == "::" else \
            f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        self.bridge.start()
        self._thread.start()

    def stop(self) -> None:
        """Stop taking connections and end open streams."""
        self._server.should_exit = True
        self.bridge.stop()  # its waiters get a "stopping" answer: open streams end
        self._thread.join(STOP_WAIT_S)
        if self._thread.is_alive():
            log.warning("the HTTP server did not stop within %g s", STOP_WAIT_S)
        self.api.text.close()
        self._sock.close()
