"""The HTTP server's access log (`--access-log`) and request log (`--log-requests`), as vLLM's
server writes them: one line per request when its answer ends (client, method, path, status,
seconds, bytes), and, when asked, one line as a completion request arrives with its sampling
parameters.

Why an ASGI wrapper: it sees every request the same way, errors and refusals included, without
a line in any handler. The request log shows parameters, never the prompt or the messages (a log
is read by more people than the prompts were meant for): what they are is said by their size.
"""
from __future__ import annotations

import json
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("kvrt.http.access")
requests_log = logging.getLogger("kvrt.http.requests")
LOGGED_BODY_BYTES = 64 << 10  # a request body larger than this is logged by its size alone
# what a request log line shows of a body (the rest: prompt, messages, tools... are shown by size)
PARAMETERS = ("model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n",
              "stream", "stop", "logprobs", "top_logprobs", "prompt_logprobs", "presence_penalty",
              "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "response_format",
              "tool_choice", "cache_salt")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class AccessLog:
    """`app` with a log line per request (`access`) and per generation request's parameters
    (`requests`)."""

    def __init__(self, app: ASGIApp, access: bool = True, requests: bool = False) -> None:
        self.app = app
        self.access = access
        self.requests = requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status, sent = [0], [0]
        body: list[bytes] = []
        watch_body = self.requests and scope["method"] == "POST" and scope["path"] in GENERATION_PATHS

        async def receiving() -> Message:
            message = await receive()
            if watch_body and message["type"] == "http.request":
                body.append(message.get("body", b""))
                if not message.get("more_body", False):
                    _log_request(scope, b"".join(body))
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body":
                sent[0] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receiving if watch_body else receive, sending)
        finally:
            if self.access:
                client = scope.get("client") or ("-", 0)
                query = f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else ""
                log.info('%s:%s "%s %s%s HTTP/%s" %s %.3fs %dB', client[0], client[1], scope["method"], scope["path"],
                         query, scope.get("http_version", "1.1"), status[0] or "-", time.monotonic() - start, sent[0])


def _log_request(scope: Scope, body: bytes) -> None:
    """One line: the path, the body's size and its sampling parameters (not its text)."""
    if len(body) > LOGGED_BODY_BYTES:
        requests_log.info("%s: a %d-byte body (parameters not shown above %d bytes)", scope["path"], len(body),
                          LOGGED_BODY_BYTES)
        return
    try:
        data = json.loads(body)
    except ValueError:
        requests_log.info("%s: a %d-byte body that is not JSON", scope["path"], len(body))
        return
    if not isinstance(data, dict):
        requests_log.info("%s: a %d-byte body that is not a JSON object", scope["path"], len(body))
        return
    shown = {k: data[k] for k in PARAMETERS if k in data}
    sizes = {k: len(json.dumps(v)) for k, v in data.items() if k not in PARAMETERS}
    requests_log.info("%s: %s; other fields (JSON bytes): %s", scope["path"], json.dumps(shown)[:2000],
                      json.dumps(sizes)[:1000])
