"""The GPU script's result files, and its figures side by side with the goals they are measured
against.

Why one module: the device tool brings back at most 8 files, so `.ci/gpu` keeps four: its
summary (the device, each step's exit status and seconds, the goals), the GPU tests' log, every
step's stderr, and `bench.jsonl`, one line per benchmark step that `record` appends
(`python -m kvrt.bench.gpu_report record DIR NAME STATUS SECONDS FILE`: the step's JSON output,
or the tail of what it printed when that was not JSON). `goals` (`python -m
kvrt.bench.gpu_report goals DIR`) prints one table from them, so a run is read off in one place;
a figure whose step is missing or holds no such row says so ("missing"), never a guess.

The goals (kvrt's own, for one H100 run of the script, the 0.5B shape, float16 and bfloat16):
decode at batch 32 at least 10x transformers' `generate` per token and at most 6x the HBM floor;
at batch 1 at least 8x `generate`; a 512-token prefill at least 2x one transformers forward;
nano-vllm's workload at least 15,000 output tokens/s; a one-block swap task's p50 at most 80 us
each way; every GPU test passing.
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class Goal:
    what: str
    value: float | None
    target: float
    at_least: bool  # the value must be >= target (else <=)
    source: str

    @property
    def status(self) -> str:
        if self.value is None:
            return "missing"
        return "met" if (self.value >= self.target if self.at_least else self.value <= self.target) else "missed"


BENCH = "bench.jsonl"


def record(out: str, name: str, status: int, seconds: float, path: str) -> dict:
    """Append step `name`'s output (file `path`) to DIR/bench.jsonl; returns the line's record."""
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError as e:
        text = f"(no output: {e})"
    try:
        result = json.loads(text)
    except ValueError:
        result = None
    line = {"step": name, "exit": status, "seconds": seconds, "result": result}
    if result is None:
        line["output"] = text[-4000:]
    with open(os.path.join(out, BENCH), "a") as f:
        f.write(json.dumps(line) + "\n")
    return line


def _load(out: str, name: str) -> Any:
    """The JSON result of step `name` in DIR/bench.jsonl (its last run), or None."""
    found = None
    try:
        with open(os.path.join(out, BENCH), errors="replace") as f:
            for text in f:
                try:
                    line = json.loads(text)
                except ValueError:
                    continue
                if isinstance(line, dict) and line.get("step") == name:
                    found = line.get("result")
    except OSError:
        return None
    return found


def _row(data: Any, pick: Callable[[dict], bool]) -> dict | None:
    rows = data.get("rows", []) if isinstance(data, dict) else []
    return next((r for r in rows if pick(r)), None)


def model_goals(out: str, dtype: str) -> list[Goal]:
    name = f"bench-model-{dtype}"
    data = _load(out, name)

    def decode(b: int, key: str) -> float | None:
        r = _row(data, lambda r: r.get("kind") == "decode" and r.get("batch") == b and r.get("context") == 128)
        return None if r is None else r.get(key)

    prefill = _row(data, lambda r: r.get("kind") == "prefill" and r.get("batch") == 1)
    return [Goal(f"decode batch 32, ctx 128, {dtype}: x generate", decode(32, "vs_gen"), 10, True, name),
            Goal(f"decode batch 32, ctx 128, {dtype}: x HBM floor", decode(32, "vs_floor"), 6, False, name),
            Goal(f"decode batch 1, ctx 128, {dtype}: x generate", decode(1, "vs_gen"), 8, True, name),
            Goal(f"prefill 512 tokens, {dtype}: x one transformers forward",
                 None if prefill is None else prefill.get("vs_hf"), 2, True, name)]


def copy_goals(out: str) -> list[Goal]:
    name = "bench-copy"
    data = _load(out, name)
    goals = []
    for case in ("e2e swap2cpu", "e2e swap2gpu"):
        r = _row(data, lambda r, c=case: r.get("case") == c and r.get("blocks") == 1)
        goals.append(Goal(f"one-block {case[4:]} task p50, us", None if r is None else r.get("p50_us"), 80, False,
                          name))
    return goals


def tests_goal(out: str) -> Goal:
    """Every GPU test passed: the value is the count that failed or errored (0 to meet it), read
    from pytest's last summary line; missing if there is none."""
    try:
        with open(os.path.join(out, "gpu-tests.log"), errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    except OSError:
        lines = []
    bad = None
    if lines:
        last = lines[-1]
        bad = sum(int(n) for n, _ in re.findall(r"(\d+) (failed|error)", last))
    return Goal("GPU tests failed or errored", bad, 0, False, "gpu-tests.log")


def all_goals(out: str) -> list[Goal]:
    data = _load(out, "throughput")
    tps = data.get("output_tokens_s") if isinstance(data, dict) else None
    return [tests_goal(out), *model_goals(out, "bfloat16"), *model_goals(out, "float16"),
            Goal("nano-vllm workload, output tokens/s", tps, 15000, True, "throughput"), *copy_goals(out)]


def render(goals: list[Goal]) -> str:
    lines = [f"{'goal':<55} {'measured':>10} {'target':>9}  status  (file)"]
    for g in goals:
        value = "-" if g.value is None else f"{g.value:,.2f}"
        target = f"{'>=' if g.at_least else '<='} {g.target:g}"
        lines.append(f"{g.what:<55} {value:>10} {target:>9}  {g.status:<7} ({g.source})")
    return "\n".join(lines)


USAGE = ("usage: python -m kvrt.bench.gpu_report record DIR NAME STATUS SECONDS FILE\n"
         "       python -m kvrt.bench.gpu_report goals DIR   (DIR: the folder .ci/gpu writes)")


def main(argv: list[str]) -> int:
    if len(argv) == 6 and argv[0] == "record":
        try:
            status, seconds = int(argv[3]), float(argv[4])
        except ValueError:
            print(USAGE, file=sys.stderr)
            return 2
        record(argv[1], argv[2], status, seconds, argv[5])
        return 0
    if len(argv) == 2 and argv[0] == "goals":
        print(render(all_goals(argv[1])))
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
