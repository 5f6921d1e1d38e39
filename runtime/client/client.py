"""The kvrt client: talks to a node's engine over ZeroMQ, speaking runtime/client/api.py.

One DEALER socket per client; every message is one frame of the API codec (msgpack, never
pickle). Answers carry the request id, so one client keeps many requests in flight:

    with Client(5555) as c:                      # or Client("tcp://host:5555")
        print(c.info().vocab_size)
        c.reset_prefix_cache()                   # drop the node's prefix cache
        r = c.generate([1, 2, 3], 8)             # blocking; r.output_token_ids, r.ttft_ms, ...
        for tok in (g := c.stream([1, 2, 3], 8)):  # tokens as they arrive
            print(tok)
        print(g.result.finish_reason)
        rid = c.submit([4, 5, 6], 8)             # many in flight: submit ...
        for ev in c.poll(1.0): ...               # ... and poll: TokenEvent, Result or ErrorEvent
        tok = node_tokenizer(c.info())           # the served model's tokenizer (runtime/client/tokenizer.py)

Every wait has a timeout (the client's `timeout` unless given): the longest silence tolerated
while waiting for one answer. A node that does not answer raises `ClientError` naming the address
and the wait, never a hang; an ErrorEvent from the engine raises `RequestError(code, message)`.

A node that was heard from and then goes silent is told apart from a slow one: the engine sends
an empty message every PROBE_S (0.5 s) to each client with requests in flight, and answers an
info or reset request at once, so a client that hears nothing at all for `liveness` seconds
(LIVENESS_S, 2 s) while it waits takes the engine as stopped, hung or gone: every request in
flight ends with an ErrorEvent of code SILENT (raised as RequestError by generate and stream;
returned by poll) and its cancel is sent for the case the engine comes back; an info or reset
request raises ClientError. Before the node has said anything, only the timeouts apply, unless
the connection to it dropped (the process owning its socket died: a request sent before may be
lost with it), from which on a silence counts as if it had spoken.

`ttft_ms` and `e2e_ms` of a `Result` are measured here, from the send to the first token and to
the FinishedEvent; the engine's own figures are kept as `engine_ttft_ms` / `engine_e2e_ms`.

A client is not thread-safe (neither is a ZeroMQ socket): use one per thread.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import json
import operator
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np
import zmq

from kvrt.ipc.errors import ProtocolError
from kvrt.runtime.client.api import (API, CancelRequest, ErrorEvent, FinishedEvent, GenerateRequest, InfoReply,
                         InfoRequest, Outcome, ResetPrefixCacheReply, ResetPrefixCacheRequest, TokenEvent,
                         LIVENESS_S, MESSAGE_SLACK, PROBE_S, SILENT, cache_salt_problem, max_message_bytes,
                         request_id_problem)
from kvrt.runtime.client.chat_template import ChatTemplate, Message
from kvrt.runtime.client.detokenizer import IncrementalDetokenizer
from kvrt.runtime.client.stop import StopStrings, stop_problem
from kvrt.runtime.client.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_TIMEOUT = 30.0
# How long the command-line clients wait for the node's socket to complete the ZeroMQ handshake.
# libzmq answers it from its own I/O thread however busy the engine is, so a few seconds tell a
# wrong port from a slow node.
CONNECT_TIMEOUT = 3.0
_MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_I32 = np.iinfo(np.int32)


class ClientError(Exception):
    """The node could not be reached or did not answer in time; the message names the address
    and what was awaited."""


class RequestError(ClientError):
    """The engine answered a request with an ErrorEvent (see the codes in runtime/client/api.py)."""

    def __init__(self, code: str, message: str, request_id: str = ""):
        super().__init__(f"{code}: {message}" + (f" (request {request_id})" if request_id else ""))
        self.code = code
        self.message = message
        self.request_id = request_id


@dataclass
class Result(Outcome):
    """A finished request: the FinishedEvent's outcome, the engine's times (`engine_*`), and the
    times measured by this client from the send."""

    engine_ttft_ms: float = 0.0
    engine_e2e_ms: float = 0.0
    engine_queue_ms: float = 0.0  # the engine's intake -> first scheduled
    ttft_ms: float = 0.0   # send -> first token (-> the FinishedEvent when no token was streamed)
    e2e_ms: float = 0.0    # send -> FinishedEvent
    prompt_logprobs: list = field(default_factory=list)  # the prompt's scores, if asked (see TokenEvent)
    prompt_ranks: list = field(default_factory=list)
    prompt_top: list = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def cached_tokens(self) -> int:
        return self.cached_device + self.cached_host + self.cached_storage

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        n = self.num_output_tokens
        return (self.e2e_ms - self.ttft_ms) / (n - 1) if n > 1 else None

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "output_token_ids": [int(t) for t in self.output_token_ids],
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": {"device": self.cached_device, "host": self.cached_host,
                              "storage": self.cached_storage},
            "computed_prompt_tokens": self.computed_prompt_tokens,
            "preemptions": self.preemptions,
            "ttft_ms": self.ttft_ms,
            "e2e_ms": self.e2e_ms,
            "tpot_ms": self.tpot_ms,
            "engine_ttft_ms": self.engine_ttft_ms,
            "engine_e2e_ms": self.engine_e2e_ms,
        }


@dataclass
class Sampling:
    """How a request picks its tokens (the rules are GenerateRequest's in runtime/client/api.py; the
    engine checks the values). The default is greedy. Any of `stop_token_ids` ends the request
    with finish reason "stop". `logprobs` makes each TokenEvent carry its tokens' log-probabilities;
    `prompt_logprobs` k (None: not asked) makes the first one carry the prompt's, with k alternatives."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    min_p: float = 0.0
    top_logprobs: int = 0
    logit_bias: list[list] = field(default_factory=list)  # [token id, bias] pairs
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    prompt_logprobs: int | None = None
    guided: dict | None = None  # {"kind": "json_object" | "json_schema" | "regex" | "choice" | "grammar", "spec": text}


