"""The OpenAI-compatible HTTP API of a node, as an ASGI app (FastAPI) over a `Bridge`.

Why FastAPI: pydantic checks every body before a handler runs (a bad type is a 400 here, never
a 500), and Starlette's streaming response cancels the handler's generator when the client goes
away, which is where a request is cancelled and its blocks freed.

Text: prompts are encoded and answers decoded with the node's tokenizer (runtime/client/tokenizer.py);
stop strings are cut as `kvrt generate` cuts them (runtime/client/stop.py). Each choice also carries its
`token_ids` (a vLLM-style extension) so that a client can compare exact tokens. A checkpoint without a
usable tokenizer still serves token-id prompts (its answers carry token ids and empty text); what
needs text answers 400 naming what the tokenizer lacks.

Beside the OpenAI routes, the operator routes vLLM's server has: /tokenize, /detokenize, /version,
/reset_prefix_cache, and /metrics with vLLM's series (runtime/http/vllm_metrics.py).

Nothing slow runs on the event loop, which serves every client: a large body is parsed, text is
tokenized and detokenized and chat templates are rendered in the text pool (runtime/http/text_pool.py,
clients in turn), each bounded by the model's length (runtime/http/request_body.py, text_limits.py) or
its own limit (a render's time); an answer's log-probabilities are bounded before its requests go
(runtime/http/answer_size.py), and a large answer is written as it is made (runtime/http/json_stream.py),
to a client that must keep reading it (runtime/http/stalled.py).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import AsyncIterator, Iterable, Sequence, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvrt.runtime.client.api import BAD_REQUEST, DUPLICATE, TOO_MANY, ErrorEvent, InfoReply, TokenEvent
from kvrt.runtime.client.chat_template import ChatTemplate, ChatTemplateError, Message
from kvrt.runtime.client.client import ClientError, Result, Sampling, node_tokenizer
from kvrt.runtime.client.detokenizer import IncrementalDetokenizer
from kvrt.runtime.client.stop import StopStrings, stop_problem
from kvrt.runtime.client.tokenizer import Tokenizer, TokenizerError
from kvrt.runtime.grammar.spec import guided_problem
from kvrt.runtime.grammar.tool_call import tool_call_spec
from kvrt.runtime.http.answer_size import BIG_ANSWER, answer_entries, answer_problem
from kvrt.runtime.http.body_limit import BODY_S, DEFAULT_MODEL_LEN, BodyLimit, max_body_bytes
from kvrt.runtime.http.bridge import UNRESPONSIVE, Bridge, Submission
from kvrt.runtime.http.chat_output import ChatOutput
from kvrt.runtime.http.errors import ApiError
from kvrt.runtime.http.json_stream import json_pieces, materialize
from kvrt.runtime.http.logprobs import TokenTexts, chat_logprobs, completion_logprobs, prompt_logprobs
from kvrt.runtime.http.openai_schema import (ChatMessage, ChatRequest, CompletionRequest, DetokenizeRequest,
                                             SamplingBody, TokenizeRequest)
from kvrt.runtime.http.reasoning import prompt_opens_thinking
from kvrt.runtime.http.request_body import parse_body
from kvrt.runtime.http.stalled import STALL_S, CutWhenStalled
from kvrt.runtime.http.text_limits import max_text_chars
from kvrt.runtime.http.text_pool import TextPool
from kvrt.runtime.http.tool_calls import default_parser
from kvrt.runtime.http.vllm_metrics import StatsReader, VllmMetrics

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's
MAX_BATCH = 64          # prompts in one /v1/completions request
METRICS_TIMEOUT_S = 5.0
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
M = TypeVar("M", bound=BaseModel)


def _error(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(ApiError(status, message, type_, param, code).body(), status_code=status)


@dataclass
class _Choice:
    """One prompt's request: its answer's text and tokens so far, cut at a stop string."""

    index: int
    prompt: list[int]
    detok: IncrementalDetokenizer
    stops: StopStrings
    prompt_index: int = 0      # which prompt of the request (its n choices share it)
    stop_ids: frozenset[int] = frozenset()  # EOS and stop token ids: their text is not shown
    include_stop: bool = False  # ...unless the request asked (include_stop_str_in_output)
    min_tokens: int = 0        # stop strings count only past this many output tokens
    echo: str = ""             # the prompt's text, shown before the first piece
    own_stop_ids: frozenset[int] = frozenset()  # the request's stop_token_ids (its stop_reason)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top: list[list | None] = field(default_factory=list)  # [ids, logprobs] per token, if asked
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    prompt_shown: bool = False  # a stream sent its prompt's scores
    result: Result | None = None
    last_tokens_at: float | None = None  # time.monotonic() of the latest answer that brought tokens

    def add(self, ids: list[int], logprobs: list[float | None], top: list | None = None) -> tuple[str, list[int]]:
        """The text and tokens to show for new output tokens ("" once a stop string was seen)."""
        if self.stops.stopped is not None:
            return "", []
        shown = ids if self.include_stop else [t for t in ids if t not in self.stop_ids]
        piece = self.stops.feed(self.detok.add(shown), check=len(self.token_ids) + len(ids) > self.min_tokens)
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.top.extend(top if top else [None] * len(ids))
        piece = self._echoed(piece)
        self.text.append(piece)
        if self.stops.stopped is not None:
            self.finish_reason, self.stop_reason = "stop", self.stops.stopped
        return piece, ids

    def _echoed(self, piece: str) -> str:
        echo, self.echo = self.echo, ""
        return echo + piece

    def end(self, result: Result) -> str:
        self.result = result
        piece = self._echoed(self.stops.feed(self.detok.flush()) + self.stops.flush())
        self.text.append(piece)
        if self.finish_reason is None:
            self.finish_reason = "stop" if self.stops.stopped is not None or result.finish_reason in ("eos", "stop") \
                else "length"
            if self.stops.stopped is not None:
                self.stop_reason = self.stops.stopped
            elif result.finish_reason == "stop" and self.token_ids and self.token_ids[-1] in self.own_stop_ids:
                self.stop_reason = self.token_ids[-1]  # (the tokenizer's other EOS ids are EOS: null)
        return piece


@dataclass
class IdsOnly:
    """The stand-in for a checkpoint without a usable tokenizer: token ids in, token ids out.
    Its answers' text is empty (no vocabulary to decode with) and its EOS is the node's."""

    why: str
    name: str = "none"
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise TokenizerError(self.why)

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return ""


class Server:
    """What the handlers share: the bridge to the engine, the model's names and tokenizer, the
    `vllm:` metrics. `model_names`: the ids requests may name; the first is the one reported."""

    def __init__(self, bridge: Bridge, model_names: str | Sequence[str], metrics_port: int = 0,
                 cache: dict | None = None, node: str = "", tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.bridge = bridge
        self.tool_call_parser = tool_call_parser  # None: the chat template's own format, if it names one
        self.reasoning_parser = reasoning_parser
        self.model_names = [model_names] if isinstance(model_names, str) else list(model_names)
        if not self.model_names:
            raise ValueError("a server needs at least one model name")
        self.model_name = self.model_names[0]
        self.metrics_port = metrics_port
        self.cache = cache
        self.metrics = VllmMetrics(self.model_name, _stats_reader(node))
        self.text = TextPool()  # parsing, tokenizing and templates, off the event loop
        self.stall_s = STALL_S  # how long an answer's write may wait for its client (runtime/http/stalled.py)
        self._tokenizer: Tokenizer | IdsOnly | None = None
        self._texts: TokenTexts | None = None
        self._template: ChatTemplate | None = None

    def decoder(self) -> Tokenizer | IdsOnly:
        """The served model's tokenizer, loaded once the node said which model it serves; an
        `IdsOnly` when the model has none usable (token ids are served all the same)."""
        if self._tokenizer is None:
            try:
                self._tokenizer = node_tokenizer(self.node_info())
            except TokenizerError as e:
                log.warning("the HTTP API serves token ids only: %s", e)
                self._tokenizer = IdsOnly(str(e))
        return self._tokenizer

    def tokenizer(self, param: str | None = None) -> Tokenizer:
        """The served model's tokenizer, for what needs text; 400 naming what it lacks when the
        model has none usable."""
        tok = self.decoder()
        if isinstance(tok, IdsOnly):
            raise ApiError(400, f"the model {self.model_name!r} has no usable tokenizer, so this node serves token "
                                f"ids only (a prompt of ids to /v1/completions): {tok.why}", param=param,
                           code="no_tokenizer")
        return tok

    def token_texts(self) -> TokenTexts:
        """Each token's text as answers show it, decoded once (runtime/http/logprobs.py)."""
        if self._texts is None:
            self._texts = TokenTexts(self.decoder())
        return self._texts

    def max_model_len(self) -> int:
        info = self.bridge.info
        return info.max_model_len if info is not None else DEFAULT_MODEL_LEN

    async def body(self, request: Request, model: type[M]) -> M:
        """The request's JSON body as `model`: parsed in the text pool when large, what it asks
        of the text work bounded by the model's length (runtime/http/request_body.py)."""
        try:
            raw = await request.body()
        except ClientDisconnect:  # (gone before its body was in: nobody reads this answer)
            raise ApiError(499, "the client closed the connection", code="client_closed") from None
        return await parse_body(raw, model, self.text, _who(request), self.max_model_len())

    async def encode(self, who: str, texts: list[str], param: str, add_special_tokens: bool = True) -> list[list[int]]:
        """The token ids of `texts`, encoded in `who`'s turn of the text pool; 400 naming `param`
        when the model has no tokenizer or the text cannot be encoded."""
        tok = self.tokenizer(param)
        try:
            return await self.text.run(who, sum(map(len, texts)), lambda: [
                tok.encode(t, add_special_tokens=add_special_tokens) for t in texts])
        except TokenizerError as e:
            raise ApiError(400, f"{param}: {e}", param=param) from None

    async def decode(self, who: str, ids: list[list[int]], param: str, skip_special_tokens: bool = True) -> list[str]:
        """The texts of token id lists, decoded in `who`'s turn of the text pool."""
        tok = self.tokenizer(param)
        return await self.text.run(who, sum(map(len, ids)), lambda: [
            tok.decode(x, skip_special_tokens=skip_special_tokens) for x in ids])

    async def chat_prompt(self, who: str, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          add_special_tokens: bool = False, tools: list[dict] | None = None,
                          template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """The text and token ids of a conversation rendered with the model's chat template
        (which writes its own special tokens: the tokenizer adds none unless asked), with the
        request's `tools` and further template variables; rendered and encoded in `who`'s turn
        of the text pool, the render bounded in time and in size (runtime/client/chat_template.py)."""
        tok = self.tokenizer("messages")
        if tok.chat_template is None:
            raise ApiError(400, f"the model {self.model_name!r} has no chat template ({tok.name}): use "
                                f"/v1/completions", param="messages", code="no_chat_template")
        template = self._chat_template(tok)
        turns = [Message(m.template_role(), m.text(), m.template_calls(), m.tool_call_id, m.name, m.reasoning_content)
                 for m in messages]
        variables = {**(template_kwargs or {}), "tools": tools}

        def render() -> tuple[str, list[int]]:
            text = template.render(turns, add_generation_prompt=add_generation_prompt, **variables)
            return text, tok.encode(text, add_special_tokens=add_special_tokens)

        try:  # (never on the loop, however short the conversation: a template's loops are its own)
            return await self.text.run(who, self.text.inline, render)
        except (ChatTemplateError, TokenizerError) as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None

    def _chat_template(self, tok: Tokenizer) -> ChatTemplate:
        """The model's chat template, compiled once, writing at most what the model can take."""
        if self._template is None or self._template.source != tok.chat_template:
            try:
                self._template = ChatTemplate(tok.chat_template, tok.special_tokens,
                                              max_chars=max_text_chars(self.max_model_len()))
            except ChatTemplateError as e:
                raise ApiError(400, f"messages: {e}", param="messages") from None
        return self._template

    def tool_format(self) -> str | None:
        """The format tool calls are read in: --tool-call-parser, else the one the chat template
        asks for (None: neither names one)."""
        return self.tool_call_parser or default_parser(self.tokenizer().chat_template)

    def chat_output(self, body: ChatRequest) -> tuple[str | None, dict | None]:
        """How a chat request's answers are read and forced: the tool-call format (None: calls
        are not read) and the guided-decoding spec of a forced call (None: nothing forced)."""
        choice = body.choice()
        if choice == "none":
            return None, None  # tools are rendered all the same, as vLLM does, and never read
        fmt = self.tool_format()
        if fmt is None:
            raise ApiError(400, f"tool_choice {choice!r}: this server reads no tool calls from {self.model_name!r} "
                                f"(its chat template names no format): start it with --tool-call-parser",
                           param="tool_choice", code="unsupported_field")
        if choice == "auto":
            return fmt, None
        named = body.tool_choice.function.name if choice == "function" else None
        allowed = [(t.function.name, t.function.parameters) for t in body.tools or []
                   if named is None or t.function.name == named]
        # the call's regex is built, and a tool's schema refused naming what in it, by the
        # node's compile processes (runtime/grammar/tool_call.py): never on this event loop
        return fmt, {"kind": "tool_call", "spec": tool_call_spec(fmt, allowed)}

    def output(self, fmt: str | None, prompt_text: str, forced: bool = False) -> ChatOutput:
        """A fresh reader of one chat answer. A forced call is the whole answer, so it does not
        start inside a thinking the prompt opened."""
        return ChatOutput(fmt, self.reasoning_parser is not None, prompt_opens_thinking(prompt_text) and not forced)

    def max_body_bytes(self) -> int:
        """The largest request body this server reads: from the served model's length once the
        node said it (runtime/http/body_limit.py)."""
        info = self.bridge.info
        return max_body_bytes(info.max_model_len if info is not None else DEFAULT_MODEL_LEN)

    def node_info(self) -> InfoReply:
        """The node's limits; 503 until the bridge has them, and once it stops."""
        if not self.bridge.ready or self.bridge.info is None:
            raise ApiError(503, "the node is not ready (starting or stopping)", "service_unavailable", code="not_ready")
        return self.bridge.info

    # ---- checks --------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        """A request names one of the served ids, or none (the served model, as vLLM reads it);
        another is a 404, as vLLM and OpenAI answer it."""
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"The model `{model:.100}` does not exist (this node serves "
                                f"{', '.join(repr(n) for n in self.model_names)})", "NotFoundError", param="model",
                           code="model_not_found")

    def check_prompt(self, ids: list[int], max_tokens: int, param: str) -> None:
        info = self.node_info()
        if not ids:
            raise ApiError(400, "the prompt is empty", param=param)
        bad = [t for t in ids if not 0 <= t < info.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary 0..{info.vocab_size - 1}", param=param,
                           code="invalid_token_id")
        if len(ids) + max_tokens > info.max_model_len:
            raise ApiError(400, f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: together more than "
                                f"the model's {info.max_model_len}", param=param, code="context_length_exceeded")

    def check_answer(self, prompt_lens: list[int], n: int, max_tokens: int, prompt_k: int | None,
                     output_k: int | None, echo_k: int | None = None) -> int:
        """The log-probabilities the answer can carry (runtime/http/answer_size.py); 400 naming
        the limit when they are more than one answer may."""
        entries = answer_entries(prompt_lens, n, max_tokens, prompt_k, output_k, echo_k)
        if problem := answer_problem(entries, self.max_model_len()):
            raise ApiError(400, problem, param="prompt_logprobs" if prompt_k is not None else "logprobs",
                           code="answer_too_large")
        return entries

    def answer(self, obj: dict, entries: int) -> Response:
        """A whole (non-streamed) answer: written as it is made when it carries many
        log-probabilities (runtime/http/json_stream.py), else at once."""
        if entries <= BIG_ANSWER:
            return JSONResponse(materialize(obj))
        return CutWhenStalled(json_pieces(obj), self.stall_s, media_type="application/json")

    def check_body(self, body: SamplingBody) -> None:
        """400 naming the first field kvrt does not implement, or a value it cannot take here."""
        if problem := body.refusal():
            raise ApiError(400, problem[1], param=problem[0], code="unsupported_field")
        self.guided(body)
        vocab = self.node_info().vocab_size
        for name, ids in (("logit_bias", list(body.logit_bias or {})), ("stop_token_ids", body.stop_token_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"{name}: token id {bad[0]} is outside the vocabulary 0..{vocab - 1}", param=name,
                               code="invalid_token_id")

    def guided(self, body: SamplingBody) -> dict | None:
        """The guided spec of `body` (structured output), its shape checked as the engine checks
        it: 400 naming the field that asked, else. What the spec says is checked by the node's
        compile processes, which answer a spec they refuse as the request's 400."""
        try:
            spec, name = body.guided()
        except ValueError as e:
            raise ApiError(400, str(e), param=str(e).split(":", 1)[0], code="invalid_response_format") from None
        if spec is not None and (problem := guided_problem(spec)):
            raise ApiError(400, f"{name}: {problem}", param=name, code="invalid_response_format")
        return spec

    def sampling(self, body: SamplingBody) -> tuple[int, Sampling]:
        """The engine's EOS id (-1: none) and sampling parameters of `body`; the tokenizer's
        further EOS ids become stop token ids, with the request's own. `ignore_eos` drops the
        EOS ids."""
        eos = [] if body.ignore_eos else list(self.decoder().eos_token_ids)
        info = self.node_info()
        if not eos and info.eos_token_id >= 0 and not body.ignore_eos:
            eos = [info.eos_token_id]
        stops = list(dict.fromkeys(eos[1:] + [t for t in body.stop_token_ids or [] if t not in eos[:1]]))
        top = body.top_logprobs_count()
        return (eos[0] if eos else -1), Sampling(
            temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0), min_p=body.min_p, seed=body.seed,
            stop_token_ids=stops, logprobs=body.wants_logprobs(), top_logprobs=top,
            prompt_logprobs=body.prompt_logprobs_count(),
            logit_bias=[[t, b] for t, b in (body.logit_bias or {}).items()], min_tokens=body.min_tokens,
            repetition_penalty=body.repetition_penalty, frequency_penalty=body.frequency_penalty,
            presence_penalty=body.presence_penalty, guided=self.guided(body))

    # ---- running -------------------------------------------------------------------------
    def run(self, prompts: list[list[int]], max_tokens: int, body: SamplingBody,
            echoes: list[str] | None = None, who: str = "", guided: dict | None = None) -> "_Run":
        """The checked requests of one HTTP request, not sent yet: a stream sends them once its
        generator runs, so that the generator's `finally` is sure to cancel them. Each prompt
        gets `body.n` choices (index prompt * n + j, seed + j as vLLM numbers them); the first
        choice of a prompt goes first and the others follow once it has its first token, so
        that they find its prompt's blocks in the prefix cache instead of each computing them.
        `who`: the HTTP client, whose quota of requests in flight at the engine they count against.
        `guided`: what the answers must match (runtime/client/api.py's Generation.guided)."""
        stops = body.stops()
        if problem := stop_problem(stops):
            raise ApiError(400, problem, param="stop")
        if body.min_tokens > max_tokens:
            raise ApiError(400, f"min_tokens ({body.min_tokens}) is above max_tokens ({max_tokens})", param="min_tokens")
        tok = self.tokenizer("stop") if stops else self.decoder()
        eos, sampling = self.sampling(body)
        if guided is not None:
            if sampling.guided is not None:  # a forced call is the whole answer: it cannot also be that
                raise ApiError(400, "tool_choice: a forced tool call cannot be combined with structured output "
                                    "(response_format, guided_json or guided_regex)", param="tool_choice")
            sampling = dataclasses.replace(sampling, guided=guided)
        stop_ids = frozenset(([eos] if eos >= 0 else []) + sampling.stop_token_ids)
        # an answer nobody reads before its end comes from the engine whole: one message, not one
        # per token (a burst of such requests cannot then flood the server's one engine client)
        whole = not body.stream and not stops and body.n == 1 and not sampling.logprobs \
            and not sampling.top_logprobs and sampling.prompt_logprobs is None
        run = _Run(self, who, body.cache_salt or "", engine_stream=not whole)
        run.guided_param = "tools" if guided is not None else body.guided()[1] or None
        for i, ids in enumerate(prompts):
            leader = None
            for j in range(body.n):
                rid = self.bridge.new_id()
                run.choices[rid] = _Choice(i * body.n + j, ids, IncrementalDetokenizer(tok, ids, body.skip_special_tokens),
                                           StopStrings(stops, body.include_stop_str_in_output), i, stop_ids,
                                           body.include_stop_str_in_output, body.min_tokens,
                                           echoes[i] if echoes else "", frozenset(body.stop_token_ids or ()))
                own = sampling if body.seed is None else dataclasses.replace(sampling, seed=(body.seed + j) % (1 << 63))
                if leader is not None:  # the prompt's first choice scores it for all
                    own = dataclasses.replace(own, prompt_logprobs=None)
                elif own.prompt_logprobs is not None:
                    run.scorers.add(rid)
                run.requests.append((rid, ids, max_tokens, eos, own))
                run.max_tokens[rid] = max_tokens
                if leader is None:
                    leader = rid
                else:
                    run.followers.setdefault(leader, []).append(rid)
        self.metrics.request(body.n)
        return run


