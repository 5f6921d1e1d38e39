"""`kvrt status` and `kvrt clean`: read a live node from its shared memory, never from the
engine, so they work while the engine is busy or hung; and reclaim the objects of dead nodes.
"""
from __future__ import annotations

import json
import time

import psutil

from ipc import protocol as P
from ipc.errors import IpcError, NodeLive
from ipc.registry import Registry, list_nodes, pid_alive, reclaim
from ipc.ring import peek_stats
from ipc.signals import Signal

STATE = {P.NODE_STARTING: "starting", P.NODE_RUNNING: "running", P.NODE_STOPPING: "stopping"}


def snapshot(node: str) -> dict:
    """Everything a reader can learn about `node` from its registry, signals and ring headers."""
    reg = Registry.attach(node)
    try:
        entries = {e.name: e for e in reg.entries()}
        out: dict = {"node": node, "launcher_pid": reg.owner_pid, "launcher_alive": reg.owner_alive(),
                     "objects": len(entries)}
        sig = {}
        for short in (P.PROCS, P.HEARTBEAT, P.READY, P.NODE_STATUS, P.ENGINE_STATS):
            if reg.name_of(short) in entries:
                s = Signal.attach(reg, short)
                sig[short] = s.array.copy()
                s.close()
        if P.NODE_STATUS in sig:
            out["state"] = STATE.get(int(sig[P.NODE_STATUS][P.ST_NODE]), "?")
        try:
            out["config"] = P.read_config(reg)
        except IpcError:
            out["config"] = {}
        out["processes"] = _processes(sig, out["config"])
        out["rings"] = {e.name.split(".", 2)[2]: peek_stats(e) for e in entries.values() if e.kind == "ring"}
        out["pools"] = [{"name": e.name.split(".", 2)[2], "dtype": e.dtype, "shape": list(e.shape)}
                        for e in entries.values() if e.kind == "pool"]
        if P.ENGINE_STATS in sig:
            out["engine"] = _engine(sig[P.ENGINE_STATS])
        return out
    finally:
        reg.close()


def _processes(sig: dict, config: dict | None = None) -> list[dict]:
    procs, beats, ready = sig.get(P.PROCS), sig.get(P.HEARTBEAT), sig.get(P.READY)
    if procs is None:
        return []
    now = time.monotonic_ns()
    rows = []
    for slot, row in enumerate(procs):
        pid = int(row[P.PROC_PID])
        if not pid:
            continue
        alive = pid_alive(pid, int(row[P.PROC_START]))
        d = {"role": P.ROLE_NAMES.get(int(row[P.PROC_ROLE]), "?"), "rank": int(row[P.PROC_RANK]), "pid": pid,
             "alive": alive, "ready": bool(ready[slot]),
             "heartbeat_age_s": round((now - int(beats[slot])) / 1e9, 3) if beats[slot] else None,
             "cpu_percent": None, "rss_mb": None}
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
    s = {name: float(stats[i]) for i, name in enumerate(P.STATS)}
    q = s["query_tokens"]
    for tier in ("device", "host", "storage"):
        s[f"hit_rate_{tier}"] = s[f"hit_tokens_{tier}"] / q if q else 0.0
    s["request_hit_rate"] = s["hit_requests"] / s["requests"] if s["requests"] else 0.0
    return s


def render(snap: dict) -> str:
    cfg = snap.get("config", {})
    lines = [f"node {snap['node']}  state {snap.get('state', '?')}  launcher pid {snap['launcher_pid']} "
             f"({'alive' if snap['launcher_alive'] else 'DEAD'})  role {cfg.get('role', '?')}  tp {cfg.get('tp', '?')}  "
             f"device {cfg.get('device', '?')}  objects {snap['objects']}", "",
             f"{'process':<20} {'pid':>8} {'alive':>6} {'ready':>6} {'beat age':>9} {'cpu %':>6} {'rss MB':>8}"]
    for p in snap["processes"]:
        age = f"{p['heartbeat_age_s']:.2f}s" if p["heartbeat_age_s"] is not None else "-"
        lines.append(f"{p['role'] + '[' + str(p['rank']) + ']':<20} {p['pid']:>8} "
                     f"{'HUNG' if p.get('hung') else str(p['alive']):>6} "
                     f"{str(p['ready']):>6} {age:>9} {_f(p['cpu_percent']):>6} {_f(p['rss_mb']):>8}")
    lines += ["", f"{'ring':<28} {'capacity':>9} {'depth B':>8} {'in':>10} {'out':>10} {'proto err':>9}"]
    for name, r in sorted(snap["rings"].items()):
        lines.append(f"{name:<28} {r['capacity']:>9} {r['depth_bytes']:>8} {r['records_in']:>10} "
                     f"{r['records_out']:>10} {r['protocol_errors']:>9}")
    e = snap.get("engine")
    if e:
        lines += ["", f"{'blocks':<8} {'total':>8} {'free':>8} {'cached':>8} {'in use':>8}"]
        for tier in ("device", "host"):
            lines.append(f"{tier:<8} " + " ".join(f"{e[f'{tier}_{k}']:>8.0f}" for k in ("total", "free", "cached", "used")))
        lines += ["", f"requests {e['requests']:.0f}  request hit rate {e['request_hit_rate']:.1%}  "
                      f"token hit rate device {e['hit_rate_device']:.1%} host {e['hit_rate_host']:.1%} "
                      f"storage {e['hit_rate_storage']:.1%} (of {e['query_tokens']:.0f} tokens)",
                  f"transfer tasks in flight {e['tasks_inflight']:.0f}  done {e['tasks_done']:.0f}  "
                  f"failed {e['tasks_failed']:.0f}  bytes {e['swap_bytes']:.0f}  evictions {e['evictions']:.0f}",
                  f"sequences running {e['seqs_running']:.0f}  waiting {e['seqs_waiting']:.0f}  loading "
                  f"{e['seqs_loading']:.0f}  steps {e['steps']:.0f}  preemptions {e['preemptions']:.0f}  "
                  f"finished {e['finished_requests']:.0f}  failed {e['failed_requests']:.0f}  generated tokens "
                  f"{e['generated_tokens']:.0f}  prompt tokens computed {e['computed_prompt_tokens']:.0f}"]
        if cfg.get("role", "mixed") != "mixed":
            lines.append(f"PD role {cfg['role']}  transport {cfg.get('pd_transport', '?')}  "
                         f"KV bytes sent to the decode node {e['pd_sent_bytes']:.0f}")
    return "\n".join(lines)


def _f(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def status_main(node: str | None, as_json: bool, watch: float) -> int:
    while True:
        nodes = [node] if node else list_nodes()
        if not nodes:
            print("no kvrt nodes found on this machine (nothing in /dev/shm)")
            return 0
        snaps, errors = [], []
        for n in nodes:
            try:
                snaps.append(snapshot(n))
            except IpcError as e:
                errors.append(f"node {n}: {e}")
        if as_json:
            print(json.dumps({"nodes": snaps, "errors": errors}, default=str))
        else:
            print("\n\n".join([render(s) for s in snaps] + errors))
        if not watch:
            return 0 if snaps else 1
        time.sleep(watch)  # a human-paced refresh of a CLI, not a hot path
        print()


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
