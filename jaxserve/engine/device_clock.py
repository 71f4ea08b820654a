"""How long the device sits idle between the executables the engine dispatches, and how long the host
works per step: the cost that overlapped steps hide.

JAX dispatch returns before the device has run anything, so the host cannot see when an executable
ends without waiting for it. A daemon thread does the waiting, in dispatch order: the device was idle
before an executable for as long as it was dispatched after the previous one had finished.
"""

from __future__ import annotations

import queue
import threading
import time


class DeviceClock:
    def __init__(self):
        self.idle_seconds = 0.0  # summed over every executable of a busy period (see `dispatched`)
        self.host_seconds = 0.0  # engine step time not spent waiting for the device's results
        self.num_steps = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._watch, name="jaxserve-device-clock", daemon=True)
        self._thread.start()

    def dispatched(self, result, continues_busy_period: bool) -> None:
        """result: any output array of the executable just dispatched. The first executable after the
        engine had nothing to do does not count the wait for work as idle time."""
        self._queue.put((time.perf_counter(), result, continues_busy_period))

    def observe_step(self, host_seconds: float) -> None:
        self.host_seconds += host_seconds
        self.num_steps += 1

    def stats(self) -> dict:
        steps = max(self.num_steps, 1)
        return {"host_seconds_per_step": round(self.host_seconds / steps, 6),
                "device_idle_seconds_per_step": round(self.idle_seconds / steps, 6)}

    def _watch(self) -> None:
        last_done = None
        while True:
            dispatched_at, result, continues = self._queue.get()
            if continues and last_done is not None:
                self.idle_seconds += max(0.0, dispatched_at - last_done)
            try:
                result.block_until_ready()
            except Exception:  # a failed step is the engine's to report; the clock just moves on
                pass
            last_done = time.perf_counter()
