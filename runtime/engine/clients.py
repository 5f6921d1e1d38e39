"""Which client gets which event: the engine's book of clients and their requests.

Why a class of its own: a request's events (streamed tokens, the final answer, an error) go to
the client that sent it, or to the connector when a peer node sent it, and a client that is
gone or stops reading must have its requests cancelled. Requests live in two places (the
scheduler, and the connector for those it holds outside it), so "whose is this request" and
"which requests are this client's" are answered here once, for intake, cancels and stopping.
"""
from __future__ import annotations

import logging
import time

from kvrt.runtime.client import api
from kvrt.runtime.engine.metrics import Metrics
from kvrt.runtime.engine.scheduler import Scheduler, StepOutcome
from kvrt.runtime.engine.sequence import Sequence
from kvrt.runtime.engine.server import ApiServer
from kvrt.runtime.engine.stats import EngineStats
from kvrt.runtime.pd.connector import KVConnector

log = logging.getLogger("kvrt.engine")
PROBE_S = api.PROBE_S  # how often each client with requests in flight is probed: its connection checked, and
                       # the client told the engine is alive (a silence of api.LIVENESS_S means it is not)


class Clients:
    """Requests by client and by id, and every answer toward a client. `server` is bound once
    the engine opens its socket (none: answers to clients go nowhere); `connector` once the
    connector, which answers through this object, is made."""

    def __init__(self, sched: Scheduler, stats: EngineStats, metrics: Metrics):
        self.sched = sched
        self.stats = stats
        self.metrics = metrics
        self.server: ApiServer | None = None
        self.connector: KVConnector | None = None
        self._per_client: dict[bytes, int] = {}  # requests in flight per quota key (recounted every PROBE_S)
        self._key_of: dict[str, bytes] = {}  # a request sent on behalf of someone -> its quota key
        self._next_probe = 0.0

    # ---- sending ----------------------------------------------------------------------------
    def reply(self, client: bytes, msg, keep: bool = False) -> None:
        if self.connector.deliver(client, msg):
            return  # a peer's request: the connector answers the peer
        if self.server is not None and client:
            self.server.send(client, api.API.encode(msg), keep)

    def send_raw(self, client: bytes, msg) -> None:
        """`msg` to a client socket as it is (a connector's sealed and handshake messages)."""
        if self.server is not None:
            self.server.send(client, api.API.encode(msg))

    def finished(self, seq: Sequence) -> None:
        now = time.monotonic()
        self.stats.count_finished(seq)
        self.connector.request_finished(seq)
        ttft = (seq.first_token_at - seq.arrival) * 1e3 if seq.first_token_at else 0.0
        queued = (seq.scheduled_at - seq.arrival) * 1e3 if seq.scheduled_at else 0.0
        if seq.first_token_at:
            self.metrics.ttft_seconds.observe(ttft / 1e3)
        self.reply(seq.client, api.FinishedEvent(
            seq.request_id, seq.output.copy(), seq.finish_reason, seq.prompt_len, *seq.cached,
            seq.computed_prompt_tokens, seq.preemptions, ttft, (now - seq.arrival) * 1e3,
            list(seq.output_logprobs), list(seq.output_top), seq.prompt_lps, seq.prompt_ranks, seq.prompt_top,
            queued))

    def apply(self, out: StepOutcome) -> None:
        """A step's outcome to its clients: streamed tokens, final answers, errors."""
        for seq, index in out.emitted:
            self.stats.count("generated_tokens")
            if seq.stream:
                ev = api.TokenEvent(seq.request_id, index, [int(seq.output[index])],
                                    seq.output_logprobs[index:index + 1], seq.output_top[index:index + 1])
                if index == 0 and seq.prompt_logprobs is not None:
                    ev.prompt_logprobs, ev.prompt_ranks, ev.prompt_top = seq.prompt_lps, seq.prompt_ranks, \
                        seq.prompt_top
                self.reply(seq.client, ev)
        for seq in out.finished:
            self.finished(seq)
        for seq, why in out.failed:
            self.connector.request_finished(seq)
            self.stats.count_failed()
            refused = seq.guide is not None and seq.guide.refused  # its grammar was refused: a bad request
            self.reply(seq.client, api.ErrorEvent(seq.request_id, api.BAD_REQUEST if refused else api.FAILED, why))

    def fail_all(self, why: str) -> None:
        """An error event for every request in flight (the connector's included), counted."""
        self.connector.fail_all(why)
        for seq in list(self.sched.seqs.values()):
            self.stats.count_failed()
            self.reply(seq.client, api.ErrorEvent(seq.request_id, api.FAILED, why))

    def tell_all(self, code: str, why: str) -> None:
        """An error event for every request the scheduler holds (stopping: not counted failed)."""
        for seq in list(self.sched.seqs.values()):
            self.reply(seq.client, api.ErrorEvent(seq.request_id, code, why))

    # ---- requests by client -----------------------------------------------------------------
    def requests_of(self, client: bytes) -> list[str]:
        """Ids of the requests in flight that `client` submitted (one scan: used on rare events)."""
        rids = [rid for rid, seq in self.sched.seqs.items() if seq.client == client]
        rids += [rid for rid, c in self.connector.requests() if c == client]
        return list(dict.fromkeys(rids))

    def owner_of(self, rid: str) -> bytes | None:
        """The client that submitted request `rid`, or None if it is not in flight."""
        if (seq := self.sched.seqs.get(rid)) is not None:
            return seq.client
        return next((c for r, c in self.connector.requests() if r == rid), None)

    @staticmethod
    def quota_key(client: bytes, on_behalf_of: str) -> bytes:
        """Whose quota a request counts against: its socket's, or the socket's client's it names
        (an HTTP server's remote client), which no other socket can take a share of."""
        return client + b"\0" + on_behalf_of.encode() if on_behalf_of else client

    def at_limit(self, client: bytes, key: bytes) -> bool:
        """`key` (a quota key of `client`'s) already has MAX_REQUESTS_PER_CLIENT requests in flight."""
        if self._per_client.get(key, 0) >= api.MAX_REQUESTS_PER_CLIENT:  # the count is an upper bound
            self._per_client[key] = sum(self._key_of.get(r, client) == key for r in self.requests_of(client))
        return self._per_client.get(key, 0) >= api.MAX_REQUESTS_PER_CLIENT

    def admitted(self, key: bytes, rid: str, client: bytes) -> None:
        self._per_client[key] = self._per_client.get(key, 0) + 1
        if key != client:
            self._key_of[rid] = key

    def cancel(self, client: bytes, rid: str) -> None:
        """Cancel `client`'s request `rid` (in flight: checked by the caller)."""
        if self.connector.cancel(client, rid):
            return
        seq = self.sched.cancel(rid)
        if seq is not None:
            self.finished(seq)

    def end_client(self, client: bytes, why: str) -> None:
        """Cancel every request of a client that is gone (`why` empty) or does not read (`why`
        goes to it with each request, kept until it reads). Blocks held for external KV stay
        until it arrives or the connector gives up: it may be being written into them."""
        seqs = self.sched.seqs
        rids = [rid for rid in self.requests_of(client) if rid not in self.sched.external_ids
                and not (rid in seqs and seqs[rid].cancelled)]  # (those end with the step in flight)
        for rid in rids:
            if why:
                self.reply(client, api.ErrorEvent(rid, api.SLOW_CLIENT, why), keep=True)
            self.cancel(client, rid)
        self._per_client.pop(client, None)
        if rids:
            log.warning("client %s %s: cancelled its %d requests in flight", client.hex(),
                        "stopped reading" if why else "disconnected", len(rids))

    def probe(self) -> None:
        """Every PROBE_S: recount the requests of each client and probe each one that has some
        (a client that is gone is then noticed even while its requests wait for a step)."""
        now = time.monotonic()
        if now < self._next_probe:
            return
        self._next_probe = now + PROBE_S
        owners = [(rid, seq.client) for rid, seq in self.sched.seqs.items()]
        owners += list(self.connector.requests())
        self._key_of = {rid: self._key_of[rid] for rid, _ in owners if rid in self._key_of}
        self._per_client = {}
        for rid, c in owners:
            key = self._key_of.get(rid, c)
            self._per_client[key] = self._per_client.get(key, 0) + 1
        for c in dict.fromkeys(c for _, c in owners):
            if c and not self.connector.is_peer_client(c):  # a peer's requests: its session's
                self.server.probe(c)
