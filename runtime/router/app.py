"""The router's HTTP side: OpenAI-compatible endpoints that forward each request to one backend.

A request body is forwarded as it came (the node validates it and answers in its own words);
the router reads it only to find the prompt's block keys (token ids as they are; text with the
served model's tokenizer, chat messages through its chat template, as the node itself does), and
picks a backend with its policy (runtime/router/policy.py); that reading is slow text work (a large
body's JSON, tokenizing, a chat template), so it is done in a text pool off the event loop
(runtime/http/text_pool.py), its text bounded by the model's length (runtime/http/text_limits.py). The
answer streams back as the node sends it, server-sent events included, with an `x-kvrt-backend`
header naming the node. A backend that
cannot be reached, or answers 5xx, before the answer's first byte: the request goes once to
another backend (and an unreachable one is out until its next good health check). A failure
after that is reported as one, never as an answer: an event stream that the backend breaks off
ends with an error event and no `[DONE]` (runtime/router/relay.py), and any other answer up to
WHOLE_BYTES is read whole before its status goes out, so that one cut mid-body is a 502 rather than a
truncated 200; a larger one (a node writes an answer with many log-probabilities as it makes it,
chunked) is passed on as it comes, never held whole, and one the backend cuts is cut for the
client too (the connection dropped before the body's end, which a client reports as an error). (Of
a stream, what arrives in the same read as the cut is not passed on: the client library reports
the cut first.) A client that goes away closes the upstream stream, which cancels the request on
the node.

A careful proxy: what a backend sends is checked before it is passed on. A 2xx answer whose body
is not JSON, or an event stream whose first event is not an OpenAI chunk, is a 502 naming the
backend (never a 200 with junk); junk later in a stream ends it with an error event. (Of an
answer passed on as it comes, what is checked is that it opens and closes as a JSON object.) A backend
that sends no answer headers within `--backend-timeout` (or nothing between two chunks of a
stream for as long) is cut: the request reached it, so it is not sent again to another backend
(the node may be computing it; sending it twice doubles the load on a fleet already slow, and
closing the connection cancels it on the node): the client gets a 504, and the backend is marked
slow for SLOW_S, during which new requests go to the others when there are others. A backend
that could not be reached (nothing was sent) is tried once on another, as before.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

from kvrt.ipc import json_bounds
from kvrt.runtime.cache.keys import BlockHasher, salted_root
from kvrt.runtime.client.api import MAX_TOP_LOGPROBS, cache_salt_problem
from kvrt.runtime.client.chat_template import ChatTemplate, ChatTemplateError, Message
from kvrt.runtime.client.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerError
from kvrt.runtime.http.body_limit import BODY_S, DEFAULT_MODEL_LEN, Budget, max_body_bytes
from kvrt.runtime.router.backends import Backends
from kvrt.runtime.router.body import Refused, read_body
from kvrt.runtime.router.metrics import PROMETHEUS_TEXT, RouterMetrics
from kvrt.runtime.router.policy import Candidate, Picker
from kvrt.runtime.http.text_limits import max_text_chars
from kvrt.runtime.http.text_pool import TextPool
from kvrt.runtime.router.relay import MAX_EVENT_BYTES, EventRelay, error_event
from kvrt.runtime.router.server import lingering_answer

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
BACKEND_TIMEOUT_S = 300.0  # for a backend's answer headers, and between two chunks of its answer
SLOW_S = 30.0           # a backend that timed out is avoided this long
ATTEMPTS = 2            # the first backend, then one other
PASSED_HEADERS = ("authorization", "content-type", "accept")
WHOLE_BYTES = 1 << 20   # an answer (not an event stream) up to this long is read whole before it is passed on
EVENT_BYTES_PER_ENTRY = 128  # an event's bytes per log-probability entry it may carry (the largest events)


def _json(body: object, status: int) -> web.Response:
    return web.Response(body=json.dumps(body).encode(), status=status, content_type="application/json")


def _error(status: int, message: str, type_: str = "service_unavailable", code: str | None = None) -> web.Response:
    return _json({"error": {"message": message, "type": type_, "param": None, "code": code}}, status)


class Router:
    """Routing state shared by the handlers: backends, policy, tokenizer, upstream client."""

    def __init__(self, backends: Backends, picker: Picker, tokenizer_dir: str = "",
                 backend_timeout: float = BACKEND_TIMEOUT_S) -> None:
        if not backend_timeout > 0:
            raise ValueError(f"the backend timeout must be > 0 s, got {backend_timeout}")
        self.backends = backends
        self.picker = picker
        self.tokenizer_dir = tokenizer_dir
        self.backend_timeout = backend_timeout
        self._tokenizer: Tokenizer | None = None
        self._template: ChatTemplate | None = None
        self._session: aiohttp.ClientSession | None = None
        self.text = TextPool()  # a large body's reading (JSON, tokens, a chat template), off the loop

    def session(self) -> aiohttp.ClientSession:
        """The upstream client, its keep-alive connections reused across requests. aiohttp: its C
        parser and thin layers cost about a third of the CPU per request of a pure-Python client,
        and the router's cost is paid on every request. Made on first use, in the server's event
        loop, which it belongs to. Bodies pass as the node sent them (no decompression, none asked
        for; a body without a content type goes without one), and no cookie a node sets is kept
        (it would go with other clients' requests). A request waits for a free pooled connection
        at most the backend timeout, and for a new one to connect CONNECT_TIMEOUT_S."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=None, connect=self.backend_timeout, sock_connect=CONNECT_TIMEOUT_S,
                                              sock_read=self.backend_timeout),
                auto_decompress=False, skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"))
        return self._session

    async def aclose(self) -> None:
        """Closes the upstream connections and the text pool (at the server's shutdown)."""
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.text.close()

    def max_model_len(self) -> int:
        """The longest model length a backend reported (DEFAULT_MODEL_LEN until one did)."""
        lens = [b.max_model_len for b in self.backends.items if b.max_model_len]
        return max(lens) if lens else DEFAULT_MODEL_LEN

    def max_body_bytes(self) -> int:
        """The largest request body the router reads: the nodes' (from the longest model length a
        backend reported; runtime/http/body_limit.py)."""
        return max_body_bytes(self.max_model_len())

    def max_event_bytes(self) -> int:
        """The longest event of a stream the router holds whole: a node's largest (a prompt of
        the model's length scored with every alternative)."""
        return max(MAX_EVENT_BYTES, EVENT_BYTES_PER_ENTRY * self.max_model_len() * (MAX_TOP_LOGPROBS + 1))

    # ---- keys
    def tokenizer(self) -> Tokenizer | None:
        """The served model's tokenizer: --tokenizer DIR, else the model directory a backend
        reports (the byte tokenizer for the reference model); None while no backend said."""
        if self._tokenizer is None:
            if self.tokenizer_dir:
                self._tokenizer = HFTokenizer.from_dir(self.tokenizer_dir)
            else:
                described = [b for b in self.backends.items if b.key_root]
                if not described:
                    return None
                d = described[0].model_dir
                if d and not os.path.isabs(d):  # a node's word, checked
                    raise TokenizerError(f"backend {described[0].url} reported {d!r:.200} as its model directory, "
                                         f"not an absolute path: pass --tokenizer DIR")
                self._tokenizer = HFTokenizer.from_dir(d) if d else ByteTokenizer()
        return self._tokenizer

    def prompt_ids(self, path: str, body: dict) -> list[int]:
        """The (first) prompt's token ids as the node will see them; [] when unknown."""
        tok = self.tokenizer()
        if path.endswith("/chat/completions"):
            msgs = body.get("messages")
            if tok is None or tok.chat_template is None or not isinstance(msgs, list):
                return []
            if self._template is None or self._template.source != tok.chat_template:
                self._template = ChatTemplate(tok.chat_template, tok.special_tokens,
                                              max_chars=max_text_chars(self.max_model_len()))
            text = self._template.render(
                [Message(str(m.get("role", "")), _text(m.get("content"))) for m in msgs if isinstance(m, dict)],
                add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False)
        p = body.get("prompt")
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]  # a batch: routed by its first prompt
        if isinstance(p, str):  # (a text longer than the model takes: the node refuses it)
            return tok.encode(p) if tok is not None and len(p) <= max_text_chars(self.max_model_len()) else []
        if isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        return []

    async def keys_off_loop(self, who: str, path: str, raw: bytes) -> dict[tuple[bytes, int], list[bytes]]:
        """`keys`, in `who`'s turn of the text pool (at once for a small body that is no chat)."""
        if self.picker.policy != "cache-aware":
            return {}
        cost = len(raw) if not path.endswith("/chat/completions") else max(len(raw), self.text.inline)
        return await self.text.run(who, cost, self.keys, path, raw)

    def keys(self, path: str, raw: bytes) -> dict[tuple[bytes, int], list[bytes]]:
        """The prompt's block keys under each backend's (key root, block size), chained from the
        root of the request's `cache_salt` as the node chains them (runtime/cache/keys.py)."""
        if self.picker.policy != "cache-aware":
            return {}
        try:
            body = json_bounds.loads(raw, None, what="the request body")  # (its size: read_body's)
            ids = self.prompt_ids(path, body) if isinstance(body, dict) else []
        except (ValueError, TokenizerError, ChatTemplateError, RecursionError) as e:  # the node will say what is wrong
            log.debug("no keys for a request: %s", e)
            return {}
        if not ids:
            return {}
        salt = body.get("cache_salt") or ""
        if cache_salt_problem(salt):  # the node will say so
            return {}
        out = {}
        for b in self.backends.items:
            if b.key_root and (b.key_root, b.block_size) not in out:
                try:
                    hasher = BlockHasher(b.block_size, salted_root(b.key_root, salt))
                    out[(b.key_root, b.block_size)] = hasher.update(ids)
                except (ValueError, OverflowError):
                    return {}
        return out

    # ---- choosing and forwarding
    def choose(self, keys: dict, exclude: list[int]) -> int | None:
        """A healthy backend not tried yet for this request; one marked slow only when no other is left."""
        items, now = self.backends.items, time.monotonic()
        open_ = [i for i in self.backends.healthy() if i not in exclude]
        fast = [i for i in open_ if items[i].slow_until <= now]
        cands, shape = [], []
        for i in fast or open_:
            own = items[i].keys_of(keys) if keys else []
            shape = shape or own
            cands.append(Candidate(i, items[i].inflight, items[i].cached_prefix(own, now), len(own)))
        if not cands:
            return None
        i = self.picker.pick(cands, shape).index
        if keys:
            items[i].sent(items[i].keys_of(keys), now)
        return i

    def _timed_out(self, i: int, what: str) -> str:
        """Backend i sent nothing for the backend timeout: avoided for SLOW_S; why, for the client."""
        b = self.backends.items[i]
        why = f"backend {b.url} sent no {what} within {self.backend_timeout:g} s (--backend-timeout)"
        if b.slow_until <= time.monotonic():
            log.warning("%s: avoided for %g s", why, SLOW_S)
        b.slow_until = time.monotonic() + SLOW_S
        return why

    async def forward(self, request: web.BaseRequest, raw: bytes, path: str) -> web.StreamResponse:
        """`raw`, the request's body, to a backend the policy picks; its answer, passed on. A
        client that leaves cancels this (the server's handler cancellation): the upstream
        request is then closed, which cancels it on the node."""
        keys = await self.keys_off_loop(request.remote or "", path, raw)
        got_headers = request.headers
        headers = {k: v for k in PASSED_HEADERS if (v := got_headers.get(k)) is not None}
        tried: list[int] = []
        why = "no backend is healthy"
        for _ in range(ATTEMPTS):
            i = self.choose(keys, tried)
            if i is None:
                break
            tried.append(i)
            b = self.backends.items[i]
            b.inflight += 1
            try:
                got = await self._fetch(b.url + path, raw, headers)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                b.inflight -= 1
                if _silent(e):  # it has the request (or part of it): not sent again, see the module's docstring
                    why = self._timed_out(i, "answer headers")
                    return _error(504, why, code="backend_timeout")
                why = f"backend {b.url} failed: {e or type(e).__name__}"
                self.backends.mark_down(i, why)
                continue
            except BaseException:  # cancelled: the client left (the send was cancelled and closed)
                b.inflight -= 1
                raise
            if got.resp.status >= 500:
                got.resp.close()
                b.inflight -= 1
                why = f"backend {b.url} answered {got.resp.status}"
                continue
            b.routed += 1
            if got.chunks is not None and got.events is None:
                return await self._through(i, got, request)
            if got.events is None:
                return self._whole(i, got)
            return await self._stream(i, got, request)
        return _error(503, f"no backend could take the request: {why}")

    async def _fetch(self, url: str, raw: bytes, headers: dict[str, str]) -> _Answer:
        """The backend's answer with its body read whole, or its event stream's first whole
        events (nothing more of a 5xx): read before the answer's status goes out, so that what
        came with the answer's headers is read before a cut that followed it (the client
        library reports a cut ahead of the bytes still buffered)."""
        resp = await self.session().post(url, data=raw, headers=headers)
        got = _Answer(resp)
        if resp.status >= 500:
            return got
        try:
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                got.events, got.chunks = EventRelay(self.max_event_bytes()), resp.content.iter_any()
                while not got.head and not got.events.junk:
                    got.head = got.events.feed(await got.chunks.__anext__())
            elif resp.content_length is None or resp.content_length > WHOLE_BYTES:
                got.chunks = resp.content.iter_any()
                try:
                    while not got.head.strip():  # (its first bytes say whether it is a JSON object)
                        got.head += await got.chunks.__anext__()
                except StopAsyncIteration:  # all of it came at once: a whole answer after all
                    got.body, got.head, got.chunks = got.head, b"", None
                    resp.release()
            else:
                got.body = await resp.read()
                resp.release()
        except (aiohttp.ClientError, asyncio.TimeoutError, StopAsyncIteration) as e:
            got.failed = e
            resp.close()
        except BaseException:  # cancelled: the client left; closing the connection cancels the request on the node
            resp.close()
            raise
        return got

    async def _next_chunk(self, i: int, got: _Answer) -> tuple[bytes | None, str]:
        """Backend i's next piece of its answer, or None at its end, with why it was cut ("" if
        it was not)."""
        try:
            return await got.chunks.__anext__(), ""
        except StopAsyncIteration:
            return None, ""
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return None, self._broke_off(i, e)

    def _broke_off(self, i: int, e: BaseException) -> str:
        """Why backend i's answer is cut; a connection that failed takes the backend out, one
        that went silent marks it slow."""
        if _silent(e):
            return self._timed_out(i, "part of its answer")
        why = f"backend {self.backends.items[i].url} broke off its answer: {e or type(e).__name__}"
        self.backends.mark_down(i, why)
        return why

    async def _stream(self, i: int, got: _Answer, request: web.BaseRequest) -> web.StreamResponse:
        """Backend i's event stream, passed on once its first whole event is in and is what a
        node sends (else a 502: the status is not out yet), then whole events as they come;
        ended with an error event when the backend breaks it off, sends junk or ends it as no
        node ends an answer."""
        b, resp, events = self.backends.items[i], got.resp, got.events
        if got.failed is not None:
            b.inflight -= 1
            why = (f"backend {b.url} ended its event stream before its first event"
                   if isinstance(got.failed, StopAsyncIteration) else self._broke_off(i, got.failed))
            log.warning("%s", why)
            return _error(502, why, code="backend_broke_off")
        if not got.head:  # junk before any event
            resp.close()
            b.inflight -= 1
            why = f"backend {b.url} answered {resp.status} with an event that is not an OpenAI chunk: {events.junk}"
            log.warning("%s", why)
            return _error(502, why, code="backend_junk")
        out = web.StreamResponse(status=resp.status, headers={"content-type": resp.headers.get("content-type", ""),
                                                              "x-kvrt-backend": b.url})
        why, code = "", "backend_broke_off"
        done = False
        try:  # (a write that fails is the client gone: it ends the request, the backend is not blamed)
            await out.prepare(request)
            await out.write(got.head)
            while not events.junk:
                chunk, why = await self._next_chunk(i, got)
                if chunk is None:
                    break
                if piece := events.feed(chunk):
                    await out.write(piece)
            if not why and events.junk:
                why, code = f"backend {b.url} sent an event that is not an OpenAI chunk: {events.junk}", "backend_junk"
            elif not why and not events.finished:
                why = f"backend {b.url} ended its event stream without [DONE] or an error"
            done = not why
        finally:  # a whole answer leaves the connection for the next request; any other end closes it
            if done:
                resp.release()
            else:
                resp.close()
            b.inflight -= 1
        if why:
            log.warning("%s", why)
            await out.write(error_event(why, code))
        await out.write_eof()
        return out

    async def _through(self, i: int, got: _Answer, request: web.BaseRequest) -> web.StreamResponse:
        """Backend i's answer (not an event stream) passed on as it comes, never held whole: a
        502 when it failed before its first bytes or (2xx) does not open as a JSON object; a cut,
        or a 2xx body that does not close as one, drops the client's connection before the end,
        which no client takes for a whole answer."""
        b, resp = self.backends.items[i], got.resp
        ok = 200 <= resp.status < 300
        if got.failed is not None:
            return self._whole(i, got)  # (a 502 or 504 naming the failure)
        if ok and not got.head.lstrip().startswith(b"{"):
            b.inflight -= 1
            resp.close()
            why = f"backend {b.url} answered {resp.status} with a body that is not a JSON object: {got.head[:100]!r}"
            log.warning("%s", why)
            return _error(502, why, code="backend_junk")
        out = web.StreamResponse(status=resp.status, headers=_answer_headers(resp, b.url))
        if resp.content_length is not None:
            out.content_length = resp.content_length
        why, tail = "", got.head
        try:  # (a write that fails is the client gone: it ends the request, the backend is not blamed)
            await out.prepare(request)
            await out.write(got.head)
            while True:
                chunk, why = await self._next_chunk(i, got)
                if chunk is None:
                    break
                await out.write(chunk)
                tail = (tail + chunk)[-64:]
            if not why and ok and not tail.rstrip().endswith(b"}"):
                why = f"backend {b.url} answered {resp.status} with a body that does not end as a JSON object"
        finally:
            if why:
                resp.close()
            else:
                resp.release()
            b.inflight -= 1
        if why:  # the status is out: the client must see a cut, not an answer
            log.warning("%s: the answer to the client is cut", why)
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError(why)
        await out.write_eof()
        return out

    def _whole(self, i: int, got: _Answer) -> web.Response:
        """Backend i's answer read whole, sent with its status: a 502 when the backend broke it
        off or answered 2xx with a body that is not JSON."""
        b, resp, body = self.backends.items[i], got.resp, got.body
        b.inflight -= 1
        if got.failed is not None:
            why = self._broke_off(i, got.failed)
            log.warning("%s", why)
            return _error(504 if _silent(got.failed) else 502, why, code="backend_broke_off")
        if 200 <= resp.status < 300 and not _is_json_object(body):
            why = f"backend {b.url} answered {resp.status} with a body that is not a JSON object: {body[:100]!r}"
            log.warning("%s", why)
            return _error(502, why, code="backend_junk")
        return web.Response(body=body, status=resp.status, headers=_answer_headers(resp, b.url))

    async def get(self, path: str) -> web.Response:
        """A GET answered by the first healthy backend (/v1/models, /version): the nodes behind
        a router serve one model under the same ids, so any of them answers for all."""
        for i in self.backends.healthy():
            b = self.backends.items[i]
            try:
                async with self.session().get(b.url + path, timeout=aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S)) as r:
                    body = await r.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.backends.mark_down(i, str(e) or type(e).__name__)
                continue
            return web.Response(body=body, status=r.status, headers=_answer_headers(r))
        return _error(503, "no backend is healthy")


