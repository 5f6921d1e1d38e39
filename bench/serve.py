"""kvrt bench serve: an OpenAI-compatible server driven over HTTP, measured as the standard serving
benchmarks measure it.

Every request is one `POST {url}/completions` with the prompt as token ids, `stream: true`,
`stream_options.include_usage`, `temperature: 0` and `ignore_eos: true` (kvrt, vLLM and SGLang honour it), so any such server
(`kvrt launch --http-port H`, vLLM, SGLang) can be compared with the same command. Times are taken
by this client when it reads each server-sent event:

- TTFT: send -> the first event carrying output; E2E: send -> `[DONE]`;
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with at least two tokens;
- ITL: the gaps between successive events carrying output (a server may pack several tokens in one);
- goodput: completed requests per second whose TTFT and TPOT meet the SLO given;
- prefix-cache hit rate: the sum of `usage.prompt_tokens_details.cached_tokens` over the sum of
  prompt tokens ("n/a" when the server reports no cached tokens).

Prompts: without --trace, synthetic ones: --num-prefixes shared prefixes of --prefix-len tokens,
each request one prefix (in turn) and its own 0.5..1.5 x --suffix-len tokens. With --trace, a
Mooncake-format trace: each hash id expanded to --tokens-per-id tokens exactly as `kvrt replay`
expands it (equal ids, equal tokens), its output lengths capped at --max-tokens. Token ids are
drawn from 0..--vocab-size-1, by default the server's own vocabulary (its /v1/models card's
vocab_size, else what its /tokenize gives): ids beyond a small model's vocabulary would fail every
request. The trace's own clock is not replayed.

With --no-stream each request asks for the whole answer at once (`stream: false`): only E2E is
measured then (no TTFT, TPOT or ITL: the client sees every token at the end), which is how a
client that does not stream sees the server, connection reuse included.

Arrival: closed loop with --concurrency C (C requests in flight; the next one goes when one ends),
or open loop with --request-rate R (Poisson arrivals, R a second on average, from --seed; nothing
waits for an answer). One unmeasured warm-up request goes first; when it fails, nothing more is
sent and the command fails naming why.

Nothing is truncated: a request whose prompt plus max tokens exceeds the server's max_model_len (from
its /v1/models card, or learnt from its first "too long" 400 answer) is skipped, counted and
reported with the reason. With --compare-zmq PORT the same requests also go to the node's own
ZeroMQ client API (kvrt.Client, in this process), after the HTTP run and with every token id
shifted by one (same lengths and sharing, nothing left cached by the HTTP run), and the table shows
HTTP next to native and their ratio: what the HTTP layer costs.

Exit status: 0 when every request sent completed (skipped ones are not failures), 1 when any
failed (an HTTP error, a broken or silent stream) or the server cannot be reached, 2 for bad
arguments, 130 when interrupted.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import re
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence
from urllib.parse import urlsplit

import httpx2
import numpy as np

from kvrt.runtime.client.api import ErrorEvent, TokenEvent
from kvrt.runtime.client.client import Client, ClientError, Result
from kvrt.runtime.client.replay import fmt, pct, trace_prompts
from kvrt.runtime.client.trace import TRACE_BLOCK, TraceError, load_trace

FALLBACK_VOCAB = 512      # token ids below it when the server names no vocabulary (ordinary tokens of any model)
PROBE_TIMEOUT_S = 5.0     # how long the server gets to answer /v1/models before we say it is not there
MAX_ERRORS_KEPT = 5       # distinct error messages a run keeps
NATIVE_MAX_IN_FLIGHT = 1024  # the ZeroMQ client API's limit per client
TICK_S = 0.05
SYNTHETIC_REQUESTS = 200
PCTS = (50, 90, 99)
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
_TOO_LONG = re.compile(r"context.length|maximum context|max_model_len|too long|longer than", re.I)
_LIMIT_IN_MESSAGE = re.compile(r"maximum context length is (\d+)", re.I)  # vLLM's wording


@dataclass
class Request:
    """One request of the run. `arrival_s`: when an open loop sends it, from the start."""

    index: int
    prompt: list[int]
    max_tokens: int
    arrival_s: float = 0.0


@dataclass
class Outcome:
    """What happened to one request, as this client saw it."""

    index: int
    status: str = "failed"  # completed | failed | skipped
    reason: str = ""        # why it failed or was skipped
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not say
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    _last: float = 0.0

    def saw_output(self, now: float, t_send: float) -> None:
        if self.ttft_s is None:
            self.ttft_s = now - t_send
        else:
            self.itl_s.append(now - self._last)
        self._last = now

    def tpot_s(self) -> float | None:
        if self.e2e_s is None or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class Arrival:
    """Closed loop (`concurrency` in flight) or open loop (Poisson at `rate` a second)."""

    concurrency: int | None
    rate: float | None

    def describe(self) -> str:
        return f"request rate {self.rate:g}/s (Poisson)" if self.rate else f"concurrency {self.concurrency}"


@dataclass
class Slo:
    """Bounds a request must meet to count towards goodput (None: no bound)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, o: Outcome) -> bool:
        """A request of one output token has no TPOT, so only its TTFT can miss."""
        if self.ttft_ms is not None and (o.ttft_s is None or o.ttft_s * 1000 > self.ttft_ms):
            return False
        tpot = o.tpot_s()
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


