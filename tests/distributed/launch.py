"""Two processes of one jaxserve program on loopback: started together, each killed in the end."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from jaxserve.router.launcher import free_port  # never the same port twice in one process
from tests.support.fake_devices import SIMULATION_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ProcessPair:
    """Processes 0 and 1, from `command(process_id)`; logs in directory/process<i>.log."""

    def __init__(self, directory, command):
        self.logs = [os.path.join(str(directory), f"process{i}.log") for i in range(2)]
        # the processes' fake devices come from their config (num_cpu_devices), the code generation of a simulation
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "XLA_FLAGS": SIMULATION_XLA_FLAGS}
        self.processes = []
        for process_id, log in enumerate(self.logs):
            with open(log, "w") as out:
                self.processes.append(
                    subprocess.Popen(command(process_id), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
                )

    def wait(self, timeout: float) -> list[int | None]:
        """Exit codes (None: still running at the deadline)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self.processes):
            time.sleep(0.1)
        return [p.poll() for p in self.processes]

    def log(self, process_id: int) -> str:
        with open(self.logs[process_id]) as f:
            return f.read()

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)


def run_workers(
    directory, timeout: float, module: str = "tests.distributed.worker"
) -> tuple[list[int | None], list[str]]:
    """Both processes of a worker module (tests/distributed/worker.py by default); exit codes and logs."""
    port = free_port()
    pair = ProcessPair(directory, lambda i: [sys.executable, "-m", module, str(i), str(port), str(directory)])
    try:
        codes = pair.wait(timeout)
        return codes, [pair.log(0), pair.log(1)]
    finally:
        pair.kill()
