"""`kvrt status` and `kvrt clean`: read a live node from its shared memory, never from the
engine, so they work while the engine is busy or hung; and reclaim the objects of dead nodes.

Why the state comes from the launcher and not only from the status word: the word is written by
the launcher, so after a SIGKILL it still says "running" over a node nobody runs. A node is what
its launcher is: a dead launcher (pid gone) means a dead node whose objects `kvrt clean`
reclaims, a launcher whose heartbeat stopped means a hung one. Whatever the shared memory holds
(a damaged segment, a NaN counter, a heartbeat from the future), status reports it as such and
goes on: it is the tool one runs when something is wrong.
"""
from __future__ import annotations

import json
import logging
import math
import sys
import time
from typing import TextIO

import msgpack
import psutil

from kvrt.ipc import protocol as P
from kvrt.ipc.errors import IpcError, NodeLive
from kvrt.ipc.registry import Registry, list_nodes, pid_alive, reclaim
from kvrt.ipc.ring import peek_stats
from kvrt.ipc.signals import Signal
from kvrt.ipc.topology import NODE_SIGNALS
from kvrt.runtime.cache.metrics import TIERS, rates

log = logging.getLogger(__name__)

STATE = {P.NODE_STARTING: "starting", P.NODE_RUNNING: "running", P.NODE_STOPPING: "stopping"}
DEAD = "dead (run kvrt clean)"
DAMAGED = "damaged"
# the launcher beats every supervision round (a fraction of a second); this much silence is a hang
LAUNCHER_STALE_S = 5.0
# a heartbeat this far ahead of now cannot be a reading of this machine's monotonic clock
_CLOCK_SLACK_S = 1.0


def snapshot(node: str) -> dict:
    """Everything a reader can learn about `node` from its registry, signals and ring headers."""
    reg = Registry.attach(node)
    try:
        entries = {e.name: e for e in reg.entries()}
        alive = reg.owner_alive()
        out: dict = {"node": node, "launcher_pid": reg.owner_pid, "launcher_alive": alive,
                     "objects": len(entries), "damaged": []}
        sig = {}
        for short in NODE_SIGNALS:
            if reg.name_of(short) in entries:
                try:
                    s = Signal.attach(reg, short)
                except (IpcError, ValueError, TypeError) as e:
                    out["damaged"].append(f"{short}: {e}")
                    continue
                sig[short] = s.array.copy()
                s.close()
        now = time.monotonic_ns()
        status = sig.get(P.NODE_STATUS)
        word = STATE.get(int(status[P.ST_NODE]), "?") if status is not None else "?"
        beat = int(status[P.ST_LAUNCHER_BEAT]) if status is not None else 0
        out["launcher_heartbeat_age_s"] = _age_s(now, beat)
        # times the launcher started the gateway again after it died or hung (runtime/gateway/)
        out["gateway_restarts"] = int(status[P.ST_GATEWAY_RESTARTS]) if status is not None else None
        out["config"] = _config(reg, out["damaged"])
        out["state"] = _state(alive, word, out["launcher_heartbeat_age_s"], bool(out["damaged"]))
        out["processes"] = _processes(sig, now, out["config"])
        out["rings"] = {}
        for e in entries.values():
            if e.kind == "ring":
                try:
                    out["rings"][e.name.split(".", 2)[2]] = peek_stats(e)
                except (IpcError, ValueError) as err:
                    out["damaged"].append(f"{e.name}: {err}")
        out["pools"] = [{"name": e.name.split(".", 2)[2], "dtype": e.dtype, "shape": list(e.shape)}
                        for e in entries.values() if e.kind == "pool"]
        if P.ENGINE_STATS in sig:
            out["engine"] = _engine(sig[P.ENGINE_STATS])
        return out
    finally:
        reg.close()


def engine_counters(node: str) -> dict[str, float] | None:
    """The engine's ENGINE_STATS counters by name, read from shared memory alone (no snapshot
    of the rest of the node: a Prometheus scrape asks for these every few seconds); None while
    the node has none to read (starting, stopped) or they are not all finite numbers."""
    try:
        reg = Registry.attach(node)
    except (IpcError, OSError, ValueError):
        return None
    try:
        sig = Signal.attach(reg, P.ENGINE_STATS)
    except (IpcError, OSError, ValueError, TypeError):
        return None
    finally:
        reg.close()
    try:
        values = [float(v) for v in sig.array]
    finally:
        sig.close()
    if len(values) < len(P.STATS) or not all(math.isfinite(v) for v in values):
        return None
    return dict(zip(P.STATS, values))


def _state(launcher_alive: bool, word: str, beat_age_s: float | None, damaged: bool) -> str:
    """The node's state as its launcher's liveness decides it (see the module docstring)."""
    if not launcher_alive:
        return DEAD
    if damaged:
        return DAMAGED
    if word == "running" and beat_age_s is not None and beat_age_s > LAUNCHER_STALE_S:
        return f"unresponsive (launcher silent for {beat_age_s:.0f}s)"
    return word


