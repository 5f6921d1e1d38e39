"""The client API contract: messages between a client and the engine over ZeroMQ.

The engine binds a ROUTER socket on `tcp://HOST:PORT`; a client connects a DEALER socket and
sends single-frame messages (this codec: msgpack maps with a type and a version, token lists as
int32 bytes; never pickle). Answers are routed back by the client's socket identity and carry
the request id, so one client socket can keep many requests in flight.

A request's life on the wire: GenerateRequest -> TokenEvent* -> FinishedEvent, or ErrorEvent at
any point (bad request, failed cache transfer, node stopping). InfoRequest and
ResetPrefixCacheRequest are answered at once, matched to their question by a nonce. CancelRequest ends it early with
a FinishedEvent whose finish_reason is "cancelled"; only the socket that submitted a request
can cancel it (to any other, the request is unknown).

What the engine tolerates from one client, so that no client can grow it without bound: a
message of at most `max_message_bytes` (bigger frames are dropped by libzmq before they are
read, and the connection with them), request ids of at most MAX_REQUEST_ID_BYTES printable
characters, MAX_REQUESTS_PER_CLIENT requests in flight (per name it sends them on behalf of), and a client that stops reading until
CLIENT_QUEUE answers wait for it has its requests cancelled (ErrorEvent SLOW_CLIENT, sent once
it reads again). A client that disconnects has its requests cancelled. The engine checks
connections by sending an empty message every PROBE_S to each client with requests in flight:
clients ignore empty messages, but take a node that sent nothing at all for LIVENESS_S, while
they wait for its answer, as stopped, hung or gone (runtime/client/client.py).

The messages P/D peers exchange on the same socket are in runtime/pd/messages.py, registered
with this codec.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from kvrt.ipc.codec import Codec

API = Codec()

# ErrorEvent codes
BAD_REQUEST = "bad_request"    # the request itself is invalid; nothing else changed
DUPLICATE = "duplicate"        # a request with this id is already in flight
UNKNOWN = "unknown_request"    # cancel of a request the engine does not know
FAILED = "failed"              # the engine could not finish it (lost KV, transfer failure)
STOPPING = "stopping"          # the node is shutting down and takes no new requests
SLOW_CLIENT = "slow_client"    # the client did not read its answers: its requests were cancelled
TOO_MANY = "too_many_requests"  # the client already has MAX_REQUESTS_PER_CLIENT requests in flight
SILENT = "node_silent"         # (the client's own) the node sent nothing for LIVENESS_S while the request was in flight

MAX_REQUEST_ID_BYTES = 256
MAX_ON_BEHALF_OF_BYTES = 256
MAX_REQUESTS_PER_CLIENT = 1024
CLIENT_QUEUE = 1024           # answers queued for one client before it counts as not reading
MESSAGE_SLACK = 64 << 10      # a message's bytes besides its token ids (keys, id, PD descriptors)
MAX_TOP_LOGPROBS = 20         # alternatives per position, as OpenAI's and vLLM's APIs allow
MAX_LOGIT_BIAS = 1024         # tokens one request may bias
MAX_CACHE_SALT_BYTES = 256    # a request's cache_salt, as UTF-8
PROBE_S = 0.5                 # the engine sends each client with requests in flight an empty message this often
LIVENESS_S = 4 * PROBE_S      # a node silent this long while a client waits for its answer is stopped, hung or gone


def max_message_bytes(max_model_len: int) -> int:
    """The largest message a node with this model length accepts: the longest valid prompt as
    int32 bytes, plus the rest of the message."""
    return max_model_len * 4 + MESSAGE_SLACK


def request_id_problem(request_id: object) -> str:
    """What is wrong with a request id, or "": every answer repeats it, so it stays short."""
    if not isinstance(request_id, str):
        return f"request_id must be a string, got {type(request_id).__name__}"
    if not request_id:
        return "request_id must not be empty"
    size = len(request_id.encode("utf-8", "replace"))
    if size > MAX_REQUEST_ID_BYTES:
        return f"request_id is {size} bytes long; at most {MAX_REQUEST_ID_BYTES} are allowed"
    if not request_id.isprintable():
        return "request_id must be printable (no control characters or line breaks)"
    return ""


def cache_salt_problem(cache_salt: object) -> str:
    """What is wrong with a cache salt, or "" ("" itself is no salt)."""
    if not isinstance(cache_salt, str):
        return f"cache_salt must be a string, got {type(cache_salt).__name__}"
    try:
        size = len(cache_salt.encode("utf-8"))
    except UnicodeEncodeError:
        return "cache_salt must be valid Unicode text (no lone surrogates)"
    if size > MAX_CACHE_SALT_BYTES:
        return f"cache_salt is {size} bytes long as UTF-8; at most {MAX_CACHE_SALT_BYTES} are allowed"
    return ""


@dataclass
class Generation:
    """What a request asks of the model, shared by a client's request and P's preallocation
    on D (so D's tokens are the ones one node would give). `eos_token_id` >= 0 stops early
    when sampled. `use_cache` False neither matches nor records prefix-cache blocks (the
    cache-off side of a comparison).

    Sampling: `temperature` 0 is greedy (exactly argmax); above 0 the logits are divided by
    it, cut to the `top_k` most likely tokens (0: no cut), then to the smallest set whose
    probability reaches `top_p`, then to the tokens at least `min_p` times as likely as the
    likeliest (0: no cut), and one token is drawn. `seed` makes the draws reproducible
    (the same request with the same seed gives the same tokens, whatever else the node runs);
    None lets the node pick one. Any of `stop_token_ids` ends the request (finish reason
    "stop", the token included). `logprobs` True adds each output token's log-probability
    under the model's unscaled logits to the answers, and `top_logprobs` (up to
    MAX_TOP_LOGPROBS) the most likely tokens and theirs at each position.

    Adjustments, applied in this order before the draw (and before greedy's argmax):
    `logit_bias`, [token id, bias] pairs (bias in [-100, 100]) added to the logits;
    `min_tokens`: the EOS and stop token ids cannot be drawn before that many output tokens;
    `repetition_penalty` (1: off) divides the positive logits of every token of the prompt
    and output so far and multiplies the negative ones; `frequency_penalty` and
    `presence_penalty` (0: off, in [-2, 2]) subtract f * count and p once from each token
    the output holds. Stop strings need text, so they are the client's (runtime/client/stop.py).

    `guided` constrains the output to a grammar: {"kind": "json_object" | "json_schema" |
    "regex" | "choice" | "grammar" | "tool_call", "spec": text} (spec: the JSON schema as JSON
    text, the regex, a JSON list of strings, a GBNF or Lark grammar, runtime/grammar/tool_call.py's
    spec, or "" for json_object). A spec the node refuses (a keyword it cannot enforce, a
    compile limit: runtime/grammar/) is a bad_request error naming what. Each token is drawn only from those the grammar allows next, after the
    adjustments above, and the request's EOS only once the grammar is complete (so such a
    request needs an `eos_token_id`); max_new_tokens may cut it first (finish reason "length").
    Its shape is checked at intake (runtime/grammar/spec.py); the node must serve a checkpoint with a
    tokenizer.json, whose vocabulary the grammar is compiled against.

    `cache_salt` (vLLM's field; "" for none) keeps the request's prefix-cache blocks apart from
    those of every other salt (runtime/cache/keys.py salted_root): requests share cached blocks
    only with requests of the same salt, so one tenant cannot learn from a hit what another sent."""

    request_id: str
    prompt: np.ndarray
    max_new_tokens: int
    eos_token_id: int = -1
    use_cache: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list = field(default_factory=list)
    logprobs: bool = False
    min_p: float = 0.0
    top_logprobs: int = 0
    logit_bias: list = field(default_factory=list)
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    guided: dict | None = None
    cache_salt: str = ""

    def generation(self) -> dict:
        """This message's `Generation` fields by name, to build another message from."""
        return {f.name: getattr(self, f.name) for f in fields(Generation)}


@API.message("generate")
@dataclass
class GenerateRequest(Generation):
    """Generation of up to `max_new_tokens` tokens after `prompt` (see `Generation`).
    `stream` False sends only the FinishedEvent. `prompt_logprobs` k (0..MAX_TOP_LOGPROBS; None:
    not asked) scores the prompt: each prompt token's log-probability given the tokens before it
    (none for the first) and rank, and the k likeliest tokens at its position, under the model's
    unscaled logits; such a request takes no prefix-cache hits while its prompt is scored (a
    cached block has no logits). A prefill node scores it itself (it is not handed to decode).
    `on_behalf_of` names the client's own client
    (an HTTP server's: the remote address) whose quota the request counts against: the
    engine's MAX_REQUESTS_PER_CLIENT is per (socket, on_behalf_of), so that one HTTP client's
    burst does not take another's share of the server's one socket."""

    stream: bool = True
    prompt_logprobs: int | None = None
    on_behalf_of: str = ""


@API.message("cancel")
@dataclass
class CancelRequest:
    request_id: str


@API.message("info")
@dataclass
class InfoRequest:
    """Ask for the node's model limits (vocab size, longest sequence) before sending work."""

    nonce: int = 0


@API.message("info_reply")
@dataclass
class InfoReply:
    """The node's model limits. `model_dir` is the checkpoint directory the node serves ("" for
    the built-in reference model): a client on the same machine loads the tokenizer from it."""

    nonce: int
    node: str
    role: str
    vocab_size: int
    max_model_len: int
    block_size: int
    eos_token_id: int
    model_dir: str = ""


@API.message("reset_prefix_cache")
@dataclass
class ResetPrefixCacheRequest:
    """Drop the node's prefix cache, as operators do with vLLM's `POST /reset_prefix_cache` or
    SGLang's `/flush_cache`: nothing cached before is matched after. Requests in flight finish
    with the answers they would have given; the blocks they hold are freed when they end."""

    nonce: int = 0


@API.message("reset_prefix_cache_reply")
@dataclass
class ResetPrefixCacheReply:
    """What a reset dropped: blocks freed per tier (`device`, `host`); keys of a node-local
    storage tier the node forgot (`storage`: it reads none of those objects again; a shared
    store belongs to several nodes and is left as it is: 0); blocks that left the cache but
    stay in use until the requests or tasks holding them end (`held_device`, `held_host`)."""

    nonce: int
    device: int
    host: int
    storage: int = 0
    held_device: int = 0
    held_host: int = 0


@API.message("tokens")
@dataclass
class TokenEvent:
    """New output tokens of a streaming request, in order; `index` is the position of the first
    of them in the output. `logprobs`: theirs, if the request asked (else empty); `top`: for
    each of them, [ids, logprobs] of its most likely alternatives, if the request asked.
    The event of the first output token (index 0) of a request that asked for prompt logprobs
    also carries them, for prompt positions 1, 2, ... (position 0 has nothing before it):
    each prompt token's log-probability (`prompt_logprobs`), rank (`prompt_ranks`: 1 + the
    tokens likelier than it) and, with k > 0, [ids, logprobs] of the k likeliest tokens there
    (`prompt_top`)."""

    request_id: str
    index: int
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    top: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    prompt_ranks: list = field(default_factory=list)
    prompt_top: list = field(default_factory=list)


@dataclass
class Outcome:
    """What a finished request gave and cost, as both the engine's FinishedEvent and the
    client's Result tell it. Every prompt token is either cached (served by a tier:
    `cached_*`) or computed (the model ran it for this request: `computed_prompt_tokens`, each
    position counted once even if a preemption made it run again), so they add up to
    `prompt_tokens` (less only for a request cancelled before its prompt was through; see
    runtime/engine/sequence.py)."""

    request_id: str
    output_token_ids: np.ndarray
    finish_reason: str           # "length", "eos", "stop" or "cancelled"
    prompt_tokens: int
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0
    computed_prompt_tokens: int = 0
    preemptions: int = 0

    def outcome(self) -> dict:
        """The `Outcome` fields by name, to build a FinishedEvent's client-side Result from."""
        return {f.name: getattr(self, f.name) for f in fields(Outcome)}


@API.message("finished")
@dataclass
class FinishedEvent(Outcome):
    """The whole answer and what it cost (see `Outcome`). Times are measured by the engine from
    intake."""

    ttft_ms: float = 0.0
    e2e_ms: float = 0.0
    output_logprobs: list = field(default_factory=list)  # one per output token, if asked
    output_top: list = field(default_factory=list)  # [ids, logprobs] per output token, if asked
    prompt_logprobs: list = field(default_factory=list)  # the prompt's scores, if asked (as TokenEvent's)
    prompt_ranks: list = field(default_factory=list)
    prompt_top: list = field(default_factory=list)
    queue_ms: float = 0.0  # intake -> first scheduled (0: never scheduled)


@API.message("error")
@dataclass
class ErrorEvent:
    request_id: str
    code: str
    message: str
