"""The wire contract of a node: object names, process slots and message types.

Both sides of every channel import this module and nothing of each other (runtime/ and
workers/ never import each other), so the contract has exactly one home.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgpack
import numpy as np

from kvrt.ipc.channel import Channel
from kvrt.ipc.codec import Codec
from kvrt.ipc.shm import Segment

PROTOCOL = Codec()
# the version of the contract below as a whole: a change to any message a channel carries
# bumps it, and a process of another build is refused when it attaches to a node's channels
PROTOCOL_VERSION = 5

# ---- object names (short names; the registry adds `kvrt.<node>.`) -------------------------
CONFIG = "config"            # msgpack of the node configuration, written once by the launcher
PROCS = "procs"              # int64[slots, PROC_FIELDS]: pid, role, rank, start_ms, step + 1 (0: none), marks
HEARTBEAT = "heartbeat"      # int64[slots]: CLOCK_MONOTONIC ns of each process's last beat
READY = "ready"              # int32[slots]: 1 once a process is up
NODE_STATUS = "node_status"  # int64[STATUS_FIELDS]: node state, launcher heartbeat
ENGINE_BELL = "engine.bell"  # the doorbell every ring into the engine shares (fan-in)
OWNERS_DEVICE = "owners.device"  # int32[blocks] debug ownership table (KVRT_CHECK_OWNERSHIP=1)
OWNERS_HOST = "owners.host"
ALLREDUCE = "allreduce"      # the workers' tensor-parallel all-reduce (a checkpoint with --tp > 1)
ERRORS = "errors"            # uint8[slots + 1, ERROR_BYTES]: each process's fatal error, in its slot;
                             # the last row: why the launcher is stopping the node (empty: no failure)
ERROR_BYTES = 512


def put_text(row, text: str) -> None:
    """Write `text` (utf-8, truncated to the row, NUL-terminated) into a uint8 row."""
    data = text.encode("utf-8", "replace")[: len(row) - 1]
    row[: len(data)] = memoryview(data)
    row[len(data)] = 0


def get_text(row) -> str:
    """The text `put_text` wrote (untrusted: undecodable bytes are replaced)."""
    data = bytes(row)
    return data.split(b"\0", 1)[0].decode("utf-8", "replace")


def device_pool(rank: int) -> str:
    return f"pool.device.{rank}"


def host_pool(rank: int) -> str:
    return f"pool.host.{rank}"


def to_transfer(rank: int) -> str:
    return f"engine.to.transfer.{rank}"


def from_transfer(rank: int) -> str:
    return f"transfer.{rank}.to.engine"


def to_messager(rank: int) -> str:
    return f"engine.to.messager.{rank}"


def from_messager(rank: int) -> str:
    return f"messager.{rank}.to.engine"


def to_worker(rank: int) -> str:
    return f"engine.to.worker.{rank}"


def from_worker(rank: int) -> str:
    return f"worker.{rank}.to.engine"


# ---- processes -------------------------------------------------------------------------
ROLE_ENGINE, ROLE_WORKER, ROLE_TRANSFER, ROLE_MESSAGER, ROLE_GATEWAY = 1, 2, 3, 4, 5
ROLE_NAMES = {ROLE_ENGINE: "engine", ROLE_WORKER: "worker", ROLE_TRANSFER: "cache-transfer",
              ROLE_MESSAGER: "cache-messager", ROLE_GATEWAY: "gateway"}
PROC_PID, PROC_ROLE, PROC_RANK, PROC_START, PROC_STEP, PROC_MARKS = range(6)
PROC_FIELDS = 6  # PROC_MARKS: a worker's progress marks so far (workers/progress.py), the engine's step bound


EXIT_ORPHAN = 3  # a child's exit status when it left because the engine or launcher was gone:
                 # a consequence of another failure, never the cause the launcher reports


def hang_threshold(config: dict, role: int) -> float:
    """Seconds without a heartbeat after which a ready process of `role` counts as hung (the
    launcher acts on it; status shows it). A cache-messager may sit in one transfer for up to
    the rank timeout without beating, so that much is added for it."""
    extra = float(config.get("rank_timeout", 0.0)) if role == ROLE_MESSAGER else 0.0
    return float(config.get("hang_timeout", 0.0)) + extra


def proc_slots(tp: int) -> list[tuple[int, int]]:
    """(role, rank) of every process slot: engine, workers, cache-transfer, cache-messager,
    gateway (last: the others' slots are as they were before it)."""
    return ([(ROLE_ENGINE, 0)] + [(ROLE_WORKER, r) for r in range(tp)]
            + [(ROLE_TRANSFER, r) for r in range(tp)] + [(ROLE_MESSAGER, r) for r in range(tp)]
            + [(ROLE_GATEWAY, 0)])


def slot_of(tp: int, role: int, rank: int) -> int:
    return proc_slots(tp).index((role, rank))


# ---- status words (NODE_STATUS indices and values) ----------------------------------------
ST_NODE, ST_LAUNCHER_BEAT = 0, 2  # ST_LAUNCHER_BEAT: CLOCK_MONOTONIC ns, while running
ST_GATEWAY_RESTARTS = 3  # how many times the launcher restarted the gateway (runtime/gateway/)
STATUS_FIELDS = 8
NODE_STARTING, NODE_RUNNING, NODE_STOPPING = 0, 1, 2

# ---- block owners (debug ownership table) -------------------------------------------------
OWNER_FREE, OWNER_WORKER, OWNER_TRANSFER, OWNER_MESSAGER, OWNER_CACHE = 0, 1, 2, 3, 4
OWNER_NAMES = {OWNER_FREE: "free", OWNER_WORKER: "worker", OWNER_TRANSFER: "cache-transfer",
               OWNER_MESSAGER: "cache-messager", OWNER_CACHE: "prefix-cache"}

# ---- engine <-> cache-transfer ------------------------------------------------------------
class TaskKind(str, enum.Enum):
    """The kinds of transfer task, and the one table of what each moves: the tier whose blocks
    it reads and the tier it writes ("device", "host" or "storage"). The prefix cache, the
    ownership check and cache-transfer's dispatch all derive from this table, so a new kind is
    one entry here plus its handlers. The value is the wire name."""

    reads: str
    writes: str

    SWAP2CPU = ("swap2cpu", "device", "host")
    SWAP2GPU = ("swap2gpu", "host", "device")
    STORAGE2GPU = ("storage2gpu", "storage", "device")
    GPU2STORAGE = ("gpu2storage", "device", "storage")

    def __new__(cls, wire: str, reads: str, writes: str) -> "TaskKind":
        kind = str.__new__(cls, wire)
        kind._value_ = wire
        kind.reads, kind.writes = reads, writes
        return kind

    def __str__(self) -> str:  # the wire name in logs and metric labels, not "TaskKind.X"
        return self.value


SWAP2CPU, SWAP2GPU = TaskKind.SWAP2CPU, TaskKind.SWAP2GPU
STORAGE2GPU, GPU2STORAGE = TaskKind.STORAGE2GPU, TaskKind.GPU2STORAGE


@PROTOCOL.message("transfer_task")
@dataclass
class TransferTask:
    """The one transfer task: the prefix cache creates it (and numbers it), the engine sends it
    to every cache-transfer rank, and the answers and the cache's bookkeeping key on its id.
    Swaps pair device_blocks[i] with host_blocks[i]; storage tasks pair device_blocks[i] with
    keys[i] (keys computed by the engine). The engine side holds block lists (a deferred
    swap-in gets its device blocks late); they travel as int32 arrays and arrive as such."""

    task_id: int
    kind: TaskKind
    device_blocks: np.ndarray | list[int]
    host_blocks: np.ndarray | list[int]
    keys: list = field(default_factory=list)
    deadline: float = 0.0  # time.monotonic() (system-wide) after which the rank must not start it; 0: none


@PROTOCOL.message("transfer_done")
@dataclass
class TransferDone:
    """A rank's answer. For STORAGE2GPU, `blocks` is how many leading blocks were read (a
    missing or corrupt object ends the prefix); for the others, all or nothing."""

    task_id: int
    rank: int
    ok: bool
    blocks: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""
    store_errors: int = 0  # storage tasks: store failures that became misses (never an error here)
    store_forged: int = 0  # storage tasks: objects without a valid MAC, answered as misses


@PROTOCOL.message("storage_keys")
@dataclass
class StorageKeys:
    """cache-transfer rank -> engine at start-up, in batches: the keys its storage holds
    (`last` marks the final batch). The engine's storage index starts from what every rank has.
    A shared store lists nothing (one empty last batch): it is asked by each read instead."""

    rank: int
    keys: list
    last: bool


@PROTOCOL.message("shutdown")
@dataclass
class Shutdown:
    """Engine -> a child: finish what you hold, then exit."""

    reason: str = ""


# ---- the node configuration, published once by the launcher ---------------------------------
def publish_config(reg, config: dict) -> None:
    """Write the node's configuration (a plain dict) into the CONFIG segment, length-prefixed."""
    data = msgpack.packb(config, use_bin_type=True)
    seg = reg.create_segment(CONFIG, len(data) + 8, kind="segment", meta={"format": "msgpack"})
    seg.mm[:8] = len(data).to_bytes(8, "little")
    seg.mm[8:8 + len(data)] = data
    seg.close()


def read_config(reg) -> dict:
    seg = Segment.attach(reg.name_of(CONFIG))
    try:
        n = int.from_bytes(seg.mm[:8], "little")
        return msgpack.unpackb(seg.mm[8:8 + n], raw=False)
    finally:
        seg.close()


# ---- engine statistics, published for `kvrt status` (float64[len(STATS)]) -----------------------
ENGINE_STATS = "engine.stats"
STATS = (
    "device_total", "device_free", "device_cached", "device_used",
    "host_total", "host_free", "host_cached", "host_used",
    "requests", "hit_requests", "query_tokens",
    "hit_tokens_device", "hit_tokens_host", "hit_tokens_storage",
    "tasks_inflight", "tasks_done", "tasks_failed", "swap_bytes",
    "evictions", "protocol_errors",
    "seqs_running", "seqs_waiting", "seqs_loading", "steps", "preemptions",
    "generated_tokens", "computed_prompt_tokens", "finished_requests", "failed_requests",
    "pd_sent_bytes", "pd_refused",
    "storage_errors",  # store failures (error returns, exceptions, a dead master) answered as misses
    "storage_forged",  # storage objects without a valid MAC (planted, or another group's) answered as misses
    "pd_early_blocks", "pd_early_bytes",  # P->D blocks sent while the prefill still ran
    "recomputed_prompt_tokens",  # prompt positions run again for a request (after a preemption)
    "intake_errors",  # client or peer messages whose handling raised: each answered with an error, the engine went on
    "pd_sessions",  # a prefill node's decode nodes with a session up now
)
STAT = {name: i for i, name in enumerate(STATS)}


# ---- engine <-> worker ---------------------------------------------------------------------
@PROTOCOL.message("step_batch")
@dataclass
class StepBatch:
    """Engine -> every worker rank: one forward step over several sequences, flattened.
    Sequence i computes tokens[sum(query_lens[:i]) : ...] at positions starts[i].. and owns the
    block table tables[sum(table_lens[:i]) : ...] (only the blocks it needs, in token order).
    A model of several layer groups (ipc/layout.py LayerGroups) has a table per group: `tables`
    is group 0's, and `group_tables` the others', sequence after sequence, each sequence's G - 1
    tables of table_lens[i] entries one after the other (-1 where a sliding group reads nothing);
    empty for a model of one group.

    How sequence i's next token is chosen travels with it, one entry per sequence (all empty:
    every sequence greedy): temperature[i] (0: greedy), top_p[i], top_k[i] (0: no limit), min_p[i],
    seed[i] (with the token's position, the only source of randomness, so a request's tokens
    do not depend on its batch) and logprobs[i] (1: answer the chosen token's log-probability);
    min_p may stay empty (0, no limit, for every sequence).
    The adjustments (workers/model/sampler.py's SamplingRows has their meaning), each group empty
    when no sequence of the step uses it: top_logprobs[i] alternatives to answer; logit biases
    (bias_lens[i] entries of bias_ids / bias_vals for sequence i, -inf banning a token);
    penalties repetition[i], presence[i], frequency[i] over the tokens pen_ids with output
    counts pen_counts (pen_lens[i] of them for sequence i), which the engine derives from the
    sequence's tokens at each step (so they need no state on the worker).
    Prompt logprobs (all three empty when no sequence asks): the first prompt_rows[i] rows of
    sequence i's tokens are scored, row r against prompt_targets (the token at the row's position
    + 1, sequence i's prompt_rows[i] of them in order: the engine knows the prompt, so a chunk's
    last row is scored against the next chunk's first token), with prompt_top[i] alternatives.
    Guided decoding (empty when no sequence of the step is guided): sequence guided_rows[j] may
    only take the tokens whose bits are set in guided_mask[j * W : (j + 1) * W], W = ceil(vocab
    / 32) int32 words (token t: bit t % 32 of word t // 32); the engine keeps the grammar state
    and sends the mask it allows now, so the worker holds none. At most
    max_guided_rows(vocab) guided rows a step, so that a step always fits its ring's record.
    Floats and 64-bit seeds travel as msgpack lists (the codec's arrays are int32)."""

    step_id: int
    tokens: np.ndarray
    query_lens: np.ndarray
    starts: np.ndarray
    tables: np.ndarray
    table_lens: np.ndarray
    temperature: list = field(default_factory=list)
    top_p: list = field(default_factory=list)
    top_k: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    seed: list = field(default_factory=list)
    logprobs: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    min_p: list = field(default_factory=list)
    top_logprobs: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    bias_lens: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    bias_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    bias_vals: list = field(default_factory=list)
    repetition: list = field(default_factory=list)
    presence: list = field(default_factory=list)
    frequency: list = field(default_factory=list)
    pen_lens: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    pen_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    pen_counts: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    prompt_rows: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    prompt_targets: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    prompt_top: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    guided_rows: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    guided_mask: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    group_tables: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))


