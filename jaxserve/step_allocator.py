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
glibc.malloc (the user's own), not on another C library, and not where the server's config says
`server.allocator: system` (read from the command line's --config and --set before anything heavier than yaml
is imported: the restart would otherwise pay for those imports twice) or the offline CLI's `--allocator system`.
"""

from __future__ import annotations

import argparse
import glob
import os
import stat
import sys

TUNABLES = ("glibc.malloc.arena_max=1", "glibc.malloc.mmap_max=0", f"glibc.malloc.trim_threshold={4 << 30}")
# server.allocator: glibc-step restarts a CPU process once with TUNABLES; system keeps the allocator as started
ALLOCATORS = ("glibc-step", "system")


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


class _QuietParser(argparse.ArgumentParser):
    def error(self, message):  # the server's own parser reports a bad command line, once, after the restart
        raise ValueError(message)


def configured_allocator(argv: list[str]) -> str:
    """server.allocator as `python -m jaxserve.serve argv` would configure it. A config that does not read
    gives the default: the server's own load after the restart names its error. A config that is not a regular
    file (a pipe, /dev/stdin) is not read here: it could not be read a second time by the server."""
    from jaxserve.config_sections import read_sections
    from jaxserve.server.config_file import SECTIONS  # no JAX, numpy or grpc: yaml and the config's dataclasses

    parser = _QuietParser(add_help=False)
    parser.add_argument("--config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    try:
        args, _ = parser.parse_known_args(argv)
        config = args.config if args.config is not None and stat.S_ISREG(os.stat(args.config).st_mode) else None
        server = read_sections(config, args.overrides, SECTIONS).get("server")
    except Exception:  # whatever it is, the load after the restart reports it
        return ALLOCATORS[0]
    allocator = server.get("allocator") if isinstance(server, dict) else None
    return allocator if allocator in ALLOCATORS else ALLOCATORS[0]


def cli_allocator(argv: list[str]) -> str:
    """The offline CLI's --allocator (`python -m jaxserve`), read before its heavy imports; a value that is not
    an allocator gives the default here, and the CLI's own parser refuses it by name after the restart."""
    parser = _QuietParser(add_help=False)
    parser.add_argument("--allocator", default=ALLOCATORS[0])
    try:
        allocator = parser.parse_known_args(argv)[0].allocator
    except ValueError:
        return ALLOCATORS[0]
    return allocator if allocator in ALLOCATORS else ALLOCATORS[0]


def restart_with_step_allocator(server_argv: list[str] | None = None, allocator: str = ALLOCATORS[0]) -> None:
    """Re-executes this very command (interpreter options included) with TUNABLES in GLIBC_TUNABLES, where
    wants_restart, unless `allocator` is system or `server_argv` (a server's command line) configures
    server.allocator: system; returns where it does not restart. Call it first thing in an entry point's __main__
    block."""
    if allocator == "system" or not wants_restart(os.environ):
        return
    if server_argv is not None and configured_allocator(server_argv) == "system":
        return
    tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES", ""), *TUNABLES]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), {**os.environ, "GLIBC_TUNABLES": tunables})