class Limit:
    """The server's max_model_len: from its model card, or learnt from a "too long" answer; a
    request over it is skipped, never cut."""

    def __init__(self, max_model_len: int | None) -> None:
        self.max_model_len = max_model_len

    def too_long(self, req: Request) -> str:
        """The reason to skip `req`, or ""."""
        if self.max_model_len is not None and len(req.prompt) + req.max_tokens > self.max_model_len:
            return f"prompt + max_tokens > max_model_len {self.max_model_len}"
        return ""

    def learn(self, message: str) -> None:
        m = _LIMIT_IN_MESSAGE.search(message)
        if m and self.max_model_len is None:
            self.max_model_len = int(m.group(1))


# ---- prompts ---------------------------------------------------------------------------------

def synthetic_requests(n: int, num_prefixes: int, prefix_len: int, suffix_len: int, max_tokens: int,
                       vocab_size: int, seed: int) -> list[Request]:
    """`n` prompts: prefix i % num_prefixes, then 0.5..1.5 x suffix_len tokens of its own."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(0, vocab_size, prefix_len).tolist() for _ in range(num_prefixes)]
    out = []
    for i in range(n):
        own = int(rng.integers(max(suffix_len // 2, 1), suffix_len + suffix_len // 2 + 1)) if suffix_len else 0
        out.append(Request(i, heads[i % num_prefixes] + rng.integers(0, vocab_size, own).tolist(), max_tokens))
    return out


def trace_requests(path: Path, limit: int | None, tokens_per_id: int, max_tokens: int,
                   vocab_size: int) -> list[Request]:
    """The trace's first `limit` requests, each hash id `tokens_per_id` tokens, uncut."""
    specs = trace_prompts(load_trace(path, limit), tokens_per_id, vocab_size=vocab_size,
                          max_new_tokens_cap=max_tokens)
    return [Request(i, s.prompt.tolist(), s.max_new_tokens) for i, s in enumerate(specs)]


def poisson_arrivals(reqs: Sequence[Request], rate: float, seed: int) -> None:
    """Exponential gaps of mean 1/rate (the first request at 0), the same for both sides of a run."""
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, len(reqs))
    for r, t in zip(reqs, np.cumsum(gaps) - gaps[0]):
        r.arrival_s = float(t)


def shifted(reqs: Sequence[Request], vocab_size: int) -> list[Request]:
    """The same requests with every token id t -> (t + 1) % vocab_size: a bijection, so lengths and
    shared prefixes stay exactly as they were, but none of it is in the cache the other run left."""
    return [Request(r.index, [(t + 1) % vocab_size for t in r.prompt], r.max_tokens, r.arrival_s) for r in reqs]


# ---- the HTTP side ---------------------------------------------------------------------------

class ServerError(Exception):
    """The server is not there, or not an OpenAI-compatible one: says which and why."""


@dataclass
class Target:
    url: str            # .../v1
    model: str
    max_model_len: int | None


def _error_text(body: bytes) -> tuple[str, str]:
    """(message, code) of an error answer, in the OpenAI shape or not."""
    text = body.decode("utf-8", "replace")
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else {}
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or text)[:300], str(err.get("code") or "")
        return str(err)[:300], ""
    except ValueError:
        return text.strip()[:300], ""


