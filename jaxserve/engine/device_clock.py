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
        self.last_done: float | None = None  # when the device finished this engine's latest executable

    def dispatched(self, result, continues_busy_period: bool) -> None:
        """result: any output array of the executable just dispatched. The first executable after the
        engine had nothing to do does not count the wait for work as idle time."""
        _watcher().put((self, time.perf_counter(), result, continues_busy_period))

    def observe_step(self, host_seconds: float, num_steps: int = 1) -> None:
        """num_steps: a decode chain's k (engine/decode_chain.py), whose host time is shared by its steps."""
        self.host_seconds += host_seconds
        self.num_steps += num_steps

    def stats(self) -> dict:
        steps = max(self.num_steps, 1)
        return {
            "host_seconds_per_step": round(self.host_seconds / steps, 6),
            "device_idle_seconds_per_step": round(self.idle_seconds / steps, 6),
        }


_queue: queue.SimpleQueue | None = None
_lock = threading.Lock()


def _watcher() -> queue.SimpleQueue:
    """One daemon thread for every engine in the process: each engine's executables run in order."""
    global _queue
    with _lock:
        if _queue is None:
            _queue = queue.SimpleQueue()
            threading.Thread(target=_watch, args=(_queue,), name="jaxserve-device-clock", daemon=True).start()
    return _queue


def _watch(work: queue.SimpleQueue) -> None:
    while True:
        clock, dispatched_at, result, continues = work.get()
        if continues and clock.last_done is not None:
            clock.idle_seconds += max(0.0, dispatched_at - clock.last_done)
        try:
            result.block_until_ready()
        except Exception:  # a failed step is the engine's to report; the clock just moves on
            pass
        clock.last_done = time.perf_counter()
        del clock, result  # hold neither an engine's clock nor its arrays while waiting for more work