def _config(reg: Registry, damaged: list[str]) -> dict:
    """The published configuration, or {} with the reason added to `damaged`."""
    try:
        cfg = P.read_config(reg)
    except IpcError:
        return {}  # not published yet (a node starting up)
    except (ValueError, msgpack.UnpackException) as e:
        damaged.append(f"config: unreadable ({e})")
        return {}
    if not isinstance(cfg, dict):
        damaged.append(f"config: holds a {type(cfg).__name__}, not a map")
        return {}
    return cfg


def _age_s(now_ns: int, beat_ns: int) -> float | None:
    """Seconds since a heartbeat; None when there is none or it is not a reading of this clock.
    A beat written just after `now` was read is 0, never negative."""
    if beat_ns <= 0:
        return None
    age = (now_ns - beat_ns) / 1e9
    if age < -_CLOCK_SLACK_S:
        return None
    return round(max(age, 0.0), 3)


def _processes(sig: dict, now: int, config: dict | None = None) -> list[dict]:
    procs, beats, ready = sig.get(P.PROCS), sig.get(P.HEARTBEAT), sig.get(P.READY)
    if procs is None:
        return []
    rows = []
    for slot, row in enumerate(procs):
        pid = int(row[P.PROC_PID])
        if not pid:
            continue
        alive = pid_alive(pid, int(row[P.PROC_START]))
        beat = int(beats[slot]) if beats is not None and slot < len(beats) else 0
        d = {"role": P.ROLE_NAMES.get(int(row[P.PROC_ROLE]), "?"), "rank": int(row[P.PROC_RANK]), "pid": pid,
             "alive": alive, "ready": bool(ready[slot]) if ready is not None and slot < len(ready) else False,
             "heartbeat_age_s": _age_s(now, beat), "cpu_percent": None, "rss_mb": None}
        limit = P.hang_threshold(config or {}, int(row[P.PROC_ROLE]))  # the launcher's rule
        d["hung"] = bool(alive and d["ready"] and limit and d["heartbeat_age_s"] is not None
                         and d["heartbeat_age_s"] > limit)
        if alive:
            try:
                p = psutil.Process(pid)
                d["cpu_percent"] = p.cpu_percent(interval=0.05)
                d["rss_mb"] = round(p.memory_info().rss / 2**20, 1)
            except psutil.Error:
                pass
        rows.append(d)
    return rows