async def probe(client: httpx2.AsyncClient, url: str, model: str | None) -> Target:
    """The model to ask for and its max_model_len, from GET {url}/models."""
    where = f"{url}/models"
    try:
        r = await client.get(where, timeout=PROBE_TIMEOUT_S)
    except httpx2.TimeoutException:
        raise ServerError(f"no answer from {where} within {PROBE_TIMEOUT_S:g} s: is an OpenAI-compatible server "
                          f"listening there?") from None
    except httpx2.HTTPError as e:
        raise ServerError(f"cannot reach {where}: {e or type(e).__name__}") from None
    if r.status_code != 200:
        msg, _ = _error_text(r.content)
        raise ServerError(f"GET {where} answered HTTP {r.status_code}{f' ({msg})' if msg else ''}: is this an "
                          f"OpenAI-compatible server, and does the URL end with /v1?")
    try:
        cards = [c for c in r.json()["data"] if isinstance(c, dict) and isinstance(c.get("id"), str)]
    except (ValueError, KeyError, TypeError):
        raise ServerError(f"GET {where} did not answer an OpenAI model list") from None
    if model is None:
        if not cards:
            raise ServerError(f"{where} lists no model: pass --model NAME")
        card = cards[0]
    else:
        card = next((c for c in cards if c["id"] == model), {"id": model})
    limit = card.get("max_model_len")
    return Target(url, card["id"], limit if isinstance(limit, int) and limit > 0 else None)


# text whose tokens reach far into a vocabulary: words, digits, punctuation, other scripts
VOCAB_PROBE_TEXT = ("The quick brown fox jumps over the lazy dog 0123456789 !?;:()[]{} naïve café Straße "
                    "日本語のテキスト Привет мир مرحبا 🙂 def f(x): return x ** 2")


async def _vocab(client: httpx2.AsyncClient, url: str, model: str | None) -> tuple[int | None, str]:
    """The server's vocabulary size and where it came from: its /v1/models card's vocab_size
    (kvrt's), else one more than the largest id its /tokenize (vLLM's, kvrt's) gives for a text
    of many scripts (every id below it is a token of the vocabulary), else (None, "")."""
    target = await probe(client, url, model)
    r = await client.get(f"{url}/models", timeout=PROBE_TIMEOUT_S)
    for card in r.json().get("data", []):
        v = card.get("vocab_size") if isinstance(card, dict) and card.get("id") == target.model else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v, f"{url}/models"
    root = url[:-len("/v1")] if url.endswith("/v1") else url
    try:
        r = await client.post(f"{root}/tokenize", json={"model": target.model, "prompt": VOCAB_PROBE_TEXT},
                              timeout=PROBE_TIMEOUT_S)
        tokens = r.json().get("tokens") if r.status_code == 200 else None
    except (httpx2.HTTPError, ValueError, AttributeError):
        tokens = None
    if isinstance(tokens, list) and tokens and all(isinstance(t, int) and t >= 0 for t in tokens):
        return max(tokens) + 1, f"{root}/tokenize (the largest id of a sample text + 1)"
    return None, ""


def server_vocab(url: str, model: str | None,
                 transport: httpx2.AsyncBaseTransport | None = None) -> tuple[int | None, str]:
    """The token ids a server takes: `_vocab` over a client of its own. ServerError when the
    server cannot be reached."""
    async def run() -> tuple[int | None, str]:
        async with httpx2.AsyncClient(transport=transport, trust_env=False) as client:
            return await _vocab(client, url, model)

    return asyncio.run(run())


