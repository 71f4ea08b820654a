"""Runs a helper module on N fake CPU devices, in a subprocess of its own: JAX fixes the device count when
it starts, and the test process already started it with one device.

The helper (tests/support/*_run.py and the like) prints one JSON object as its last line of stdout
(`report_and_exit`); tests read its results from a module-scoped fixture, so one subprocess answers a whole
test module.
"""

import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # helpers run as tests.*
# XLA:CPU's fast-compiling code generation for the mesh simulations: LLVM unoptimized, the loop emitters instead
# of the fusion emitters (a test file's engines compile about 2.3x faster). Fake CPU devices stand in for GPUs and
# TPUs, which run other code anyway, and these tests compare with transformers within tolerances or one mesh's
# logic with another's; the one-device tests in the pytest process keep the serving CPU's code generation, whose
# bits the row-invariance tests pin (docs/notes/test-suite.md, Session 36).
SIMULATION_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def fake_device_xla_flags(devices: int, serving_codegen: bool = False) -> str:
    """XLA_FLAGS for a process of `devices` fake CPU devices; serving_codegen: XLA's own defaults (for a
    helper whose results are compared bit for bit with the pytest process's)."""
    return f"--xla_force_host_platform_device_count={devices}" + ("" if serving_codegen else f" {SIMULATION_XLA_FLAGS}")


def run_on_fake_devices(
    module: str, *args: str, devices: int = 8, timeout: float = 900, serving_codegen: bool = False
) -> dict[str, Any]:
    """`python -m module *args` with `devices` fake CPU devices; the JSON object its last stdout line holds.
    A helper that fails (or prints nothing) fails the test with the end of its stderr."""
    env = {**os.environ, "XLA_FLAGS": fake_device_xla_flags(devices, serving_codegen), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, (
        f"{module} exited with {done.returncode} ({'after' if lines else 'before'} printing its results):\n"
        f"{done.stderr[-4000:]}"
    )
    return json.loads(lines[-1])


def report_and_exit(results: dict[str, Any]) -> None:
    """For a helper: print its results as the JSON line run_on_fake_devices reads, then leave at once. The
    interpreter's teardown of JAX's native threads has aborted helpers that had already printed ("terminate
    called ... FATAL: exception not rethrown", SIGABRT: docs/notes/test-suite.md, sessions 21, 32 and 53), failing
    every test of their module on work that was done."""
    print(json.dumps(results), flush=True)
    sys.stderr.flush()
    os._exit(0)


def results_per_case(run, cases) -> dict[str, Any]:
    """For a helper: {case: run(case)} over its command-line cases, a case that raises reported as
    {"error": ...} so that one failure does not hide the others (its test asserts there is none)."""
    results: dict[str, Any] = {}
    for case in cases:
        try:
            results[case] = run(case)
        except Exception as error:
            results[case] = {"error": f"{type(error).__name__}: {error}"}
    return results
