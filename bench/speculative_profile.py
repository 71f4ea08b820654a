"""Where a speculative round goes, single stream: the device time of each executable kind (plain decode,
verify, and a draft model's steps), the device's idle time before each (the host's fetch + postprocess +
proposal + schedule + dispatch, while nothing runs), and the host phases of the engine step, from one
greedy run of bench/speculative.py's code or chat workload on the default model.

    .venv/bin/python bench/speculative_profile.py [--workload code] [--requests 3] [--max-tokens 128]
        [--variants plain,ngram-forced,ngram-forced:k4:min2] [--k 7] [--lookup-min 1] [--lookup-max 4]
        [--draft-k K] [--draft-quantization int8]

Every executable's dispatch and completion are timed (a watcher thread blocks on each result in dispatch
order, as engine/device_clock.py does). Its device time runs from max(the return of the runner's execute
call, the previous executable's completion) to its own completion; the idle gap before it is the return
of its execute call minus the previous completion, when positive (the execute call itself counts as host
time: on a CPU it takes 1-15 ms). Prints JSON lines per variant: per kind of executable, split by the kind
that ran before it, the count, median and total device ms, idle ms before it, and the execute call's
median ms; the host phases' totals; tokens/s and tokens per verify row. Compare ratios within one run on a
loaded machine.
"""

from __future__ import annotations

import argparse
import gc
import os
import queue
import statistics
import sys
import threading
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from speculative import DRAFT_QUANTIZATIONS, Jaxserve, draft_pair, prompts_for, variant_config  # noqa: E402
from vs_llamacpp import DTYPES, emit, model_files, pin_threads  # noqa: E402


class ExecutableLog:
    """(kind, dispatched_at, done_at) per executable, in dispatch order."""

    def __init__(self):
        self.records: list[list] = []
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._watch, daemon=True).start()

    def dispatched(self, kind: str, pending, called_at: float, call_cpu: float) -> None:
        """called_at: when the runner's execute was called; call_cpu: the calling thread's CPU seconds in it."""
        record = [kind, called_at, None, time.perf_counter(), call_cpu]
        self.records.append(record)
        self._work.put((record, pending.sampled.token_ids))

    def _watch(self) -> None:
        while True:
            record, result = self._work.get()
            result.block_until_ready()
            record[2] = time.perf_counter()

    def summary(self) -> dict:
        while any(record[2] is None for record in self.records):
            time.sleep(0.01)
        busy, idle, call, call_cpu, before_call = (defaultdict(list) for _ in range(5))
        previous_done, previous_kind = None, "start"
        for kind, called, done, returned, cpu in self.records:
            # the execute call's own time counts as the gap (the host's), the device's from its return on
            started = returned if previous_done is None else max(returned, previous_done)
            key = f"{kind} after {previous_kind}"
            busy[key].append(done - started)
            call[key].append(returned - called)
            call_cpu[key].append(cpu)
            if previous_done is not None:
                idle[key].append(max(0.0, returned - previous_done))
                before_call[key].append(max(0.0, called - previous_done))
            previous_done, previous_kind = done, kind

        def ms(values, reduce):
            return round(1e3 * reduce(values or [0.0]), 2)

        return {
            key: {
                "count": len(busy[key]),
                "device_ms_median": ms(busy[key], statistics.median),
                "device_ms_total": ms(busy[key], sum),
                "idle_before_ms_median": ms(idle[key], statistics.median),
                "idle_before_ms_total": ms(idle[key], sum),
                "execute_call_ms_median": ms(call[key], statistics.median),
                # of the idle gap: the host's work before the execute call, and the calling thread's CPU in the
                # call. An execute call onto an idle CPU device runs the start of the step while the caller
                # waits (idle-device calls of 12-20 ms burnt 2.5-3.5 ms of the caller's CPU, and a step alone
                # took as long as one of 5 back to back): the rest of such a "gap" is the step computing
                "host_before_call_ms_median": ms(before_call[key], statistics.median),
                "execute_call_cpu_ms_median": ms(call_cpu[key], statistics.median),
            }
            for key in sorted(busy)
        }


