"""One request as the scheduler sees it: its tokens, how many have KV written, and its stats.

Why one preallocated token array per request: the prompt and every output token live in
`tokens[:num_tokens]`, sized for prompt + max_new_tokens at intake, so appending a token is
one store, a step's slice is a view, and the block hasher reads the same buffer.

What a request is told its prompt cost (`cached`, `computed_prompt_tokens`): every prompt
position is either computed (the model ran it for this request, at least once) or cached (it
never had to run it), so cached per tier + computed = prompt tokens, exactly, for every request
whose prompt was processed (a client reads cached tokens as "prompt tokens not computed", as
vLLM's `prompt_tokens_details.cached_tokens` means). A request may be matched several times
(its match given back for lack of blocks, a preemption, a lost swap-in) and each match may find
a different prefix; the tier of a cached position is that of the first match that found it
(as the node's hit counters count a request's first match: a block a request swapped in from
the host is a host hit, even when the request finds it on the device after giving its match
back). A position run again after a preemption counts once in `computed_prompt_tokens`; the
repeats are `recomputed_prompt_tokens` (work, not cost).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from kvrt.runtime.cache.keys import ROOT_KEY, BlockHasher
from kvrt.runtime.engine.guide import GuideState


class SeqState(enum.Enum):
    WAITING = "waiting"    # not admitted, or preempted and queued again
    LOADING = "loading"    # admitted; its cached prefix is still being swapped in or read
    RUNNING = "running"    # prefilling in chunks, then decoding
    EXTERNAL = "external"  # holds its blocks while a connector moves their KV in or out
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_len: int
    max_new_tokens: int
    tokens: np.ndarray               # int32[prompt_len + max_new_tokens]
    hasher: BlockHasher
    client: bytes = b""              # the client socket identity answers go to
    owner: bytes = b""               # whose fair share it counts against (b"": its client's)
    eos_token_id: int = -1
    use_cache: bool = True
    stream: bool = True
    temperature: float = 0.0         # sampling (see workers/model/sampler.py); 0: greedy
    top_p: float = 1.0
    top_k: int = 0                   # 0: no limit
    min_p: float = 0.0               # 0: no limit
    seed: int = 0                    # with a token's position, what its random draw depends on
    stop_token_ids: frozenset[int] = frozenset()  # end the request, finish reason "stop"
    logprobs: bool = False           # record each output token's log-probability
    output_logprobs: list[float] = field(default_factory=list)
    top_logprobs: int = 0            # record each output token's most likely alternatives
    output_top: list[list] = field(default_factory=list)  # [ids, logprobs] per output token
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0              # EOS and stop token ids are banned before this many outputs
    repetition_penalty: float = 1.0  # over prompt and output; 1: off
    frequency_penalty: float = 0.0   # over the output; 0: off
    presence_penalty: float = 0.0
    guide: GuideState | None = None  # guided decoding: the grammar state its output reached
    _prompt_distinct: np.ndarray | None = None  # the prompt's distinct tokens, once asked
    prompt_logprobs: int | None = None  # score the prompt's tokens, with this many alternatives
    prompt_lps: list[float] = field(default_factory=list)  # of prompt positions 1, 2, ... so far
    prompt_ranks: list[int] = field(default_factory=list)
    prompt_top: list[list] = field(default_factory=list)  # [ids, logprobs] per scored position
    num_tokens: int = 0              # prompt + output tokens known so far
    num_computed: int = 0            # tokens whose KV is written
    state: SeqState = SeqState.WAITING
    matched: bool = False            # holds a prefix-cache entry (matched, maybe blocks)
    counted: bool = False            # its first match is in the hit counters (count it once)
    gave_way: bool = False           # gave its blocks up to swap-ins that wait for room
    asked_storage: bool = False      # read storage since it was last admitted (ask once)
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float = 0.0
    scheduled_at: float = 0.0        # when it was first scheduled (its time queued ends there)
    # per match made, in order: the prompt tokens it served from device, host and storage, in
    # token order (the last one's storage part lowered when its read comes back short)
    matches: list[tuple[int, int, int]] = field(default_factory=list)
    computed_prompt_tokens: int = 0  # prompt positions the model ran, each counted once
    recomputed_prompt_tokens: int = 0  # runs of positions it had run before (after a preemption)
    ran: list[tuple[int, int]] = field(default_factory=list)  # the positions run: disjoint, sorted
    preemptions: int = 0
    finish_reason: str = ""
    cancelled: bool = False

    @classmethod
    def new(cls, request_id: str, prompt: np.ndarray, max_new_tokens: int, block_size: int,
            key_root: bytes = ROOT_KEY, **kw) -> "Sequence":
        """`key_root`: the node's model identity root (NodeConfig.key_root), so its keys never
        match another model's blocks."""
        tokens = np.empty(len(prompt) + max_new_tokens, dtype=np.int32)
        tokens[:len(prompt)] = prompt
        return cls(request_id, len(prompt), max_new_tokens, tokens, BlockHasher(block_size, root=key_root),
                   num_tokens=len(prompt), **kw)

    @property
    def output(self) -> np.ndarray:
        return self.tokens[self.prompt_len:self.num_tokens]

    @property
    def num_output(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def cached(self) -> tuple[int, int, int]:
        """Prompt tokens served by the device, host and storage tiers and never computed for
        this request: each position in the tier of the first match that found it (every match
        covers a prefix), less the positions the request ran itself (see the module docstring)."""
        out = [0, 0, 0]
        covered = 0  # positions an earlier match found
        for match in self.matches:
            start = 0
            for tier, n in enumerate(match):
                lo, hi = max(start, covered), min(start + n, self.prompt_len)
                if hi > lo:
                    out[tier] += hi - lo - self._ran_within(lo, hi)
                start += n
            covered = max(covered, min(start, self.prompt_len))
        return out[0], out[1], out[2]

    def ran_prompt(self, start: int, end: int) -> None:
        """The model runs positions [start, end) (a chunk): count its prompt positions, once each."""
        end = min(end, self.prompt_len)
        if start >= end:
            return
        again = self._ran_within(start, end)
        self.recomputed_prompt_tokens += again
        self.computed_prompt_tokens += end - start - again
        out = []
        for a, b in self.ran:
            if b < start or a > end:
                out.append((a, b))
            else:  # touches the new run: merged into it
                start, end = min(a, start), max(b, end)
        out.append((start, end))
        out.sort()
        self.ran = out

    def _ran_within(self, lo: int, hi: int) -> int:
        """How many positions in [lo, hi) were run."""
        return sum(max(0, min(b, hi) - max(a, lo)) for a, b in self.ran)

    @property
    def keys(self) -> list[bytes]:
        """Keys of every full block of the known tokens (hashed once each, as they complete);
        none when the request opted out of the prefix cache."""
        if not self.use_cache:
            return []
        self.hasher.update(self.tokens[:self.num_tokens])
        return self.hasher.keys

    def append(self, token: int, logprob: float = 0.0, top: list | None = None) -> None:
        """One output token and, if the request asked for them, its log-probability and its
        alternatives ([ids, logprobs]); a guided request's grammar state follows it."""
        self.tokens[self.num_tokens] = token
        self.num_tokens += 1
        if self.guide is not None:
            self.guide.advance(int(token))
        if self.logprobs:
            self.output_logprobs.append(float(logprob))
        if self.top_logprobs:
            self.output_top.append(top if top is not None else [[], []])
        if self.first_token_at == 0.0:
            self.first_token_at = time.monotonic()

    @property
    def scores_prompt(self) -> bool:
        """The request asked for its prompt's logprobs and some positions are not scored yet."""
        return self.prompt_logprobs is not None and len(self.prompt_lps) < self.prompt_len - 1

    @property
    def reads_cache(self) -> bool:
        """Whether a match may serve this request cached blocks. A request still scoring its
        prompt takes no hits, as vLLM does: a cached block has KV but no logits, and the scores
        of its positions need the model's hidden states there, so they are computed (and the
        blocks this request writes are cached for others all the same). Recomputing only the
        hit's logits would cost the same forward pass over those positions."""
        return not self.scores_prompt

    def prompt_rows(self, start: int, chunk: int) -> int:
        """How many rows of a chunk of `chunk` tokens at `start` are scored: those whose next
        token is a prompt token (rows are scored again after a preemption, and kept once)."""
        return max(0, min(chunk, self.prompt_len - 1 - start)) if self.scores_prompt else 0

    def add_prompt_scores(self, start: int, lps: list[float], ranks: list[int], top: list[list] | None) -> None:
        """Scores of prompt positions start + 1, start + 2, ... (rows from `start`); positions
        already scored (a chunk run again after a preemption) keep their first values."""
        skip = len(self.prompt_lps) - start
        if skip < 0:
            raise ValueError(f"{self.request_id}: prompt scores from position {start + 1} leave a gap after "
                             f"{len(self.prompt_lps)}")
        self.prompt_lps += lps[skip:]
        self.prompt_ranks += ranks[skip:]
        if self.prompt_logprobs:
            self.prompt_top += (top or [[[], []]] * len(lps))[skip:]

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def bias(self) -> dict[int, float]:
        """The logit biases of the next token: the request's, and -inf on its EOS and stop
        token ids while it has fewer than min_tokens outputs."""
        if self.num_output >= self.min_tokens:
            return self.logit_bias
        bans = set(self.stop_token_ids) | ({self.eos_token_id} if self.eos_token_id >= 0 else set())
        return {**self.logit_bias, **{t: -np.inf for t in bans}}

    def penalty_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """The tokens the penalties of the next token touch and their counts in the output:
        the output's distinct tokens, and the prompt's too (count 0 unless also in the output)
        when the repetition penalty is on (it covers the prompt)."""
        ids, counts = np.unique(self.output, return_counts=True)
        if self.repetition_penalty != 1.0:
            if self._prompt_distinct is None:
                self._prompt_distinct = np.unique(self.tokens[:self.prompt_len])
            only = np.setdiff1d(self._prompt_distinct, ids, assume_unique=True)
            ids, counts = np.concatenate([ids, only]), np.concatenate([counts, np.zeros(len(only), counts.dtype)])
        return ids, counts

    def done(self) -> bool:
        """Finished by length, end-of-sequence or a stop token (sets finish_reason)."""
        last = int(self.tokens[self.num_tokens - 1]) if self.num_output else -1
        if self.num_output and self.eos_token_id >= 0 and last == self.eos_token_id:
            self.finish_reason = "eos"
        elif last in self.stop_token_ids:
            self.finish_reason = "stop"
        elif self.num_output >= self.max_new_tokens:
            self.finish_reason = "length"
        return bool(self.finish_reason)
