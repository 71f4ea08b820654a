"""Timing shared by the benchmarks: the best of several runs, after one to compile and warm up."""

import time

import jax


def best_time(fn, *args, repeats: int = 5) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)