@dataclass
class _Req:
    t_send: float
    owned: bool                     # consumed by a Generation, never returned by poll()
    t_first: float | None = None
    queue: deque = field(default_factory=deque)  # events of an owned request
    sent: float = field(default_factory=time.monotonic)  # (the clock of last_heard)


def address_of(address: str | int, host: str = DEFAULT_HOST) -> str:
    """A port, "host:port" or a full ZeroMQ address -> the ZeroMQ address to connect."""
    if isinstance(address, int) and not isinstance(address, bool):
        port = address
    elif isinstance(address, str) and "://" in address:
        return address
    elif isinstance(address, str) and address.rpartition(":")[2].isdigit():
        host, _, p = address.rpartition(":")
        port = int(p)
    else:
        raise ValueError(f"not a client address: {address!r} (want a port, host:port or tcp://host:port)")
    if not 0 < port <= 65535:
        raise ValueError(f"port must be 1..65535, got {port}")
    return f"tcp://{host or DEFAULT_HOST}:{port}"


def as_prompt(prompt: Iterable[int] | np.ndarray) -> np.ndarray:
    """A prompt as the int32 array the wire carries; ValueError for anything that is not a flat
    sequence of integers that fit int32 (range checks against the vocabulary are the engine's)."""
    arr = np.asarray(prompt if isinstance(prompt, np.ndarray) else list(prompt))
    if arr.ndim != 1:
        raise ValueError(f"a prompt is a flat sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"prompt token ids must be integers, got {arr.dtype}")
    if arr.min() < _I32.min or arr.max() > _I32.max:
        raise ValueError("prompt token ids must fit in int32")
    return arr.astype(np.int32)


class Client:
    """A connection to one node's client API. See the module docstring."""

    def __init__(self, address: str | int, timeout: float = DEFAULT_TIMEOUT, *, host: str = DEFAULT_HOST,
                 connect_timeout: float | None = None, liveness: float | None = LIVENESS_S):
        """`connect_timeout`: if given, wait up to that many seconds for the node's socket to
        accept the connection and complete the ZeroMQ handshake, and raise ClientError naming
        the address and what went wrong otherwise (ZeroMQ itself would retry silently, and the
        first request would wait its whole `timeout`). `liveness`: the node's longest silence
        tolerated while an answer is awaited, once it was heard from (module docstring; None:
        only the timeouts)."""
        if liveness is not None and not liveness > PROBE_S:
            raise ValueError(f"liveness must be above the engine's probe interval {PROBE_S:g} s (or None), "
                             f"got {liveness!r}")
        self.address = address_of(address, host)
        self.timeout = float(timeout)
        self.liveness = liveness
        self._ctx = zmq.Context()
        self._drops: zmq.Socket | None = None  # the socket's monitor of dropped connections (_dropped)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # A ROUTER drops what a peer's full pipe cannot take: never let ours fill up.
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        monitor = self._sock.get_monitor_socket(_MONITOR_EVENTS) if connect_timeout is not None else None
        try:
            self._sock.connect(self.address)
            if monitor is not None:
                self._await_handshake(monitor, connect_timeout)
        except (zmq.ZMQError, ClientError) as e:
            if monitor is not None:
                monitor.close(linger=0)  # before close(): the context waits for every socket
            self.close()
            if isinstance(e, ClientError):
                raise
            raise ClientError(f"cannot connect to {self.address}: {e}") from None
        if monitor is not None:
            monitor.close(linger=0)
        # (after the handshake's monitor: a socket has one at a time)
        if liveness is not None:
            self._drops = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED, f"inproc://drops-{id(self)}")
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count(1)
        self._nonces = itertools.count(1)
        self._model_len: int | None = None  # the node's max_model_len, once asked
        self._reqs: dict[str, _Req] = {}
        self.last_heard = time.monotonic()  # when the node last sent anything (its liveness probes included)
        self._heard = False               # whether it ever did (before, a silence says nothing about it)
        self._pending: deque = deque()    # events for poll()
        self._replies: dict[int, InfoReply | ResetPrefixCacheReply] = {}  # by nonce
        self.protocol_errors = 0
        self.last_protocol_error = ""
        self.dropped_events = 0           # events of requests this client no longer tracks

    def _await_handshake(self, monitor: zmq.Socket, timeout: float) -> None:
        """Wait for the handshake with the node's socket; ClientError naming what was seen instead."""
        from zmq.utils.monitor import recv_monitor_message

        seen = "no answer at all"
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0:
                if not monitor.poll(int(left * 1000) + 1, zmq.POLLIN):
                    continue
                event = recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return
                if event == zmq.EVENT_CONNECT_RETRIED:
                    seen = "the connection was refused"
                else:  # something accepts connections there but is not a ZeroMQ socket (e.g. an HTTP port)
                    seen = "something accepts connections there but does not speak the kvrt client protocol"
        finally:
            self._sock.disable_monitor()
        raise ClientError(f"could not reach a kvrt node at {self.address} within {timeout:g} s: {seen} (is a node "
                          f"serving its client API there? kvrt launch --port P)")

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Close the socket at once (linger 0: nothing unsent is kept)."""
        if self._sock is not None:
            if self._drops is not None:  # (before close(): the context waits for every socket)
                self._sock.disable_monitor()
                self._drops.close(linger=0)
                self._drops = None
            self._sock.close(linger=0)
            self._sock = None
            self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.address!r}, in_flight={len(self._reqs)})"

    @property
    def in_flight(self) -> int:
        return len(self._reqs)

    # ---- requests ----------------------------------------------------------------------------
    def info(self, timeout: float | None = None) -> InfoReply:
        """The node's model limits; ClientError if it does not answer within `timeout` s."""
        return self._ask(InfoRequest, "info", timeout)

    def reset_prefix_cache(self, timeout: float | None = None) -> ResetPrefixCacheReply:
        """Drop the node's prefix cache (see ResetPrefixCacheRequest); what it dropped.
        ClientError if it does not answer within `timeout` s."""
        return self._ask(ResetPrefixCacheRequest, "prefix cache reset", timeout)

    def _ask(self, kind: type, what: str, timeout: float | None):
        """Send a `kind(nonce=...)` question and wait for the reply with that nonce."""
        timeout = self._timeout(timeout)
        nonce = next(self._nonces)
        self._send(kind(nonce=nonce), f"{what} request")
        sent = time.monotonic()
        deadline = sent + timeout
        while nonce not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClientError(f"no {what} reply from {self.address} within {timeout:g} s: is a kvrt node "
                                  f"serving its client API there (kvrt launch --port P)?{self._proto_note()}")
            if quiet := self._silent(sent):
                raise ClientError(f"{self.address} sent nothing for {quiet:.1f} s while its {what} reply was "
                                  f"awaited (a live node answers at once): {self._gone}")
            self._pump(self._slice(left))
        reply = self._replies.pop(nonce)
        self._replies.clear()  # late replies to questions that timed out
        return reply

    def submit(self, prompt: Iterable[int] | np.ndarray, max_new_tokens: int, *, eos_token_id: int = -1,
               use_cache: bool = True, request_id: str | None = None, stream: bool = True,
               sampling: Sampling | None = None, cache_salt: str | None = None, on_behalf_of: str = "") -> str:
        """Send a request without waiting; its events come from poll(). Returns its id.
        `cache_salt`: the request shares cached blocks only with requests of the same salt
        (one per tenant; see GenerateRequest). `on_behalf_of`: this client's own client it is
        for (its quota is that one's: see runtime/client/api.py GenerateRequest)."""
        return self._submit(prompt, max_new_tokens, eos_token_id, use_cache, request_id, stream, owned=False,
                            sampling=sampling, cache_salt=cache_salt, on_behalf_of=on_behalf_of)

    def poll(self, timeout: float = 0.0) -> list:
        """Events of submitted requests, in arrival order: TokenEvent (new tokens), Result (the
        request finished; it is no longer in flight) or ErrorEvent (it failed; no longer in
        flight). Waits up to `timeout` s for the first one; [] if none came."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while not self._pending:
            left = deadline - time.monotonic()
            if not self._pump(self._slice(max(left, 0.0))) and self._reqs and \
                    (quiet := self._silent(min(r.sent for r in self._reqs.values()))):
                self._end_all(quiet)
            elif left <= 0:
                break
        else:
            self._pump(0.0)  # also take what already arrived
        out = list(self._pending)
        self._pending.clear()
        return out

    def cancel(self, request_id: str) -> None:
        """Ask the engine to stop a request; it ends with a Result whose finish_reason is
        "cancelled" (or an ErrorEvent "unknown_request" if the engine does not know it)."""
        self._send(CancelRequest(request_id=request_id), f"cancel of request {request_id}")

    def stream(self, prompt: Iterable[int] | np.ndarray, max_new_tokens: int, *, eos_token_id: int = -1,
               use_cache: bool = True, request_id: str | None = None,
               timeout: float | None = None, sampling: Sampling | None = None,
               cache_salt: str | None = None) -> "Generation":
        """Start a request and iterate its output token ids as they arrive; `.result` holds the
        Result once the iteration ends. Leaving the loop early cancels the request."""
        rid = self._submit(prompt, max_new_tokens, eos_token_id, use_cache, request_id, True, owned=True,
                           sampling=sampling, cache_salt=cache_salt)
        return Generation(self, rid, self._timeout(timeout))

    def generate(self, prompt: Iterable[int] | np.ndarray, max_new_tokens: int, *, eos_token_id: int = -1,
                 use_cache: bool = True, request_id: str | None = None, timeout: float | None = None,
                 on_token: Callable[[int], None] | None = None, sampling: Sampling | None = None,
                 cache_salt: str | None = None) -> Result:
        """Run one request to the end (calling `on_token` for each token as it arrives) and
        return its Result. RequestError if the engine fails it, ClientError if the node falls
        silent for `timeout` s (the request is then cancelled)."""
        with self.stream(prompt, max_new_tokens, eos_token_id=eos_token_id, use_cache=use_cache,
                         request_id=request_id, timeout=timeout, sampling=sampling, cache_salt=cache_salt) as gen:
            for tok in gen:
                if on_token is not None:
                    on_token(tok)
            return gen.result

    # ---- internals ---------------------------------------------------------------------------
    def _timeout(self, timeout: float | None) -> float:
        t = self.timeout if timeout is None else float(timeout)
        if not t > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        return t

    def _submit(self, prompt, max_new_tokens, eos_token_id, use_cache, request_id, stream, owned,
                sampling: Sampling | None = None, cache_salt: str | None = None, on_behalf_of: str = "") -> str:
        arr = as_prompt(prompt)
        try:
            max_new_tokens, eos_token_id = operator.index(max_new_tokens), operator.index(eos_token_id)
        except TypeError:
            raise ValueError("max_new_tokens and eos_token_id must be integers") from None
        rid = request_id if request_id is not None else f"{self._prefix}-{next(self._ids)}"
        if problem := request_id_problem(rid):
            raise ValueError(problem)
        if rid in self._reqs:
            raise ValueError(f"request {rid!r} is already in flight on this client")
        salt = "" if cache_salt is None else cache_salt
        if problem := cache_salt_problem(salt):
            raise ValueError(problem)
        msg = GenerateRequest(request_id=rid, prompt=arr, max_new_tokens=max_new_tokens,
                              eos_token_id=eos_token_id, use_cache=bool(use_cache), stream=bool(stream),
                              cache_salt=salt, on_behalf_of=on_behalf_of, **dataclasses.asdict(sampling or Sampling()))
        data = API.encode(msg)
        if len(data) > MESSAGE_SLACK and len(data) > (limit := max_message_bytes(self._max_model_len())):
            # the node's socket would drop it unread (and the connection): say why here instead
            raise ValueError(f"request {rid}: a prompt of {len(arr)} tokens is longer than the node's "
                             f"max_model_len ({self._max_model_len()}): its message of {len(data)} bytes is over "
                             f"the {limit} the node reads")
        self._reqs[rid] = _Req(time.perf_counter(), owned)
        try:
            self._send_bytes(data, f"request {rid}")
        except BaseException:
            del self._reqs[rid]
            raise
        return rid

    def _max_model_len(self) -> int:
        """The node's max_model_len, asked once (only a long prompt needs it)."""
        if self._model_len is None:
            self._model_len = self.info().max_model_len
        return self._model_len

    def _send(self, msg, what: str) -> None:
        self._send_bytes(API.encode(msg), what)

    def _send_bytes(self, data: bytes, what: str) -> None:
        if self._sock is None:
            raise ClientError(f"client for {self.address} is closed")
        try:
            self._sock.send(data, zmq.NOBLOCK)
        except zmq.ZMQError as e:  # Again included: with unlimited HWM only a broken socket
            raise ClientError(f"could not send the {what} to {self.address}: {e}") from None

    def _proto_note(self) -> str:
        if not self.protocol_errors:
            return ""
        return (f" ({self.protocol_errors} undecodable answers; last: {self.last_protocol_error}"
                " - does the node speak this version of runtime/client/api.py?)")

    def _pump(self, timeout: float) -> bool:
        """Wait up to `timeout` s for messages, then route every one already queued. True if any
        message arrived (routed somewhere or dropped)."""
        if self._sock is None:
            raise ClientError(f"client for {self.address} is closed")
        if not self._sock.poll(int(timeout * 1000) if timeout > 0 else 0, zmq.POLLIN):
            return False
        self.last_heard = time.monotonic()
        self._heard = True
        for _ in range(10_000):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if frames[-1]:  # (an empty message is the node checking that this client is still there)
                self._route(frames[-1], time.perf_counter())
        return True

    def _route(self, data: bytes, now: float) -> None:
        try:
            msg = API.decode(data)
        except ProtocolError as e:
            self.protocol_errors += 1
            self.last_protocol_error = str(e)
            return
        if isinstance(msg, (InfoReply, ResetPrefixCacheReply)):
            self._replies[msg.nonce] = msg
            return
        if not isinstance(msg, (TokenEvent, FinishedEvent, ErrorEvent)):
            self.protocol_errors += 1
            self.last_protocol_error = f"unexpected message {type(msg).__name__} from the node"
            return
        req = self._reqs.get(msg.request_id)
        if req is None:
            if isinstance(msg, ErrorEvent):  # e.g. unknown_request for a cancel: the caller's to see
                self._pending.append(msg)
            else:
                self.dropped_events += 1
            return
        if isinstance(msg, TokenEvent):
            if req.t_first is None and msg.token_ids:
                req.t_first = now
            ev = msg
        elif isinstance(msg, FinishedEvent):
            del self._reqs[msg.request_id]
            ev = _result(msg, req, now)
        else:
            del self._reqs[msg.request_id]
            ev = msg
        (req.queue if req.owned else self._pending).append(ev)

    def _forget(self, request_id: str) -> None:
        """Stop tracking an owned request: its late events are dropped."""
        self._reqs.pop(request_id, None)

    def _next_owned(self, request_id: str, req: _Req, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while not req.queue:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClientError(f"no answer from {self.address} within {timeout:g} s: waited for {what} "
                                  f"of request {request_id}{self._proto_note()}")
            if not self._pump(self._slice(left)) and (quiet := self._silent(req.sent)):
                self._end_all(quiet)
        return req.queue.popleft()

    # ---- the node's liveness ---------------------------------------------------------------
    _gone = "its engine is stopped, hung or gone"

    def _silent(self, since: float) -> float:
        """The node's silence in seconds, once it passed `liveness` while an answer has been
        awaited since `since` (monotonic); 0.0 within it, with liveness off, or before the
        node was ever heard from."""
        if self.liveness is None:
            return 0.0
        if not self._heard and self._dropped():
            self._heard, self.last_heard = True, time.monotonic()
        if not self._heard:
            return 0.0
        quiet = time.monotonic() - max(self.last_heard, since)
        return quiet if quiet > self.liveness else 0.0

    def _dropped(self) -> bool:
        """Whether a connection to the node dropped (its socket's owner died or went away) since
        this client was made: then the node was there, and a silence from now on is the node's
        even if it never spoke to this client (its first request may have died with the socket)."""
        if self._drops is None or not self._drops.poll(0):
            return False
        while self._drops.poll(0):
            self._drops.recv_multipart()
        return True

    def _slice(self, left: float) -> float:
        """How long one wait for messages may block: short enough to see a silence in time."""
        return left if self.liveness is None else min(left, self.liveness / 4)

    def _end_all(self, quiet: float) -> None:
        """The node fell silent: every request in flight ends with an ErrorEvent SILENT (owned
        ones in their own queue), and its cancel is sent for the case the engine comes back."""
        why = (f"{self.address} sent nothing for {quiet:.1f} s while the request was in flight (a live node "
               f"sends each client with requests in flight a message every {PROBE_S:g} s): {self._gone}")
        for rid, req in list(self._reqs.items()):
            del self._reqs[rid]
            (req.queue if req.owned else self._pending).append(ErrorEvent(rid, SILENT, why))
            try:
                self.cancel(rid)
            except ClientError:
                pass


def _result(msg: FinishedEvent, req: _Req, now: float) -> Result:
    e2e = (now - req.t_send) * 1000
    first = req.t_first if req.t_first is not None and len(msg.output_token_ids) else now
    return Result(**dict(msg.outcome(), output_token_ids=np.asarray(msg.output_token_ids, dtype=np.int32)),
                  engine_ttft_ms=float(msg.ttft_ms), engine_e2e_ms=float(msg.e2e_ms),
                  engine_queue_ms=float(msg.queue_ms),
                  ttft_ms=(first - req.t_send) * 1000, e2e_ms=e2e, prompt_logprobs=list(msg.prompt_logprobs),
                  prompt_ranks=list(msg.prompt_ranks), prompt_top=list(msg.prompt_top))


class Generation:
    """Iterator over the output token ids of one streaming request (from Client.stream)."""

    def __init__(self, client: Client, request_id: str, timeout: float):
        self.client = client
        self.request_id = request_id
        self.timeout = timeout
        self.result: Result | None = None
        self._req = client._reqs[request_id]
        self._buf: deque[int] = deque()
        self._seen = 0  # tokens received so far
        self._closed = False

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        while not self._buf:
            if self.result is not None or self._closed:
                raise StopIteration
            what = "the first token" if self._seen == 0 else f"token {self._seen} or the end"
            ev = self.client._next_owned(self.request_id, self._req, self.timeout, what)
            if isinstance(ev, TokenEvent):
                skip = max(self._seen - int(ev.index), 0)  # a resent overlap is not repeated
                new = [int(t) for t in ev.token_ids[skip:]]
                self._buf.extend(new)
                self._seen += len(new)
            elif isinstance(ev, Result):
                self.result = ev
                rest = [int(t) for t in ev.output_token_ids[self._seen:]]  # not streamed (or lost)
                self._buf.extend(rest)
                self._seen += len(rest)
            else:
                raise RequestError(ev.code, ev.message, ev.request_id)
        return self._buf.popleft()

    @property
    def done(self) -> bool:
        return self.result is not None

    def close(self) -> None:
        """Cancel the request if it has not finished (best effort) and drop its late events."""
        self._closed = True
        if self.request_id in self.client._reqs:
            self.client._forget(self.request_id)
            try:
                self.client.cancel(self.request_id)
            except ClientError:
                pass

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- kvrt generate ---------------------------------------------------------------------------

def _parse_ids(text: str) -> list[int]:
    parts = [p for p in text.replace(",", " ").split()]
    out = []
    for p in parts:
        try:
            out.append(int(p))
        except ValueError:
            raise ValueError(f"--prompt-ids: {p!r} is not an integer") from None
    return out


def node_tokenizer(info: InfoReply, directory: str | None = None) -> Tokenizer:
    """The tokenizer for what the node serves: `directory` when given (a copy of the
    checkpoint's tokenizer files, e.g. for a node on another machine), else the model directory
    the node reports, else (the reference model) the byte tokenizer. TokenizerError when the
    node's directory cannot be read here or holds no usable tokenizer."""
    if directory:
        return HFTokenizer.from_dir(directory)
    if not info.model_dir:
        return ByteTokenizer()
    if not (isinstance(info.model_dir, str) and os.path.isabs(info.model_dir)):  # a node's word, checked
        raise TokenizerError(f"node {info.node} reported {info.model_dir!r:.200} as its model directory, which is "
                             f"not an absolute path: pass --tokenizer DIR")
    if not os.path.isdir(info.model_dir):
        raise TokenizerError(f"node {info.node} serves the model in {info.model_dir}, which is not a directory on "
                             f"this machine: pass --tokenizer DIR (a directory with its tokenizer files)")
    return HFTokenizer.from_dir(info.model_dir)


def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvrt generate",
        description="Send one request to a running node (kvrt launch --port P) and print its tokens (or text) as "
                    "they stream in, then what it cost (TTFT, prompt tokens served by each cache tier). --text and "
                    "--chat use the tokenizer of the model the node serves (read from the model directory the node "
                    "reports, or --tokenizer DIR); the built-in reference model's tokenizer is one token per byte.")
    p.add_argument("--port", type=int, required=True, help="the node's client API port")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"the node's host (default {DEFAULT_HOST})")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, comma-separated: 1,2,3")
    src.add_argument("--text", help="prompt text, encoded with the model's tokenizer (special tokens added as the "
                                    "tokenizer adds them, e.g. a BOS)")
    src.add_argument("--chat", metavar="MESSAGE", help="a user message, rendered with the model's chat template "
                                                       "(ending where the assistant's answer begins)")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before the user's")
    p.add_argument("--tokenizer", metavar="DIR", help="read the tokenizer from this checkpoint directory instead of "
                                                      "the one the node serves")
    p.add_argument("--max-new-tokens", type=int, required=True, metavar="N", help="tokens to generate at most")
    p.add_argument("--eos", type=int, default=None, metavar="ID",
                   help="stop at this token id (default: the model's EOS ids with --text/--chat, none with "
                        "--prompt-ids)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling: the smallest set of tokens "
                                                                        "whose probability reaches P (default 1)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K likeliest tokens (0: all)")
    p.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="sample among the tokens at least P times as likely as the likeliest (0: all)")
    p.add_argument("--seed", type=int, default=None, help="seed of the draws: the same seed gives the same answer")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="with --text/--chat: end the answer before this text (repeatable)")
    p.add_argument("--no-cache", action="store_true", help="neither use nor fill the prefix cache")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"seconds to wait for each answer of the node (default {DEFAULT_TIMEOUT:g}); a port where "
                        f"no node completes the connection is reported after {CONNECT_TIMEOUT:g} s")
    return p