@dataclass
class _Answer:
    """A backend's answer as `Router._fetch` read it: its body whole, or its event stream's
    first whole events (`head`, with the relay and the rest of the chunks), or how reading
    failed."""

    resp: aiohttp.ClientResponse
    body: bytes = b""
    events: EventRelay | None = None
    chunks: AsyncIterator[bytes] | None = None
    head: bytes = b""
    failed: BaseException | None = None


def _answer_headers(resp: aiohttp.ClientResponse, backend: str = "") -> dict[str, str]:
    """The headers of a backend's answer that are passed on: its content type (none when it
    sent none), and the backend's URL."""
    out = {"x-kvrt-backend": backend} if backend else {}
    if ct := resp.headers.get("content-type"):
        out["content-type"] = ct
    return out


def _silent(e: BaseException) -> bool:
    """Whether an upstream failure is a backend that went silent (no answer headers, or nothing
    between two chunks, within the backend timeout) rather than one that could not be reached or
    broke the connection (a connect timeout is one that could not be reached)."""
    return isinstance(e, asyncio.TimeoutError) and not isinstance(e, aiohttp.ConnectionTimeoutError)


def _is_json_object(body: bytes) -> bool:
    try:
        return isinstance(json_bounds.loads(body, None), dict)
    except ValueError:
        return False


