"""Where a compiled step's time goes, op by op, from XLA's own trace (issue #29): jax.profiler records every
thunk XLA:CPU runs (each custom call, each fusion) with its start and duration on the thread that runs the
step. `step_breakdown` sums them per step by kind: each custom call target (the projections' kernel, the
attention kernel, the KV write), XLA's fusions and copies between them, and the gaps between two thunks
(the executor's own cost per thunk). Used by bench/decode_step.py --trace.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import tempfile

import jax

FUSION_KINDS = ("fusion", "wrapped_", "copy", "cond", "concatenate", "bitcast", "broadcast")


def custom_call_targets(hlo_text: str) -> dict[str, str]:
    """Optimized HLO's custom call instructions (the trace's op names) -> their targets."""
    found = re.finditer(r"%([\w.\-]+) = [^\n]*?custom_call_target=\"([\w.\-]+)\"", hlo_text)
    return {m.group(1): m.group(2).removeprefix("jaxserve_cpu_") for m in found}


def op_kind(name: str, targets: dict[str, str]) -> str:
    if name in targets:
        return targets[name]
    return "xla_fusions" if any(k in name for k in FUSION_KINDS) else "xla_other"


def step_breakdown(run_step, hlo_text: str, steps: int = 10) -> dict:
    """Runs `run_step()` (one step, blocking) `steps` times under the profiler; the median over steps of the
    ms each kind of op took, the gaps between thunks, the step's wall time and its number of top-level
    thunks."""
    targets = custom_call_targets(hlo_text)
    with perfetto_trace(run_step, steps) as path, gzip.open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    executes = [e for e in events if e["name"] == "ThunkExecutor::Execute"]
    # a step's own executor, not a conditional branch's inside it
    top_level = [e for e in executes if not any(inside(e, outer) for outer in executes if outer is not e)]
    per_step = [thunk_times(events, step, targets) for step in top_level]
    kinds = sorted({k for times in per_step for k in times})
    return {k: round(statistics.median(t.get(k, 0.0) for t in per_step), 3) for k in kinds}


@contextlib.contextmanager
def perfetto_trace(run_step, steps: int):
    """The path of a perfetto trace (.json.gz, in a temporary directory while the context lasts) of `steps` runs
    of `run_step()` under the profiler, after one unprofiled run."""
    run_step()
    with tempfile.TemporaryDirectory() as out:
        with jax.profiler.trace(out, create_perfetto_trace=True):
            for _ in range(steps):
                run_step()
        (path,) = glob.glob(os.path.join(out, "plugins", "profile", "*", "perfetto_trace.json.gz"))
        yield path


def save_trace(run_step, path: str, steps: int = 5) -> None:
    """`steps` runs of `run_step()` under the profiler, the perfetto trace written to `path` (.json.gz): on a lent
    GPU, the step's kernels and the host's calls on one timeline, to read after the machine is gone."""
    with perfetto_trace(run_step, steps) as found:
        shutil.copy(found, path)


def inside(event: dict, outer: dict) -> bool:
    return (
        event["tid"] == outer["tid"]
        and outer["ts"] <= event["ts"]
        and event["ts"] + event["dur"] <= outer["ts"] + outer["dur"]
    )


def thunk_times(events: list[dict], step: dict, targets: dict[str, str]) -> dict[str, float]:
    """ms per kind of the top-level thunks inside one ThunkExecutor::Execute event (nested ones, a
    conditional's branch, count in their parent)."""
    start, end = step["ts"], step["ts"] + step["dur"]
    inner = sorted(
        (
            e
            for e in events
            if inside(e, step)
            and e is not step
            and not e["name"].startswith("end: ")
            and e["name"] != "ThunkExecutor::Execute"
        ),
        key=lambda e: e["ts"],
    )
    times: dict[str, float] = collections.defaultdict(float)
    previous_end, count = start, 0
    for e in inner:
        if e["ts"] < previous_end:  # inside the previous thunk
            continue
        times["gaps"] += e["ts"] - previous_end
        times[op_kind(e["name"], targets)] += e["dur"]
        previous_end, count = e["ts"] + e["dur"], count + 1
    times["gaps"] += end - previous_end
    result = {k: v / 1e3 for k, v in times.items()}
    result["step"] = step["dur"] / 1e3
    result["thunks"] = float(count)
    return result
