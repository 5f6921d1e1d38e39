"""`--api-key`: every route of the HTTP API but `GET /health` needs `Authorization: Bearer KEY`,
as vLLM's flag asks.

Why `/health` stays open, as in vLLM: what probes a node's liveness (a load balancer, Kubernetes,
`kvrt route`'s health thread) holds no client's key, and the answer says only `{"status": "ok"}`.

Why an ASGI wrapper outside the app: it answers before anything else runs, so a client without
the key gets its 401 before its body is read (the body limits' budget is not its to spend) and
before any handler, route or error page could tell it more. The comparison takes the same time
whatever the key sent (hmac.compare_digest), so the key cannot be guessed a byte at a time.
"""
from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send


OPEN = {("GET", "/health")}  # (method, path) answered without the key (module docstring)


class ApiKeyAuth:
    """`app` behind a bearer-key check on every HTTP request but those of OPEN."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        if not key:
            raise ValueError("an API key must not be empty")
        self.app = app
        self._expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope.get("method"), scope.get("path")) in OPEN or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": "a valid API key is needed: Authorization: Bearer KEY",
                                     "type": "authentication_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _allowed(self, scope: Scope) -> bool:
        got = [v for k, v in scope.get("headers", ()) if k == b"authorization"]
        return len(got) == 1 and hmac.compare_digest(got[0], self._expected)
