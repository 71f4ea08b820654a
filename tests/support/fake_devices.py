"""Runs a helper module on N fake CPU devices, in a subprocess of its own: JAX fixes the device count when
it starts, and the test process already started it with one device.

The helper (tests/support/*_run.py and the like) prints one JSON object as its last line of stdout;
tests read its results from a module-scoped fixture, so one subprocess answers a whole test module.
"""

import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # helpers run as tests.*


def run_on_fake_devices(module: str, *args: str, devices: int = 8, timeout: float = 900) -> dict[str, Any]:
    """`python -m module *args` with `devices` fake CPU devices; the JSON object its last stdout line holds.
    A helper that fails (or prints nothing) fails the test with the end of its stderr."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"{module} exited with {done.returncode}:\n{done.stderr[-4000:]}"
    return json.loads(lines[-1])


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