@dataclass
class _Prompt:
    """A request's prompt as `kvrt generate` was given it."""

    ids: list[int]
    what: str                       # how it was given, for error messages
    eos_ids: tuple[int, ...]        # stop at any of these
    tokenizer: Tokenizer | None     # None: --prompt-ids (the answer prints as ids)


def _prompt(args: argparse.Namespace, info: InfoReply) -> _Prompt:
    """The prompt of --prompt-ids, --text or --chat for this node (ValueError naming the
    problem: TokenizerError and ChatTemplateError are ValueErrors too)."""
    if args.prompt_ids is not None:
        ids, what, eos, tok = _parse_ids(args.prompt_ids), "--prompt-ids", (), None
    else:
        tok = node_tokenizer(info, args.tokenizer)
        if args.text is not None:
            ids, what = tok.encode(args.text), f"--text: the tokenizer ({tok.name})"
        elif tok.chat_template is None:
            raise ValueError(f"--chat: the tokenizer ({tok.name}) has no chat template")
        else:
            messages = [Message("system", args.system)] if args.system is not None else []
            text = ChatTemplate(tok.chat_template, tok.special_tokens).render(
                messages + [Message("user", args.chat)], add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)  # the template wrote the special tokens itself
            what = f"--chat: the tokenizer ({tok.name})"
        eos = tok.eos_token_ids
    if not ids:
        raise ValueError(f"{what} gave an empty prompt")
    bad = [t for t in ids if not 0 <= t < info.vocab_size]
    if bad:
        raise ValueError(f"{what}: token id {bad[0]} is outside the node's vocabulary 0..{info.vocab_size - 1}")
    return _Prompt(ids, what, (args.eos,) if args.eos is not None else eos, tok)


