"""This process's place in the multi-controller program: joining it (`initialize` returns the
ProcessGroup that owns jaxserve's side of it), the coordination service's key-value store (the side
channel plans and beats travel on), and stopping every process with a clear error.

Plans travel on the coordination service's key-value store rather than as device collectives: a
broadcast on the devices would queue behind the running step, and a dead peer makes it hang; a
key-value read takes a timeout.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

import jax

from jaxserve.distributed.config import DistributedConfig

if TYPE_CHECKING:
    from jaxserve.distributed.leader_runner import LeaderRunner

logger = logging.getLogger(__name__)

FATAL_EXIT_CODE = 3
FATAL_GRACE_SECONDS = 1.0  # between health turning NOT_SERVING and the exit, so a health check can see it
KEY_PREFIX = "jaxserve"
START_ERROR_KEY = f"{KEY_PREFIX}/start_error"
START_WATCH_INTERVAL = 0.5  # seconds between process 0's looks for a follower's start failure


def initialize(config: DistributedConfig | None) -> ProcessGroup | None:
    """Join the program (before anything touches a device); None without a config (one process)."""
    if config is None:
        return None
    if config.num_cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", config.num_cpu_devices)
    # CPU collectives across processes (tests, bench); accelerators use their own (ICI, NCCL).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption notifier would take SIGTERM from the server, which drains on it (process.py).
    jax.config.update("jax_enable_preemption_service", False)
    # The coordination service aborts every process (no clear error, no NOT_SERVING) once a peer misses
    # heartbeats this long: leave our own, shorter, peer_timeout the first word.
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address,
        num_processes=config.num_processes,
        process_id=config.process_id,
        local_device_ids=config.local_device_ids,
        initialization_timeout=config.initialization_timeout,
        heartbeat_timeout_seconds=int(2 * config.peer_timeout) + 10,
    )
    group = ProcessGroup(config, jax.process_index(), jax.process_count())
    if group.is_leader and group.is_multiprocess:
        group.start_watching_start_failures()
    logger.info(
        "process %d of %d; %d devices, %d local",
        group.process_index,
        group.num_processes,
        jax.device_count(),
        jax.local_device_count(),
    )
    return group


class RefusedOnEveryProcess(ValueError):
    """A start-up refusal that every process reaches alike from the same config (e.g. a mesh that leaves a
    process without devices): a follower does not report it to process 0, which refuses it itself and may
    already have stopped the coordination service."""


def spans_processes(group: ProcessGroup | None) -> bool:
    """Whether an engine built with this group runs as one program over several processes."""
    return group is not None and group.is_multiprocess


def client():
    """The coordination service's client (JAX keeps it private; it is the runtime's own channel)."""
    from jax._src import distributed

    kv = distributed.global_state.client
    if kv is None:
        raise RuntimeError("jax.distributed is not initialized by jaxserve.distributed.runtime.initialize")
    return kv


@dataclass(eq=False)
class ProcessGroup:
    """jaxserve's side of the multi-controller program, made once by `initialize` and handed to whoever
    needs it (serve.py -> the engine build -> agreement, leader runner, follower, checkpoint saves):
    its settings, this process's place, the counters that must advance alike on every process, what
    runs before a fatal exit, and the engine leading now. jax.distributed keeps its own state."""

    config: DistributedConfig
    process_index: int
    num_processes: int
    fatal_hooks: list[Callable[[], None]] = field(default_factory=list)
    active_leader: LeaderRunner | None = None  # the engine serving now (process 0 only)
    exit: Callable[[int], None] = os._exit  # tests replace it
    # one session per engine built, one key per exchange: drawn in the same order on every process
    _sessions: Iterator[int] = field(default_factory=itertools.count)
    _exchanges: Iterator[int] = field(default_factory=itertools.count)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _start_watch: threading.Thread | None = None

    @property
    def is_multiprocess(self) -> bool:
        return self.num_processes > 1

    @property
    def is_leader(self) -> bool:
        return self.process_index == 0

    def next_session(self) -> str:
        """Keys of one engine's plans; engines are built in the same order on every process."""
        return f"{KEY_PREFIX}/{next(self._sessions)}"

    def on_fatal(self, hook: Callable[[], None]) -> None:
        """Run hook (e.g. health NOT_SERVING) before a fatal error ends this process."""
        self.fatal_hooks.append(hook)

    def fatal(self, message: str) -> NoReturn:
        """End this process with a clear error: hooks first, then a short grace, then exit."""
        print(f"jaxserve.distributed: process {self.process_index}: {message}", file=sys.stderr, flush=True)
        logger.error("%s", message)
        for hook in list(self.fatal_hooks):
            try:
                hook()
            except Exception:  # the exit below must happen whatever a hook does
                logger.exception("fatal hook failed")
        time.sleep(FATAL_GRACE_SECONDS)
        sys.stdout.flush()
        self.exit(FATAL_EXIT_CODE)
        raise SystemExit(FATAL_EXIT_CODE)  # only where a test's exit returns

    def report_start_failure(self, message: str) -> None:
        """A follower that cannot build its engine says so, so that process 0 stops too instead of
        waiting for it (or serving without it)."""
        try:
            client().key_value_set(f"{START_ERROR_KEY}/{self.process_index}", message, allow_overwrite=True)
        except Exception as error:  # the coordination service is gone: process 0 is stopping anyway
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            logger.warning("could not report the start failure to process 0 (it has stopped?): %s", first_line)

    def start_watching_start_failures(self) -> None:
        self._start_watch = threading.Thread(target=self.watch_start_failures, daemon=True, name="jaxserve-start-watch")
        self._start_watch.start()

    def watch_start_failures(self) -> None:
        """Process 0, until shutdown: a follower's reported start failure ends it with that error."""
        kv = client()
        while not self._stopping.wait(START_WATCH_INTERVAL):
            for process in range(1, self.num_processes):
                try:
                    message = kv.key_value_try_get(f"{START_ERROR_KEY}/{process}")
                except Exception:  # nothing reported (or the service is shutting down)
                    continue
                self.fatal(f"process {process} could not start: {message}; process 0 stops")

    def report_and_stop(self, session: str, message: str) -> NoReturn:
        """A follower's fatal error: published first, so that process 0 stops with the same message."""
        try:
            client().key_value_set(f"{session}/error/{self.process_index}", message, allow_overwrite=True)
        finally:
            self.fatal(message)

    def shutdown(self) -> None:
        """Tell the followers to stop (process 0), end this process's own threads that call into the
        coordination service, then leave the distributed runtime. The threads are joined, not left as
        daemons: one still inside a C++ call when the interpreter finalizes is unwound by force there,
        and the runtime's C++ aborts the process ("FATAL: exception not rethrown") after a clean stop."""
        if self.active_leader is not None:
            self.active_leader.shutdown()
        self._stopping.set()
        if self._start_watch is not None and self._start_watch is not threading.current_thread():
            self._start_watch.join(timeout=2 * START_WATCH_INTERVAL + 5)
        jax.distributed.shutdown()

    def exchange(self, what: str, value: str) -> list[str]:
        """Every process's value, by process index (each publishes its own and waits for the rest)."""
        key = f"{KEY_PREFIX}/exchange/{next(self._exchanges)}/{what}"
        kv = client()
        kv.key_value_set(f"{key}/{self.process_index}", value)
        timeout_ms = int(self.config.initialization_timeout * 1000)
        return [kv.blocking_key_value_get(f"{key}/{process}", timeout_ms) for process in range(self.num_processes)]

    def agree_across_processes(self, what: str, value: str) -> None:
        """Every process describes what it is about to build; the descriptions must be equal, or the
        engines would compile different programs and hang in their first collective."""
        digest = hashlib.blake2b(value.encode(), digest_size=16).hexdigest()
        mismatched = [process for process, other in enumerate(self.exchange(what, digest)) if other != digest]
        if mismatched:
            raise ValueError(
                f"process {self.process_index}'s {what} differs from that of process(es) {mismatched}: "
                "every process must be started with the same model and engine config"
            )