async def _send(client: httpx2.AsyncClient, target: Target, req: Request, limit: Limit,
                timeout: float, stream: bool = True) -> Outcome:
    out = Outcome(req.index, prompt_tokens=len(req.prompt))
    if why := limit.too_long(req):
        out.status, out.reason = "skipped", why
        return out
    body = {"model": target.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "stream": stream, "ignore_eos": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    t_send = time.perf_counter()
    try:
        async with client.stream("POST", f"{target.url}/completions", json=body,
                                 timeout=httpx2.Timeout(timeout, connect=PROBE_TIMEOUT_S)) as r:
            if r.status_code != 200:
                msg, code = _error_text(await r.aread())
                if r.status_code == 400 and (code == "context_length_exceeded" or _TOO_LONG.search(msg)):
                    limit.learn(msg)
                    out.status, out.reason = "skipped", f"the server refused it as too long: {msg}"
                else:
                    out.reason = f"HTTP {r.status_code}: {msg}"
                return out
            if stream:
                await _read_events(r, out, t_send)
            else:
                _read_answer(await r.aread(), out, t_send)
    except httpx2.TimeoutException:
        out.status, out.reason = "failed", f"the server sent nothing for {timeout:g} s"
    except httpx2.HTTPError as e:
        out.status, out.reason = "failed", f"broken stream: {type(e).__name__}: {e}"
    return out


def _count(v: object) -> int | None:
    """A token count the server reported, if it is one (the server's answers are not trusted)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _usage(obj: dict, out: Outcome) -> None:
    """The token counts of an answer's or a stream's `usage`, where the server gave them."""
    usage = obj.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        out.prompt_tokens = _count(usage.get("prompt_tokens")) or out.prompt_tokens
        out.output_tokens = _count(usage.get("completion_tokens")) or 0
        out.cached_tokens = cached if cached is not None else out.cached_tokens


def _read_answer(body: bytes, out: Outcome, t_send: float) -> None:
    """Fill `out` from one whole (not streamed) completion: its time and token counts."""
    out.e2e_s = time.perf_counter() - t_send
    try:
        obj = json.loads(body)
    except ValueError:
        out.reason = f"an answer that is not JSON: {body[:100]!r}"
        return
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not any(isinstance(ch, dict) and (ch.get("text") or ch.get("token_ids"))
                                                for ch in choices):
        out.reason = f"an answer without output: {body[:100]!r}"
        return
    _usage(obj, out)
    out.status = "completed"


async def _read_events(r: httpx2.Response, out: Outcome, t_send: float) -> None:
    """Fill `out` from the server-sent events of one completion stream."""
    counted = 0
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        now = time.perf_counter()
        if data == "[DONE]":
            out.e2e_s = now - t_send
            break
        try:
            obj = json.loads(data)
        except ValueError:
            out.reason = f"an event that is not JSON: {data[:100]!r}"
            return
        if not isinstance(obj, dict):
            out.reason = f"an event that is not a JSON object: {data[:100]!r}"
            return
        if "error" in obj:
            out.reason = f"error in the stream: {_error_text(data.encode())[0]}"
            return
        for ch in obj.get("choices") or []:
            if not isinstance(ch, dict):
                continue
            ids = ch.get("token_ids")
            if ch.get("text") or ids:
                out.saw_output(now, t_send)
                counted += len(ids) if isinstance(ids, list) and ids else 1
        _usage(obj, out)
    else:
        out.reason = "the stream ended without [DONE]"
        return
    if out.ttft_s is None:
        out.reason = "the stream carried no output"
        return
    out.output_tokens = out.output_tokens or counted
    out.status = "completed"


async def _http_run(url: str, model: str | None, reqs: Sequence[Request], arrival: Arrival, timeout: float,
                    transport: httpx2.AsyncBaseTransport | None, stream: bool) -> tuple[Target, list[Outcome], float]:
    limits = httpx2.Limits(max_connections=arrival.concurrency, max_keepalive_connections=arrival.concurrency)
    # trust_env off: a proxy from the environment would sit inside every measurement
    async with httpx2.AsyncClient(limits=limits, transport=transport, trust_env=False) as client:
        target = await probe(client, url, model)
        limit = Limit(target.max_model_len)
        warm = Request(-1, [0, 1, 2, 3], 1)
        w = await _send(client, target, warm, limit, timeout, stream)
        if w.status != "completed":
            raise ServerError(f"the warm-up request to {url}/completions failed: {w.reason}")
        t0 = time.perf_counter()
        if arrival.rate:
            async def at(req: Request) -> Outcome:
                await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
                return await _send(client, target, req, limit, timeout, stream)

            outcomes = list(await asyncio.gather(*(at(r) for r in reqs)))
        else:
            todo = iter(reqs)
            outcomes = []

            async def worker() -> None:
                for req in todo:  # one iterator shared by the workers: each request taken once
                    outcomes.append(await _send(client, target, req, limit, timeout, stream))

            await asyncio.gather(*(worker() for _ in range(arrival.concurrency)))
        return target, outcomes, time.perf_counter() - t0


def run_http(url: str, model: str | None, reqs: Sequence[Request], arrival: Arrival, timeout: float,
             transport: httpx2.AsyncBaseTransport | None = None,
             stream: bool = True) -> tuple[Target, list[Outcome], float]:
    """Send every request over HTTP: (the target, one outcome per request, the run's duration in
    s). ServerError when the server cannot be reached or fails the warm-up request."""
    return asyncio.run(_http_run(url, model, reqs, arrival, timeout, transport, stream))


# ---- the native side -------------------------------------------------------------------------

def run_native(port: int, host: str, reqs: Sequence[Request], arrival: Arrival,
               timeout: float) -> tuple[list[Outcome], float]:
    """The same requests over kvrt's ZeroMQ client API, on the same arrival schedule, timed the
    same way (when this loop sees each event). ClientError when the node does not answer."""
    with Client(port, timeout, host=host) as c:
        limit = Limit(c.info(timeout=PROBE_TIMEOUT_S).max_model_len)
        c.generate([0, 1, 2, 3], 1)  # warm-up, as on the HTTP side
        outcomes: list[Outcome] = []
        pending = deque(sorted(reqs, key=lambda r: r.arrival_s))
        cap = min(arrival.concurrency or NATIVE_MAX_IN_FLIGHT, NATIVE_MAX_IN_FLIGHT)
        inflight: dict[str, tuple[Outcome, float]] = {}
        t0 = last_heard = time.perf_counter()
        try:
            while pending or inflight:
                now = time.perf_counter()
                while pending and len(inflight) < cap and (not arrival.rate or t0 + pending[0].arrival_s <= now):
                    req = pending.popleft()
                    out = Outcome(req.index, prompt_tokens=len(req.prompt))
                    if why := limit.too_long(req):
                        out.status, out.reason = "skipped", why
                        outcomes.append(out)
                        continue
                    rid = c.submit(req.prompt, req.max_tokens)
                    inflight[rid] = (out, time.perf_counter())
                    outcomes.append(out)
                    if len(inflight) == 1:
                        last_heard = time.perf_counter()
                wait = TICK_S
                if arrival.rate and pending and len(inflight) < cap:
                    wait = min(wait, max(0.0, t0 + pending[0].arrival_s - time.perf_counter()))
                events = c.poll(wait)
                now = time.perf_counter()
                for ev in events:
                    got = inflight.get(ev.request_id)
                    if got is None:
                        continue
                    out, t_send = got
                    if isinstance(ev, TokenEvent):
                        if ev.token_ids:
                            out.saw_output(now, t_send)
                        continue
                    del inflight[ev.request_id]
                    if isinstance(ev, Result):
                        out.status, out.e2e_s = "completed", now - t_send
                        out.output_tokens, out.cached_tokens = ev.num_output_tokens, ev.cached_tokens
                        out.prompt_tokens = ev.prompt_tokens
                        if out.ttft_s is None:
                            out.status, out.reason = "failed", "no output token"
                    elif isinstance(ev, ErrorEvent):
                        out.reason = f"{ev.code}: {ev.message}"
                if events:
                    last_heard = now
                elif inflight and now - last_heard > timeout:
                    for rid, (out, _) in inflight.items():
                        out.reason = f"no answer from the node for {timeout:g} s"
                        c.cancel(rid)
                    inflight.clear()
        except BaseException:
            for rid in inflight:
                c.cancel(rid)
            raise
        return outcomes, time.perf_counter() - t0


# ---- the numbers -----------------------------------------------------------------------------

def _stats(values_ms: list[float]) -> dict[str, float | None]:
    if not values_ms:
        return {"mean": None, **{f"p{q}": None for q in PCTS}}
    a = np.asarray(values_ms, dtype=np.float64)
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in PCTS}}


def summarize(outcomes: Sequence[Outcome], duration_s: float, slo: Slo) -> dict:
    """The standard serving figures of one run, under stable keys."""
    done = [o for o in outcomes if o.status == "completed"]
    failed = [o for o in outcomes if o.status == "failed"]
    skipped = [o for o in outcomes if o.status == "skipped"]
    prompt = sum(o.prompt_tokens for o in done)
    output = sum(o.output_tokens for o in done)
    reported = [o.cached_tokens for o in done if o.cached_tokens is not None]
    cached = sum(reported) if reported else None
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    has_slo = slo.ttft_ms is not None or slo.tpot_ms is not None
    good = sum(slo.met(o) for o in done) if has_slo else None
    return {
        "completed": len(done), "failed": len(failed), "skipped": len(skipped),
        "skipped_reasons": dict(Counter(o.reason for o in skipped).most_common()),
        "errors": dict(Counter(o.reason for o in failed).most_common(MAX_ERRORS_KEPT)),
        "duration_s": duration_s,
        "request_throughput": per_s(len(done)),
        "input_tokens": prompt, "output_tokens": output,
        "input_token_throughput": per_s(prompt), "output_token_throughput": per_s(output),
        "ttft_ms": _stats([o.ttft_s * 1000 for o in done if o.ttft_s is not None]),
        "tpot_ms": _stats([t * 1000 for o in done if (t := o.tpot_s()) is not None]),
        "itl_ms": _stats([g * 1000 for o in done for g in o.itl_s]),
        "e2e_ms": _stats([o.e2e_s * 1000 for o in done if o.e2e_s is not None]),
        "slo": asdict(slo) if has_slo else None,
        "good_requests": good,
        "goodput": None if good is None else per_s(good),
        "cached_tokens": cached,
        "prefix_cache_hit_rate": None if cached is None or not prompt else cached / prompt,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


RATIO_KEYS = ("duration_s", "request_throughput", "input_token_throughput", "output_token_throughput", "goodput")


def ratios(http: dict, native: dict) -> dict:
    """HTTP / native for every throughput and latency figure."""
    out: dict = {k: _ratio(http[k], native[k]) for k in RATIO_KEYS}
    for k in LATENCIES:
        out[k] = {s: _ratio(http[k][s], native[k][s]) for s in http[k]}
    return out


def render(result: dict) -> str:
    """The table (under the description line, printed first): one column per side, and their
    ratio when both ran."""
    cols = [("http", result["http"])] + ([("native (zmq)", result["native"])] if result["native"] else [])
    rt = result["ratio_http_native"]
    head = f"{'':<28}" + "".join(f"{n:>14}" for n, _ in cols) + (f"{'http/native':>13}" if rt else "")
    lines = [head, "-" * len(head)]

    def row(label: str, get, spec: str, r: float | None | bool = False) -> None:
        """`r`: the ratio (None: not defined), or False for a row that has none."""
        cells = "".join(f"{fmt(get(s), spec):>14}" for _, s in cols)
        ratio = "" if r is False else fmt(r, ".2f", "x")
        lines.append(f"{label:<28}{cells}" + (f"{ratio:>13}" if rt else ""))

    row("completed requests", lambda s: s["completed"], "d")
    row("failed requests", lambda s: s["failed"], "d")
    row("skipped requests", lambda s: s["skipped"], "d")
    row("duration (s)", lambda s: s["duration_s"], ".2f", rt and rt["duration_s"])
    row("request throughput (req/s)", lambda s: s["request_throughput"], ".2f", rt and rt["request_throughput"])
    row("input tokens", lambda s: s["input_tokens"], ",d")
    row("output tokens", lambda s: s["output_tokens"], ",d")
    row("input throughput (tok/s)", lambda s: s["input_token_throughput"], ",.0f",
        rt and rt["input_token_throughput"])
    row("output throughput (tok/s)", lambda s: s["output_token_throughput"], ",.1f",
        rt and rt["output_token_throughput"])
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")):
        for stat in ("mean", *(f"p{q}" for q in PCTS)):
            row(f"{name} {stat} (ms)", lambda s, k=key, st=stat: s[k][st], ".1f", rt and rt[key][stat])
    slo = result["http"]["slo"]
    if slo:
        row("goodput (req/s)", lambda s: s["goodput"], ".2f", rt and rt["goodput"])
        row("requests meeting the SLO", lambda s: s["good_requests"], "d")
    else:
        lines.append(f"{'goodput (req/s)':<28}{'n/a (no --slo-ttft-ms / --slo-tpot-ms)':>14}")
    lines.append(f"{'prefix cache hit rate':<28}" + "".join(
        f"{pct(s['prefix_cache_hit_rate']) if s['prefix_cache_hit_rate'] is not None else 'n/a':>14}"
        for _, s in cols))
    if slo:
        parts = [f"{name} <= {slo[key]:g} ms" for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"))
                 if slo[key] is not None]
        lines.append(f"SLO: {', '.join(parts)}")
    for name, s in cols:
        for why, n in s["skipped_reasons"].items():
            lines.append(f"{name}: {n} skipped: {why}")
    return "\n".join(lines)


# ---- the command -----------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrt bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server's OpenAI API base, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="the model to ask for (default: the first that /v1/models lists)")
    p.add_argument("--trace", type=Path, default=None,
                   help="a Mooncake-format trace (JSON lines with hash_ids); default: synthetic prompts")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="requests: the trace's first N (default: all), or N synthetic ones (default 200)")
    arr = p.add_mutually_exclusive_group()
    arr.add_argument("--concurrency", type=int, default=None, metavar="C",
                     help="closed loop: C requests in flight (default 8)")
    arr.add_argument("--request-rate", type=float, default=None, metavar="R",
                     help="open loop: Poisson arrivals, R requests a second on average")
    p.add_argument("--max-tokens", type=int, default=16, metavar="T",
                   help="output tokens per request; with --trace, the cap on the trace's output lengths (default 16)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, metavar="X", help="goodput: TTFT at most X ms")
    p.add_argument("--slo-tpot-ms", type=float, default=None, metavar="Y", help="goodput: TPOT at most Y ms")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="synthetic prompts and arrivals (default 0)")
    p.add_argument("--tokens-per-id", type=int, default=TRACE_BLOCK, metavar="T",
                   help=f"with --trace: tokens per hash id, 1..{TRACE_BLOCK} (default {TRACE_BLOCK}, the trace as "
                        f"it is; fewer keep its sharing at a fraction of the length)")
    p.add_argument("--num-prefixes", type=int, default=4, metavar="G",
                   help="synthetic: shared prefixes (default 4)")
    p.add_argument("--prefix-len", type=int, default=256, metavar="P",
                   help="synthetic: tokens of each shared prefix (default 256)")
    p.add_argument("--suffix-len", type=int, default=64, metavar="S",
                   help="synthetic: mean tokens of each request's own part (default 64)")
    p.add_argument("--vocab-size", type=int, default=None, metavar="V",
                   help="token ids are drawn from 0..V-1 (default: the server's vocabulary, from its /v1/models "
                        f"card, else from what its /tokenize gives; {FALLBACK_VOCAB} when it says neither)")
    p.add_argument("--compare-zmq", type=int, default=None, metavar="PORT",
                   help="also send the same requests over the node's ZeroMQ client API on PORT (kvrt launch --port; "
                        "the host is the --url's) and show HTTP / native")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="a request fails when the server sends nothing for S seconds (default 60)")
    p.add_argument("--no-stream", action="store_true",
                   help="ask for whole answers (stream: false): E2E only, no TTFT/TPOT/ITL")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    parts = urlsplit(args.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        p.error(f"--url must be http://HOST:PORT/v1, got {args.url!r}")
    args.url = args.url.rstrip("/")
    for name in ("limit", "concurrency", "max_tokens", "num_prefixes", "vocab_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    for name in ("prefix_len", "suffix_len"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.prefix_len + args.suffix_len == 0:
        p.error("--prefix-len and --suffix-len cannot both be 0")
    for name in ("request_rate", "slo_ttft_ms", "slo_tpot_ms"):
        v = getattr(args, name)
        if v is not None and not (v > 0 and math.isfinite(v)):
            p.error(f"--{name.replace('_', '-')} must be a positive number, got {v}")
    if not 1 <= args.tokens_per_id <= TRACE_BLOCK:
        p.error(f"--tokens-per-id must be 1..{TRACE_BLOCK}, got {args.tokens_per_id}")
    if not args.timeout > 0:
        p.error(f"--timeout must be > 0, got {args.timeout}")
    if args.compare_zmq is not None and not 0 < args.compare_zmq <= 65535:
        p.error(f"--compare-zmq must be a port 1..65535, got {args.compare_zmq}")
    if args.trace is not None and not args.trace.is_file():
        p.error(f"--trace {args.trace}: no such file")
    if args.no_stream and (args.slo_ttft_ms is not None or args.slo_tpot_ms is not None or args.compare_zmq is not None):
        p.error("--no-stream measures E2E only: it goes with neither --slo-ttft-ms, --slo-tpot-ms nor --compare-zmq")
    if args.request_rate is None and args.concurrency is None:
        args.concurrency = 8


def main(argv: list[str]) -> int:
    p = parser()
    args = p.parse_args(argv)
    check_args(p, args)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # one INFO line per request otherwise
    arrival = Arrival(args.concurrency, args.request_rate)
    vocab_from = "--vocab-size"
    if args.vocab_size is None:
        try:
            args.vocab_size, vocab_from = server_vocab(args.url, args.model)
        except ServerError as e:
            print(f"kvrt bench serve: error: {e}", file=sys.stderr)
            return 1
        if args.vocab_size is None:
            args.vocab_size, vocab_from = FALLBACK_VOCAB, "a default: the server names no vocabulary size"
    if args.trace is not None:
        try:
            reqs = trace_requests(args.trace, args.limit, args.tokens_per_id, args.max_tokens, args.vocab_size)
        except (OSError, TraceError) as e:
            p.error(str(e))
        if not reqs:
            p.error(f"{args.trace} has no requests")
        what = (f"{len(reqs)} requests of the trace {args.trace.name} ({args.tokens_per_id} tokens per hash id, "
                f"output lengths capped at {args.max_tokens})")
    else:
        reqs = synthetic_requests(args.limit or SYNTHETIC_REQUESTS, args.num_prefixes, args.prefix_len, args.suffix_len,
                                  args.max_tokens, args.vocab_size, args.seed)
        what = (f"{len(reqs)} synthetic requests ({args.num_prefixes} shared prefixes of {args.prefix_len} tokens, "
                f"~{args.suffix_len} own tokens each, {args.max_tokens} output tokens)")
    if arrival.rate:
        poisson_arrivals(reqs, arrival.rate, args.seed)
    native_to = f" and over ZeroMQ to port {args.compare_zmq}" if args.compare_zmq is not None else ""
    whole = ", whole answers (not streamed)" if args.no_stream else ""
    description = (f"kvrt bench serve: {what} to {args.url}/completions{native_to}, {arrival.describe()}{whole}; "
                   f"token ids below {args.vocab_size} ({vocab_from})")
    print(description, file=sys.stderr if args.json else sys.stdout, flush=True)
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    try:
        target, outcomes, duration = run_http(args.url, args.model, reqs, arrival, args.timeout,
                                              stream=not args.no_stream)
        http = summarize(outcomes, duration, slo)
        native = None
        if args.compare_zmq is not None:
            host = urlsplit(args.url).hostname
            n_out, n_dur = run_native(args.compare_zmq, host, shifted(reqs, args.vocab_size), arrival, args.timeout)
            native = summarize(n_out, n_dur, slo)
    except KeyboardInterrupt:
        print("kvrt bench serve: interrupted", file=sys.stderr)
        return 130
    except (ServerError, ClientError) as e:
        print(f"kvrt bench serve: error: {e}", file=sys.stderr)
        return 1
    result = {
        "description": description,
        "config": {"url": args.url, "model": target.model, "max_model_len": target.max_model_len,
                   "source": "trace" if args.trace is not None else "synthetic",
                   "trace": str(args.trace) if args.trace is not None else None, "requests": len(reqs),
                   "tokens_per_id": args.tokens_per_id if args.trace is not None else None,
                   "concurrency": arrival.concurrency, "request_rate": arrival.rate, "max_tokens": args.max_tokens,
                   "seed": args.seed, "vocab_size": args.vocab_size, "vocab_source": vocab_from,
                   "compare_zmq": args.compare_zmq,
                   "stream": not args.no_stream},
        "http": http,
        "native": native,
        "ratio_http_native": ratios(http, native) if native is not None else None,
    }
    print(json.dumps(result, indent=1) if args.json else "\n" + render(result))
    if args.trace is not None and http["skipped"] and args.tokens_per_id > 1:
        print(f"kvrt bench serve: {http['skipped']} prompts of the trace are too long for this server: "
              f"--tokens-per-id T < {args.tokens_per_id} scales the trace's prompts down", file=sys.stderr)
    failed = http["failed"] + (native["failed"] if native else 0)
    if failed:
        print(f"kvrt bench serve: {failed} requests failed; first errors:", file=sys.stderr)
        for side, s in (("http", http), ("native", native)):
            for why, n in (s or {}).get("errors", {}).items():
                print(f"  {side}: {n} x {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