def generate_main(argv: list[str]) -> int:
    """`kvrt generate`: exit 0 done, 1 engine error or no answer, 2 bad input."""
    p = generate_parser()
    args = p.parse_args(argv)
    if args.prompt_ids is not None:
        try:
            empty = not _parse_ids(args.prompt_ids)  # refused before any connection
        except ValueError as e:
            p.error(str(e))
    else:
        empty = not (args.text or args.chat)
    if empty:
        p.error("the prompt is empty")
    if args.system is not None and args.chat is None:
        p.error("--system goes with --chat")
    if args.stop and args.prompt_ids is not None:
        p.error("--stop is text: it goes with --text or --chat")
    if problem := stop_problem(args.stop):
        p.error(f"--stop: {problem}")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.timeout > 0:
        p.error(f"--timeout must be > 0, got {args.timeout}")
    if not 0 < args.port <= 65535:
        p.error(f"--port must be 1..65535, got {args.port}")
    err = sys.stderr
    try:
        with Client(args.port, args.timeout, host=args.host,
                    connect_timeout=min(args.timeout, CONNECT_TIMEOUT)) as c:
            info = c.info()
            try:
                prompt = _prompt(args, info)
                prompt_arr = as_prompt(prompt.ids)
            except ValueError as e:
                p.error(str(e))
            detok = IncrementalDetokenizer(prompt.tokenizer, prompt.ids) if prompt.tokenizer is not None else None
            stops = StopStrings(args.stop)
            pieces: list[str] = []
            stopped_at = None

            def show(piece: str) -> None:
                pieces.append(piece)
                if not args.json:
                    sys.stdout.write(piece)
                    sys.stdout.flush()

            # The engine stops at `eos_token_id`; a model's other EOS ids (an instruct model ends its
            # turn with one, its text with another) are stop token ids.
            eos = list(prompt.eos_ids)
            sampling = Sampling(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                                stop_token_ids=eos[1:])
            gen = c.stream(prompt_arr, args.max_new_tokens, eos_token_id=eos[0] if eos else -1,
                           use_cache=not args.no_cache, sampling=sampling)
            try:
                with gen:
                    for n, tok_id in enumerate(gen, 1):
                        if stopped_at is not None:
                            continue  # computed before the cancel arrived
                        show(stops.feed(detok.add([tok_id])) if detok is not None else f"{tok_id} ")
                        if stops.stopped is not None:
                            stopped_at = n
                            c.cancel(gen.request_id)
            except KeyboardInterrupt:
                print("\nkvrt generate: interrupted (request cancelled)", file=err)
                return 130
            r = gen.result
            if stopped_at is not None:  # a stop string: the answer is cut there
                r = dataclasses.replace(r, output_token_ids=r.output_token_ids[:stopped_at], finish_reason="stop")
    except RequestError as e:
        print(f"\nkvrt generate: engine error ({e.code}): {e.message}", file=err)
        return 1
    except ClientError as e:
        print(f"\nkvrt generate: error: {e}", file=err)
        return 1
    if detok is not None:
        pieces.append(stops.feed(detok.flush()) + stops.flush())
        if stops.stopped is not None and stopped_at is None:  # in the very last text
            r = dataclasses.replace(r, finish_reason="stop")
    if args.json:
        out = r.to_dict()
        if detok is not None:
            out["text"] = "".join(pieces)
        print(json.dumps(out))
    else:
        if detok is not None:
            sys.stdout.write(pieces[-1])
        print()
        tpot = f", TPOT {r.tpot_ms:.1f} ms" if r.tpot_ms is not None else ""
        print(f"[{r.finish_reason}] {r.num_output_tokens} tokens; TTFT {r.ttft_ms:.1f} ms{tpot}, "
              f"total {r.e2e_ms:.1f} ms; prompt {r.prompt_tokens} tokens, cached: device {r.cached_device}, "
              f"host {r.cached_host}, storage {r.cached_storage}; computed {r.computed_prompt_tokens}", file=err)
    return 0
