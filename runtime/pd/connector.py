"""The KV connector seam: where KV that is not computed here comes from, or where KV computed
here goes, without the engine or the scheduler knowing which.

The engine picks one connector for the node (`runtime.pd.roles.connector_class`) and calls
only the hooks below; the scheduler calls the three marked "scheduler". A prefill node's
connector sends each request's KV to a decode node, a decode node's receives it, a mixed node's
does nothing; a shared store or layer-wise streaming would be one more connector.

Hooks (small on purpose; each says when it is called):
- scheduler: `get_num_new_matched_tokens(seq)`: at admission, how many of the request's tokens
  an external source supplies and whether that load is asynchronous (then the scheduler holds
  blocks for them and parks the request until `Scheduler.external_kv_arrived`);
- scheduler: `update_state_after_alloc(seq, blocks)`: the blocks for such a request are held;
- scheduler: `takes_over(seq)`: a request sampled a token and is not done: True if the rest of
  it happens elsewhere (its blocks are then freed later, when the connector drops it);
- scheduler: `reading(seq)`: the connector's ranks are reading the request's blocks (sending
  them out while it still prefills): the scheduler does not preempt it, and if it ends its
  blocks stay held until the connector gives them back (`Scheduler.release_held`);
- `build_orders()`: after a step's answers are applied: send this step's transfer orders;
- `request_finished(seq)`: a request ended here (finished, failed or cancelled);
- `on_request`, `cancel`, `busy`, `requests`: client requests the connector holds outside the
  scheduler (a prefill node's request waits for the decode node's blocks there);
- `on_peer_message`, `on_rank_message`, `deliver`, `is_peer_client`: messages from the peer
  node, from the connector's own ranks, and answers to requests a peer created;
- `tick()`: periodic deadlines (leases, pings); `fail_all(why)` and `inflight` for stopping;
- `has_ranks` (a class attribute): the connector has processes of its own (cache-messager[r]),
  whose channels the engine attaches and hands it as `ConnectorContext.to_ranks`; it must agree
  with the rings the launcher creates (NodeConfig.disaggregated).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

import numpy as np

if TYPE_CHECKING:
    from kvrt.ipc.channel import Sender
    from kvrt.runtime.client import api
    from kvrt.runtime.engine.sequence import Sequence
    from kvrt.runtime.node.config import NodeConfig


class StepView(Protocol):
    """The step the worker ranks compute now, as a connector sees it."""

    seqs: list["Sequence"]  # their blocks are the workers' until the step is answered


class SchedulerVerbs(Protocol):
    """What a connector may ask of the scheduler (its narrow view of it)."""

    seqs: dict[str, "Sequence"]
    external_ids: dict[str, int]
    inflight: StepView | None

    def add(self, seq: "Sequence") -> None: ...
    def cancel(self, request_id: str) -> "Sequence | None": ...
    def drop(self, seq: "Sequence", reason: str) -> None: ...
    def release_held(self, seq: "Sequence") -> None: ...
    def external_kv_arrived(self, seq: "Sequence", first_token: int, first_logprob: float = 0.0) -> bool: ...


@dataclass
class ConnectorContext:
    """Everything a connector may use of its node, as objects and callbacks (never the
    engine itself: connectors and the engine do not import each other)."""

    cfg: "NodeConfig"
    stats: np.ndarray                                # ENGINE_STATS counters (ipc.protocol.STAT)
    sched: SchedulerVerbs
    block_table: Callable[[str], list[int]]          # a request's device blocks
    reply: Callable[[bytes, object], None]           # an answer to a client (or a peer's request)
    send_raw: Callable[[bytes, object], None]        # a message to a socket identity as it is
    finished: Callable[["Sequence"], None]           # a request ended here: answer and count it
    count_finished: Callable[["Sequence"], None]
    count_failed: Callable[[], None]
    accepting: Callable[[], bool]                    # False once the node stops taking requests
    to_ranks: list["Sender"]                         # the connector's own rank channels (cache-messager[r])
    guide: Callable[[object], object] = lambda req: None  # a request's grammar state (guided decoding)
    # a request's block tables of its model's other layer groups (runtime/cache/groups.py; [] for one group)
    group_tables: Callable[[str], list[list[int]]] = lambda rid: []


class SchedulerHooks:
    """The hooks the scheduler calls (all it knows of a connector). The defaults mean "no
    external KV": a scheduler built without a connector uses this class as it is."""

    def get_num_new_matched_tokens(self, seq: "Sequence") -> tuple[int, bool]:
        """(tokens of `seq` an external source supplies, whether that load is asynchronous).
        Local prefix-cache hits are found by the scheduler first and never travel. Only
        asynchronous loads are supported: (n, False) is treated as (0, False)."""
        return 0, False

    def update_state_after_alloc(self, seq: "Sequence", blocks: list[int]) -> None:
        """The scheduler now holds `blocks` for the external tokens of `seq`."""

    def takes_over(self, seq: "Sequence") -> bool:
        """`seq` sampled a token and is not done: True if the connector takes it from here;
        the scheduler parks it (EXTERNAL) holding its blocks until the connector drops it."""
        return False

    def reading(self, seq: "Sequence") -> bool:
        """True while the connector's ranks read blocks of `seq` (a send ordered before its
        prefill ended): the blocks must not be freed, reused or evicted under the read, so
        the scheduler never preempts `seq` then, and if `seq` ends it keeps its blocks until
        the connector calls `release_held(seq)`."""
        return False