def _text(content: object) -> str:
    """A chat message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def create_handler(router: Router, body_s: float = BODY_S) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
    """The router's one request handler (runtime/router/server.py serves it): /health, and
    forwarded: /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize,
    /version (a model id is the nodes' business: they answer one they do not serve); /metrics,
    the router's own series (runtime/router/metrics.py); request
    bodies bounded as a node bounds them (runtime/router/body.py). One lookup of (method, path)
    in a table: no routing framework or middleware is paid on every forwarded request."""
    budget = Budget()
    metrics = RouterMetrics(router.backends, router.picker.policy)

    async def prometheus(request: web.BaseRequest) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"content-type": PROMETHEUS_TEXT})

    async def health(request: web.BaseRequest) -> web.Response:
        items = router.backends.items
        now = time.monotonic()
        body = {"status": "ok" if router.backends.healthy() else "no healthy backend", "policy": router.picker.policy,
                "backends": [{"url": b.url, "healthy": b.healthy, "slow": b.slow_until > now, "inflight": b.inflight,
                              "routed": b.routed,
                              "cached_blocks": len(b.view.media) if b.view is not None else None,
                              "events": {"last_seq": b.view.last_seq, "gaps": b.view.gaps, "lost": b.view.lost,
                                         "snapshots": b.view.snapshots, "malformed": b.view.malformed}
                              if b.view is not None else None} for b in items]}
        return _json(body, 200 if router.backends.healthy() else 503)

    def forwarded(path: str, post: bool) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
        if not post:
            async def get(request: web.BaseRequest) -> web.StreamResponse:
                return await router.get(path)
            return get

        async def post_(request: web.BaseRequest) -> web.StreamResponse:
            try:
                raw = await read_body(request, router.max_body_bytes(), body_s, budget)
            except Refused as e:
                return await lingering_answer(request, e.status, e.reason, e.message, e.code)
            return await router.forward(request, raw, path)
        return post_

    routes = {("GET", "/health"): health, ("GET", "/metrics"): prometheus}
    routes.update({("GET", p): forwarded(p, post=False) for p in ("/v1/models", "/version")})
    routes.update({("POST", p): forwarded(p, post=True) for p in ("/v1/completions", "/v1/chat/completions",
                                                                   "/tokenize", "/detokenize")})
    paths = {p for _, p in routes}

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        endpoint = routes.get((request.method, request.path))
        if endpoint is not None:
            answer = await endpoint(request)
            metrics.answered(request.path, answer.status)
            return answer
        if request.path in paths:
            return _error(405, f"{request.path} does not take {request.method:.20}", "invalid_request_error",
                          "method_not_allowed")
        return _error(404, f"no endpoint {request.path!r:.200}", "invalid_request_error", "not_found")

    return handle
