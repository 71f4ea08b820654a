"""Timing shared by the benchmarks: the best (or median) of several runs, after one to compile and warm up."""

import statistics
import time

import jax


def _times(fn, *args, repeats: int) -> list[float]:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def best_time(fn, *args, repeats: int = 5) -> float:
    return min(_times(fn, *args, repeats=repeats))


def median_time(fn, *args, repeats: int = 5) -> float:
    """For a shared, noisy machine: the median resists other processes' bursts better than the best."""
    return statistics.median(_times(fn, *args, repeats=repeats))