class _Run:
    """The engine requests of one HTTP request, and their events as they arrive."""

    def __init__(self, server: Server, who: str = "", cache_salt: str = "", engine_stream: bool = True) -> None:
        self.server = server
        self.who = who
        self.cache_salt = cache_salt
        self.engine_stream = engine_stream  # False: the engine sends each answer whole, at its end
        self.events: asyncio.Queue = asyncio.Queue()
        self.choices: dict[str, _Choice] = {}
        self.requests: list[tuple[str, list[int], int, int, Sampling]] = []
        self.followers: dict[str, list[str]] = {}  # a prompt's first request -> its other choices
        self.max_tokens: dict[str, int] = {}  # each request's max_tokens (for the metrics)
        self.pending: set[str] = set()  # not finished
        self.sent: set[str] = set()
        self.arrival = time.monotonic()
        self.guided_param: str | None = None  # the field that asked for a grammar: an engine refusal names it
        self.scorers: set[str] = set()  # requests that score their prompt: each prompt's first choice
        self.prompt_scores: dict[int, tuple[list, list, list]] = {}  # by prompt: (logprobs, ranks, top)

    def unshown_prompt(self, ch: _Choice) -> tuple[list, list, list] | None:
        """The scores of `ch`'s prompt the first time a stream asks for that choice, then None."""
        if ch.prompt_shown or ch.prompt_index not in self.prompt_scores:
            return None
        ch.prompt_shown = True
        return self.prompt_scores[ch.prompt_index]

    def _timed(self, ch: _Choice, n: int) -> None:
        """Observe the latency of an answer that brought `n` tokens to `ch`."""
        if not n:
            return
        now = time.monotonic()
        if ch.last_tokens_at is None:
            self.server.metrics.first_token(now - self.arrival)
        else:
            self.server.metrics.next_tokens(now - ch.last_tokens_at)
        ch.last_tokens_at = now

    def start(self) -> None:
        """Send the requests (a prompt's other choices once its first has a token); their
        events come to this run's queue."""
        self.pending = set(self.choices)
        waiting = {r for rest in self.followers.values() for r in rest}
        self._send([rid for rid, *_ in self.requests if rid not in waiting])

    def _send(self, rids: list[str]) -> None:
        loop = asyncio.get_running_loop()
        for rid, ids, max_tokens, eos, sampling in self.requests:
            if rid in rids and rid in self.pending and rid not in self.sent:
                self.sent.add(rid)
                self.server.bridge.submit(Submission(rid, ids, max_tokens, eos, sampling, loop, self.events,
                                                     self.cache_salt, self.who, self.engine_stream))

    async def __aiter__(self) -> AsyncIterator[tuple[_Choice, str, list[int], bool]]:
        """(choice, new text, new tokens, finished) as the engine answers; ApiError on an engine error."""
        while self.pending:
            rid, ev = await self.events.get()
            if rid not in self.pending:
                continue
            if not isinstance(ev, ErrorEvent):  # its first answer: its prompt's blocks are cached
                self._send(self.followers.pop(rid, []))
            ch = self.choices[rid]
            if isinstance(ev, TokenEvent):
                skip = max(len(ch.token_ids) - int(ev.index), 0)  # a resent overlap is not repeated
                ids = [int(t) for t in ev.token_ids[skip:]]
                lps = [float(x) for x in ev.logprobs[skip:]] if ev.logprobs else [None] * len(ids)
                top = list(ev.top[skip:]) if ev.top else None
                if int(ev.index) == 0 and rid in self.scorers:
                    self.prompt_scores.setdefault(ch.prompt_index, (list(ev.prompt_logprobs), list(ev.prompt_ranks),
                                                                    list(ev.prompt_top)))
                self._timed(ch, len(ids))
                stopped_before = ch.stops.stopped is not None
                piece, shown = ch.add(ids, lps, top)
                if ch.stops.stopped is not None and not stopped_before:
                    self.server.bridge.cancel(rid)  # the rest is not wanted; its Result still brings the usage
                yield ch, piece, shown, False
            elif isinstance(ev, ErrorEvent):
                self.pending.discard(rid)
                raise _engine_error(ev, self.guided_param)
            else:
                res = ev  # a Result: the client converted the FinishedEvent
                self.pending.discard(rid)
                if rid in self.scorers and res.finish_reason != "cancelled":
                    self.prompt_scores.setdefault(ch.prompt_index, (res.prompt_logprobs, res.prompt_ranks,
                                                                    res.prompt_top))
                rest = [int(t) for t in res.output_token_ids[len(ch.token_ids):]]
                if not self.engine_stream and rest:  # its token times are the engine's
                    self.server.metrics.first_token(res.engine_ttft_ms / 1e3)
                    if len(rest) > 1:
                        self.server.metrics.next_tokens((res.engine_e2e_ms - res.engine_ttft_ms) / 1e3 / (len(rest) - 1))
                elif ch.stops.stopped is None:
                    self._timed(ch, len(rest))
                piece, shown = ch.add(rest, [None] * len(rest)) if rest else ("", [])
                piece += ch.end(res)
                self.server.metrics.finished(len(ch.prompt), len(res.output_token_ids),
                                             time.monotonic() - self.arrival, ch.finish_reason or "length",
                                             self.max_tokens.get(rid, 0), res)
                yield ch, piece, shown, True

    async def complete(self, request: Request) -> None:
        """Run to the end, or cancel when the client goes away first (a request without a
        stream has no write to fail, so its disconnect is awaited beside it)."""

        async def drain() -> None:
            async for _ in self:
                pass

        await self._unless_gone(drain(), request)

    async def first(self, request: Request) -> tuple[AsyncIterator, tuple]:
        """Start the stream: its first item, so that an engine error (bad request, node stopping
        or full) is answered with its status before a 200 goes out; the iterator goes on."""
        it = self.__aiter__()
        return it, await self._unless_gone(it.__anext__(), request)

    async def _unless_gone(self, awaitable, request: Request):
        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(awaitable), asyncio.ensure_future(gone())
        try:
            await asyncio.wait([work, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            left = not work.done()
            if left:
                work.cancel()
            if left or work.cancelled() or work.exception() is not None:
                self.cancel()
        if left:
            raise ApiError(499, "the client closed the connection", code="client_closed")
        return work.result()  # an engine error is raised here

    def cancel(self) -> None:
        for rid in self.pending & self.sent:
            self.server.bridge.cancel(rid)
        self.pending.clear()

    def usage(self) -> dict:
        """Token counts; a prompt counts once however many choices it has (as vLLM counts it)."""
        prompt = sum(len(c.prompt) for c in {c.prompt_index: c for c in self.choices.values()}.values())
        completion = sum(len(c.token_ids) for c in self.choices.values())
        cached = sum(c.result.cached_tokens for c in self.choices.values() if c.result is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


def _engine_error(ev: ErrorEvent, param: str | None = None) -> ApiError:
    """An engine's error as the HTTP answer; `param`: the field that asked for a grammar (what a
    refusal of the request itself concerns, as the HTTP server checks everything else first)."""
    if ev.code in (BAD_REQUEST, DUPLICATE):
        return ApiError(400, f"the engine refused the request: {ev.message}", code=ev.code,
                        param=param if ev.code == BAD_REQUEST else None)
    if ev.code == UNRESPONSIVE:
        return ApiError(504, ev.message, "service_unavailable", code=ev.code)
    if ev.code == TOO_MANY:  # this HTTP client's quota, not the node's state
        return ApiError(429, f"over capacity: {ev.message}", "rate_limit_exceeded", code=ev.code)
    return ApiError(503, f"the node cannot serve the request now ({ev.code}): {ev.message}", "service_unavailable",
                    code=ev.code)


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    yield first
    async for item in rest:
        yield item


async def _sse(obj) -> AsyncIterator[str]:
    """One server-sent event of `obj`: one piece, unless its log-probabilities make it large
    (runtime/http/json_stream.py)."""
    held = None
    async for piece in json_pieces(obj):
        if held is not None:
            yield held
        held = piece if held is not None else "data: " + piece
    yield (held or "data: ") + "\n\n"


async def _stream(run, first, rest: AsyncIterator, frame, usage_base: dict, include_usage: bool,
                  opening: dict | None = None, continuous: bool = False) -> AsyncIterator[str]:
    """The server-sent events of one answer, for both endpoints: an optional opening frame,
    `frame(choice, text, token_ids, done)` for each event (None: nothing to send; a list: those
    frames), the usage
    frame if asked (`continuous`: the usage so far in every frame too, vLLM's
    continuous_usage_stats), then `[DONE]`. A request that fails (the engine failed it, naming why; or
    this side failed) ends with an error frame instead, and no `[DONE]`: the status 200 went out
    with the first frame, and a failed answer must not read as a finished one. The request is
    cancelled however the stream ends (a client that leaves frees its blocks)."""
    try:
        if opening is not None:
            async for piece in _sse({**opening, "usage": run.usage()} if continuous else opening):
                yield piece
        async for ch, piece, ids, done in _chain(first, rest):
            out = frame(ch, piece, ids, done)
            for one in out if isinstance(out, list) else [] if out is None else [out]:
                async for part in _sse({**one, "usage": run.usage()} if continuous else one):
                    yield part
        if include_usage:
            async for piece in _sse({**usage_base, "choices": [], "usage": run.usage()}):
                yield piece
    except ApiError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
        return
    except Exception:  # noqa: BLE001 - whatever failed, the client is told so
        log.exception("a stream failed")
        failed = ApiError(500, "internal error (see the node's log)", "internal_error").body()
        yield f"data: {json.dumps(failed)}\n\n"
        return
    finally:
        run.cancel()
    yield "data: [DONE]\n\n"


def create_app(server: Server, body_s: float = BODY_S) -> FastAPI:
    """The ASGI app: /health, /v1/models, /v1/completions, /v1/chat/completions, /tokenize,
    /detokenize, /version, /reset_prefix_cache, /metrics, /kvrt/cache; its bodies bounded in size
    and in time (`body_s`: runtime/http/body_limit.py)."""
    app = FastAPI(title="kvrt", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, limit=server.max_body_bytes, body_s=body_s)

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, e: ApiError) -> JSONResponse:
        return _error(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        for err in errors:  # a validator's exception, kept here, holds the body through its frames (a cycle)
            err.pop("ctx", None)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        return _error(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}",
                      "invalid_request_error", ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error in an HTTP handler")
        return _error(500, "internal error (see the node's log)", "internal_error")

    @app.get("/health")
    async def health() -> JSONResponse:
        server.node_info()
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        info = server.node_info()
        return JSONResponse({"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                                         "owned_by": "kvrt", "root": server.model_name,
                                                         "parent": None, "max_model_len": info.max_model_len,
                                                         "vocab_size": info.vocab_size}]})

    @app.get("/version")
    async def version_() -> JSONResponse:
        return JSONResponse({"version": _version()})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's: a prompt's (or a conversation's) token ids, their count and the model's limit."""
        body = await server.body(request, TokenizeRequest)
        server.check_model(body.model)
        info = server.node_info()
        who = _who(request)
        if body.messages is not None:
            _, ids = await server.chat_prompt(who, body.messages, body.add_generation_prompt,
                                              bool(body.add_special_tokens), body.template_tools(),
                                              body.chat_template_kwargs)
        else:
            [ids] = await server.encode(who, [body.prompt], "prompt", body.add_special_tokens is not False)
        out = {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = await server.decode(who, [[t] for t in ids], "tokens", skip_special_tokens=False)
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        """vLLM's: the text of token ids (special tokens kept, as the ids say)."""
        body = await server.body(request, DetokenizeRequest)
        server.check_model(body.model)
        info = server.node_info()
        bad = [t for t in body.tokens if not 0 <= t < info.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary 0..{info.vocab_size - 1}",
                           param="tokens", code="invalid_token_id")
        [text] = await server.decode(_who(request), [body.tokens], "tokens", skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    @app.get("/kvrt/cache")
    async def cache() -> JSONResponse:
        """How this node keys its blocks and where it publishes its KV events (for a router)."""
        if server.cache is None:
            raise ApiError(404, "this server does not describe its cache", code="no_cache_info")
        return JSONResponse(server.cache)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        """Drop the node's prefix cache, as vLLM's and SGLang's servers do (runtime/cache/reset.py):
        the blocks freed per tier, those held until released and the storage keys forgotten."""
        server.node_info()
        try:
            got = await server.bridge.reset_prefix_cache()
        except ClientError as e:
            raise ApiError(503, f"the node did not reset its prefix cache: {e}", "service_unavailable") from None
        return JSONResponse({"freed": {"device": got.device, "host": got.host},
                             "held": {"device": got.held_device, "host": got.held_host},
                             "storage_keys_forgotten": got.storage})

    @app.get("/metrics")
    async def metrics() -> Response:
        """vLLM's series (runtime/http/vllm_metrics.py), and the engine's own from --metrics-port
        when the node has one."""
        ours = await asyncio.to_thread(server.metrics.exposition)
        if not server.metrics_port:
            return Response(ours, media_type=PROMETHEUS_TEXT)
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        try:
            engine = await asyncio.to_thread(_fetch, url)
        except (OSError, urllib.error.URLError) as e:
            raise ApiError(503, f"the node's metrics at {url} did not answer: {e}", "service_unavailable") from None
        return Response(ours + engine, media_type=PROMETHEUS_TEXT)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await server.body(request, CompletionRequest)
        server.check_model(body.model)
        server.check_body(body)
        who = _who(request)
        text = server.token_texts()
        p = body.prompt
        texts: list[str] | None = None
        if isinstance(p, str):
            texts = [p]
        elif p and all(isinstance(x, str) for x in p):
            texts = list(p)
        if texts is not None and len(texts) * body.n <= MAX_BATCH:
            prompts = await server.encode(who, texts, "prompt", add_special_tokens=body.add_special_tokens)
        elif texts is not None:
            prompts = [[]] * len(texts)  # (refused just below, untokenized)
        elif p and all(isinstance(x, list) for x in p):
            prompts = [list(x) for x in p]
        else:
            prompts = [list(p)]
        if not 0 < len(prompts) * body.n <= MAX_BATCH:
            raise ApiError(400, f"a request takes 1..{MAX_BATCH} prompts times n, got {len(prompts)} x {body.n}",
                           param="prompt")
        max_tokens = body.max_tokens or DEFAULT_MAX_TOKENS  # an explicit null is the default too
        for ids in prompts:
            server.check_prompt(ids, max_tokens, "prompt")
        k = body.logprobs if body.wants_logprobs() else None
        entries = server.check_answer([len(x) for x in prompts], body.n, max_tokens, body.prompt_logprobs, k,
                                      k if body.echo else None)
        echoes = None
        if body.echo:
            echoes = texts if texts is not None else await server.decode(
                who, prompts, "echo", skip_special_tokens=body.skip_special_tokens)
        run = server.run(prompts, max_tokens, body, echoes, who)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "text_completion", "created": created, "model": server.model_name}

        def logprobs(ids, lps, top, prompt, scores):
            return completion_logprobs(text, ids, lps, top, prompt, scores, body.echo, body.logprobs or 0) \
                if body.wants_logprobs() else None

        if body.stream:
            run.start()
            it, first = await run.first(request)

            def frame(ch, piece, ids, done):
                scores = run.unshown_prompt(ch)
                if not (piece or ids or done or scores):
                    return None
                at = len(ch.token_ids) - len(ids)
                return {**base, "choices": [{"index": ch.index, "text": piece,
                                             "logprobs": logprobs(ids, ch.logprobs[at:], ch.top[at:], ch.prompt,
                                                                  scores),
                                             "finish_reason": ch.finish_reason if done else None,
                                             "stop_reason": ch.stop_reason if done else None, "token_ids": ids,
                                             "prompt_logprobs": prompt_logprobs(text, ch.prompt, scores,
                                                                                body.prompt_logprobs)}]}

            usage = body.stream_options is not None and body.stream_options.include_usage
            return CutWhenStalled(_stream(run, first, it, frame, base, usage, continuous=body.continuous_usage()),
                                  server.stall_s, media_type="text/event-stream")
        run.start()
        await run.complete(request)
        choices = sorted(run.choices.values(), key=lambda c: c.index)
        scores = run.prompt_scores
        return server.answer({**base, "choices": [
            {"index": c.index, "text": "".join(c.text),
             "logprobs": logprobs(c.token_ids, c.logprobs, c.top, c.prompt, scores.get(c.prompt_index)),
             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "token_ids": c.token_ids,
             "prompt_logprobs": prompt_logprobs(text, c.prompt, scores.get(c.prompt_index), body.prompt_logprobs)}
            for c in choices], "usage": run.usage()}, entries)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await server.body(request, ChatRequest)
        server.check_model(body.model)
        server.check_body(body)
        if problem := body.tools_problem():
            raise ApiError(400, problem[1], param=problem[0])
        who = _who(request)
        prompt_text, ids = await server.chat_prompt(who, body.messages, body.add_generation_prompt,
                                                    body.add_special_tokens, tools=body.template_tools(),
                                                    template_kwargs=body.template_variables())
        text = server.token_texts()
        info = server.node_info()
        max_tokens = body.max_completion_tokens or body.max_tokens or max(info.max_model_len - len(ids), 1)
        server.check_prompt(ids, max_tokens, "messages")
        entries = server.check_answer([len(ids)], body.n, max_tokens, body.prompt_logprobs,
                                      body.top_logprobs_count() if body.logprobs else None)
        fmt, guided = server.chat_output(body)
        run = server.run([ids], max_tokens, body, who=who, guided=guided)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "chat.completion", "created": created, "model": server.model_name}

        def finish_reason(ch: _Choice, out: ChatOutput) -> str | None:
            """A finished answer that called tools says so, unless it was cut short."""
            return "tool_calls" if out.called and ch.finish_reason == "stop" else ch.finish_reason

        if body.stream:
            chunk = {**base, "object": "chat.completion.chunk"}
            outputs = {j: server.output(fmt, prompt_text, guided is not None) for j in range(body.n)}

            run.start()
            it, first = await run.first(request)

            def frame(ch, piece, ids_, done):
                scores = run.unshown_prompt(ch) if body.prompt_logprobs is not None else None
                out = outputs[ch.index]
                deltas = out.feed(piece) if piece else []
                if done:
                    deltas += out.finish()
                if not deltas and (done or (ids_ and body.logprobs) or scores):
                    deltas = [{}]
                at = len(ch.token_ids) - len(ids_)
                lp = chat_logprobs(text, ids_, ch.logprobs[at:], ch.top[at:]) if body.logprobs else None
                frames = []
                for k, d in enumerate(deltas):
                    last = done and k == len(deltas) - 1
                    one = {**chunk, "choices": [{"index": ch.index, "delta": d, "logprobs": lp if k == 0 else None,
                                                 "finish_reason": finish_reason(ch, out) if last else None,
                                                 "stop_reason": ch.stop_reason if last else None}]}
                    if k == 0 and scores is not None:
                        one["prompt_logprobs"] = prompt_logprobs(text, ch.prompt, scores, body.prompt_logprobs)
                    frames.append(one)
                return frames

            opening = {**chunk, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None, "stop_reason": None}
                                            for j in range(body.n)]}
            usage = body.stream_options is not None and body.stream_options.include_usage
            return CutWhenStalled(_stream(run, first, it, frame, chunk, usage, opening,
                                          continuous=body.continuous_usage()), server.stall_s,
                                  media_type="text/event-stream")
        run.start()
        await run.complete(request)
        choices = []
        for c in sorted(run.choices.values(), key=lambda c: c.index):
            out = server.output(fmt, prompt_text, guided is not None)
            choices.append({"index": c.index, "message": out.message("".join(c.text)),
                            "logprobs": chat_logprobs(text, c.token_ids, c.logprobs, c.top) if body.logprobs else None,
                            "finish_reason": finish_reason(c, out), "stop_reason": c.stop_reason,
                            "token_ids": c.token_ids})
        return server.answer({**base, "choices": choices, "usage": run.usage(),
                              "prompt_logprobs": prompt_logprobs(text, ids, run.prompt_scores.get(0),
                                                                 body.prompt_logprobs)}, entries)

    return app


def _who(request: Request) -> str:
    """An HTTP client's identity for its quota, its fair share of the engine and its turn in the
    text pool: its address (a port is not: a client opens as many connections as it likes).
    Behind `kvrt route` every client is the router's address."""
    return request.client.host if request.client else ""


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as r:
        return r.read()


def _stats_reader(node: str) -> StatsReader:
    """The engine's counters of `node` for the `vllm:` gauges (none without a node name: a
    server built over a bridge alone, as in tests)."""
    if not node:
        return lambda: None
    from kvrt.runtime.node.status import engine_counters

    return lambda: engine_counters(node)


def _version() -> str:
    try:
        return version("kvrt")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"
