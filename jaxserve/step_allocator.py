"""glibc's allocator settings for a process that serves on the CPU, set by re-executing the entry point.

XLA:CPU allocates a step's temporary buffers afresh on every run (one block: 78 MB for a batch-64 decode step of
SmolLM2-135M, whose [64, 49152] float32 logits take 12.6 MB each) and frees them after it. glibc maps a block that
large from the kernel and unmaps it when freed (from XLA's worker threads always: their arenas' heaps hold 64 MB
at most), so each step faulted in and zeroed its temporaries anew: 3.5 K page faults a greedy batch-64 step,
10 K a sampled one, 4 and 20 ms of a 59 and 86 ms step on a 2-core Xeon. With one arena (the main one, grown by
brk), no mmap and no trimming, the freed block is reused as it lies: 40-400 faults a step, 55 and 66 ms.
bench/load_memory.py: loads' peak memory unchanged.

The settings are read once, when the process starts (GLIBC_TUNABLES), hence the re-execution. Not on an
accelerator (its host memory would then stay at its peak for good), not where GLIBC_TUNABLES already sets
glibc.malloc (the user's own), not on another C library.
"""

from __future__ import annotations

import glob
import os
import sys

TUNABLES = ("glibc.malloc.arena_max=1", "glibc.malloc.mmap_max=0", f"glibc.malloc.trim_threshold={4 << 30}")


def serving_on_the_cpu(environ) -> bool:
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not any(glob.glob(pattern) for pattern in ("/dev/nvidiactl", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*"))


def wants_restart(environ) -> bool:
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        libc = ""
    return (
        libc.startswith("glibc")
        and "glibc.malloc." not in environ.get("GLIBC_TUNABLES", "")
        and serving_on_the_cpu(environ)
    )


def restart_with_step_allocator() -> None:
    """Re-executes this very command (interpreter options included) with TUNABLES in GLIBC_TUNABLES, where
    wants_restart; returns where it does not. Call it first thing in an entry point's __main__ block."""
    if not wants_restart(os.environ):
        return
    tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES", ""), *TUNABLES]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), {**os.environ, "GLIBC_TUNABLES": tunables})