# the bytes of one step's guided masks: a ring holds records up to half its size (1 MiB
# rings, runtime/node/supervisor.py), and the rest of a step stays well under the other half
GUIDED_MASK_BYTES = 256 << 10


def max_guided_rows(vocab_size: int) -> int:
    """How many guided sequences one step may carry: 13 at a 151,936-token vocabulary."""
    return max(1, GUIDED_MASK_BYTES // (4 * -(-vocab_size // 32)))


@PROTOCOL.message("step_result")
@dataclass
class StepResult:
    """A rank's answer to a step: rank 0 sends the next token of every sequence, chosen as
    the batch said (the engine ignores it for a prefill chunk that does not end the known
    tokens), and its log-probability in `logprobs` (one float per sequence, 0.0 where not asked;
    empty when none asked), and the alternatives each sequence asked for (its batch's
    top_logprobs[i] of them, most likely first, flattened in sequence order: `top_ids` and their
    `top_logprobs`); other ranks only acknowledge. A non-empty `error` fails the step.
    For the batch's prompt rows, in its order (all empty when none were asked): each target's
    log-probability (`prompt_logprobs`) and rank (`prompt_ranks`: 1 + the tokens likelier than
    it), and each row's prompt_top[i] alternatives, most likely first (`prompt_top_ids` and
    `prompt_top_logprobs`, flattened row after row)."""

    step_id: int
    rank: int
    tokens: np.ndarray
    seconds: float = 0.0
    error: str = ""
    logprobs: list = field(default_factory=list)
    top_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    top_logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    prompt_ranks: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    prompt_top_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    prompt_top_logprobs: list = field(default_factory=list)


# ---- engine <-> cache-messager (P->D handoff) ---------------------------------------------------
@PROTOCOL.message("messager_hello")
@dataclass
class MessagerHello:
    """A cache-messager rank, once its transport is open: how a P node reaches this rank's
    device pool (the transport's descriptor, sent to P in the handshake)."""

    rank: int
    descriptor: dict


@PROTOCOL.message("send_blocks")
@dataclass
class SendBlocks:
    """Engine (P) -> every cache-messager rank: write src_blocks[i] of this rank's pool into
    block dst_blocks[i] of the D node's pool of the same rank (peers[rank] describes it).
    Past `deadline` D may have given the blocks to another request: the rank answers
    "expired" without writing (it checks right before it touches them)."""

    task_id: int
    request_id: str
    peers: list
    src_blocks: np.ndarray
    dst_blocks: np.ndarray
    deadline: float = 0.0  # P's time.monotonic() after which no block of D may be touched; 0: none


@PROTOCOL.message("send_done")
@dataclass
class SendDone:
    task_id: int
    rank: int
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""


# ---- the channels between the engine and the other processes of a rank -------------------------
def worker_orders(rank: int) -> Channel:
    return Channel(to_worker(rank), (StepBatch, Shutdown), PROTOCOL, PROTOCOL_VERSION)


def worker_answers(rank: int) -> Channel:
    return Channel(from_worker(rank), (StepResult,), PROTOCOL, PROTOCOL_VERSION)


def transfer_orders(rank: int) -> Channel:
    return Channel(to_transfer(rank), (TransferTask, Shutdown), PROTOCOL, PROTOCOL_VERSION)


def transfer_answers(rank: int) -> Channel:
    return Channel(from_transfer(rank), (TransferDone, StorageKeys), PROTOCOL, PROTOCOL_VERSION)


def messager_orders(rank: int) -> Channel:
    return Channel(to_messager(rank), (SendBlocks, Shutdown), PROTOCOL, PROTOCOL_VERSION)


def messager_answers(rank: int) -> Channel:
    return Channel(from_messager(rank), (MessagerHello, SendDone), PROTOCOL, PROTOCOL_VERSION)