class KVConnector(SchedulerHooks):
    """The null connector (a mixed node): every KV is computed here, nothing leaves. Real
    connectors override the hooks they need; the defaults are what "nothing external" means."""

    has_ranks = False  # True: it has processes of its own (cache-messager[r]) and rings to them

    def __init__(self, ctx: ConnectorContext):
        self.ctx = ctx

    def build_orders(self) -> None:
        """Send the transfer orders the last step made due (called after its answers)."""

    def request_finished(self, seq: "Sequence") -> None:
        """`seq` ended here (finished, failed or cancelled)."""

    def on_request(self, client: bytes, req: "api.GenerateRequest") -> bool:
        """A valid client request: True if the connector takes it (it adds it to the
        scheduler itself, later); False: the engine adds it now."""
        return False

    def cancel(self, client: bytes, request_id: str) -> bool:
        """True if `request_id` is held by the connector (then it is cancelled here)."""
        return False

    def busy(self, request_id: str) -> bool:
        """`request_id` is in flight in the connector's own bookkeeping."""
        return False

    def requests(self) -> Iterable[tuple[str, bytes]]:
        """(request id, client) of every request the connector holds outside the scheduler."""
        return ()

    def on_peer_message(self, client: bytes, msg: object) -> bool:
        """A message from the client socket: True if it was the peer's (then it is handled)."""
        return False

    def on_rank_message(self, msg: object) -> bool:
        """An answer on one of the connector's rank rings: True if it was the connector's."""
        return False

    def deliver(self, client: bytes, msg: object) -> bool:
        """True if `client` is a peer's request identity (then `msg` went to the peer)."""
        return False

    def is_peer_client(self, client: bytes) -> bool:
        """`client` is the peer node or stands for its requests (never probed as a client)."""
        return False

    def tick(self) -> None:
        """Periodic deadlines (called every loop turn)."""

    @property
    def inflight(self) -> bool:
        """Transfers under way that a stopping node waits for."""
        return False

    def fail_all(self, why: str) -> None:
        """Fail every request the connector holds outside the scheduler."""

    def outgoing_blocks(self) -> list[int]:
        """Device blocks the connector's ranks are reading now (KVRT_CHECK_OWNERSHIP=1 marks
        them so that no step writes them)."""
        return []
