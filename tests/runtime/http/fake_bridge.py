"""A bridge to no engine, for the HTTP layer's unit tests (a fake: unit tests only)."""
from __future__ import annotations

from kvrt.runtime.client.api import InfoReply


class FakeBridge:
    """Ready (or not), with an InfoReply of the given vocabulary and context length, handing out
    request ids r1, r2, ...; what its engine answers is a subclass's `submit`, which puts events
    on the request's queue with `put`."""

    def __init__(self, ready: bool = True, vocab_size: int = 512, max_model_len: int = 64) -> None:
        self.ready = ready
        self.info = InfoReply(nonce=1, node="n", role="mixed", vocab_size=vocab_size, max_model_len=max_model_len,
                              block_size=8, eos_token_id=-1)
        self._n = 0

    def new_id(self) -> str:
        self._n += 1
        return f"r{self._n}"

    @staticmethod
    def put(sub, event) -> None:
        """Put `event` on `sub`'s queue as the engine's side does: from another thread."""
        sub.loop.call_soon_threadsafe(sub.events.put_nowait, (sub.request_id, event))

    def submit(self, sub) -> None:
        raise NotImplementedError("a fake bridge's subclass answers its requests")

    def cancel(self, request_id: str) -> None:
        pass