def instrument(engine, log: ExecutableLog) -> dict[str, float]:
    """Wrap the engine's host phases with timers (seconds summed per phase) and its runner's execute."""
    phases: dict[str, float] = defaultdict(float)

    def timed(owner, name: str, phase: str):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                phases[phase] += time.perf_counter() - start

        setattr(owner, name, wrapper)

    def log_executions(runner, prefix: str) -> None:
        execute = runner.execute

        def execute_logged(shape, inputs):
            called, cpu = time.perf_counter(), time.thread_time()
            pending = execute(shape, inputs)
            # a draft's two-token catch-up step is a "prefill" shape of query blocks of 2: named apart
            kind = "catch-up" if shape.query_block == runner.buckets.catch_up_width else shape.kind
            log.dispatched(prefix + kind, pending, called, time.thread_time() - cpu)
            return pending

        runner.execute = execute_logged
        timed(runner, "execute", prefix + "dispatch")
        timed(runner, "build_inputs", prefix + "build_inputs")

    log_executions(engine.runner, "")
    draft_runner = getattr(engine.speculation.proposer, "runner", None)
    if draft_runner is not None:  # a draft model's steps: "draft-decode", "draft-prefill"
        log_executions(draft_runner, "draft-")
    timed(engine.speculation, "proposals", "propose")
    timed(engine, "_postprocess", "postprocess")
    timed(engine, "_collect", "collect")
    for scheduler in engine.schedulers:
        timed(scheduler, "schedule", "schedule")
    timed(engine, "step", "step_total")
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--precision", default="f32", choices=sorted(DTYPES))
    parser.add_argument("--workload", default="code", choices=("code", "chat"))
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--variants", default="plain,ngram-forced")
    parser.add_argument("--k", type=int, default=7, help="ngram's num_speculative_tokens")
    parser.add_argument(
        "--draft-k", type=int, default=None, help="a draft model's num_speculative_tokens (default: the engine's own)"
    )
    parser.add_argument("--lookup-min", type=int, default=1)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--draft-quantization", default="int8", choices=DRAFT_QUANTIZATIONS)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    pin_threads(args.threads)
    jax_path, ggufs, name = model_files(args)
    from jaxserve.loading.model_source import open_model

    prompts = prompts_for(open_model(jax_path).tokenizer, args.workload, args.requests)
    max_model_len = max(map(len, prompts)) + args.max_tokens + 16
    ngram = dict(method="ngram", num_speculative_tokens=args.k, prompt_lookup_min=args.lookup_min,
                 prompt_lookup_max=args.lookup_max)  # fmt: skip
    draft = draft_pair(args, ggufs)[0]
    variants = {"plain": None, "ngram": ngram, "ngram-forced": {**ngram, "speculative_adaptive": False},
                "draft": draft, "draft-forced": {**draft, "speculative_adaptive": False}}  # fmt: skip
    emit(bench="speculative_profile", model=name, workload=args.workload, k=args.k,
         prompt_lookup=[args.lookup_min, args.lookup_max], requests=args.requests, max_tokens=args.max_tokens)  # fmt: skip
    outputs = {}
    for variant in args.variants.split(","):
        engine = Jaxserve(jax_path, DTYPES[args.precision][0], 1, max_model_len, variant_config(variants, variant))
        engine.run(prompts[:1], 8, at_once=False)  # warm-up
        log = ExecutableLog()
        phases = instrument(engine.llm.engine, log)
        tokens, seconds = engine.run(prompts, args.max_tokens, at_once=False)
        outputs[variant] = tokens
        stats = engine.llm.stats()
        generated = sum(map(len, tokens))
        emit(variant=variant, tokens_per_s=round(generated / seconds, 2), generated=generated,
             seconds=round(seconds, 3), steps=len(log.records),
             verify_rows=stats.get("speculative_num_verify_rows"),
             tokens_per_verify_row=stats.get("speculative_mean_accepted_length"),
             acceptance=stats.get("speculative_acceptance_rate"), steps_on=stats.get("speculative_steps_on"),
             steps_off=stats.get("speculative_steps_off"), draft_steps=stats.get("speculative_draft_decode_steps"),
             policy_tokens_per_s=stats.get("speculative_tokens_per_second"))  # fmt: skip
        emit(variant=variant, host_phases_ms={k: round(1e3 * v, 1) for k, v in sorted(phases.items())})
        for key, row in log.summary().items():
            emit(variant=variant, executable=key, **row)
        del engine
        gc.collect()
    if "plain" in outputs:
        for variant, tokens in outputs.items():
            emit(check=f"greedy tokens equal, {variant} vs plain", identical=tokens == outputs["plain"])


if __name__ == "__main__":
    main()
