"""Where vs_llamacpp.py's batched run goes, step by step: the device time of every executable the engine runs,
by step kind and bucket (decode S rows; prefill T tokens / S sequences) and, for decode, by how many of the
bucket's rows are real sequences, from one run of the same workload (48 requests, prompts 16-384 random
tokens, outputs 8-128, max_num_seqs 48, max_num_batched_tokens 512) on the default model.

    .venv/bin/python bench/batched_step_profile.py [--precision f32] [--num-requests 48] [--repeats 1]

Written to find what made 2dd1dc9's few-row CPU matmul lose a third of the batched throughput (issues #29,
#26) while every 1-8-row step in bench/decode_step.py ran faster: run it on two trees (PYTHONPATH and the
working directory at each; each tree's kernel library is cached under its own content hash), interleaved,
and compare the per-bucket medians. Device time is timed as bench/speculative_profile.py times it (a watcher
thread blocks on each step's result in dispatch order; a step's device time runs from max(its execute
call's return, the previous step's completion) to its own completion). Prints JSON lines: per bucket the
count, median and total device ms, the idle ms before it; then the run's tokens/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speculative_profile import ExecutableLog  # noqa: E402
from vs_llamacpp import DTYPES, Jaxserve, emit, model_files, pin_threads, workload  # noqa: E402


def instrument(engine, log: ExecutableLog) -> None:
    """Log every step the engine's runner executes under a key naming its bucket and its real rows."""
    runner = engine.runner
    build_inputs, execute = runner.build_inputs, runner.execute
    real_rows = [0]

    def build_inputs_counted(per_rank_chunks, shape):
        real_rows[0] = max(len(chunks) for chunks in per_rank_chunks)
        return build_inputs(per_rank_chunks, shape)

    def execute_logged(shape, inputs):
        called = time.perf_counter()
        pending = execute(shape, inputs)
        if shape.kind == "decode":
            key = f"decode S{shape.num_seqs:02d} real{real_rows[0]:02d}"
        else:
            key = f"{shape.kind} T{shape.num_tokens:03d} S{shape.num_seqs:02d}"
        log.dispatched(key, pending, called)
        return pending

    runner.build_inputs, runner.execute = build_inputs_counted, execute_logged


def summarize(log: ExecutableLog) -> dict:
    """Per key (no 'after' split): count, median and total device ms, idle ms before."""
    while any(record[2] is None for record in log.records):
        time.sleep(0.01)
    busy, idle = defaultdict(list), defaultdict(list)
    previous_done = None
    for key, _called, done, returned in log.records:
        started = returned if previous_done is None else max(returned, previous_done)
        busy[key].append(done - started)
        if previous_done is not None:
            idle[key].append(max(0.0, returned - previous_done))
        previous_done = done
    return {
        key: dict(
            count=len(busy[key]),
            device_ms_median=round(1e3 * statistics.median(busy[key]), 2),
            device_ms_total=round(1e3 * sum(busy[key]), 1),
            idle_ms_total=round(1e3 * sum(idle[key] or [0.0]), 1),
        )
        for key in sorted(busy)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--precision", default="f32", choices=("f32", "bf16"))
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="batched runs in this process, each profiled")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--label", default="", help="a name for this tree in the output lines")
    parser.add_argument("--single-prompt", type=int, default=64)
    parser.add_argument("--single-tokens", type=int, default=128)
    parser.add_argument(
        "--before", action="store_true", help="vs_llamacpp.py's single request and text prompts before the batch"
    )
    args = parser.parse_args()
    pin_threads(args.threads)
    jax_path, _, name = model_files(args)
    single, (prompts, lengths), text_prompts = workload(jax_path, args)
    engine = Jaxserve(
        jax_path,
        DTYPES[args.precision][0],
        dict(max_model_len=512, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512),  # vs_llamacpp's
    )
    engine.generate([[101, 102, 103, 104] * 8], [4])  # warm-up, as vs_llamacpp.py's
    if args.before:  # what vs_llamacpp.py's measure() runs before the batch
        _, single_s = engine.generate([single[0]], [single[1]])
        engine.generate(text_prompts, [32] * len(text_prompts))
        emit(label=args.label, single_tokens_per_s=round(single[1] / single_s, 1))
    emit(bench="batched_step_profile", label=args.label, model=name, precision=args.precision,
         prompt_tokens=sum(map(len, prompts)), output_tokens=sum(lengths), startup_s=round(engine.startup_s, 1))  # fmt: skip
    for repeat in range(args.repeats):
        log = ExecutableLog()
        instrument(engine.llm.engine, log)
        cpu_before = os.times()
        _, seconds = engine.generate(prompts, lengths)
        cpu_after = os.times()  # the process's CPU seconds (all threads): under load, wall time is mostly others'
        cpu_s = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
        emit(label=args.label, repeat=repeat, tokens_per_s=round(sum(lengths) / seconds, 1), seconds=round(seconds, 2),
             cpu_s=round(cpu_s, 2), steps=len(log.records))  # fmt: skip
        for key, row in summarize(log).items():
            emit(label=args.label, repeat=repeat, step=key, **row)
        runner = engine.llm.engine.runner  # undo the wrappers before the next repeat wraps again
        del runner.build_inputs, runner.execute


if __name__ == "__main__":
    main()