class Beats:
    """A counter each process bumps in the key-value store every beat interval from a thread of its own,
    so that a process that died (or whose Python stopped) is noticed while everything is idle."""

    def __init__(self, group: ProcessGroup, session: str, interval: float):
        self.group = group
        self.key = f"{session}/beat"
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="jaxserve-beat")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 5)

    def _run(self) -> None:
        count = 0
        kv = client()
        while not self._stop.wait(self.interval):
            count += 1
            try:
                kv.key_value_set(f"{self.key}/{self.group.process_index}", str(count), allow_overwrite=True)
            except Exception as error:  # the coordination service (process 0) is gone
                if not self._stop.is_set():
                    self.group.fatal(f"lost the coordination service (process 0): {error}")
                return


class PeerWatch:
    """Seconds since each peer's beat last changed, and the errors peers reported."""

    def __init__(self, session: str, peers: list[int]):
        self.key = f"{session}/beat"
        self.session = session
        self.seen = {peer: (None, time.monotonic()) for peer in peers}

    def reported_error(self) -> str | None:
        kv = client()
        for peer in self.seen:
            try:
                return f"process {peer}: {kv.key_value_try_get(f'{self.session}/error/{peer}')}"
            except Exception:  # no error reported
                continue
        return None

    def stalest(self) -> tuple[int, float]:
        """(peer, seconds since its beat last changed) of the peer silent longest."""
        kv, now = client(), time.monotonic()
        for peer, (last, _since) in self.seen.items():
            try:
                value = kv.key_value_try_get(f"{self.key}/{peer}")
            except Exception:  # not written yet
                value = None
            if value != last:
                self.seen[peer] = (value, now)
        peer = min(self.seen, key=lambda p: self.seen[p][1])
        return peer, now - self.seen[peer][1]