def _engine(stats) -> dict:
    """The engine's counters with the hit rates of runtime.cache.metrics.RATES (None, never NaN,
    where a counter is not a finite number or a denominator is still 0)."""
    s = {name: _finite(float(stats[i])) for i, name in enumerate(P.STATS) if i < len(stats)}
    if all(s.get(k) is not None for k in ("query_tokens", "requests", "hit_requests",
                                         *(f"hit_tokens_{t}" for t in TIERS))):
        s.update(rates(s))
    return s


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _json_safe(v):
    """`v` with every non-finite float replaced by None, so `--json` is strict JSON."""
    if isinstance(v, float):
        return _finite(v)
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def render(snap: dict) -> str:
    """The human view of one snapshot; a missing or non-finite number shows as "-"."""
    cfg = snap.get("config", {})
    beat = snap.get("launcher_heartbeat_age_s")
    lines = [f"node {snap['node']}  state {snap.get('state', '?')}  launcher pid {snap['launcher_pid']} "
             f"({'alive' if snap['launcher_alive'] else 'DEAD'}, heartbeat {_n(beat, '.1f', 's')})  "
             f"role {cfg.get('role', '?')}  tp {cfg.get('tp', '?')}  "
             f"device {cfg.get('device', '?')}  objects {snap['objects']}"]
    if cfg.get("port") or cfg.get("kv_events_port"):
        lines.append(f"  gateway restarts {_n(snap.get('gateway_restarts'), 'd')} (it owns the public ports; "
                     f"the launcher restarts it when it dies)")
    lines += [f"  damaged: {d}" for d in snap.get("damaged", [])]
    lines += ["", f"{'process':<20} {'pid':>8} {'alive':>6} {'ready':>6} {'beat age':>9} {'cpu %':>6} {'rss MB':>8}"]
    for p in snap["processes"]:
        lines.append(f"{p['role'] + '[' + str(p['rank']) + ']':<20} {p['pid']:>8} "
                     f"{'HUNG' if p.get('hung') else str(p['alive']):>6} "
                     f"{str(p['ready']):>6} {_n(p['heartbeat_age_s'], '.2f', 's'):>9} {_n(p['cpu_percent']):>6} "
                     f"{_n(p['rss_mb']):>8}")
    lines += ["", f"{'ring':<28} {'capacity':>9} {'depth B':>8} {'in':>10} {'out':>10} {'proto err':>9}"]
    for name, r in sorted(snap["rings"].items()):
        lines.append(f"{name:<28} {r['capacity']:>9} {r['depth_bytes']:>8} {r['records_in']:>10} "
                     f"{r['records_out']:>10} {r['protocol_errors']:>9}")
    e = snap.get("engine")
    if e:
        def c(k: str) -> str:  # a counter
            return _n(e.get(k), ".0f")

        def pct(k: str) -> str:  # a rate of runtime.cache.metrics.RATES
            return _n(None if e.get(k) is None else 100 * e[k], ".1f", "%")

        lines += ["", f"{'blocks':<8} {'total':>8} {'free':>8} {'cached':>8} {'in use':>8}"]
        for tier in ("device", "host"):
            lines.append(f"{tier:<8} " + " ".join(f"{c(f'{tier}_{k}'):>8}" for k in ("total", "free", "cached", "used")))
        lines += ["", f"requests {c('requests')}  request hit rate {pct('request_hit_rate')}  token hit rate "
                      f"{pct('hit_token_rate')}: device {pct('hit_token_rate_device')} host {pct('hit_token_rate_host')} "
                      f"storage {pct('hit_token_rate_storage')} (shares of {c('query_tokens')} prompt tokens looked up)",
                  f"transfer tasks in flight {c('tasks_inflight')}  done {c('tasks_done')}  "
                  f"failed {c('tasks_failed')}  bytes {c('swap_bytes')}  evictions {c('evictions')}",
                  f"sequences running {c('seqs_running')}  waiting {c('seqs_waiting')}  loading "
                  f"{c('seqs_loading')}  steps {c('steps')}  preemptions {c('preemptions')}  "
                  f"finished {c('finished_requests')}  failed {c('failed_requests')}  generated tokens "
                  f"{c('generated_tokens')}  prompt tokens computed {c('computed_prompt_tokens')}"]
        if cfg.get("storage"):
            lines.append(f"storage {cfg['storage']}  errors {c('storage_errors')}  forged (no valid MAC, not served) "
                         f"{c('storage_forged')}")
        if cfg.get("role", "mixed") != "mixed":
            sessions = f"decode sessions up {c('pd_sessions')}  " if cfg["role"] == "prefill" else ""
            lines.append(f"PD role {cfg['role']}  transport {cfg.get('pd_transport', '?')}  {sessions}"
                         f"KV bytes sent to the decode node {c('pd_sent_bytes')}  of them while prefilling "
                         f"{c('pd_early_bytes')} ({c('pd_early_blocks')} blocks)")
    return "\n".join(lines)


def _n(v, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:{spec}}{suffix}"


# With --watch on a terminal, each frame replaces the last: cursor home, then erase the screen.
REDRAW = "\x1b[H\x1b[2J"


def status_main(node: str | None, as_json: bool, watch: float, out: TextIO | None = None) -> int:
    """Print every node's snapshot (or one node's); one node's damage never hides the others.
    With `watch`, a terminal gets each frame redrawn in place; a pipe or file gets plain frames
    one after another (a log of them, no escape codes)."""
    out = sys.stdout if out is None else out
    redraw = bool(watch) and not as_json and out.isatty()
    while True:
        nodes = [node] if node else list_nodes()
        if not nodes:
            print("no kvrt nodes found on this machine (nothing in /dev/shm)", file=out)
            return 0
        snaps, errors = [], []
        for n in nodes:
            try:
                snaps.append(snapshot(n))
            except IpcError as e:
                errors.append(f"node {n}: {e}")
            except Exception as e:  # whatever a damaged node holds, the other nodes still get reported
                log.debug("snapshot of node %s failed", n, exc_info=True)
                errors.append(f"node {n}: {DAMAGED}, unreadable ({type(e).__name__}: {e})")
        if as_json:
            frame = json.dumps(_json_safe({"nodes": snaps, "errors": errors}), default=str, allow_nan=False)
        else:
            frame = "\n\n".join([render(s) for s in snaps] + errors)
        out.write((REDRAW if redraw else "") + frame + "\n")
        out.flush()
        if not watch:
            return 0 if snaps else 1
        time.sleep(watch)  # a human-paced refresh of a CLI, not a hot path
        if not redraw:
            out.write("\n")


def clean_main(node: str | None, dry_run: bool) -> int:
    nodes = [node] if node else list_nodes()
    if not nodes:
        print("nothing to clean: no kvrt nodes in /dev/shm")
        return 0
    rc = 0
    for n in nodes:
        try:
            removed = reclaim(n, dry_run=dry_run)
        except NodeLive as e:
            print(f"refusing: {e}")
            rc = 1 if node else rc
            continue
        verb = "would remove" if dry_run else "removed"
        print(f"node {n}: {verb} {len(removed)} objects" + "".join(f"\n  {x}" for x in removed))
    return rc
